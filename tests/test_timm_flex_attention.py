"""attn_implementation="flex_attention" in the 2-D attention (``ls_timm``): FlexAttention against the SDPA layouts
(themselves checked against the per-query reference in test_timm_attention.py), eager over a grid of shapes, compiled
on two, the timm models, and its errors.

Checked, never timed. Eager FlexAttention warns that it materialises the scores; that is expected at these sizes.
"""

import pytest
import timm
import torch

import ls_hf.long_short_rules as rules
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
@pytest.mark.parametrize("case", [CASES[2], (8, 6, 16, 1, 2, 4, 1, CASES[3][-1])], ids=["vil_bias_cls", "cvt_one_head"])
def test_compiled_flex_matches_sdpa(case, device):
    """torch.compile'd FlexAttention (the fused kernel), float32, tolerance scaled to the outputs' magnitude; one head
    (CvT stage 1), where the heads-first view of the projection needs its own copy."""
    sdpa, flex, x = pair(*case, device, torch.float32)
    H, W = case[:2]
    with torch.no_grad():
        expected = sdpa(x, (H, W))
        out = torch.compile(flex, fullgraph=True, dynamic=False)(x, (H, W))
    torch.testing.assert_close(out, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("name,kwargs", [
    ("cvt_ls_13", {"depths": (1, 1, 2)}),
    ("vil_ls_small", {"depths": (1, 1, 1, 1), "img_size": 64}),
], ids=["cvt", "vil"])
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
