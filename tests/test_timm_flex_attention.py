"""The fused path of the 2-D attention (``ls_timm``): FlexAttention over the patches in window-tile order against the
SDPA layouts (themselves checked against the per-query reference in test_timm_attention.py), eager over a grid of
shapes, compiled on two maps of several 128-token blocks (where the kernel skips blocks by the BlockMask), the timm
models, where ``attn_implementation="sdpa"`` takes it, and its errors. Its block structure: test_timm_blocks_2d.py.

Checked, never timed. Eager FlexAttention warns that it materialises the scores; that is expected at these sizes.
"""

import functools

import pytest
import timm
import torch

import ls_hf.long_short_rules as rules
from ls_hf import long_short_blocks, long_short_fused
from ls_hf.long_short_blocks import flex_attend
from ls_timm import long_short_attention_2d, long_short_blocks_2d
from ls_timm.long_short_attention_2d import LongShortAttention2d
from tests.cuda_lowered import compile_on_cpu
from tests.devices import assert_close
from tests.test_flex_attention import _dense_flex_attend, package_compiled_with
from tests.test_timm_attention import CASES, _randomise

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
EXACT = 1e-10  # float64: the paths differ only in summation order
NO_CPU_BACKWARD = "FlexAttention has no backward on CPU (torch 2.14/2.15); runs on CUDA"


