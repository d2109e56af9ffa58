"""Where the time of one attention layer goes: ``torch.profiler`` over forward + backward steps of
``bench.bench_attention``'s peers (hidden 768, 12 heads, w = 256, r = 64), after warm-up steps (compilation included
there), with the operators that take the most device time listed per peer.

    python -m bench.profile_attention --n 16384                      # CUDA, bf16: long-short and flex-window
    python -m bench.profile_attention --device cpu --dtype fp32 --n 1024 --steps 2
    python -m bench.profile_attention --device cpu --dtype fp32 --cpu-as-cuda --peers long-short long-short-kernel

Prints each peer's table (the operators by self device time, or by self CPU time on the CPU) and its operator calls
and device kernels per step, and writes them to ``bench/results/profile_attention_<device>.txt`` (``--out``: another
file). ``--cpu-as-cuda``: the CPU takes CUDA's choices (the fused path, its compiled kernel and the layer compiled
around it), forward only (FlexAttention has no backward on the CPU); it counts what compiling the layer removes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench import bench_attention
from bench.common import DTYPES, RESULTS, run_meta, sync
from ls_hf import long_short_attention, long_short_blocks


def profile_peer(
    peer: str, n: int, device: str, dtype: torch.dtype, warmups: int, steps: int, rows: int, backward: bool = True
) -> str:
    """The profiler's operator table of ``steps`` forward + backward (or forward) steps of ``peer`` at ``n`` tokens,
    then the operator calls (``aten::`` events, nested ones included) and device kernels per step."""
    module = bench_attention.build_peer(peer).to(device=device, dtype=dtype)
    x, grad = bench_attention.inputs(n, device, dtype)
    for _ in range(warmups):
        bench_attention.step(module, x, grad, backward)
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            bench_attention.step(module, x, grad, backward)
        sync(device)
    events = prof.key_averages()
    sort_by = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    operators = sum(e.count for e in events if e.key.startswith("aten::")) / steps
    kernels = sum(e.count for e in events if e.device_type == DeviceType.CUDA) / steps
    counts = f"per step: {operators:.0f} aten operator calls, {kernels:.0f} device kernels"
    return f"{events.table(sort_by=sort_by, row_limit=rows, max_name_column_width=60)}\n{counts}"


def take_cuda_choices_on_cpu() -> None:
    """Let the CPU take CUDA's choices in this process: the fused path, its compiled kernel and compiled layer."""
    long_short_attention.FUSED_DEVICES = (*long_short_attention.FUSED_DEVICES, "cpu")
    long_short_attention.COMPILED_LAYER_DEVICES = (*long_short_attention.COMPILED_LAYER_DEVICES, "cpu")
    long_short_blocks.COMPILED_DEVICES = (*long_short_blocks.COMPILED_DEVICES, "cpu")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16384, help="tokens (batch 1)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--peers", nargs="+", default=["long-short", "flex-window"], choices=bench_attention.PEERS)
    parser.add_argument("--warmups", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=25, help="operators listed per peer")
    parser.add_argument("--out", default=None, help="default: bench/results/profile_attention_<device>.txt")
    parser.add_argument("--cpu-as-cuda", action="store_true", help="the CPU takes CUDA's choices; forward only")
    args = parser.parse_args(argv)
    if args.cpu_as_cuda and args.device != "cpu":
        parser.error(f"--cpu-as-cuda needs --device cpu, got --device {args.device}")
    if args.cpu_as_cuda:
        take_cuda_choices_on_cpu()
    if args.n < 1 or args.steps < 1 or args.warmups < 0:
        parser.error(f"--n and --steps must be >= 1 and --warmups >= 0, got {args.n}, {args.steps}, {args.warmups}")
    meta = run_meta("profile_attention", argv, device=args.device, dtype=args.dtype, n=args.n, steps=args.steps)
    report = [f"{meta}\n"]
    for peer in args.peers:
        backward = not args.cpu_as_cuda
        table = profile_peer(
            peer, args.n, args.device, DTYPES[args.dtype], args.warmups, args.steps, args.rows, backward
        )
        kind = "forward + backward" if backward else "forward"
        report.append(f"== {peer}, n = {args.n}, {args.steps} {kind} steps\n{table}")
        print(report[-1], flush=True)
    path = Path(args.out) if args.out else RESULTS / f"profile_attention_{args.device}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(report))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
