"""Long-Short attention against dense and sliding-window peers: forward + backward time and peak memory.

One attention module each (query/key/value/output projections included; hidden 768, 12 heads, batch 1 by default):

* ``long-short``: ``LongShortSelfAttention`` with w = 256, r = 64 (window span 2w = 512), its default path: on CUDA
  one block-sparse FlexAttention call inside the compiled layer, elsewhere every window tile gathered at once;
* ``long-short-eager``: the same with ``attn_implementation="eager"``: the grouped SDPA path on every device;
* ``long-short-kernel``: the same with ``compile_attention=False``: on CUDA only the attention kernel compiled;
* ``long-short-recompute``: the same with ``recompute_window_tiles=True``, the memory-lean training path;
* ``sdpa``: dense ``F.scaled_dot_product_attention`` (flash attention on CUDA);
* ``eager``: dense softmax(Q K^T / sqrt(d)) V, the n x n scores materialised;
* ``longformer``: Hugging Face ``LongformerSelfAttention`` with attention_window 512 (the same span) and an output
  Linear;
* ``flex-window``: FlexAttention's own sliding window (keys within w of the query: the same 2w span) on the same
  projections, a block mask and, on CUDA, the compiled kernel. CUDA only for training (FlexAttention has no backward
  on the CPU), and there by default.

On CPU every (peer, n) runs in a forked process so that its peak memory is its own: the RSS high-water mark
(``VmHWM``) minus the RSS before the first step, and, in a second step, the CPU allocator's own peak of tensor memory
(``peak_allocated_above``: what RSS shows without glibc's heap keeping freed blocks). On CUDA it runs in-process:
``max_memory_allocated`` minus the memory allocated before the first step. A peer whose estimated need exceeds free
memory is skipped, not run into the OOM killer.

    python -m bench.bench_attention                 # CPU float32, n = 1024 ... 16384 (a few minutes)
    python -m bench.bench_attention --quick         # n = 1024, 2048 (well under a minute)
    python -m bench.bench_attention --device cuda --dtype bf16 --max-n 65536

Writes ``bench/results/attention_<device>[_<dtype>].json``, ``.md`` and ``.png`` and prints markdown tables with
Long-Short's speed and memory over each peer's. Times are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from transformers import LongformerConfig
from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

from bench.common import (
    DTYPES,
    check_device,
    free_bytes,
    interleaved_times,
    isolated,
    peak_allocated_above,
    peak_memory_above,
    reset_peak_memory,
    results_path,
    run_meta,
    sync,
    write_json,
)
from bench.plot import plot_scaling
from ls_hf.long_short_attention import LongShortSelfAttention


@dataclass(frozen=True)
class Shape:
    """The attention layer measured: width, heads, Long-Short's w and r (Longformer's window: 2w, the same span;
    FlexAttention's sliding window: +-w), and the batch."""

    hidden: int = 768
    heads: int = 12
    window: int = 256
    rank: int = 64
    batch: int = 1


SHAPE = Shape()
PEERS = (
    "long-short",
    "sdpa",
    "eager",
    "longformer",
    "flex-window",
    "long-short-recompute",
    "long-short-eager",
    "long-short-kernel",
)
TRAIN_FACTOR = 3  # forward + backward ~ 3x the forward FLOPs


# ---------------------------------------------------------------------------------------------- peers
class DenseAttention(nn.Module):
    """Full multi-head attention with the same q/k/v/o Linear layers: fused SDPA or eager (materialised scores)."""

    def __init__(self, hidden: int, heads: int, eager: bool):
        super().__init__()
        self.heads, self.eager = heads, eager
        self.query, self.key, self.value, self.output = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x):
        q, k, v = (
            proj(x).unflatten(-1, (self.heads, -1)).transpose(1, 2) for proj in (self.query, self.key, self.value)
        )
        return self.output(self.attend(q, k, v).transpose(1, 2).flatten(2))

    def attend(self, q, k, v):
        """(B, heads, n, d) queries, keys, values -> context, same shape."""
        if self.eager:
            return ((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])).softmax(-1) @ v
        return F.scaled_dot_product_attention(q, k, v)


class LongformerAttention(nn.Module):
    """Hugging Face ``LongformerSelfAttention`` (local attention only, no global token) plus the output Linear."""

    def __init__(self, hidden: int, heads: int, window: int):
        super().__init__()
        config = LongformerConfig(
            hidden_size=hidden, num_attention_heads=heads, attention_window=[window], attention_probs_dropout_prob=0.0
        )
        self.attn = LongformerSelfAttention(config, layer_id=0)
        self.output = nn.Linear(hidden, hidden)

    def forward(self, x):
        # Longformer's per-layer mask convention: 0 = local attention, < 0 = padding, > 0 = global.
        mask = x.new_zeros(x.shape[:2])
        none = mask.bool()
        out = self.attn(x, attention_mask=mask, is_index_masked=none, is_index_global_attn=none, is_global_attn=False)
        return self.output(out[0])