def pair(H, W, dim, heads, w, r, g, kwargs, device, dtype):
    """The same randomised module on the SDPA path and on FlexAttention, and an input (B = 2)."""
    sdpa = LongShortAttention2d(dim, heads, w, r, num_prefix_tokens=g, **kwargs).eval()
    _randomise(sdpa)
    flex = LongShortAttention2d(dim, heads, w, r, num_prefix_tokens=g, **kwargs, attn_implementation="flex_attention")
    flex.load_state_dict(sdpa.state_dict())
    x = torch.randn(2, g + H * W, dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return sdpa.to(device, dtype), flex.to(device, dtype).eval(), x.to(device, dtype)


@pytest.mark.parametrize("use_dual_ln", [True, False], ids=["dual_ln", "no_dual_ln"])
@pytest.mark.parametrize("strips", [False, True], ids=["blocked", "strips"])
@pytest.mark.parametrize("H,W,dim,heads,w,r,g,kwargs", CASES)
def test_flex_matches_sdpa(H, W, dim, heads, w, r, g, kwargs, strips, use_dual_ln, device, dtype):
    """Odd and even sizes and windows, partial blocks, the ViL-LS bias table, global tokens, CvT projections, LMSA,
    no projection; against both SDPA layouts."""
    sdpa, flex, x = pair(H, W, dim, heads, w, r, g, {**kwargs, "use_dual_ln": use_dual_ln}, device, dtype)
    sdpa.strip_max_tokens = 10**9 if strips else 0
    with torch.no_grad():
        assert_close(flex(x, (H, W)), sdpa(x, (H, W)), atol=EXACT)


@pytest.mark.slow
@pytest.mark.compiled
@pytest.mark.parametrize(
    "case",
    [(19, 23, 16, 2, 7, 2, 1, CASES[2][-1]), (20, 18, 16, 1, 4, 4, 1, CASES[3][-1])],
    ids=["vil_bias_cls", "cvt_one_head"],
)
def test_compiled_flex_matches_sdpa(case, device, monkeypatch):
    """The package's compiled FlexAttention kernel (``compiled_flex_attention`` on ``FUSED_DEVICES``, as CUDA runs it:
    the fused kernel, which skips the blocks the BlockMask leaves out and calls no mask_mod on full ones; the rest of
    the layer uncompiled), float32, tolerance scaled to the outputs' magnitude: 588 and 400 slots in tile order,
    partial tiles on both sides for ViL-LS (w = 7, 8-wide heads); one head (CvT stage 1). Two map sizes each, each
    compiled specialised to its size."""
    monkeypatch.setattr(long_short_blocks, "FUSED_DEVICES", (device.type,))
    for shrink in (0, 3):
        H, W = case[0] - shrink, case[1] - shrink
        sdpa, flex, x = pair(H, W, *case[2:], device, torch.float32)
        flex.compile_attention = False
        with torch.no_grad():
            expected = sdpa(x, (H, W))
            out = flex(x, (H, W))
        torch.testing.assert_close(out, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


@pytest.mark.slow
@pytest.mark.compiled
def test_callers_compile_matches_sdpa():
    """A caller's torch.compile of a module on the FlexAttention path (ViL-LS bias, a cls token, partial tiles),
    float32, equals the SDPA path: the attention call is a compile boundary (inside the caller's graph, inductor's CPU
    kernel refused the heads-first queries, torch 2.14)."""
    case = CASES[2]
    sdpa, flex, x = pair(*case, "cpu", torch.float32)
    with torch.no_grad():
        expected = sdpa(x, case[:2])
        out = torch.compile(flex)(x, case[:2])
    torch.testing.assert_close(out, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


def built(case, *, seed=2, **kwargs):
    """A randomised ``LongShortAttention2d`` of a ``CASES``-style case (float64, eval mode; the same weights for every
    call) and a float64 input (B = 2)."""
    H, W, dim, heads, w, r, g, case_kwargs = case
    module = LongShortAttention2d(dim, heads, w, r, num_prefix_tokens=g, **case_kwargs, **kwargs).double().eval()
    _randomise(module)
    x = torch.randn(2, g + H * W, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return module, x


@pytest.mark.slow
@pytest.mark.compiled
def test_compiled_layer_matches_sdpa_and_is_shared(monkeypatch):
    """The fused path's whole layer compiled (``compiled_attention_layer``; the CPU standing in for CUDA,
    FlexAttention computed densely there with its score_mod, float64; CvT projections with BatchNorm in training mode,
    the ViL-LS window bias, a global token, partial tiles): the output, and the gradients of the input and of every
    parameter, are the SDPA layouts'; a second module of the same settings reuses every compilation."""
    from torch._dynamo.utils import counters

    compile_on_cpu(monkeypatch)
    monkeypatch.setattr(long_short_blocks, "FUSED_DTYPES", (torch.float64,))
    monkeypatch.setattr(long_short_attention_2d, "flex_attend", _dense_flex_attend)
    compiled_layers = []
    real = long_short_attention_2d.compiled_attention_layer
    monkeypatch.setattr(
        long_short_attention_2d,
        "compiled_attention_layer",
        lambda layer, **kwargs: compiled_layers.append(1) or real(layer, **kwargs),
    )
    case = (9, 11, 16, 2, 3, 2, 1, {"conv_proj": True, "conv_dynamic_proj": True, "window_bias": True})
    results, new_graphs = {}, []
    for name in ("eager", "first", "second"):
        module, x = built(case, attn_implementation="eager" if name == "eager" else "sdpa")
        x.requires_grad_()
        before = counters["stats"]["unique_graphs"]
        out = module.train()(x, case[:2])
        out.square().sum().backward()
        new_graphs.append(counters["stats"]["unique_graphs"] - before)
        results[name] = {"output": out, "input": x.grad, **{key: p.grad for key, p in module.named_parameters()}}
    assert len(compiled_layers) == 2
    assert new_graphs[1] > 0 and new_graphs[2] == 0  # the second module reuses the first one's compilations
    for name in ("first", "second"):
        assert results[name].keys() == results["eager"].keys()
        for key, expected in results["eager"].items():
            torch.testing.assert_close(results[name][key], expected, atol=1e-9, rtol=1e-7, msg=f"{name}: {key}")


@pytest.mark.compiled
def test_compiled_layer_is_specialised_to_each_map_size(monkeypatch):
    """The fused 2-D path compiles with static shapes (the CPU standing in for CUDA, dynamo's eager backend, whose
    graphs are the ones inductor gets): no graph, the layer's or the kernel's, has a symbolic size, so the tile
    order's copies and the mask index with constants; a second map size compiles anew and a second module at the
    first size compiles nothing; every output is the SDPA layouts'."""
    from torch._dynamo.utils import counters

    def symbolic(graph: torch.fx.GraphModule) -> bool:
        values = [node.meta.get("example_value") for node in graph.graph.find_nodes(op="placeholder")]
        sizes = [s for v in values for s in (v.shape if isinstance(v, torch.Tensor) else (v,))]
        return any(isinstance(size, torch.SymInt) for size in sizes)

    graphs = []

    def recording(graph, example_inputs):
        graphs.append(symbolic(graph))
        return graph.forward

    monkeypatch.setattr(long_short_blocks, "FUSED_DTYPES", (torch.float64,))
    monkeypatch.setattr(long_short_blocks, "FUSED_DTYPES", (torch.float64,))
    case = (20, 18, 16, 2, 4, 4, 1, {"window_bias": True})
    new_graphs = []
    cached = (long_short_fused.compiled_attention_layer, long_short_blocks.compiled_flex_attention)
    with package_compiled_with(monkeypatch, recording, *cached):
        for seed, shrink in ((2, 0), (2, 3), (3, 0)):  # the third: another module, the first map size
            H, W = case[0] - shrink, case[1] - shrink
            module, x = built((H, W, *case[2:]), seed=seed, attn_implementation="eager")
            with torch.no_grad():
                expected = module(x, (H, W))
                before = counters["stats"]["unique_graphs"]
                module.attn_implementation = "sdpa"
                out = module(x, (H, W))
            new_graphs.append(counters["stats"]["unique_graphs"] - before)
            assert_close(out, expected, atol=EXACT)
    assert new_graphs[0] > 0 and new_graphs[1] > 0 and new_graphs[2] == 0
    assert len(graphs) == new_graphs[0] + new_graphs[1] and not any(graphs)


def test_compiled_layer_runs_where_it_can(monkeypatch):
    """``forward`` sends the fused path to ``compiled_attention_layer`` on ``ls_hf``'s ``FUSED_DEVICES`` in
    ``FUSED_DTYPES``, and not with ``compile_attention=False`` (``timm.create_model``'s too) or on the SDPA layouts;
    the output is the layer's either way. (The compiled region itself is checked above; here it runs uncompiled, to
    count its calls, FlexAttention computed densely.)"""
    monkeypatch.setattr(long_short_attention_2d, "flex_attend", _dense_flex_attend)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return LongShortAttention2d._layer(*args, **kwargs)

    monkeypatch.setattr(long_short_attention_2d, "compiled_attention_layer", lambda layer, **kwargs: counted)
    kwargs = {"depths": (1, 1, 1, 1), "img_size": 64}
    default = timm.create_model("vil_ls_small", **kwargs)
    _randomise(default)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def compiled_calls(model):
        calls.clear()
        with torch.no_grad():
            out = model.double().eval()(x)
        return len(calls), out

    count, expected = compiled_calls(default)
    assert count == 0  # the CPU does not compile the layer by default
    monkeypatch.setattr(long_short_blocks, "FUSED_DEVICES", ("cpu",))
    monkeypatch.setattr(long_short_blocks, "FUSED_DTYPES", (torch.float64,))
    count, out = compiled_calls(default)
    assert count == 2  # the two Long-Short stages
    assert_close(out, expected, atol=EXACT)
    for other in ({"compile_attention": False}, {"attn_implementation": "eager"}):
        model = timm.create_model("vil_ls_small", **kwargs, **other)
        model.load_state_dict(default.state_dict())
        count, out = compiled_calls(model)
        assert count == 0, other
        assert_close(out, expected, atol=EXACT)
    for name in ("vil_ls_small", "cvt_ls_13"):  # the models' compile_attention reaches every Long-Short layer
        for setting in (True, False):
            model = timm.create_model(
                name, depths=(1, 1, 1, 1)[: 3 if name == "cvt_ls_13" else 4], compile_attention=setting
            )
            layers = [m for m in model.modules() if isinstance(m, LongShortAttention2d)]
            assert layers and all(layer.compile_attention is setting for layer in layers)


@pytest.mark.compiled_layer
@pytest.mark.parametrize(
    "case",
    [
        pytest.param((19, 23, 16, 2, 7, 2, 1, CASES[2][-1]), id="vil_bias_cls"),
        pytest.param((20, 18, 16, 1, 4, 4, 1, CASES[3][-1]), id="cvt_one_head", marks=pytest.mark.slow),
    ],
)
def test_default_matches_the_portable_path_on_the_test_device(case, device, dtype, monkeypatch):
    """The default (attn_implementation="sdpa": on CUDA the fused FlexAttention path in tile order, the rest of the
    layer compiled around it; here on any test device, the CPU standing in, uncompiled) against "eager" (the SDPA
    layouts) on the test device, with several 128-token blocks and partial tiles: outputs, and where FlexAttention
    has a backward (not on the CPU) the gradients of the input, of W^P (Eq. 3) and of LN_L's gain (Eq. 7)."""
    monkeypatch.setattr(long_short_blocks, "FUSED_DEVICES", (device.type,))
    monkeypatch.setattr(long_short_blocks, "FUSED_DTYPES", (dtype,))
    if (
        device.type == "cpu"
    ):  # FlexAttention uncompiled there, as the CPU runs it (its compiled kernel takes no float64)
        monkeypatch.setattr(long_short_attention_2d, "flex_attend", functools.partial(flex_attend, compiled=False))
    grads = device.type != "cpu"
    outs = []
    for implementation in ("sdpa", "eager"):
        module, x = built(case, attn_implementation=implementation)
        module, x = module.to(device, dtype), x.to(device, dtype)
        with torch.set_grad_enabled(grads):
            x.requires_grad_(grads)
            out = module(x, case[:2])
            if grads:
                out.float().square().sum().backward()
        params = (module.dynamic_projection.weight, module.dual_ln_local.weight)
        outs.append((out.detach(), x.grad, *(p.grad for p in params)))
    for got, expected in zip(*outs):
        if got is not None or grads:
            assert_close(got, expected, atol=EXACT)


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("cvt_ls_13", {"depths": (1, 1, 2)}),
        ("vil_ls_small", {"depths": (1, 1, 1, 1), "img_size": 64}),
    ],
    ids=["cvt", "vil"],
)
def test_models_take_attn_implementation(name, kwargs, device, dtype):
    """``timm.create_model(..., attn_implementation="flex_attention")`` reaches every Long-Short layer and gives the
    default model's outputs (odd input size for CvT: partial blocks in every stage)."""
    sdpa = timm.create_model(name, **kwargs)
    _randomise(sdpa)
    flex = timm.create_model(name, **kwargs, attn_implementation="flex_attention")
    flex.load_state_dict(sdpa.state_dict())
    layers = [m for m in flex.modules() if isinstance(m, LongShortAttention2d)]
    assert layers and {m.attn_implementation for m in layers} == {"flex_attention"}
    assert {m.attn_implementation for m in sdpa.modules() if isinstance(m, LongShortAttention2d)} == {"sdpa"}
    side = 64 if name.startswith("vil") else 75
    x = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sdpa, flex = (m.to(device, dtype).eval() for m in (sdpa, flex))
    with torch.no_grad():
        assert_close(flex(x.to(device, dtype)), sdpa(x.to(device, dtype)), atol=EXACT)


def test_backward_matches_sdpa_where_supported(device):
    """Gradients equal the SDPA path's where FlexAttention has a backward (not on CPU)."""
    if device.type == "cpu":
        pytest.skip(NO_CPU_BACKWARD)
    sdpa, flex, x = pair(*CASES[2], device, torch.float64)
    grads = []
    for module in (sdpa, flex):
        xi = x.clone().requires_grad_()
        module(xi, CASES[2][:2]).square().sum().backward()
        grads.append((xi.grad, module.relative_position_bias_table.grad, module.qkv.weight.grad))
    for got, expected in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-9)


def test_cpu_training_and_dropout_are_refused_clearly():
    flex = LongShortAttention2d(16, 2, 3, 2, attn_implementation="flex_attention", attn_drop=0.1)
    x = torch.randn(1, 20, 16)
    with pytest.raises(NotImplementedError, match="forward only on CPU.*sdpa"):
        flex.eval()(x, (4, 5))
    with torch.no_grad(), pytest.raises(ValueError, match="no attention dropout.*attn_drop_rate"):
        flex.train()(x, (4, 5))


def test_unknown_implementation_and_missing_flex_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="attn_implementation must be one of"):
        LongShortAttention2d(16, 2, 3, 2, attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="attn_implementation must be one of"):
        timm.create_model("cvt_ls_13", depths=(1, 1, 1), attn_implementation="flash")
    monkeypatch.setattr(rules, "flex_attention", None)  # a torch without FlexAttention
    with pytest.raises(ImportError, match=r"torch >= 2\.6.*sdpa"):
        LongShortAttention2d(16, 2, 3, 2, attn_implementation="flex_attention")
    with pytest.raises(ImportError, match=r"torch >= 2\.6"):
        timm.create_model("vil_ls_small", depths=(1, 1, 1, 1), attn_implementation="flex_attention")


