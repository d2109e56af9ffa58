"""Where the time of one attention layer goes: ``torch.profiler`` over forward + backward steps of
``bench.bench_attention``'s peers (hidden 768, 12 heads, w = 256, r = 64), after warm-up steps (compilation included
there), with the operators that take the most device time listed per peer.

    python -m bench.profile_attention --n 16384                      # CUDA, bf16: long-short and flex-window
    python -m bench.profile_attention --n 4096 --batch 8             # the batch-8 setting of the bars
    python -m bench.profile_attention --n 4096 --peers long-short long-short-boundary flex-window  # one graph or three
    python -m bench.profile_attention --device cpu --dtype fp32 --n 1024 --steps 2
    python -m bench.profile_attention --device cpu --dtype fp32 --cpu-as-cuda --peers long-short long-short-kernel
    python -m bench.profile_attention --device cpu --dtype fp32 --cpu-as-cuda --saved --n 2048 --peers sdpa long-short
    python -m bench.profile_attention --vision cvt_ls_13 cvt_ls_13-kernel hf_cvt_13 --resolution 224 --batch 32
    python -m bench.profile_attention --vision cvt_ls_13 cvt_ls_13-triton --train --resolution 224 --batch 32

Prints each peer's table (the operators by self device time, or by self CPU time on the CPU) and its operator calls,
device kernels and compiled graphs run per step, and writes them to ``bench/results/profile_attention_<device>.txt``
(``--out``: another file). ``--cpu-as-cuda``: the CPU takes CUDA's choices (the fused path, its compiled kernel and
the layer compiled around it), forward only (FlexAttention has no backward on the CPU); it counts what compiling the
layer removes.
``--vision``: instead, inference of whole vision models (``bench.bench_vision``'s), or with ``--train`` training steps
(forward and backward of the cross-entropy loss); ``cvt_ls_13-kernel`` is ``cvt_ls_13`` with its Long-Short layers'
``compile_attention=False`` (the kernel alone compiled), ``cvt_ls_13-triton`` it on the Triton window kernels instead
of FlexAttention. Below each table, the time of the attention layers of each input shape (each stage), their kernels
included (in training, their forward passes).

``--saved``: instead, what one forward pass keeps for the backward pass, the distinct storages autograd saves (the
parameters and the input left out), in units of one (n, hidden) tensor, with their shapes: the part of training's
peak memory that stays from the forward pass to the backward pass. With ``--cpu-as-cuda``, FlexAttention's call runs
without autograd and keeps what FlexAttention's backward takes on CUDA (query, keys, values, output, log-sum-exp),
with its output laid out as CUDA's kernel writes it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from unittest.mock import patch

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from transformers.models.cvt.modeling_cvt import CvtSelfAttention

from bench import bench_attention, bench_vision
from bench.common import DTYPES, RESULTS, run_meta, sync, take_cuda_choices_on_cpu
from ls_hf import long_short_blocks
from ls_timm.long_short_attention_2d import LongShortAttention2d


class FlexAttentionKeepingItsInputs(torch.autograd.Function):
    """``long_short_blocks.flex_attend`` for ``--saved`` on the CPU, which has no FlexAttention backward: the call
    without autograd, keeping what FlexAttention's backward pass takes on CUDA (query, key, value, output and the
    float32 log-sum-exp, here a stand-in of zeros, which it also returns), the output laid out as CUDA's kernel writes
    it, in the query's layout. Its backward pass returns zero gradients: it is for counting only
    (``flex_attend_keeping_its_inputs``)."""

    attend = staticmethod(long_short_blocks.flex_attend)

    @staticmethod
    def forward(ctx, query, key, value, block_mask, tokens_first):
        heads_first = [x.detach().transpose(1, 2) if tokens_first else x.detach() for x in (query, key, value)]
        out = FlexAttentionKeepingItsInputs.attend(*heads_first, block_mask)
        out = out.transpose(1, 2).contiguous() if tokens_first else out
        lse = query.new_zeros(heads_first[0].shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, *_ = ctx.saved_tensors
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value), None, None


def flex_attend_keeping_its_inputs(query, key, value, block_mask, *, return_lse=False, tokens_first=False):
    """``FlexAttentionKeepingItsInputs`` called as ``long_short_blocks.flex_attend`` is."""
    out, lse = FlexAttentionKeepingItsInputs.apply(query, key, value, block_mask, tokens_first)
    return (out, lse) if return_lse else out


def saved_for_backward(peer: str, n: int, device: str, dtype: torch.dtype, cpu_as_cuda: bool = False) -> str:
    """What one forward pass of ``peer`` at ``n`` tokens keeps for the backward pass (after a forward + backward
    warm-up step): the distinct storages autograd saves, the parameters and the input left out, in total and by
    shape, in units of one (n, hidden) tensor of ``dtype``. ``cpu_as_cuda``: FlexAttention's calls go through
    ``FlexAttentionKeepingItsInputs``."""
    if cpu_as_cuda:
        with patch.object(long_short_blocks, "flex_attend", flex_attend_keeping_its_inputs):
            return saved_for_backward(peer, n, device, dtype)
    module = bench_attention.build_peer(peer).to(device=device, dtype=dtype)
    x, grad = bench_attention.inputs(n, device, dtype)
    bench_attention.step(module, x, grad)
    left_out = {t.untyped_storage().data_ptr() for t in (x, *module.parameters())}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in left_out:
            saved[storage.data_ptr()] = (
                storage.nbytes(),
                tuple(tensor.shape),
                str(tensor.dtype).removeprefix("torch."),
            )
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    unit = x[0].numel() * x.element_size()
    total = sum(size for size, *_ in saved.values())
    lines = [f"kept for the backward pass: {total / 2**20:.1f} MiB = {total / unit:.2f} x (n, hidden)"]
    by_shape = Counter(saved.values())
    for (size, shape, kind), count in sorted(by_shape.items(), key=lambda item: -item[0][0] * item[1]):
        lines.append(f"  {count} x {size / unit:.3f}  {shape} {kind}")
    return "\n".join(lines)


def profile_peer(
    peer: str,
    n: int,
    device: str,
    dtype: torch.dtype,
    warmups: int,
    steps: int,
    rows: int,
    backward: bool = True,
    batch: int = 1,
) -> str:
    """The profiler's operator table of ``steps`` forward + backward (or forward) steps of ``peer`` at ``batch``
    sequences of ``n`` tokens, then the operator calls (``aten::`` events, nested ones included), device kernels and
    compiled graphs run (``torch.compile``'s regions) per step."""
    shape = dataclasses.replace(bench_attention.SHAPE, batch=batch)
    module = bench_attention.build_peer(peer, shape).to(device=device, dtype=dtype)
    x, grad = bench_attention.inputs(n, device, dtype, shape)
    return profiled(lambda: bench_attention.step(module, x, grad, backward), device, warmups, steps, rows)


def profile_vision(
    peer: str,
    resolution: int,
    batch: int,
    device: str,
    dtype: torch.dtype,
    warmups: int,
    steps: int,
    rows: int,
    train: bool = False,
) -> str:
    """``profile_peer`` for inference (``train``: a training step, forward and backward of the cross-entropy loss)
    of a ``bench.bench_vision`` model (random weights) on ``batch`` images of ``resolution``; a peer name ending in
    one of ``bench_vision.VARIANTS`` builds that variant (``-kernel``: its Long-Short layers with
    ``compile_attention=False``; ``-triton``: on the Triton window kernels)."""
    model = bench_vision.build_peer(peer, resolution).to(device=device, dtype=dtype).train(train)
    images = torch.randn(batch, 3, resolution, resolution, device=device, dtype=dtype)
    labels = torch.zeros(batch, dtype=torch.long, device=device)

    def step():
        if train:
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(bench_vision.logits(model, images), labels).backward()
            return
        with torch.no_grad():
            bench_vision.logits(model, images)

    with labelled_attention_layers(model):
        return profiled(step, device, warmups, steps, rows)


# The profiler ranges of ``labelled_attention_layers``: the attention layer's class and its input's shape follow.
LAYER_RANGE = "attention layer "


@contextlib.contextmanager
def labelled_attention_layers(model: torch.nn.Module):
    """While it is open, each attention layer of ``model`` (Long-Short's 2-D layers, Transformers' CvT attention) runs
    inside a profiler range named ``LAYER_RANGE`` + its class and input shape, so that ``profiled`` reports the device
    time of the layers of each shape (a stage of the model) apart."""
    handles = []
    for module in model.modules():
        if isinstance(module, LongShortAttention2d | CvtSelfAttention):
            ranges = []

            def enter(module, inputs, ranges=ranges):
                ranges.append(record_function(f"{LAYER_RANGE}{type(module).__name__} {tuple(inputs[0].shape)}"))
                ranges[-1].__enter__()

            def leave(module, inputs, output, ranges=ranges):
                ranges.pop().__exit__(None, None, None)

            handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def profiled(step: Callable[[], None], device: str, warmups: int, steps: int, rows: int) -> str:
    """The profiler's operator table of ``steps`` calls of ``step`` after ``warmups``, then the operator calls
    (``aten::`` events, nested ones included), device kernels and compiled graphs run
    (``torch.compile``'s regions) per step."""
    for _ in range(warmups):
        step()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    events = prof.key_averages()
    sort_by = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    operators = sum(e.count for e in events if e.key.startswith("aten::")) / steps
    kernels = sum(e.count for e in events if e.device_type == DeviceType.CUDA) / steps
    graphs = sum(e.count for e in events if e.key.startswith("Torch-Compiled Region")) / steps
    counts = (
        f"per step: {operators:.0f} aten operator calls, {kernels:.0f} device kernels, {graphs:.0f} compiled graphs run"
    )
    time_of = (lambda e: e.device_time_total) if device == "cuda" else (lambda e: e.cpu_time_total)
    layers = [
        f"  {e.key.removeprefix(LAYER_RANGE)}: {e.count / steps:.0f} calls, {time_of(e) / steps / 1e3:.3f} ms"
        for e in sorted(events, key=lambda e: e.key)
        if e.key.startswith(LAYER_RANGE)
    ]
    if layers:
        kind = "device" if device == "cuda" else "CPU"
        counts += f"\nattention layers by input shape, per step ({kind} time, the layer's kernels included):\n"
        counts += "\n".join(layers)
    return f"{events.table(sort_by=sort_by, row_limit=rows, max_name_column_width=60)}\n{counts}"


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
    parser.add_argument("--saved", action="store_true", help="what the forward pass keeps for the backward pass")
    parser.add_argument(
        "--vision",
        nargs="+",
        default=None,
        help="instead of the attention peers, inference of these bench.bench_vision models (a name ending in -kernel: "
        "compile_attention=False; in -triton: the Triton window kernels), at --resolution and --batch",
    )
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--train", action="store_true", help="--vision: training steps (forward + backward)")
    parser.add_argument("--batch", type=int, default=None, help="sequences or images (default 1; --vision: 32)")
    args = parser.parse_args(argv)
    if args.train and not args.vision:
        parser.error("--train profiles vision models' training steps; it needs --vision (the attention peers train)")
    if args.vision and args.saved:
        parser.error("--saved counts the attention peers' training memory; it does not take --vision")
    if args.cpu_as_cuda and args.device != "cpu":
        parser.error(f"--cpu-as-cuda needs --device cpu, got --device {args.device}")
    if args.cpu_as_cuda:
        take_cuda_choices_on_cpu()
    if args.saved and args.batch not in (None, 1):
        parser.error(f"--saved counts what one sequence keeps; it does not take --batch {args.batch}")
    args.batch = args.batch if args.batch is not None else 32 if args.vision else 1
    if args.n < 1 or args.steps < 1 or args.warmups < 0 or args.batch < 1:
        parser.error(
            f"--n, --steps and --batch must be >= 1 and --warmups >= 0, got {args.n}, {args.steps}, {args.batch}, "
            f"{args.warmups}"
        )
    shape = {"resolution": args.resolution} if args.vision else {"n": args.n}
    meta = run_meta(
        "profile_attention", argv, device=args.device, dtype=args.dtype, steps=args.steps, batch=args.batch, **shape
    )
    report = [f"{meta}\n"]
    for peer in args.vision or ():
        table = profile_vision(
            peer,
            args.resolution,
            args.batch,
            args.device,
            DTYPES[args.dtype],
            args.warmups,
            args.steps,
            args.rows,
            train=args.train,
        )
        kind = "training (forward + backward)" if args.train else "forward"
        report.append(
            f"== {peer}, {args.resolution} x {args.resolution}, batch {args.batch}, {args.steps} {kind} steps\n{table}"
        )
        print(report[-1], flush=True)
    for peer in () if args.vision else args.peers:
        if args.saved:
            saved = saved_for_backward(peer, args.n, args.device, DTYPES[args.dtype], cpu_as_cuda=args.cpu_as_cuda)
            report.append(f"== {peer}, n = {args.n}\n{saved}")
            print(report[-1], flush=True)
            continue
        backward = not args.cpu_as_cuda
        table = profile_peer(
            peer, args.n, args.device, DTYPES[args.dtype], args.warmups, args.steps, args.rows, backward, args.batch
        )
        kind = "forward + backward" if backward else "forward"
        report.append(f"== {peer}, n = {args.n}, batch {args.batch}, {args.steps} {kind} steps\n{table}")
        print(report[-1], flush=True)
    path = Path(args.out) if args.out else RESULTS / f"profile_attention_{args.device}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(report))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
