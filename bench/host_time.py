"""The host's part of an attention layer's training step on a GPU, measured on the CPU.

At 4,096 tokens a training step of the attention module on a GPU is bound by the host (bench/RESULTS.md: the
FlexAttention peers' GPU work is a fraction of their step), so its time is that of the Python, dynamo's guards,
AOTAutograd's wrappers, inductor's launches and allocations and the operators the host dispatches. This script times
that part on the CPU: inductor generates for CPU tensors the code it generates for CUDA (``bench.cuda_lowered``), and
each Triton kernel's launch returns at once, so that a step's time is the host's alone; the GEMMs and the eager
operators still run on the CPU, at a small width (hidden 32, 2 heads of 16, w = 128, r = 4, batch 1, 512 tokens, one
thread), where each takes microseconds. Peers, as ``bench.bench_attention`` builds them:

* ``long-short``: the default path, the layer compiled as one graph with the FlexAttention kernel inside;
* ``long-short-boundary``: the kernel's call a compile boundary (three graphs a pass);
* ``flex-window``: FlexAttention's own sliding window on eager projections, the kernel compiled.

    python -m bench.host_time                   # 200 rounds, the three peers in turn (under a minute)
    python -m bench.host_time --repeats 20      # a quick look

Prints each peer's median time a step, and of its forward and backward passes apart, the Triton kernels it launches a
step and its ratio to ``flex-window`` (the median of the rounds' ratios: on a shared machine the load moves between
rounds more than within one), and writes ``bench/results/host_time_cpu.json``. Where every peer is host-bound
on a GPU, the ratios estimate the GPU's; a GPU charges each kernel's launch too (here free), and its host may be slower
or faster than this CPU. Needs the test extras (``pytest.MonkeyPatch`` undoes the patches) and Triton (run in its
interpreter mode, which this module sets before Triton is imported). Times are never asserted anywhere.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.bench_attention import Shape, build_peer
from bench.common import interleaved_times, results_path, run_meta, write_json
from bench.cuda_lowered import launched_as_for_cuda

SHAPE = Shape(hidden=32, heads=2, window=128, rank=4)
PEERS = ("long-short", "long-short-boundary", "flex-window")
BASELINE = "flex-window"


def timed_step(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, passes: list) -> None:
    """One forward + backward step (as ``bench_attention.step``), the times of its two passes appended to ``passes``."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    start = time.perf_counter()
    out = module(x)
    middle = time.perf_counter()
    out.backward(grad)
    passes.append((middle - start, time.perf_counter() - middle))


def measure(peers: list[str], n: int, repeats: int) -> dict[str, dict]:
    """Each of ``peers``' median host time of a training step (forward + backward) at ``n`` tokens, and of its two
    passes apart, the Triton kernels it launches a step, and its ratio to ``BASELINE``'s (when measured), the peers
    taking their steps in turn (``interleaved_times``)."""
    torch.manual_seed(0)
    x = torch.randn(SHAPE.batch, n, SHAPE.hidden, requires_grad=True)
    grad = torch.randn(SHAPE.batch, n, SHAPE.hidden)
    with launched_as_for_cuda() as launched:
        modules = {peer: build_peer(peer, SHAPE) for peer in peers}
        passes = {peer: [] for peer in peers}
        steps = {
            peer: (lambda module=module, record=passes[peer]: timed_step(module, x, grad, record))
            for peer, module in modules.items()
        }
        launches = {}
        for peer, run in steps.items():
            run()  # compiles
            launched.clear()
            run()
            launches[peer] = len(launched)
        times = interleaved_times(steps, repeats, warmups=2)
    baseline = times.get(BASELINE)
    return {
        peer: {
            "time_s": statistics.median(times[peer]),
            # each round's steps run back to back: a change in the machine's load between rounds cancels out
            "ratio_to_baseline": None
            if baseline is None
            else statistics.median(time / base for time, base in zip(times[peer], baseline)),
            "forward_s": statistics.median(forward for forward, _ in passes[peer][-repeats:]),
            "backward_s": statistics.median(backward for _, backward in passes[peer][-repeats:]),
            "triton_launches": launches[peer],
        }
        for peer in peers
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--n", type=int, default=512, help="tokens (default 512: four query blocks)")
    parser.add_argument("--repeats", type=int, default=200, help="timed rounds (default 200)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/host_time_cpu.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(args.peers, args.n, args.repeats)
    print(
        f"| peer | host ms / step | forward / backward ms | Triton launches / step | / {BASELINE} |\n"
        "|---|---|---|---|---|"
    )
    for peer, row in rows.items():
        ratio = "-" if row["ratio_to_baseline"] is None else f"{row['ratio_to_baseline']:.2f}x"
        passes = f"{1e3 * row['forward_s']:.3f} / {1e3 * row['backward_s']:.3f}"
        print(f"| {peer} | {1e3 * row['time_s']:.3f} | {passes} | {row['triton_launches']} | {ratio} |")
    results = {"meta": run_meta("host_time", argv, n=args.n, shape=vars(SHAPE)), "rows": rows}
    write_json(results_path("host_time_cpu", quick=False) if args.out is None else args.out, results)
    return results


if __name__ == "__main__":
    main()
