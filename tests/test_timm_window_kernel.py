"""The Triton window kernels of the 2-D attention (``ls_timm.window_kernel_2d``), forward and backward, against the
SDPA layouts (themselves checked against the per-query reference in test_timm_attention.py) on the test device, where
``LongShortAttention2d`` calls them, inside the compiled layer, and as custom operators. On the CPU they run in
Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``); on CUDA, compiled by Triton.

Checked, never timed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

from ls_hf import long_short_blocks, long_short_fused
from ls_timm import long_short_attention_2d, window_kernel_2d
from ls_timm.long_short_attention_2d import LongShortAttention2d, plan_attention_2d
from ls_timm.window_kernel_2d import (
    LaunchGeometry,
    bias_table_rows,
    has_window_kernel,
    launch_geometry,
    query_rectangle,
    window_attention_2d,
)
from tests.cuda_lowered import compile_on_cpu
from tests.devices import RELATIVE_ATOL, assert_close
from tests.test_timm_attention import CASES, _randomise

pytestmark = pytest.mark.skipif(not has_window_kernel(), reason="Triton is not installed")
EXACT = 1e-10  # float64: the paths differ only in summation order
INTERPRETER_BF16 = "Triton's interpreter computes bfloat16 on its raw bits (numpy has none); the GPU check runs it"
# Triton's compiler, run for a GPU target on any machine (no GPU needed): the kernels' cubins for each case, (arch,
# dtype, map, window, extra keys, (query/key, value) head dims, bias table, one head, backward too), one head making
# ``num_heads`` a constant as Triton's launcher specialises an argument of 1; the backward kernel for each code path
# (plain, bias table, head dims below 16, LMSA without extra keys, Ampere), the forward for every case.
COMPILE = """
import inspect, json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ls_timm import window_kernel_2d as wk

# the tensors the kernels take in the accumulators' float32 (the rest in the inputs' dtype)
FLOAT32 = {"Lse", "Delta", "GradK", "GradV", "GradExtraK", "GradExtraV", "GradTable"}
for arch, dtype, feat_size, window, extra, head_dims, bias, one_head, backward in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    geometry = wk.launch_geometry(tuple(feat_size), window, extra)
    constants = wk.kernel_constants(geometry, window, tuple(head_dims), dtype, bias=bias)
    constants |= {"num_heads": 1} if one_head else {}
    pointer = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    for kernel in (wk._window_attention_2d_kernel, wk._window_attention_2d_backward_kernel)[: 1 + backward]:
        names = list(inspect.signature(kernel.fn).parameters)
        signature = {
            name: "constexpr" if name in constants else "*fp32" if name in FLOAT32 else pointer if name[0].isupper()
            else "fp32" if name == "sm_scale" else "i32"
            for name in names
        }
        source = ASTSource(kernel, signature, {(names.index(name),): value for name, value in constants.items()})
        options = {"num_warps": wk.WARPS[kernel.fn.__name__]}
        print(len(triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["cubin"]))