def test_default_stays_sdpa():
    assert LongShortAttention2d(16, 2, 3, 2).attn_implementation == "sdpa"


def test_sdpa_runs_the_fused_path_where_fused_devices_say(monkeypatch):
    """attn_implementation="sdpa" (the default) runs FlexAttention in tile order on ``ls_hf``'s ``FUSED_DEVICES`` in
    ``FUSED_DTYPES`` (CUDA, not float64; here the CPU in float64 stands in), decided at each call from where the input
    is, with the SDPA path's outputs: one BlockMask per Long-Short stage, shared by the stage's layers and by later
    calls; not with active attention dropout, and never with "eager". ViL-LS: window bias, a global token, maps of
    16 x 16 and 8 x 8 (w = 7: partial tiles)."""
    built = []
    real = long_short_blocks_2d.tile_block_mask
    monkeypatch.setattr(long_short_blocks_2d, "tile_block_mask", lambda *a, **k: built.append(a) or real(*a, **k))
    long_short_blocks_2d.cached_tile_block_mask.cache_clear()
    kwargs = {"depths": (1, 2, 1, 1), "img_size": 64}
    default = timm.create_model("vil_ls_small", **kwargs)
    _randomise(default)
    eager = timm.create_model("vil_ls_small", **kwargs, attn_implementation="eager")
    eager.load_state_dict(default.state_dict())
    default, eager = default.double().eval(), eager.double().eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def builds(model):
        built.clear()
        with torch.no_grad():
            out = model(x)
        return out, len(built)

    monkeypatch.setattr(long_short_attention_2d, "flex_attend", functools.partial(flex_attend, compiled=False))
    expected, count = builds(default)
    assert count == 0  # the CPU is not a fused device
    monkeypatch.setattr(long_short_blocks, "FUSED_DEVICES", ("cpu",))
    assert builds(default)[1] == 0  # nor is float64 a fused dtype
    monkeypatch.setattr(long_short_blocks, "FUSED_DTYPES", (torch.float64,))
    out, count = builds(default)
    assert count == 2
    assert_close(out, expected, atol=EXACT)
    assert builds(default)[1] == 0  # cached
    long_short_blocks_2d.cached_tile_block_mask.cache_clear()  # from here on, a fused call would build them again
    out, count = builds(eager)
    assert count == 0
    assert torch.equal(out, expected)
    default.train()
    for m in default.modules():
        if isinstance(m, LongShortAttention2d):
            m.attn_drop = 0.1
    assert builds(default)[1] == 0
