"""A synthetic long-range task: does the dynamic projection (paper Eq. 3) carry information across the sequence?

Each sequence is random tokens with one marker token (A or B) at a random position of its second half; the label
says which. ``LongShortForSequenceClassification`` reads the first token, here with no global token (an all-zero
``global_attention_mask`` replaces the head's default global first token), so with 2 layers and window w the first
token's receptive field through the window is about 3w tokens: a window-only model must stay at chance, and whatever
Long-Short learns above chance came through the projected rows. ``full`` is the same model with a window covering the
input. ``--global_first_token`` makes the first token global instead (Longformer's way: it then sees every token).
``python -m recipes.lra.synthetic --help``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ls_hf import LongShortConfig, LongShortForSequenceClassification

BOS, PAD, MARKERS, FIRST_RANDOM = 0, 1, (2, 3), 4
ATTENTIONS = ("long_short", "window", "full")


def batch(generator: torch.Generator, size: int, length: int, vocab_size: int):
    """``size`` sequences of ``length`` tokens: BOS, random tokens, one marker in ``[length // 2, length)``. The
    labels are balanced, half of each (one more 0 when ``size`` is odd) in random order: with independent labels the
    batch's surplus of one class pushes W^P's gradient along every token's input, noise that does not shrink with n,
    while the marker's part of it is about 1/n (see ``recipes/lra/README.md``)."""
    ids = torch.randint(FIRST_RANDOM, vocab_size, (size, length), generator=generator)
    ids[:, 0] = BOS
    labels = torch.randperm(size, generator=generator) % 2
    where = torch.randint(length // 2, length, (size,), generator=generator)
    ids[torch.arange(size), where] = torch.tensor(MARKERS)[labels]
    return ids, labels


def build(attention: str, length: int, window_size: int = 16, projection_rank: int = 8, vocab_size: int = 32,
          seed: int = 0) -> LongShortForSequenceClassification:
    """2 layers, width 64, 2 heads, FFN 128, no dropout; ``full``: one window covering the input, no projection."""
    if attention not in ATTENTIONS:
        raise ValueError(f"--attention must be one of {ATTENTIONS}, got {attention!r}.")
    window, rank = {"long_short": (window_size, projection_rank), "window": (window_size, 0),
                    "full": (length, 0)}[attention]
    config = LongShortConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=128, window_size=window, projection_rank=rank,
                             max_position_embeddings=length + 2, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0, num_labels=2, pad_token_id=PAD, bos_token_id=BOS,
                             eos_token_id=None)
    torch.manual_seed(seed)
    return LongShortForSequenceClassification(config)


def logits(model, ids, global_first_token: bool = False):
    """The classifier's logits (B, 2), with the first token global or no global token at all."""
    glob = torch.zeros_like(ids)
    glob[:, 0] = int(global_first_token)
    return model(input_ids=ids, global_attention_mask=glob).logits


@torch.no_grad()
def accuracy(model, ids, labels, batch_size: int = 64, global_first_token: bool = False) -> float:
    model.eval()
    correct = sum(int((logits(model, ids[i : i + batch_size], global_first_token).argmax(-1)
                       == labels[i : i + batch_size]).sum())
                  for i in range(0, len(ids), batch_size))
    model.train()
    return correct / len(ids)


def train(attention: str, length: int, steps: int, *, window_size: int = 16, projection_rank: int = 8,
          lr: float = 1e-3, batch_size: int = 16, eval_every: int = 100, eval_size: int = 512, seed: int = 0,
          target: float | None = None, global_first_token: bool = False, progress: bool = False) -> dict:
    """AdamW, fresh batches every step; held-out accuracy every ``eval_every`` steps. Stops early once it reaches
    ``target``. Returns the history and the best accuracy."""
    model = build(attention, length, window_size, projection_rank, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(seed + 1)
    held_out = batch(torch.Generator().manual_seed(10_000 + seed), eval_size, length, model.config.vocab_size)
    history, start, cpu = [], time.perf_counter(), time.process_time()
    bar = tqdm(range(1, steps + 1), disable=not progress, desc=f"{attention} n={length}")
    for step in bar:
        ids, labels = batch(data, batch_size, length, model.config.vocab_size)
        loss = F.cross_entropy(logits(model, ids, global_first_token), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % eval_every == 0 or step == steps:
            history.append({"step": step, "loss": loss.item(),
                            "accuracy": accuracy(model, *held_out, global_first_token=global_first_token),
                            "seconds": round(time.perf_counter() - start, 1),
                            "cpu_seconds": round(time.process_time() - cpu, 1)})
            bar.set_postfix(accuracy=history[-1]["accuracy"])
            if target is not None and history[-1]["accuracy"] >= target:
                break
    return {"attention": attention, "length": length, "window_size": window_size, "projection_rank": projection_rank,
            "lr": lr, "batch_size": batch_size, "seed": seed, "global_first_token": global_first_token,
            "history": history,
            "best_accuracy": max(h["accuracy"] for h in history), "torch": torch.__version__}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m recipes.lra.synthetic", description=__doc__)
    p.add_argument("--attention", choices=ATTENTIONS, default="long_short")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--window_size", type=int, default=16)
    p.add_argument("--projection_rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--eval_every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, help="stop once the held-out accuracy reaches this")
    p.add_argument("--global_first_token", action="store_true", help="make the first token global (default: none)")
    p.add_argument("--threads", type=int)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = train(args.attention, args.length, args.steps, window_size=args.window_size,
                   projection_rank=args.projection_rank, lr=args.lr, batch_size=args.batch_size,
                   eval_every=args.eval_every, seed=args.seed, target=args.target,
                   global_first_token=args.global_first_token, progress=True)
    print(json.dumps({k: v for k, v in result.items() if k != "history"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
