"""Whole models: a masked-LM training step against RoBERTa (SDPA), Longformer and ModernBERT, and cached generation.

Training: base width (hidden 768, 12 heads, intermediate 3072), few layers on CPU:

* ``long-short``: ``LongShortForMaskedLM`` with w = 256, r = 64;
* ``roberta-sdpa``: ``RobertaForMaskedLM`` with SDPA attention and n + 2 positions;
* ``longformer``: ``LongformerForMaskedLM`` with attention_window 512 (the same 2w span), no global tokens;
* ``modernbert``: ModernBERT-base as ``ModernBertConfig`` defines it (its own widths and 22 layers, whatever
  ``--layers`` says), random weights, with its fastest attention available here (``modernbert_attention``); not a
  default peer.

One step = forward + backward of the MLM loss on all n tokens of ``--batch`` sequences (with ``--optimizer-step``,
then AdamW's update, fused on CUDA). The vocabulary is small (``--vocab``, 1024) so that the LM head, identical work
for every peer (2 n d V FLOPs), does not hide the encoders when only 1-2 layers run. Attention dropout is 0 for every
peer (hidden dropout stays 0.1): with attention dropout PyTorch's CPU SDPA leaves its fused kernel for the n x n math
path (measured 3.4x slower at n = 4096), which would not be RoBERTa-SDPA. Peak memory: each (peer, n) runs one step
in its own forked process, RSS high-water mark minus the RSS of the built model. Time: the peers of one n are built in
one forked process and stepped in turn, round after round, so that the load of other processes on this shared machine
hits them alike. A peer whose estimated need exceeds 80 % of free memory is skipped.

Generation: ``LongShortForCausalLM`` (same width and layers, w = 256, l = 16, r = 1 as the official enwik8
models) decoding greedily after a prompt of 512, 2048 and 8192 tokens, with the ``LongShortCache`` and without
(every step recomputes the whole sequence). Per-token time = median time between consecutive decoding steps
inside ``generate`` (a stopping criterion records the clock), so the prefill is not counted.

    python -m bench.bench_models                                   # 4096 (2 layers) and generation
    python -m bench.bench_models --lengths 16384 --layers 1 --repeats 1 --skip-generation
    python -m bench.bench_models --quick                           # n = 1024, short contexts: a smoke run
    python -m bench.bench_models --lengths 16384 --layers 12 --gradient-checkpointing --global-first-token \
        --single-step --skip-generation                            # 12 layers: one step per peer
    python -m bench.bench_models --device cuda --dtype bf16 --layers 12 --lengths 4096 --batch 8 --optimizer-step \
        --peers long-short roberta-sdpa modernbert --contexts 512 8192

``--gradient-checkpointing`` recomputes each layer in the backward pass (every peer); ``--global-first-token`` makes
the first token global in LongShort and Longformer (what their classification heads do; RoBERTa is dense anyway);
``--single-step`` times the one step that measures memory, in its own process, instead of warm-up and rounds.
``--device cuda`` runs every measurement in-process, peak memory as ``torch.cuda.max_memory_allocated`` above the
memory allocated before the step.

Writes ``bench/results/models_<device>[_<dtype>].json`` (``bench/results/quick/`` with ``--quick``; ``--out`` another
path): the machine and command, each row's step times in run order with their median, tokens/s and ratios. Prints
markdown tables with the ratios; times are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    LongformerConfig,
    LongformerForMaskedLM,
    ModernBertConfig,
    ModernBertForMaskedLM,
    RobertaConfig,
    RobertaForMaskedLM,
    StoppingCriteria,
    StoppingCriteriaList,
)

from bench.common import (
    DTYPES,
    check_device,
    free_bytes,
    interleaved_times,
    isolated,
    peak_memory_above,
    reset_peak_memory,
    results_path,
    run_meta,
    sync,
    write_json,
)
from ls_hf import LongShortConfig, LongShortForCausalLM, LongShortForMaskedLM

BASE = {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072}
WINDOW, RANK, LONGFORMER_WINDOW = 256, 64, 512
PEERS = ("long-short", "roberta-sdpa", "longformer", "modernbert")  # the first three by default


def modernbert_attention(device: str) -> str:
    """ModernBERT's fastest attention here: flash attention 2 on CUDA when the ``flash_attn`` package is installed,
    else SDPA."""
    return "flash_attention_2" if device == "cuda" and importlib.util.find_spec("flash_attn") else "sdpa"


def depth(peer: str, layers: int) -> int:
    """The layers of ``peer``'s model: ``layers``, or ModernBERT-base's own."""
    return ModernBertConfig().num_hidden_layers if peer == "modernbert" else layers


def build_mlm(peer: str, n: int, layers: int, vocab: int, recompute_window_tiles: bool = False, device: str = "cpu"):
    """The peer's masked LM with ``layers`` layers (ModernBERT: its own) and room for n tokens (RoBERTa positions:
    n + 2 rows); ``recompute_window_tiles`` for Long-Short (``LongShortConfig``). ``device``: where it will run
    (ModernBERT's attention depends on it)."""
    if peer == "modernbert":  # token ids 0-2 as RoBERTa's, inside any vocabulary
        return ModernBertForMaskedLM(
            ModernBertConfig(
                vocab_size=vocab,
                max_position_embeddings=n,
                pad_token_id=1,
                bos_token_id=0,
                eos_token_id=2,
                cls_token_id=0,
                sep_token_id=2,
                attn_implementation=modernbert_attention(device),
            )
        )
    common = {
        **BASE,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "max_position_embeddings": n + 2,
        "type_vocab_size": 1,
        "layer_norm_eps": 1e-5,
        "attention_probs_dropout_prob": 0.0,
    }
    if peer == "long-short":
        return LongShortForMaskedLM(
            LongShortConfig(
                **common, window_size=WINDOW, projection_rank=RANK, recompute_window_tiles=recompute_window_tiles
            )
        )
    if peer in ("roberta-sdpa", "roberta-eager"):  # eager: the n x n scores materialised
        return RobertaForMaskedLM(RobertaConfig(**common, attn_implementation=peer.removeprefix("roberta-")))
    if peer == "longformer":
        return LongformerForMaskedLM(LongformerConfig(**common, attention_window=LONGFORMER_WINDOW))
    raise ValueError(f"peer must be one of {PEERS + ('roberta-eager',)}, got {peer!r}")


@dataclass(frozen=True)
class Setup:
    """What every peer's training step shares: the models' layers and vocabulary, gradient checkpointing, the first
    token global, where it runs, and the batch; ``optimizer_step``: the step ends with AdamW's update of every
    parameter (fused on CUDA), as a step of real training does."""

    layers: int = 2
    vocab: int = 1024
    checkpointing: bool = False
    global_first: bool = False
    device: str = "cpu"
    dtype: str = "fp32"
    batch: int = 1
    optimizer_step: bool = False


def estimated_bytes(peer: str, n: int, setup: Setup) -> float:
    """Generous fp32 estimate of a training step: ~64 d floats per token and layer held (one layer and every layer's
    input with checkpointing), logits x3, Longformer's bands."""
    layers = depth(peer, setup.layers)
    held = 1 if setup.checkpointing else layers
    need = (
        held * 64 * n * BASE["hidden_size"] * 4
        + 3 * n * setup.vocab * 4
        + setup.checkpointing * layers * n * BASE["hidden_size"] * 8
    )
    if peer == "longformer":
        need += held * 8 * BASE["num_attention_heads"] * n * (LONGFORMER_WINDOW + 1) * 4
    return setup.batch * need


def training_step(peer: str, n: int, setup: Setup):
    """A closure running one training step (forward + backward of the MLM loss over ``setup.batch`` sequences of n
    tokens, then the optimizer's step if ``setup.optimizer_step``) of a freshly built peer."""
    device = setup.device
    torch.manual_seed(0)
    model = build_mlm(peer, n, setup.layers, setup.vocab, device=device).to(device, DTYPES[setup.dtype]).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda") if setup.optimizer_step else None
    if setup.checkpointing:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    ids = torch.randint(3, setup.vocab, (setup.batch, n), device=device)
    inputs = {"input_ids": ids, "labels": ids}
    if setup.global_first and peer in ("long-short", "longformer"):
        inputs["global_attention_mask"] = torch.zeros_like(ids)
        inputs["global_attention_mask"][:, 0] = 1

    def step():
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()
        if optimizer is not None:
            optimizer.step()

    return step


def measure_memory(peer: str, n: int, setup: Setup) -> dict:
    """Peak memory (RSS; CUDA: allocated) of one training step above that of the built model, and that step's time."""
    step = training_step(peer, n, setup)
    base = reset_peak_memory(setup.device)
    start = time.perf_counter()
    step()
    sync(setup.device)
    return {"single_step_s": time.perf_counter() - start, "peak_mem_bytes": peak_memory_above(setup.device, base)}


def measure_times(peers, n: int, repeats: int, setup: Setup) -> dict:
    """Step times of all peers built in one process and stepped in turn (``interleaved_times``). Returns
    {peer: times in run order}."""
    steps = {peer: training_step(peer, n, setup) for peer in peers}
    return interleaved_times(steps, repeats, sync=lambda: sync(setup.device))


def run_training(peers, lengths, repeats: int, threads: int, setup: Setup, single_step: bool = False) -> list[dict]:
    """Per n: peak memory of each peer in its own process (CUDA: in this one), then the interleaved timing of the
    peers that fit (with ``single_step``, the memory step's time instead)."""
    rows = []
    device = setup.device
    for n in lengths:
        fitting = []
        for peer in peers:
            row = {"peer": peer, "n": n, "batch": setup.batch, "layers": depth(peer, setup.layers)}
            need, free = estimated_bytes(peer, n, setup), free_bytes(device)
            if need > 0.8 * free:
                row |= {"status": "skipped", "reason": f"needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"}
            else:
                row |= isolated(device, measure_memory, peer, n, setup, threads=threads)
                if row["status"] == "ok":
                    fitting.append(peer)
            rows.append(row)
            print(
                f"  memory n={n:<6} {peer:<13} {row['status']:<8} "
                f"{row.get('peak_mem_bytes', 0) / 2**20:8.0f} MiB {row.get('single_step_s', 0):8.1f} s "
                f"{row.get('reason', '')}",
                flush=True,
            )
        if single_step:
            timed = {
                "status": "ok",
                **{row["peer"]: [row["single_step_s"]] for row in rows[-len(peers) :] if row["peer"] in fitting},
            }
        else:
            timed = isolated(device, measure_times, fitting, n, repeats, setup, threads=threads) if fitting else {}
        for row in rows[-len(peers) :]:
            if row["peer"] in fitting and timed["status"] == "ok":
                times = timed[row["peer"]]
                median = sorted(times)[len(times) // 2]
                row |= {"time_s": median, "times_s": times, "tokens_per_s": setup.batch * n / median}
                print(f"  time   n={n:<6} {row['peer']:<13} {row['time_s']:8.3f} s", flush=True)
            elif row["peer"] in fitting:
                row |= {"status": timed["status"], "reason": timed.get("reason", "")}
    return rows


class StepClock(StoppingCriteria):
    """Records the time of every decoding step of ``generate``; never stops it."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def measure_generation(
    context: int,
    new_tokens: int,
    use_cache: bool,
    layers: int,
    vocab: int,
    device: str = "cpu",
    dtype: str = "fp32",
) -> dict:
    """Median per-token decoding time after a ``context``-token prompt, with or without the cache."""
    torch.manual_seed(0)
    config = LongShortConfig(
        **BASE,
        num_hidden_layers=layers,
        vocab_size=vocab,
        is_decoder=True,
        window_size=WINDOW,
        projection_rank=1,
        causal_segment_length=16,
        max_position_embeddings=context + new_tokens + 3,
    )
    model = LongShortForCausalLM(config).to(device, DTYPES[dtype]).eval()
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=1, bos_token_id=0)
    prompt = torch.randint(3, vocab, (1, context), device=device)
    clock = StepClock()
    start = time.perf_counter()
    model.generate(
        prompt,
        max_new_tokens=new_tokens + 1,
        do_sample=False,
        use_cache=use_cache,
        stopping_criteria=StoppingCriteriaList([clock]),
    )
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    per_token = sorted(steps)[len(steps) // 2]
    return {
        "prefill_s": clock.times[0] - start,
        "per_token_s": per_token,
        "per_token_times_s": steps,
        "tokens_per_s": 1 / per_token,
    }


def run_generation(
    contexts, layers, vocab, cached_tokens, uncached_tokens, threads, device="cpu", dtype="fp32"
) -> list[dict]:
    rows = []
    for context in contexts:
        for use_cache, tokens in ((True, cached_tokens), (False, uncached_tokens)):
            row = {"context": context, "use_cache": use_cache, "new_tokens": tokens}
            row |= isolated(
                device, measure_generation, context, tokens, use_cache, layers, vocab, device, dtype, threads=threads
            )
            rows.append(row)
            shown = f"{row['per_token_s'] * 1e3:9.1f} ms/token" if row["status"] == "ok" else row.get("reason", "")
            print(f"  generate context={context:<6} cache={use_cache!s:<5} {row['status']:<6} {shown}", flush=True)
    return rows


def _find(rows, **keys):
    return next((r for r in rows if all(r.get(k) == v for k, v in keys.items()) and r["status"] == "ok"), None)


def add_ratios(train_rows, gen_rows) -> None:
    """Store what the tables show as ratios: ``ls_speedup`` (long-short tokens/s over the peer's, at the same n) in
    the other peers' rows, ``cache_speedup`` (cached tokens/s over uncached, same context) in the cached rows."""
    for row in train_rows:
        ours = _find(train_rows, peer="long-short", n=row["n"])
        if ours and row["peer"] != "long-short" and row["status"] == "ok":
            row["ls_speedup"] = ours["tokens_per_s"] / row["tokens_per_s"]
    for row in gen_rows:
        plain = _find(gen_rows, context=row["context"], use_cache=False)
        if plain and row["use_cache"] and row["status"] == "ok":
            row["cache_speedup"] = row["tokens_per_s"] / plain["tokens_per_s"]


def training_table(rows, peers, lengths) -> str:
    lines = [
        "| n | layers | peer | s / step | tokens / s | LS speedup | peak memory above model (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in lengths:
        for peer in peers:
            row = next(r for r in rows if r["peer"] == peer and r["n"] == n)
            if row["status"] != "ok":
                lines.append(f"| {n} | {row['layers']} | {peer} | {row['status']} ({row.get('reason', '')}) | | | |")
                continue
            speedup = f"{row['ls_speedup']:.2f}x" if "ls_speedup" in row else ""
            lines.append(
                f"| {n} | {row['layers']} | {peer} | {row['time_s']:.3f} | {row['tokens_per_s']:.0f} | "
                f"{speedup} | {row['peak_mem_bytes'] / 2**20:.0f} |"
            )
    return "\n".join(lines) + "\n"


def generation_table(rows, contexts) -> str:
    lines = [
        "| context | cached tokens / s | uncached tokens / s | cache speedup | cached ms / token | prefill s |",
        "|---|---|---|---|---|---|",
    ]
    for context in contexts:
        cached, plain = _find(rows, context=context, use_cache=True), _find(rows, context=context, use_cache=False)
        cells = [
            f"{cached['tokens_per_s']:.1f}" if cached else "-",
            f"{plain['tokens_per_s']:.2f}" if plain else "-",
            f"{cached['cache_speedup']:.0f}x" if cached and "cache_speedup" in cached else "-",
            f"{cached['per_token_s'] * 1e3:.1f}" if cached else "-",
            f"{cached['prefill_s']:.2f}" if cached else "-",
        ]
        lines.append(f"| {context} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096], help="training sequence lengths")
    parser.add_argument("--layers", type=int, default=2, help="layers of every model (training and generation)")
    parser.add_argument("--batch", type=int, default=1, help="training sequences in one step")
    parser.add_argument("--repeats", type=int, default=2, help="timed training steps after one warm-up")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size (LM head cost, same for all)")
    parser.add_argument("--peers", nargs="+", default=list(PEERS[:3]), choices=PEERS)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192], help="generation prompts")
    parser.add_argument("--cached-tokens", type=int, default=32, help="timed new tokens with the cache")
    parser.add_argument("--uncached-tokens", type=int, default=3, help="timed new tokens without the cache")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per measurement (0: torch default)")
    parser.add_argument("--quick", action="store_true", help="n = 1024, 1 layer, contexts 256 and 1024")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/models_cpu.json)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute layers in the backward pass")
    parser.add_argument("--global-first-token", action="store_true", help="LS and Longformer: first token global")
    parser.add_argument("--optimizer-step", action="store_true", help="each training step ends with AdamW's update")
    parser.add_argument("--single-step", action="store_true", help="time the memory step only (no warm-up, rounds)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    args = parser.parse_args(argv)
    check_device(parser, args.device)
    for name in ("layers", "batch", "repeats", "vocab", "cached_tokens", "uncached_tokens", "threads"):
        if getattr(args, name) < (0 if name == "threads" else 1):
            parser.error(
                f"--{name.replace('_', '-')} must be >= {0 if name == 'threads' else 1}, got {getattr(args, name)}"
            )
    if min(args.lengths + args.contexts) < 1:
        parser.error("--lengths and --contexts must be positive")
    if args.quick:
        args.lengths, args.layers, args.repeats, args.contexts = [1024], 1, 1, [256, 1024]
        args.cached_tokens, args.uncached_tokens = 8, 2
    setup = Setup(
        args.layers,
        args.vocab,
        args.gradient_checkpointing,
        args.global_first_token,
        args.device,
        args.dtype,
        args.batch,
        args.optimizer_step,
    )

    train_rows = (
        []
        if args.skip_training
        else run_training(args.peers, args.lengths, args.repeats, args.threads, setup, args.single_step)
    )
    gen_rows = (
        []
        if args.skip_generation
        else run_generation(
            args.contexts,
            args.layers,
            args.vocab,
            args.cached_tokens,
            args.uncached_tokens,
            args.threads,
            args.device,
            args.dtype,
        )
    )
    add_ratios(train_rows, gen_rows)
    meta = run_meta(
        "bench.bench_models",
        argv,
        measurement_threads=args.threads or torch.get_num_threads(),
        device=args.device,
        dtype=args.dtype,
        config={
            **BASE,
            **asdict(setup),
            "window": WINDOW,
            "rank": RANK,
            "longformer_attention_window": LONGFORMER_WINDOW,
            "generation": {
                "window": WINDOW,
                "causal_segment_length": 16,
                "rank": 1,
                "cached_tokens": args.cached_tokens,
                "uncached_tokens": args.uncached_tokens,
            },
        },
        memory="RSS high-water mark (VmHWM) over one training step minus RSS of the built model, forked process "
        "per (peer, n)"
        if args.device == "cpu"
        else "torch.cuda.max_memory_allocated over one training step minus memory_allocated of the built model",
        time=(
            "training: the one MLM step that measured memory, in its own forked process"
            if args.single_step
            else f"training: median of {args.repeats} MLM steps after a warm-up round, the peers of one n stepped in "
            "turn in one forked process (times_s in run order)"
        )
        + "; generation: median time between consecutive greedy decoding steps (per_token_times_s), prefill excluded",
    )
    print(
        f"\n{meta['date']}  {meta['cpu']}  nproc={meta['nproc']} threads={meta['measurement_threads']}  "
        f"torch {meta['torch']}  {meta.get('gpu', args.device)} {args.dtype}\n`{meta['command']}`\n"
    )
    if train_rows:
        timing = (
            "one step per peer, in its own process"
            if args.single_step
            else f"median of {args.repeats} rounds after a warm-up round, peers interleaved in one process"
        )
        options = (
            "gradient checkpointing, " * args.gradient_checkpointing
            + "global first token, " * args.global_first_token
            + "AdamW's update, " * args.optimizer_step
        )
        print(
            f"**MLM training step (fwd + bwd), batch {args.batch}, vocab {args.vocab}, {timing}; {options}"
            f"LS w={WINDOW} r={RANK}, Longformer window {LONGFORMER_WINDOW}**\n"
        )
        print(training_table(train_rows, args.peers, args.lengths))
    if gen_rows:
        print(
            f"**Greedy decoding, LongShortForCausalLM d=768, {args.layers} layers, w={WINDOW}, l=16, r=1; median time "
            f"between decoding steps over {args.cached_tokens} cached / {args.uncached_tokens} uncached steps**\n"
        )
        print(generation_table(gen_rows, args.contexts))

    suffix = "" if args.dtype == "fp32" else f"_{args.dtype}"
    out = args.out or results_path(f"models_{args.device}{suffix}", args.quick)
    write_json(out, {"meta": meta, "training": train_rows, "generation": gen_rows})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
