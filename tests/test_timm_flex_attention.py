"""The fused path of the 2-D attention (``ls_timm``): FlexAttention over the patches in window-tile order against the
SDPA layouts (themselves checked against the per-query reference in test_timm_attention.py), eager over a grid of
shapes, compiled on two maps of several 128-token blocks (where the kernel skips blocks by the BlockMask), the timm
models, where ``attn_implementation="sdpa"`` takes it, and its errors. Its block structure: test_timm_blocks_2d.py.

Checked, never timed. Eager FlexAttention warns that it materialises the scores; that is expected at these sizes.
"""

import pytest
import timm
import torch

import ls_hf.long_short_rules as rules
from ls_hf import long_short_attention, long_short_blocks
from ls_timm import long_short_blocks_2d
from ls_timm.long_short_attention_2d import LongShortAttention2d
from tests.devices import assert_close
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


@pytest.mark.compiled
@pytest.mark.parametrize(
    "case",
    [(19, 23, 16, 2, 7, 2, 1, CASES[2][-1]), (20, 18, 16, 1, 4, 4, 1, CASES[3][-1])],
    ids=["vil_bias_cls", "cvt_one_head"],
)
def test_compiled_flex_matches_sdpa(case, device, monkeypatch):
    """The package's compiled FlexAttention kernel (``compiled_flex_attention`` on ``COMPILED_DEVICES``, as CUDA runs
    it: the fused kernel, which skips the blocks the BlockMask leaves out and calls no mask_mod on full ones), float32,
    tolerance scaled to the outputs' magnitude: 588 and 400 slots in tile order, partial tiles on both sides for ViL-LS
    (w = 7, 8-wide heads); one head (CvT stage 1). Two map sizes each, so that the second compiles with symbolic
    sizes."""
    monkeypatch.setattr(long_short_blocks, "COMPILED_DEVICES", (device.type,))
    for shrink in (0, 3):
        H, W = case[0] - shrink, case[1] - shrink
        sdpa, flex, x = pair(H, W, *case[2:], device, torch.float32)
        with torch.no_grad():
            expected = sdpa(x, (H, W))
            out = flex(x, (H, W))
        torch.testing.assert_close(out, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


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

    expected, count = builds(default)
    assert count == 0  # the CPU is not a fused device
    monkeypatch.setattr(long_short_attention, "FUSED_DEVICES", ("cpu",))
    assert builds(default)[1] == 0  # nor is float64 a fused dtype
    monkeypatch.setattr(long_short_attention, "FUSED_DTYPES", (torch.float64,))
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
