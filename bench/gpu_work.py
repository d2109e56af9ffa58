"""The GPU's work of an attention layer's training step, counted on the CPU.

Where a step is bound by the GPU (batch 8 at 4,096 tokens, or 64k tokens), its time is the memory its kernels move
and the products its GEMMs compute. This script counts both in the code inductor generates for CUDA, on the CPU
(``bench.cuda_lowered``; each Triton kernel launched, not run): the bytes inductor estimates each of its Triton kernels
reads and writes (``kernel_num_gb``: FlexAttention's kernels apart), the FLOPs of every GEMM (the profiler's count for
mm, addmm, bmm, baddbmm), and the bytes of the eager elementwise operators a peer runs outside compiled code (each
operator's inputs, and an output the size of its first; FlexAttention's window peer adds its Linears' gradients so).
Peers, as ``bench.bench_attention`` builds them, at the bars' width (hidden 768, 12 heads, w = 256, r = 64, bf16):

* ``long-short``: the default path, the layer compiled as one graph with the FlexAttention kernel inside;
* ``flex-window``: FlexAttention's own sliding window on eager projections, the kernel compiled.

    python -m bench.gpu_work                          # 4,096 tokens x 8 and 32,768 x 1 (a minute or two)
    python -m bench.gpu_work --settings 65536x1       # one setting

Prints, for each setting and peer, the Triton kernels a step, their GB (FlexAttention's apart), the eager
operators' GB, the GEMMs' TFLOP, and the kernels that move the most; writes ``bench/results/gpu_work_cpu.json``. A
count, not a time: the attention kernels' own compute is not in it, and how fast each kernel runs is the GPU's to
say. Needs the test extras and Triton, as ``bench.host_time``, and torch 2.14 or later (``TORCH_NEEDED``).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import argparse
from collections import Counter
from pathlib import Path

import torch

from bench.bench_attention import Shape, build_peer, step
from bench.common import results_path, run_meta, write_json
from bench.cuda_lowered import launched_as_for_cuda

PEERS = ("long-short", "flex-window")
SETTINGS = ("4096x8", "32768x1")
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
# Eager operators that move memory, counted where the compiled code does not run them (its kernels are Triton's)
ELEMENTWISE = ("aten::add", "aten::add_", "aten::copy_", "aten::fill_", "aten::sum", "aten::mul", "aten::cat")
TOP_KERNELS = 8
# Inductor's estimates come from each kernel's benchmark harness, which torch 2.11 writes for CPU kernels so that it
# does not import (a device guard ``with pass:``); written with 2.14
TORCH_NEEDED = "2.14"


# Element sizes by the profiler's names of dtypes (others: 4)
ITEMSIZE = {"c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "bool": 1, "unsigned char": 1}


def _operator_bytes(event) -> int:
    """The bytes an eager operator moves: its tensor inputs read, and an output the size of its first input written;
    ``copy_`` and ``fill_`` write into their first input, a sum writes a small output."""
    sizes = [
        torch.Size(shape).numel() * ITEMSIZE.get(dtype, 4)
        for shape, dtype in zip(event.input_shapes, event.input_dtypes)
        if shape and dtype
    ]
    if not sizes or event.name == "aten::fill_":
        return sizes[0] if sizes else 0
    return sum(sizes) + (0 if event.name in ("aten::copy_", "aten::sum") else sizes[0])


def _counted_eagerly(event) -> bool:
    """Whether ``event`` is an eager elementwise operator to count: not inside another one, nor inside a GEMM, where
    the CPU copies what CUDA's GEMMs read as laid out (a strided operand, a vector bias, which they add in their
    epilogue), except the copy of a bias that is not a vector over the output of ``addmm`` or ``baddbmm``, which
    CUDA makes too, for its GEMM to read again."""
    parent = event.cpu_parent
    if event.name == "aten::copy_" and parent is not None and parent.name in ("aten::addmm", "aten::baddbmm"):
        return len(parent.input_shapes[0]) > 1
    while parent is not None and parent.name.startswith("aten::"):
        if parent.name in ELEMENTWISE or parent.name in GEMMS:
            return False
        parent = parent.cpu_parent
    return event.name in ELEMENTWISE


def count_step(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, launched: list) -> dict:
    """One training step of ``module`` (after one that compiles), counted: its Triton kernels (``launched``, as
    ``lowered_as_for_cuda`` records them), its GEMMs' FLOPs and its eager elementwise operators' bytes."""
    step(module, x, grad)
    launched.clear()
    with torch.profiler.profile(record_shapes=True, with_flops=True) as profile:
        step(module, x, grad)
    events = profile.events()
    kernels = Counter()
    flex_gb = 0.0
    for kernel in launched:
        gb = kernel.inductor_meta.get("kernel_num_gb") or 0.0
        name = kernel.fn.__name__
        if "flex_attention" in name and "_tem_" in name:
            flex_gb += gb
        else:
            kernels[name] += gb
    eager = [e for e in events if _counted_eagerly(e)]
    return {
        "triton_kernels": len(launched),
        "triton_gb": sum(kernels.values()),
        "flex_attention_gb": flex_gb,
        "eager_gb": sum(_operator_bytes(e) for e in eager) / 1e9,
        "gemm_tflop": sum(e.flops for e in events if e.name in GEMMS) / 1e12,
        "gemms": sum(1 for e in events if e.name in GEMMS),
        "top_kernels_gb": dict(kernels.most_common(TOP_KERNELS)),
    }


def measure(peers: list[str], settings: list[tuple[int, int]], dtype: torch.dtype) -> dict[str, dict]:
    """``count_step`` of each peer at each (tokens, batch) setting."""
    rows = {}
    with (
        launched_as_for_cuda() as launched,
        torch._inductor.config.patch(benchmark_kernel=True),  # each kernel's estimated bytes
    ):
        for n, batch in settings:
            torch._dynamo.reset()  # compiled for this shape: inductor's estimates are for the shapes it compiled
            shape = Shape(batch=batch)
            torch.manual_seed(0)
            x = torch.randn(batch, n, shape.hidden, dtype=dtype, requires_grad=True)
            grad = torch.randn(batch, n, shape.hidden, dtype=dtype)
            for peer in peers:
                module = build_peer(peer, shape).to(dtype)
                rows[f"{n}x{batch} {peer}"] = count_step(module, x, grad, launched)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), help="TOKENSxBATCH (default 4096x8 32768x1)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/gpu_work_cpu.json)")
    args = parser.parse_args(argv)
    settings = []
    for setting in args.settings:
        n, _, batch = setting.partition("x")
        if not (n.isdigit() and batch.isdigit()):
            parser.error(f"--settings takes TOKENSxBATCH, such as 4096x8; got {setting!r}")
        settings.append((int(n), int(batch)))
    if torch.torch_version.TorchVersion(torch.__version__) < TORCH_NEEDED:
        parser.error(
            f"needs torch {TORCH_NEEDED} or later, whose inductor writes its CPU kernels' benchmark harness (where the "
            f"estimates are read) so that it imports; got torch {torch.__version__}"
        )
    rows = measure(args.peers, settings, torch.bfloat16)
    print(
        "| tokens x batch, peer | Triton kernels | Triton GB (FlexAttention's apart) | FlexAttention's GB | eager GB | "
        "GEMM TFLOP |\n|---|---|---|---|---|---|"
    )
    for name, row in rows.items():
        print(
            f"| {name} | {row['triton_kernels']} | {row['triton_gb']:.3f} | {row['flex_attention_gb']:.3f} | "
            f"{row['eager_gb']:.3f} | {row['gemm_tflop']:.3f} |"
        )
    for name, row in rows.items():
        print(f"\n{name}, the kernels that move the most (GB):")
        for kernel, gb in row["top_kernels_gb"].items():
            print(f"  {gb:.3f}  {kernel}")
    results = {"meta": run_meta("gpu_work", argv, dtype="bf16", shape=vars(Shape())), "rows": rows}
    write_json(results_path("gpu_work_cpu", quick=False) if args.out is None else args.out, results)
    return results


if __name__ == "__main__":
    main()
