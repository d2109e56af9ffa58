"""Inductor's code for CUDA on a CPU, for the tests: ``lowered_as_for_cuda`` makes inductor generate for CPU tensors the
code it generates for CUDA, and Triton's interpreter run it (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``
before Triton is imported); ``compile_on_cpu`` lets the CPU take CUDA's choices of the package's paths."""

from __future__ import annotations

import contextlib
import inspect
import math

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass


def compile_on_cpu(monkeypatch) -> None:
    """Let the CPU stand in for CUDA (``long_short_blocks.FUSED_DEVICES``, the one device rule): the fused path, its
    compiled kernel and its compiled layer, the 1-D layer's graph taking the attention kernel in, from no earlier
    compilation (``monkeypatch``: a ``pytest.MonkeyPatch``, which undoes it). Inductor's CPU FlexAttention kernel does
    not build inside the layer's graph (torch 2.14), so what compiles so with inductor computes FlexAttention
    otherwise: densely, or as for CUDA (``lowered_as_for_cuda``)."""
    from ls_hf import long_short_blocks

    torch._dynamo.reset()
    monkeypatch.setattr(long_short_blocks, "FUSED_DEVICES", ("cpu",))


@contextlib.contextmanager
def lowered_as_for_cuda(monkeypatch):
    """While it is open, inductor generates for CPU tensors the code it generates for CUDA, and Triton's interpreter
    runs its kernels, FlexAttention's Triton templates among them, forward and backward (``monkeypatch``: a
    ``pytest.MonkeyPatch``, which undoes what is patched here). What stands in the way is turned aside:

    - inductor's FlexAttention lowering sends CPU tensors to its C++ kernel, and its concatenation's lowering takes a
      CPU's branch: copies of both without those branches are registered (``_register_rewritten``);
    - FlexAttention refuses a backward pass on the CPU and has its forward kernel skip the log-sum-exp there, which
      the backward kernel reads: both as on CUDA;
    - Triton asks its driver, which finds no GPU, for the target to generate code for: an sm80 CUDA target;
    - inductor's kernels call CUDA's libdevice, which the interpreter cannot run: ``triton.language.math`` instead;
    - Triton 3.6's interpreter reads a loop bound given as a one-element array wrongly: read as Triton 3.8 reads it;
    - the package gives inductor's CPU FlexAttention kernel contiguous copies of its inputs: the views instead, as on
      CUDA (``contiguous_inputs``);
    - inductor schedules and fuses a CPU's kernels otherwise (no loop reordering after fusion, no mix-order reductions
      such as a LayerNorm's two gradients in one pass, no addmm split for its epilogue's fusion, no padding of
      strides): its lowering, fusion passes and scheduler take a CPU for a GPU (``_as_gpu``), except where they create a
      device's backend or guard, which a GPU has by index;
    - inductor makes a softmax's max and sum one online reduction for CUDA's tensors only: for the CPU's too
      (``_OnlineSoftmax``).

    So that the interpreter takes seconds, not minutes, each kernel runs its widest configuration, and FlexAttention's
    one tile a block of the mask; the code is otherwise what inductor generates for CUDA (sm80)."""
    import torch.nn.attention.flex_attention as flex_api
    import triton
    import triton.language as tl
    from torch._inductor import lowering
    from torch._inductor.kernel.flex import flex_attention as flex_lowering
    from torch._inductor.runtime import triton_helpers, triton_heuristics
    from torch.utils import _triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import interpreter

    from ls_hf import long_short_blocks
    from ls_hf.long_short_blocks import DEFAULT_BLOCK_SIZE

    _as_gpu(monkeypatch)

    _register_rewritten(
        monkeypatch, flex_lowering.flex_attention, old='if query.get_device().type == "cpu":', new="if False:"
    )
    _register_rewritten(
        monkeypatch, lowering.cat, old='cpu_device = inputs[0].get_device().type == "cpu"', new="cpu_device = False"
    )

    # FlexAttention's tiles, forward and backward
    tiles = dict.fromkeys(("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"), DEFAULT_BLOCK_SIZE)

    def kernel_options(*args, apply=flex_api._apply_kernel_options, **kwargs):
        options = apply(*args, **kwargs)
        options["OUTPUT_LOGSUMEXP"] = options["OUTPUT_LOGSUMEXP"] or torch.is_grad_enabled()
        return {**tiles, **options}

    class Driver:
        def get_current_target(self):
            return GPUTarget("cuda", 80, 32)

    def patch_tensor(tensor, scope, patch=interpreter._patch_lang_tensor):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    def run_widest(self, *args, run=triton_heuristics.CachingAutotuner.run, **kwargs):
        self.configs = sorted(self.configs, key=lambda config: -math.prod(config.kwargs.values()))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(triton_heuristics.CachingAutotuner, "run", run_widest)
    monkeypatch.setattr(flex_api, "_validate_device", lambda query, key, value: None)
    monkeypatch.setattr(flex_api, "_apply_kernel_options", kernel_options)
    monkeypatch.setattr(triton.runtime.driver, "_active", Driver())
    monkeypatch.setattr(triton_helpers, "libdevice", tl.math)
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_tensor)
    monkeypatch.setattr(long_short_blocks, "contiguous_inputs", lambda device: False)
    backend_caches = (_triton.triton_backend, _triton.triton_hash_with_backend)  # they keep the target
    for cache in backend_caches:
        cache.cache_clear()
    try:
        with torch._inductor.config.patch(cpu_backend="triton", post_grad_custom_post_pass=_OnlineSoftmax()):
            yield
    finally:  # no later compilation sees the CUDA lowering
        torch._dynamo.reset()
        for cache in backend_caches:
            cache.cache_clear()