"""
GPU_CASES = [
    (90, "bfloat16", (56, 56), 8, 64, (64, 64), False, True, True),  # cvt_ls_13 at 224 on an H100 / H200: stage 1
    (90, "bfloat16", (14, 14), 2, 5, (64, 64), False, False, False),  # its stage 3
    (90, "bfloat16", (112, 112), 16, 128, (64, 64), False, True, False),  # stage 1 at 448
    (90, "bfloat16", (56, 56), 7, 9, (32, 32), True, False, True),  # vil_ls_medium, stage 1
    (90, "float16", (28, 28), 4, 16, (64, 64), False, False, False),
    (90, "float32", (9, 10), 3, 2, (8, 8), True, False, True),  # IEEE dot products, head dims below 16
    (90, "bfloat16", (9, 10), 4, 0, (4, 8), False, False, True),  # LMSA, no extra keys
    (80, "bfloat16", (56, 56), 8, 64, (64, 64), False, True, True),  # an A100
    (80, "float32", (28, 28), 4, 16, (64, 64), False, False, False),
]
# Geometries of the kernel's own: a CvT stage-1 block of 64 queries, a block wider than a program's 64 queries (its
# rows in turn), a map smaller than one window, w = 16 with the bias table and partial blocks.
RECTANGLE_CASES = [
    (16, 16, 32, 1, 8, 4, 0, {}),
    (13, 25, 16, 2, 12, 0, 0, {}),
    (3, 5, 16, 2, 8, 2, 0, {}),
    (20, 18, 16, 2, 16, 2, 1, {"window_bias": True}),
]


@pytest.fixture
def kernel_calls(monkeypatch):
    """The calls of ``window_attention_2d`` that ``LongShortAttention2d`` makes while the test runs."""
    calls = []

    def counted(*args, **kwargs):
        calls.append((kwargs["map_height"], kwargs["map_width"]))
        return window_attention_2d(*args, **kwargs)

    monkeypatch.setattr(long_short_attention_2d, "window_attention_2d", counted)
    return calls


def _fused_on(monkeypatch, device, dtype):
    """The fused path where the test runs (CUDA and its dtypes take it anyway; the CPU and float64 stand in)."""
    monkeypatch.setattr(long_short_blocks, "FUSED_DEVICES", (device.type,))
    monkeypatch.setattr(long_short_blocks, "FUSED_DTYPES", (dtype,))


def test_launch_geometry_of_cvt_ls_13_at_224():
    """Programs and key steps of the three stages, counted by hand: 56 x 56, w = 8, 64 extra keys: 7 x 7 rectangles of
    one block, a 16 x 16 window (4 steps of 64 keys) and the extra keys (1); 28 x 28, w = 4: 4 x 4 rectangles of 2 x 2
    blocks, at most 12 x 12 window keys (3 steps) and 16 extra keys (1); 14 x 14, w = 2: 2 x 2 rectangles of 4 x 4
    blocks, at most 9 x 9 window keys (2 steps) and 5 extra keys (1)."""
    assert launch_geometry((56, 56), 8, 64) == LaunchGeometry((8, 8), 64, 7, 49, 4, 1)
    assert launch_geometry((28, 28), 4, 16) == LaunchGeometry((8, 8), 64, 4, 16, 3, 1)
    assert launch_geometry((14, 14), 2, 5) == LaunchGeometry((8, 8), 64, 2, 4, 2, 1)


def _output_and_gradients(module: LongShortAttention2d, x: torch.Tensor, feat_size: tuple[int, int], call=None) -> dict:
    """The module's output (through ``call``, the module by default), and the gradients of the input and of every
    parameter of a loss that weighs each output element differently."""
    x = x.detach().requires_grad_()
    out = (module if call is None else call)(x, feat_size)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out)
    (out * weights).sum().backward()
    return {"output": out, "input": x.grad, **{name: p.grad for name, p in module.named_parameters()}}


def _assert_all_close(actual: dict, expected: dict, *, relative: float | None = None) -> None:
    """Every output and gradient equal to the reference's, the same ones absent (parameters a case leaves unused,
    such as DualLN's global norm without projected rows): computed in float64 within ``EXACT``; otherwise within
    ``relative`` (default ``RELATIVE_ATOL`` of the dtype) times the largest magnitude among them all, as W^P's bias has a gradient
    of ~0, a sum of terms that cancel (the softmax over the sequence does not see a constant)."""
    assert {name for name, value in actual.items() if value is None} == {n for n, v in expected.items() if v is None}
    present = {name: value for name, value in expected.items() if value is not None}
    dtype = actual["output"].dtype
    scale = max(value.abs().max().item() for value in present.values())
    atol = EXACT if dtype == torch.float64 else (relative or RELATIVE_ATOL[dtype]) * scale
    for name, value in present.items():
        torch.testing.assert_close(
            actual[name].to("cpu", torch.float64), value.to("cpu", torch.float64), atol=atol, rtol=0
        )


@pytest.mark.parametrize("H,W,dim,heads,w,r,g,kwargs", CASES + RECTANGLE_CASES)
def test_window_kernel_matches_sdpa(H, W, dim, heads, w, r, g, kwargs, kernel_calls, device, dtype, monkeypatch):
    """Odd and even sizes and windows, partial blocks, the ViL-LS bias table, global tokens, CvT projections, LMSA,
    no projection, and the kernels' own rectangles (``RECTANGLE_CASES``), against the blocked layout: the output, and
    the gradients of the input and of every parameter (the bias table's among them) through the backward kernel."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip(INTERPRETER_BF16)
    _fused_on(monkeypatch, device, dtype)
    sdpa = LongShortAttention2d(dim, heads, w, r, num_prefix_tokens=g, **kwargs, attn_implementation="eager").eval()
    _randomise(sdpa)
    sdpa.strip_max_tokens = 0
    kernel = LongShortAttention2d(dim, heads, w, r, num_prefix_tokens=g, **kwargs, compile_attention=False).eval()
    kernel.load_state_dict(sdpa.state_dict())
    kernel.window_kernel = True
    x = torch.randn(2, g + H * W, dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    sdpa, kernel, x = sdpa.to(device, dtype), kernel.to(device, dtype), x.to(device, dtype)
    _assert_all_close(_output_and_gradients(kernel, x, (H, W)), _output_and_gradients(sdpa, x, (H, W)))
    assert kernel_calls == [(H, W)]


def test_window_kernel_where_asked(monkeypatch):
    """The plan (``plan_attention_2d``) takes the kernels with ``window_kernel`` (off by default), on the fused path,
    in training as in inference, but not for training under ``torch.use_deterministic_algorithms``;
    ``"flex_attention"`` always FlexAttention, ``"eager"`` and the CPU by default the SDPA layouts."""
    _fused_on(monkeypatch, torch.device("cpu"), torch.float32)
    module = LongShortAttention2d(16, 2, 4, 2)
    x = torch.randn(1, 36, 16)

    def backend(x):
        return plan_attention_2d([module], x, (6, 6)).backend

    assert backend(x) == "flex"  # off by default
    module.window_kernel = True
    assert backend(x) == "window_kernel"
    with torch.inference_mode():
        assert backend(x) == "window_kernel"
    assert backend(x.double()) == "sdpa"  # not a fused dtype
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert backend(x) == "flex"  # the kernels' backward adds gradients atomically
        with torch.no_grad():
            assert backend(x) == "window_kernel"
    finally:
        torch.use_deterministic_algorithms(deterministic)
    module.attn_implementation = "flex_attention"
    with torch.no_grad():  # FlexAttention has no backward on the CPU
        assert backend(x) == "flex"
    module.attn_implementation = "eager"
    assert backend(x) == "sdpa"
    module.attn_implementation = "sdpa"
    _fused_on(monkeypatch, torch.device("cuda"), torch.float32)
    assert backend(x) == "sdpa"  # the CPU is no longer a fused device


def test_query_rectangle_holds_whole_blocks_or_rows_of_one():
    """A program's queries: whole w x w blocks up to 64 queries, or rows of one larger block that divide it (so that
    a rectangle meets one block's window); never more than 64."""
    assert [query_rectangle(w) for w in (1, 2, 3, 4, 7, 8, 12, 16)] == [
        (8, 8),
        (8, 8),
        (6, 6),
        (8, 8),
        (7, 7),
        (8, 8),
        (4, 12),
        (4, 16),
    ]


def test_timm_model_takes_the_kernels(kernel_calls, monkeypatch):
    """A whole timm model (ViL-LS: a cls token, the bias table, one Long-Short stage per map) with the kernels on:
    every Long-Short layer calls them, and the logits in inference and every parameter's gradient are those of the
    SDPA layouts."""
    _fused_on(monkeypatch, torch.device("cpu"), torch.float64)
    kwargs = {"depths": (1, 1, 1, 1), "img_size": 32, "compile_attention": False}
    model = timm.create_model("vil_ls_small", **kwargs).double().eval()
    _randomise(model)
    expected = timm.create_model("vil_ls_small", **kwargs, attn_implementation="eager").double().eval()
    expected.load_state_dict(model.state_dict())
    monkeypatch.setattr(LongShortAttention2d, "window_kernel", True)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        assert_close(model(x), expected(x), atol=EXACT)
    assert kernel_calls == [(8, 8), (4, 4)]  # the two Long-Short stages (the last two are full attention)
    for net in (model, expected):
        net(x).logsumexp(-1).sum().backward()
    for p, reference in zip(model.parameters(), expected.parameters(), strict=True):
        assert_close(p.grad, reference.grad, atol=EXACT)


@pytest.mark.slow
@pytest.mark.compiled
@pytest.mark.parametrize("compiled_by", ["package", "caller"])
def test_compiled_layer_calls_the_kernels(compiled_by, monkeypatch):
    """The layer compiled with the kernels inside, as operators of its graphs (the profiler sees the forward and
    backward operators run): by the package (the fused path's ``compiled_attention_layer``, static shapes) or by
    the caller (``torch.compile`` of a module with ``compile_attention=False``, as timm's training script compiles a
    model); float32: the SDPA layouts' output and gradients, tolerance scaled to their magnitudes."""
    compile_on_cpu(monkeypatch)
    monkeypatch.setattr(long_short_blocks, "FUSED_DTYPES", (torch.float32,))
    long_short_fused.compiled_attention_layer.cache_clear()
    sdpa = LongShortAttention2d(16, 2, 7, 2, num_prefix_tokens=1, window_bias=True, attn_implementation="eager")
    _randomise(sdpa)
    kwargs = {"compile_attention": compiled_by == "package"}
    compiled = LongShortAttention2d(16, 2, 7, 2, num_prefix_tokens=1, window_bias=True, **kwargs)
    compiled.load_state_dict(sdpa.state_dict())
    compiled.window_kernel = True
    call = torch.compile(compiled) if compiled_by == "caller" else compiled
    x = torch.randn(2, 1 + 9 * 11, 16, generator=torch.Generator().manual_seed(2))
    try:
        with torch.profiler.profile() as profile:
            expected = _output_and_gradients(sdpa.eval(), x, (9, 11))
            actual = _output_and_gradients(compiled.eval(), x, (9, 11), call)
    finally:
        long_short_fused.compiled_attention_layer.cache_clear()
    _assert_all_close(actual, expected, relative=1e-5)
    ran = {event.name for event in profile.events() if event.name.startswith(("transformer_ls::", "Torch-Compiled"))}
    assert {"transformer_ls::window_attention_2d", "transformer_ls::window_attention_2d_backward"} <= ran
    assert any(name.startswith("Torch-Compiled") for name in ran)


def test_operators_pass_torch_library_checks():
    """``torch.library.opcheck`` of the forward operator (with its autograd formula: inputs that require gradients)
    and of the backward operator: the schemas, the fake (meta) implementations that compiled graphs trace with, and
    the operators under ``make_fx`` and AOT dispatch, with and without the bias table."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 30, 8, generator=generator, requires_grad=True) for _ in range(3))
    extra_k, extra_v = (torch.randn(2, 3, 8, generator=generator, requires_grad=True) for _ in range(2))
    table = torch.randn(bias_table_rows(3), 2, generator=generator, requires_grad=True)
    for bias in (None, table):
        args = (q, k, v, extra_k, extra_v, 5, 6, 3, 2, bias)
        torch.library.opcheck(window_kernel_2d._window_attention_2d_forward, args)
        tensors = [t.detach() for t in (q, k, v, extra_k, extra_v)]  # no double backward
        bias = None if bias is None else bias.detach()
        out, lse = window_kernel_2d._window_attention_2d_forward(*tensors, 5, 6, 3, 2, bias)
        backward_args = (torch.randn_like(out), *tensors, out, lse, 5, 6, 3, 2, bias)
        torch.library.opcheck(window_kernel_2d._window_attention_2d_backward, backward_args)


def test_keys_and_values_taken_in_the_queries_dtype():
    """Keys and values in another dtype than the queries (under autocast DualLN's norms give float32 keys and values
    beside half-precision queries, and the bias table stays float32) are taken in the queries' dtype, as SDPA takes
    them: the output, in the queries' dtype, is that of the call with them cast, the gradients come back in each
    tensor's own dtype, and both are those of float64 to float16's precision."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 30, 16, generator=generator).half()
    k, v, extra_k, extra_v = (torch.randn(2, n, 16, generator=generator) for n in (30, 30, 3, 3))
    table = torch.randn(bias_table_rows(3), 2, generator=generator)
    sizes = {"map_height": 5, "map_width": 6, "window": 3, "num_heads": 2}
    runs = {}
    for name, dtypes in (
        ("mixed", (None,) * 6),
        ("cast", (torch.float16,) * 5 + (None,)),
        ("float64", (torch.float64,) * 6),
    ):
        tensors = [
            (t if dtype is None else t.to(dtype)).clone().requires_grad_()
            for t, dtype in zip((q, k, v, extra_k, extra_v, table), dtypes, strict=True)
        ]
        out = window_attention_2d(*tensors[:5], **sizes, bias_table=tensors[5])
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
        runs[name] = {"output": out, **{f"grad {i}": t.grad for i, t in enumerate(tensors)}}
    assert runs["mixed"]["output"].dtype == torch.float16
    assert [grad.dtype for grad in list(runs["mixed"].values())[1:]] == [torch.float16] + [torch.float32] * 5
    for name, value in runs["cast"].items():
        torch.testing.assert_close(runs["mixed"][name].to(value.dtype), value, atol=0, rtol=0)
    _assert_all_close(runs["mixed"], runs["float64"], relative=1e-2)


def test_operator_names_what_it_lacks(monkeypatch):
    """Called where it cannot run, the operator says why and what to do, before any work: a bias table of the wrong
    size (the kernels would read and write past it), keys in another dtype than the queries (``window_attention_2d``
    casts them), an image too large for 32-bit offsets, CPU tensors outside Triton's interpreter, a torch build
    without Triton."""
    q = torch.zeros(1, 4, 8)
    sizes = {"map_height": 2, "map_width": 2, "window": 2, "num_heads": 1, "bias_table": None}
    with pytest.raises(ValueError, match=r"bias_table must have shape \(21, 1\) for window=2"):
        window_attention_2d(q, q, q, q[:, :0], q[:, :0], **sizes | {"bias_table": torch.zeros(20, 1)})
    with pytest.raises(ValueError, match=r"in one dtype, got .*float64.*call window_attention_2d"):
        window_kernel_2d._window_attention_2d_forward(q, q.double(), q, q[:, :0], q[:, :0], 2, 2, 2, 1, None)
    huge = torch.empty_strided((1, 2, 8), (2**32, 2**30, 1), device="meta")  # rows 2**30 elements apart
    with pytest.raises(ValueError, match="32-bit offsets.*window_kernel False"):
        window_kernel_2d._inputs(huge, q, q, q[:, :0], q[:, :0], None, 2, 1)
    monkeypatch.setattr(window_kernel_2d, "_window_attention_2d_kernel", object())  # as compiled for a GPU
    with pytest.raises(RuntimeError, match="only in Triton's interpreter; set TRITON_INTERPRET=1"):
        window_attention_2d(q, q, q, q[:, :0], q[:, :0], **sizes)
    monkeypatch.setattr(window_kernel_2d, "triton", None)
    with pytest.raises(RuntimeError, match="needs Triton.*window_kernel False"):
        window_attention_2d(q, q, q, q[:, :0], q[:, :0], **sizes)


@pytest.mark.slow
@pytest.mark.compiled
def test_triton_compiles_the_kernels_for_gpus(tmp_path):
    """Triton's compiler builds the forward and backward kernels' cubins for Hopper (the H100 and H200 of the GPU
    checks) and Ampere in the dtypes and shapes the models meet (``GPU_CASES``), on this machine, GPU or not: what the
    interpreter, which runs the kernels' Python, does not check (types across branches, the dot products' shapes and
    dtypes, the atomic additions' types). In a process without ``TRITON_INTERPRET``, so that Triton compiles."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, json.dumps(GPU_CASES)],
        check=False,
        cwd=Path(__file__).resolve().parents[1],
        env=env | {"TRITON_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = [int(line) for line in done.stdout.split()]
    assert len(sizes) == len(GPU_CASES) + sum(case[-1] for case in GPU_CASES) and min(sizes) > 0
