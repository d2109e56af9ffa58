"""Where the time of one attention layer goes: ``torch.profiler`` over forward + backward steps of
``bench.bench_attention``'s peers (hidden 768, 12 heads, w = 256, r = 64), after warm-up steps (compilation included
there), with the operators that take the most device time listed per peer.

    python -m bench.profile_attention --n 16384                      # CUDA, bf16: long-short and flex-window
    python -m bench.profile_attention --device cpu --dtype fp32 --n 1024 --steps 2

Prints each peer's table (the operators by self device time, or by self CPU time on the CPU) and writes them to
``bench/results/profile_attention_<device>.txt`` (``--out``: another file).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench import bench_attention
from bench.common import DTYPES, RESULTS, run_meta, sync


def profile_peer(peer: str, n: int, device: str, dtype: torch.dtype, warmups: int, steps: int, rows: int) -> str:
    """The profiler's operator table of ``steps`` forward + backward steps of ``peer`` at ``n`` tokens."""
    module = bench_attention.build_peer(peer).to(device=device, dtype=dtype)
    x, grad = bench_attention.inputs(n, device, dtype)
    for _ in range(warmups):
        bench_attention.step(module, x, grad)
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            bench_attention.step(module, x, grad)
        sync(device)
    sort_by = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=60)


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
    args = parser.parse_args(argv)
    if args.n < 1 or args.steps < 1 or args.warmups < 0:
        parser.error(f"--n and --steps must be >= 1 and --warmups >= 0, got {args.n}, {args.steps}, {args.warmups}")
    meta = run_meta("profile_attention", argv, device=args.device, dtype=args.dtype, n=args.n, steps=args.steps)
    report = [f"{meta}\n"]
    for peer in args.peers:
        table = profile_peer(peer, args.n, args.device, DTYPES[args.dtype], args.warmups, args.steps, args.rows)
        report.append(f"== {peer}, n = {args.n}, {args.steps} forward + backward steps\n{table}")
        print(report[-1], flush=True)
    path = Path(args.out) if args.out else RESULTS / f"profile_attention_{args.device}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(report))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