def _register_rewritten(monkeypatch, lowering_fn, *, old: str, new: str) -> None:
    """Register inductor's lowering ``lowering_fn`` again as it registers itself, from its own source with ``old``
    (where it takes a CPU's branch) replaced by ``new``; ``monkeypatch`` restores every lowering it replaces."""
    from torch._inductor import lowering

    source = inspect.getsource(lowering_fn)
    assert old in source, f"inductor's lowering {lowering_fn.__name__} no longer reads as this module knows"
    module = inspect.getmodule(lowering_fn)
    before = dict(lowering.lowerings)
    exec(compile(source.replace(old, new), module.__file__, "exec"), dict(vars(module)))  # noqa: S102
    for key, registered in list(lowering.lowerings.items()):
        if before.get(key) is not registered:  # put back as it was, then replaced through monkeypatch, which undoes it
            if key in before:
                lowering.lowerings[key] = before[key]
            else:
                del lowering.lowerings[key]
            monkeypatch.setitem(lowering.lowerings, key, registered)


def _as_gpu(monkeypatch) -> None:
    """Inductor's lowering, fusion passes and scheduler take a CPU for a GPU whose backend is Triton, so that they make
    for CPU tensors the choices they make for CUDA's, but create the CPU's backend and device guards as a CPU's."""
    from torch._inductor import compile_fx, ir, lowering, scheduler, utils
    from torch._inductor.fx_passes import post_grad

    def is_gpu(device: str | None, gpu=utils.is_gpu) -> bool:
        return device == "cpu" or gpu(device)

    for module in (compile_fx, ir, lowering, post_grad, scheduler):
        monkeypatch.setattr(module, "is_gpu", is_gpu)
    monkeypatch.setattr(scheduler.BaseSchedulerNode, "is_cpu", lambda self: False)
    if hasattr(scheduler, "_is_gpu_triton_backend"):  # torch 2.11 checks the device inline: no mix-order reductions
        monkeypatch.setattr(scheduler, "_is_gpu_triton_backend", lambda node1, node2: True)

    def create_backend(self, device, create=scheduler.Scheduler.create_backend):
        scheduler.is_gpu = utils.is_gpu  # a CPU's backend, which has no device index
        try:
            return create(self, device)
        finally:
            scheduler.is_gpu = is_gpu

    monkeypatch.setattr(scheduler.Scheduler, "create_backend", create_backend)


class _OnlineSoftmax(CustomGraphPass):
    """Inductor's rewrite of a softmax's max and sum into one online reduction, which it makes for CUDA's and XPU's
    tensors only (``prepare_softmax_extra_check``), for a CPU's too: a post-grad pass."""

    def __init__(self):
        from torch._inductor.fx_passes import post_grad
        from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

        self.patterns = PatternMatcherPass()
        register_replacement(
            post_grad.prepare_softmax_pattern,
            post_grad.prepare_softmax_replacement,
            [torch.empty(4, 8)],
            scalar_workaround={"dim": -1},
            trace_fn=fwd_only,
            pass_dicts=self.patterns,
            extra_check=lambda match: torch._inductor.config.online_softmax,
        )

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.patterns.apply(graph)

    def uuid(self) -> str:
        return "online softmax as on CUDA"