class LongShortAttention(nn.Module):
    """``LongShortSelfAttention`` returning only its output."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        window: int,
        rank: int,
        recompute_window_tiles: bool = False,
        attn_implementation: str = "sdpa",
        compile_attention: bool = True,
    ):
        super().__init__()
        self.attn = LongShortSelfAttention(
            hidden,
            heads,
            window,
            rank,
            recompute_window_tiles=recompute_window_tiles,
            attn_implementation=attn_implementation,
            compile_attention=compile_attention,
        )

    def forward(self, x):
        return self.attn(x)[0]


@functools.cache
def compiled(fn):
    """``torch.compile(fn)`` made once per process, so that every instance shares its compilations (one per shape at
    most), as the Long-Short path shares the package's."""
    return torch.compile(fn)


@functools.cache
def sliding_window(window: int):
    """FlexAttention's mask_mod for keys at most ``window`` positions from the query (one function per window, so a
    compiled kernel's guards hold for every instance)."""

    def within(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= window

    return within


class FlexWindowAttention(DenseAttention):
    """FlexAttention's sliding window: the dense peer's projections, keys at most ``window`` positions from the query,
    a block mask per length and, on CUDA, the compiled kernel (``compiled``; the CPU runs FlexAttention eagerly,
    forward only). The mask is built compiled there: built eagerly, ``create_block_mask`` evaluates every (query, key) pair (10 GiB at 32,768 tokens),
    which would dwarf the attention's own memory."""

    def __init__(self, hidden: int, heads: int, window: int):
        super().__init__(hidden, heads, eager=False)
        self.window = window
        self.masks = {}

    def attend(self, q, k, v):
        n, compile_here = q.shape[-2], q.device.type == "cuda"
        if n not in self.masks:
            build = compiled(create_block_mask) if compile_here else create_block_mask
            self.masks[n] = build(sliding_window(self.window), None, None, n, n, device=q.device)
        return (compiled(flex_attention) if compile_here else flex_attention)(q, k, v, block_mask=self.masks[n])


def build_peer(peer: str, shape: Shape = SHAPE) -> nn.Module:
    hidden, heads = shape.hidden, shape.heads
    if peer.startswith("long-short"):
        return LongShortAttention(
            hidden,
            heads,
            shape.window,
            shape.rank,
            recompute_window_tiles=peer == "long-short-recompute",
            attn_implementation="eager" if peer == "long-short-eager" else "sdpa",
            compile_attention=peer != "long-short-kernel",
        )
    if peer in ("sdpa", "eager"):
        return DenseAttention(hidden, heads, eager=peer == "eager")
    if peer == "longformer":
        return LongformerAttention(hidden, heads, 2 * shape.window)
    if peer == "flex-window":
        return FlexWindowAttention(hidden, heads, shape.window)
    raise ValueError(f"peer must be one of {PEERS}, got {peer!r}")


# ------------------------------------------------------------------------------------- models of cost
def model_flops(peer: str, n: int, shape: Shape = SHAPE) -> float:
    """Forward FLOPs of one sequence (multiply-add = 2), projections included."""
    d, window, rank = shape.hidden, shape.window, shape.rank
    projections = 8 * n * d * d
    if peer in ("sdpa", "eager"):
        return projections + 4 * n * n * d
    if peer in ("longformer", "flex-window"):
        return projections + 4 * n * (2 * window + 1) * d
    span = window + 2 * max(window // 2, 1)
    dynamic_projection = 2 * n * d * shape.heads * rank + 4 * n * rank * d
    return projections + dynamic_projection + 4 * n * (span + rank) * d


def estimated_bytes(peer: str, n: int, element_size: int, shape: Shape = SHAPE) -> float:
    """Generous estimate of a training step's activations: eager keeps ~3 n x n score tensors per head."""
    batch, heads = shape.batch, shape.heads
    linear = 64 * batch * n * shape.hidden * element_size
    if peer == "eager":
        return linear + 3 * batch * heads * n * n * element_size
    if peer == "longformer":
        return linear + 8 * batch * heads * n * (2 * shape.window + 1) * element_size
    return linear


# ------------------------------------------------------------------------------------------ one run
def inputs(n: int, device: str, dtype: torch.dtype, shape: Shape = SHAPE):
    """The layer's input (batch, n, hidden), which takes gradients, and the gradient its output gets."""
    torch.manual_seed(0)
    x = torch.randn(shape.batch, n, shape.hidden, device=device, dtype=dtype, requires_grad=True)
    return x, torch.randn(shape.batch, n, shape.hidden, device=device, dtype=dtype)


def step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    """One forward + backward pass."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    module(x).backward(grad)


def measure_memory(peer: str, n: int, device: str, dtype: torch.dtype, shape: Shape) -> dict:
    """Peak memory of one forward + backward step above the memory held before it."""
    module = build_peer(peer, shape).to(device=device, dtype=dtype)
    x, grad = inputs(n, device, dtype, shape)
    base = reset_peak_memory(device)
    step(module, x, grad)
    result = {"peak_mem_bytes": peak_memory_above(device, base)}
    if device == "cpu":
        result["peak_alloc_bytes"] = peak_allocated_above(lambda: step(module, x, grad))
    return result


def measure_times(peers: list[str], n: int, device: str, dtype: torch.dtype, repeats: int, shape: Shape) -> dict:
    """Forward + backward times of the peers stepped in turn (``interleaved_times``). Median per peer."""
    modules = {peer: build_peer(peer, shape).to(device=device, dtype=dtype) for peer in peers}
    x, grad = inputs(n, device, dtype, shape)
    steps = {peer: (lambda module=module: step(module, x, grad)) for peer, module in modules.items()}
    times = interleaved_times(steps, repeats, sync=lambda: sync(device))
    return {peer: {"time_s": sorted(t)[len(t) // 2], "times_s": t} for peer, t in times.items()}


def run_length(
    peers: list[str], n: int, device: str, dtype: torch.dtype, repeats: int, shape: Shape = SHAPE
) -> list[dict]:
    """Rows for one n: each peer's memory in its own process, then the times of all peers that fit, side by side.
    A peer whose estimated need exceeds 80% of the free memory is skipped."""
    rows = {}
    for peer in peers:
        flops = TRAIN_FACTOR * shape.batch * model_flops(peer, n, shape)
        rows[peer] = {"peer": peer, "n": n, "batch": shape.batch, "model_gflop_fwd_bwd": flops / 1e9}
        need, free = estimated_bytes(peer, n, dtype.itemsize, shape), free_bytes(device)
        if need > 0.8 * free:
            rows[peer] |= {"status": "skipped", "reason": f"needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"}
        else:
            rows[peer] |= isolated(device, measure_memory, peer, n, device, dtype, shape)
    timed = [peer for peer in peers if rows[peer]["status"] == "ok"]
    if timed:
        times = isolated(device, measure_times, timed, n, device, dtype, repeats, shape)
        for peer in timed:
            if times["status"] == "ok":
                rows[peer] |= times[peer]
                rows[peer]["gflop_per_s"] = rows[peer]["model_gflop_fwd_bwd"] / rows[peer]["time_s"]
            else:  # the timing process failed as a whole
                rows[peer] |= {"status": times["status"], "reason": times.get("reason", "")}
    return list(rows.values())


# ------------------------------------------------------------------------------------------ report
def _get(rows, peer, n):
    return next((r for r in rows if r["peer"] == peer and r["n"] == n), None)


def _cell(row, key, scale, fmt, base=None):
    """``row[key]`` scaled, and beside it the ratio of Long-Short's (``base``) to the row's: of speeds for a time,
    of the quantities otherwise."""
    if row is None:
        return "-"
    if row["status"] != "ok":
        return row["status"] + (f" ({row['reason']})" if row.get("reason") else "")
    text = format(row[key] * scale, fmt)
    if base is not None and base.get("status") == "ok" and base[key] > 0 and row[key] > 0:
        ratio = row[key] / base[key] if key == "time_s" else base[key] / row[key]
        text += f" ({ratio:.2f}x)"
    return text


def tables(rows, peers, ns, memory_label) -> str:
    """Markdown tables: time (Long-Short's speed over each peer's in parentheses) and memory (Long-Short's over each
    peer's), GFLOP/s and the FLOP bound."""
    lines = []
    ratio = "(x) = long-short / peer"
    metrics = [
        ("median time, forward + backward (ms); (x) = long-short's speed / peer's", "time_s", 1e3, ".1f"),
        (f"{memory_label} (MiB); {ratio}", "peak_mem_bytes", 2.0**-20, ".0f"),
    ]
    if any("peak_alloc_bytes" in row for row in rows):
        metrics.append((f"peak tensor memory, CPU allocator (MiB); {ratio}", "peak_alloc_bytes", 2.0**-20, ".0f"))
    for title, key, scale, fmt in metrics:
        lines += [f"**{title}**", "", "| n | " + " | ".join(peers) + " |", "|---" * (len(peers) + 1) + "|"]
        for n in ns:
            base = _get(rows, "long-short", n)
            cells = [_cell(_get(rows, p, n), key, scale, fmt, None if p == "long-short" else base) for p in peers]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "**effective GFLOP/s (model FLOPs of ``model_flops``, projections included, x3 for fwd + bwd)**",
        "",
        "| n | " + " | ".join(peers) + " | FLOP bound dense / LS |",
        "|---" * (len(peers) + 2) + "|",
    ]
    for n in ns:
        cells = [_cell(_get(rows, p, n), "gflop_per_s", 1.0, ".0f") for p in peers]
        lines.append(
            f"| {n} | " + " | ".join(cells) + f" | {model_flops('sdpa', n) / model_flops('long-short', n):.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="n = 1024, 2048 and 1 timed step (under a minute)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    parser.add_argument("--min-n", type=int, default=1024)
    parser.add_argument("--max-n", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1, help="sequences of n tokens in one step")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps after one warm-up (default 3)")
    parser.add_argument(
        "--peers",
        nargs="+",
        default=None,
        choices=PEERS,
        help="default: the first four, and flex-window on CUDA (no FlexAttention backward on CPU); "
        "long-short-recompute is Long-Short with recompute_window_tiles=True",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON path (default bench/results/[quick/]attention_<device>...)"
    )
    args = parser.parse_args(argv)
    check_device(parser, args.device)
    if min(args.batch, args.min_n, 1 if args.repeats is None else args.repeats) < 1:
        parser.error("--batch, --min-n and --repeats must be positive")
    args.peers = args.peers or [*PEERS[:4], *(["flex-window"] if args.device == "cuda" else [])]
    if args.quick:
        args.max_n = min(args.max_n, 2048)
    args.repeats = args.repeats or (1 if args.quick else 3)
    ns = [n for n in (2**k for k in range(10, 31)) if args.min_n <= n <= args.max_n]
    if not ns:
        parser.error(f"no power of two from 1024 lies within --min-n {args.min_n} and --max-n {args.max_n}")
    shape = replace(SHAPE, batch=args.batch)
    memory_label = "peak CUDA memory above baseline" if args.device == "cuda" else "peak RSS above baseline"

    rows = []
    for n in ns:
        for row in run_length(args.peers, n, args.device, DTYPES[args.dtype], args.repeats, shape):
            rows.append(row)
            ok = row["status"] == "ok" and "time_s" in row
            shown = f"{row['time_s'] * 1e3:9.1f} ms {row['peak_mem_bytes'] / 2**20:8.0f} MiB" if ok else ""
            print(f"  n={n:<6} {row['peer']:<20} {row['status']:<8} {shown} {row.get('reason', '')}", flush=True)

    meta = run_meta(
        "bench.bench_attention",
        argv,
        device=args.device,
        dtype=args.dtype,
        repeats=args.repeats,
        config=asdict(shape) | {"longformer_attention_window": 2 * shape.window},
        memory="RSS high-water mark (VmHWM) minus RSS before the first step, forked process per (peer, n)"
        if args.device == "cpu"
        else "torch.cuda.max_memory_allocated minus memory_allocated before the first step",
        time=f"median of {args.repeats} forward + backward steps after 1 warm-up, the peers of one n stepped in "
        "turn in one process",
    )
    lines = [
        f"{meta['date']}, {meta['cpu']}, nproc {meta['nproc']}, torch {meta['torch']}, {args.device} {args.dtype}",
        f"(torch threads {meta['threads']}); command: `{meta['command']}`",
        f"time: {meta['time']}; memory: {meta['memory']}.",
        "",
        tables(rows, args.peers, ns, memory_label),
    ]
    text = "\n".join(lines)
    print("\n" + text)

    suffix = "" if args.dtype == "fp32" else f"_{args.dtype}"
    out = args.out or results_path(f"attention_{args.device}{suffix}", args.quick)
    write_json(out, {"meta": meta, "results": rows})
    out.with_suffix(".md").write_text(text)
    title = (
        f"one attention layer, fwd+bwd, d={shape.hidden}, H={shape.heads}, w={shape.window}, r={shape.rank}, "
        f"batch {shape.batch}, {args.device} {args.dtype}"
    )
    plot_scaling(rows, out.with_suffix(".png"), title, memory_label + " (MiB)")
    print(f"wrote {out} and its .md, .png")


if __name__ == "__main__":
    main()
