"""A synthetic long-range task: does the dynamic projection (paper Eq. 3) carry information across the sequence?

Each sequence is random tokens with one marker token (A or B) at a random position of its second half; the label
says which. ``LongShortForSequenceClassification`` reads the first token, here with no global token (an all-zero
``global_attention_mask`` replaces the head's default global first token), so with 2 layers and window w the first
token's receptive field through the window is about 3w tokens: a window-only model must stay at chance, and whatever
Long-Short learns above chance came through the projected rows. ``full`` is the same model with a window covering the
input. ``--global_first_token`` makes the first token global instead (Longformer's way: it then sees every token).
The task's settings (``Task``): ``--vocab_size``, ``--labels`` (balanced or independent within a batch),
``--marker_from`` (where the markers' positions start, as a fraction of the length) and ``--global_first_token``.
``--checkpoint FILE`` saves the run at every evaluation and resumes from it. ``python -m recipes.lra.synthetic --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ls_hf import LongShortConfig, LongShortForSequenceClassification

from .train import save

BOS, PAD, MARKERS, FIRST_RANDOM = 0, 1, (2, 3), 4
ATTENTIONS = ("long_short", "window", "full")
LABELS = ("balanced", "independent")


@dataclasses.dataclass(frozen=True)
class Task:
    """The task's settings. Sequences of ``length`` tokens: BOS, then random ids from ``[4, vocab_size)`` and one
    marker (id 2 or 3, naming the label) at a uniform position in ``[int(marker_from * length), length)``.
    ``labels``: ``balanced`` puts half of each label in every batch (one more 0 when its size is odd), in random
    order; ``independent`` draws each label on its own. ``global_first_token``: the classifier's first token attends
    to every token (the classification head's default) instead of there being no global token."""

    length: int = 1024
    vocab_size: int = 32
    labels: str = "balanced"
    marker_from: float = 0.5
    global_first_token: bool = False

    def __post_init__(self):
        if self.length < 2:
            raise ValueError(f"--length must be at least 2 (BOS and a marker), got {self.length}.")
        if self.vocab_size <= FIRST_RANDOM:
            raise ValueError(
                f"--vocab_size must be at least {FIRST_RANDOM + 1}: ids 0-3 are BOS, PAD and the two "
                f"markers, the random tokens come after them; got {self.vocab_size}."
            )
        if self.labels not in LABELS:
            raise ValueError(f"--labels must be one of {LABELS}, got {self.labels!r}.")
        if not 1 <= self.first_marker_position < self.length:
            raise ValueError(
                f"--marker_from must leave the markers a position in [1, {self.length}) (after BOS, "
                f"before the end): a fraction in (0, 1) with int(marker_from * length) >= 1; got "
                f"{self.marker_from} (first position {self.first_marker_position})."
            )

    @property
    def first_marker_position(self) -> int:
        return int(self.marker_from * self.length)

    def batch(self, generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``size`` sequences and their labels. Balanced labels matter: with independent labels the batch's surplus
        of one class pushes W^P's gradient along every token's input, noise that does not shrink with n, while the
        marker's part of it is about 1/n (see ``recipes/lra/README.md``)."""
        ids = torch.randint(FIRST_RANDOM, self.vocab_size, (size, self.length), generator=generator)
        ids[:, 0] = BOS
        if self.labels == "balanced":
            labels = torch.randperm(size, generator=generator) % 2
        else:
            labels = torch.randint(0, 2, (size,), generator=generator)
        where = torch.randint(self.first_marker_position, self.length, (size,), generator=generator)
        ids[torch.arange(size), where] = torch.tensor(MARKERS)[labels]
        return ids, labels


def build(
    attention: str, task: Task, window_size: int = 16, projection_rank: int = 8, seed: int = 0
) -> LongShortForSequenceClassification:
    """2 layers, width 64, 2 heads, FFN 128, no dropout; ``full``: one window covering the input, no projection."""
    if attention not in ATTENTIONS:
        raise ValueError(f"--attention must be one of {ATTENTIONS}, got {attention!r}.")
    window, rank = {"long_short": (window_size, projection_rank), "window": (window_size, 0), "full": (task.length, 0)}[
        attention
    ]
    config = LongShortConfig(
        vocab_size=task.vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        window_size=window,
        projection_rank=rank,
        max_position_embeddings=task.length + 2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=None,
    )
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
    correct = sum(
        int((logits(model, ids[i : i + batch_size], global_first_token).argmax(-1) == labels[i : i + batch_size]).sum())
        for i in range(0, len(ids), batch_size)
    )
    model.train()
    return correct / len(ids)


def train(
    attention: str,
    task: Task,
    steps: int,
    *,
    window_size: int = 16,
    projection_rank: int = 8,
    lr: float = 1e-3,
    batch_size: int = 16,
    eval_every: int = 100,
    eval_size: int = 512,
    seed: int = 0,
    target: float | None = None,
    checkpoint: str | Path | None = None,
    progress: bool = False,
) -> dict:
    """AdamW, fresh batches every step; accuracy on ``eval_size`` held-out sequences every ``eval_every`` steps.
    Stops early once it reaches ``target``. With ``checkpoint``, the run is saved there at every evaluation and
    resumed from it when the file exists (the same settings; ``steps`` may grow). Returns the settings, the history
    and the best accuracy."""
    for name, value in (
        ("steps", steps),
        ("batch_size", batch_size),
        ("eval_every", eval_every),
        ("eval_size", eval_size),
    ):
        if value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}.")
    if target is not None and not 0 < target <= 1:
        raise ValueError(f"--target must be an accuracy in (0, 1], got {target}.")
    if checkpoint:
        Path(checkpoint).parent.mkdir(parents=True, exist_ok=True)
    settings = {
        "attention": attention,
        **dataclasses.asdict(task),
        "window_size": window_size,
        "projection_rank": projection_rank,
        "lr": lr,
        "batch_size": batch_size,
        "eval_every": eval_every,
        "eval_size": eval_size,
        "seed": seed,
    }
    state = torch.load(checkpoint) if checkpoint and Path(checkpoint).exists() else None
    if state is not None and state["settings"] != settings:
        raise ValueError(
            f"--checkpoint {checkpoint} is of another run ({state['settings']}); give a new path or delete it."
        )
    model = build(attention, task, window_size, projection_rank, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(seed + 1)
    held_out = task.batch(torch.Generator().manual_seed(10_000 + seed), eval_size)
    history, done, seconds, cpu_seconds = [], 0, 0.0, 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        data.set_state(state["data"])
        history, done, seconds, cpu_seconds = state["history"], state["step"], state["seconds"], state["cpu_seconds"]
    reached = bool(history) and target is not None and history[-1]["accuracy"] >= target
    start, cpu = time.perf_counter() - seconds, time.process_time() - cpu_seconds
    bar = tqdm(
        range(done + 1, (done if reached else steps) + 1), disable=not progress, desc=f"{attention} n={task.length}"
    )
    for step in bar:
        ids, labels = task.batch(data, batch_size)
        loss = F.cross_entropy(logits(model, ids, task.global_first_token), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % eval_every == 0 or step == steps:
            history.append(
                {
                    "step": step,
                    "loss": loss.item(),
                    "accuracy": accuracy(model, *held_out, global_first_token=task.global_first_token),
                    "seconds": round(time.perf_counter() - start, 1),
                    "cpu_seconds": round(time.process_time() - cpu, 1),
                }
            )
            bar.set_postfix(accuracy=history[-1]["accuracy"])
            if checkpoint:
                save(
                    {
                        "settings": settings,
                        "step": step,
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "data": data.get_state(),
                        "history": history,
                        "seconds": history[-1]["seconds"],
                        "cpu_seconds": history[-1]["cpu_seconds"],
                    },
                    Path(checkpoint),
                )
            if target is not None and history[-1]["accuracy"] >= target:
                break
    return {
        **settings,
        "history": history,
        "best_accuracy": max(h["accuracy"] for h in history),
        "torch": torch.__version__,
    }


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m recipes.lra.synthetic",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--attention", choices=ATTENTIONS, default="long_short")
    p.add_argument("--length", type=int, default=Task.length)
    p.add_argument("--vocab_size", type=int, default=Task.vocab_size, help="ids 0-3 reserved, random ids after them")
    p.add_argument("--labels", choices=LABELS, default=Task.labels, help="within each batch")
    p.add_argument(
        "--marker_from",
        type=float,
        default=Task.marker_from,
        help="the markers' first position, as a fraction of the length",
    )
    p.add_argument("--global_first_token", action="store_true", help="make the first token global (default: none)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--window_size", type=int, default=16)
    p.add_argument("--projection_rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--eval_every", type=int, default=100)
    p.add_argument("--eval_size", type=int, default=512, help="held-out sequences")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, help="stop once the held-out accuracy reaches this")
    p.add_argument("--checkpoint", help="save the run here at every evaluation; resume from it if it exists")
    p.add_argument("--threads", type=int)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    if args.json and not Path(args.json).resolve().parent.is_dir():
        p.error(f"--json {args.json}: its folder does not exist; create it or name another file.")
    task = Task(args.length, args.vocab_size, args.labels, args.marker_from, args.global_first_token)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = train(
        args.attention,
        task,
        args.steps,
        window_size=args.window_size,
        projection_rank=args.projection_rank,
        lr=args.lr,
        batch_size=args.batch_size,
        eval_every=args.eval_every,
        eval_size=args.eval_size,
        seed=args.seed,
        target=args.target,
        checkpoint=args.checkpoint,
        progress=True,
    )
    print(json.dumps({k: v for k, v in result.items() if k != "history"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
