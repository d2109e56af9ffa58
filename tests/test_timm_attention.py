"""2-D Long-Short attention (``ls_timm.long_short_attention_2d``) against an explicit per-query reference, the
official ViL-LS fixtures, the LMSA parameter counts and its argument checks."""

import copy
import json
import math
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from ls_timm.conv_layers import ConvBn, StdConv2d
from ls_timm.long_short_attention_2d import LongShortAttention2d, window_layout
from ls_timm.vil_ls import VilLs, checkpoint_filter_fn
from tests.devices import assert_close, cpu64

FIXTURES = Path(__file__).resolve().parent / "fixtures"  # produced by the official code (fixtures/README.md)


def _ln(ln, x):
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def reference_attention(m: LongShortAttention2d, x: torch.Tensor, feat_size) -> torch.Tensor:
    """Paper Eq. 3/6/7 + the official 2-D window and post-cls rules, one query at a time, from m's parameters."""
    B, N, C = x.shape
    (H, W), w, g, heads = feat_size, m.window_size, m.num_prefix_tokens, m.num_heads
    e = max(w // 2, 1)
    if m.conv_proj is None:
        q, k, v = m.qkv(x).split(m.splits, -1)
    else:  # depthwise conv + BN per branch on the map (eval statistics), global tokens bypass it, then Linear
        x_map = x[:, g:].transpose(1, 2).reshape(B, C, H, W)
        branches = []
        for (conv, bn), lin in zip(m.conv_proj, (m.q, m.k, m.v)):
            y = F.conv2d(x_map, conv.weight, padding=1, groups=C)
            y = F.batch_norm(y, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
            branches.append(lin(torch.cat([x[:, :g], y.flatten(2).transpose(1, 2)], 1)))
        q, k, v = branches
    k = _ln(m.dual_ln_local_key or m.dual_ln_local, k)
    v = _ln(m.dual_ln_local, v)
    q, k, v = (t.view(B, N, heads, -1) for t in (q, k, v))
    d_v = v.shape[-1]

    rows_k, rows_v = q.new_zeros(B, 0, heads, q.shape[-1]), v.new_zeros(B, 0, heads, d_v)
    if m.projection_rank:
        patches = x[:, g:]
        if m.dp_conv is not None:
            wt = m.dp_conv.weight
            wt = (wt - wt.mean((1, 2, 3), keepdim=True)) / (
                wt.var((1, 2, 3), unbiased=False, keepdim=True) + m.dp_conv.eps
            ).sqrt()
            patches = F.conv2d(patches.transpose(1, 2).reshape(B, C, H, W), wt, padding=1, groups=C)
            patches = patches.flatten(2).transpose(1, 2)
        prob = m.dynamic_projection(patches).view(B, H * W, heads, -1).softmax(1)  # softmax over the HW tokens, Eq. 3
        rows_k = torch.einsum("bnhr,bnhd->brhd", prob, k[:, g:])
        rows_v = torch.einsum("bnhr,bnhd->brhd", prob, v[:, g:])
        rows_k = _ln(m.dual_ln_global_key or m.dual_ln_global, rows_k.flatten(2)).view_as(rows_k)
        rows_v = _ln(m.dual_ln_global, rows_v.flatten(2)).view_as(rows_v)

    out = v.new_zeros(B, N, heads, d_v)
    pad = w // 2
    for y in range(H):
        for xx in range(W):
            by, bx = y // w * w, xx // w * w
            keys, values, bias = [rows_k, k[:, :g]], [rows_v, v[:, :g]], []
            for ky in range(max(by - e, 0), min(by + w + e, H)):
                for kx in range(max(bx - e, 0), min(bx + w + e, W)):
                    keys.append(k[:, g + ky * W + kx, None])
                    values.append(v[:, g + ky * W + kx, None])
                    if m.relative_position_bias_table is not None:
                        ty, tx = ky - (by - pad), kx - (bx - pad)
                        dy, dx = (y - by) - (ty - pad), (xx - bx) - (tx - pad)
                        index = (dy + pad + w - 1) * (2 * pad + w) + dx + pad + w - 1
                        bias.append(m.relative_position_bias_table[index])
            keys, values = torch.cat(keys, 1), torch.cat(values, 1)
            scores = torch.einsum("bhd,bkhd->bhk", q[:, g + y * W + xx], keys) / math.sqrt(q.shape[-1])
            if bias:
                n_extra = keys.shape[1] - len(bias)
                scores = scores + torch.cat([scores.new_zeros(n_extra, heads), torch.stack(bias)]).T
            out[:, g + y * W + xx] = torch.einsum("bhk,bkhd->bhd", scores.softmax(-1), values)
    for i in range(g):  # post-cls: own key/values of all global tokens, then the patch outputs
        keys = torch.cat([k[:, :g], out[:, g:]], 1)
        values = torch.cat([v[:, :g], out[:, g:]], 1)
        scores = torch.einsum("bhd,bkhd->bhk", q[:, i], keys) / math.sqrt(q.shape[-1])
        out[:, i] = torch.einsum("bhk,bkhd->bhd", scores.softmax(-1), values)
    return m.proj(out.reshape(B, N, C))


def _randomise(m: torch.nn.Module) -> None:
    """Non-trivial parameters and BN statistics so that every term matters."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() > 1 else 0.3) + (1.0 if name.endswith("norm.weight") else 0))
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.running_mean.normal_()
                mod.running_var.uniform_(0.5, 2.0)


def test_reparameterize_model_fuses_the_conv_projections():
    """``timm.utils.reparameterize_model`` turns CvT*-LS's conv+BatchNorm projections and its weight-standardised
    dynamic-projection convs into plain convs, folded once: same eval outputs (logits and stage maps), no BatchNorm
    or standardisation left, and the original model untouched. In float64, so that the folded and unfolded roundings
    of the randomised (large) activations stay far below the tolerance."""
    model = timm.create_model("cvt_ls_13", depths=(1, 1, 2))
    _randomise(model)
    model.double().eval()
    fused = timm.utils.reparameterize_model(model)
    kinds = (ConvBn, StdConv2d, nn.BatchNorm2d)
    assert not any(isinstance(m, kinds) for m in fused.modules())
    assert sum(isinstance(m, ConvBn) for m in model.modules()) == 3 * 4  # q, k, v in each of the 4 blocks
    x = torch.randn(2, 3, 64, 48, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-9, rtol=1e-9)
        for got, want in zip(
            fused.forward_intermediates(x, intermediates_only=True),
            model.forward_intermediates(x, intermediates_only=True),
        ):
            torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


CASES = [  # (H, W, dim, heads, w, r, g, kwargs)
    (10, 9, 16, 2, 4, 3, 0, {}),  # padding on both sides, even w
    (7, 7, 12, 3, 7, 2, 1, {"window_bias": True}),  # ViL-LS: odd w, bias table, global token
    (9, 11, 16, 2, 3, 2, 1, {"window_bias": True}),  # bias table with padding
    (8, 6, 16, 2, 2, 4, 1, {"conv_proj": True, "conv_dynamic_proj": True}),  # CvT*-LS
    (5, 7, 8, 1, 2, 0, 0, {"conv_proj": True}),  # no projection (window only), w=2
    (6, 6, 16, 2, 1, 2, 0, {"qk_head_dim": 4}),  # LMSA with w=1 (e=1 rounding)
    (12, 12, 16, 4, 8, 2, 2, {"qk_head_dim": 4}),  # one block, two global tokens (query/key heads of the value width)
    (8, 6, 16, 2, 2, 0, 0, {}),  # four strips, no extra keys
]


@pytest.mark.parametrize("strips", [False, True], ids=["blocked", "strips"])
@pytest.mark.parametrize("H,W,dim,heads,w,r,g,kwargs", CASES)
def test_matches_reference(H, W, dim, heads, w, r, g, kwargs, strips, device, dtype):
    m = LongShortAttention2d(dim, heads, w, r, num_prefix_tokens=g, **kwargs).eval()
    _randomise(m)
    m.strip_max_tokens = 10**9 if strips else 0
    x = torch.randn(2, g + H * W, dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    m, x = m.to(device, dtype), x.to(device, dtype)
    with torch.no_grad():
        assert_close(m(x, (H, W)), reference_attention(*cpu64(m, x), (H, W)), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize(
    "w,side,strips", [(2, 14, True), (3, 24, True), (4, 28, False), (2, 15, True), (2, 17, False), (2, 21, False)]
)
def test_layout_choice(w, side, strips):
    """Strips for maps of up to 576 patches whose height w divides (CvT stage 3 at 224 and 384), one strip only up to
    256 patches, blocks otherwise (CvT stage 3 at 448, odd sizes, stages 1-2)."""
    assert LongShortAttention2d(16, 2, w, 2)._in_strips((side, side)) == strips


@pytest.mark.parametrize("H,W,dim,heads,w,r,g,kwargs", CASES)
def test_layouts_give_the_same_gradients(H, W, dim, heads, w, r, g, kwargs, device):
    """Strips (keys and values as one overlapping strided view) and blocks (gathered keys and values): the same
    gradients for the input and every parameter. In float64: some true gradients are 0 (a dynamic-projection bias,
    constant over the positions, cancels in Eq. 3's softmax over them) while others reach ~1e3, so float32 rounding
    noise would exceed any absolute tolerance that still tests the small ones."""
    m = LongShortAttention2d(dim, heads, w, r, num_prefix_tokens=g, **kwargs).eval()
    _randomise(m)
    m.to(device, torch.float64)
    x = torch.randn(2, g + H * W, dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)
    grads = []
    for strip_max_tokens in (0, 10**9):
        m.strip_max_tokens = strip_max_tokens
        m.zero_grad()
        xi = x.clone().requires_grad_()
        m(xi, (H, W)).square().sum().backward()
        grads.append([xi.grad] + [p.grad for p in m.parameters() if p.grad is not None])
    assert len(grads[1]) == len(grads[0]) > 5
    torch.testing.assert_close(grads[1], grads[0], atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize(
    "kwargs", [{"window_bias": True}, {"conv_proj": True, "conv_dynamic_proj": True}], ids=["vil", "cvt"]
)
@pytest.mark.parametrize("chunk", ["block", "half_image", "two_images"])
def test_chunked_blocks_match_reference_and_gradients(kwargs, chunk):
    """The blocked layout taken in chunks (one block, part of an image, several images with a shorter last chunk)
    gives the reference output and the same gradients as one chunk."""
    H, W, dim, heads, w, r, g, B = 9, 11, 16, 2, 4, 3, 1, 3
    m = LongShortAttention2d(dim, heads, w, r, num_prefix_tokens=g, **kwargs).eval()
    _randomise(m)
    m.double()  # gradients in float64: some are 0 in exact arithmetic (see test_layouts_give_the_same_gradients)
    m.strip_max_tokens = 0
    blocks = math.ceil(H / w) * math.ceil(W / w)
    block_bytes = ((w + 2 * (w // 2)) ** 2 + r + g) * 2 * dim * 8  # keys + values of one block, float64
    m.chunk_bytes = {
        "block": block_bytes,
        "half_image": blocks * block_bytes // 2,
        "two_images": 2 * blocks * block_bytes,
    }[chunk]
    x = torch.randn(B, g + H * W, dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    chunks = m._chunks(B, blocks, block_bytes, x.device)
    assert len(chunks) == {"block": B * blocks, "half_image": 2 * B, "two_images": 2}[chunk]
    with torch.no_grad():
        torch.testing.assert_close(m(x, (H, W)), reference_attention(m, x, (H, W)), atol=2e-5, rtol=1e-4)

    grads = []
    for chunk_bytes in (m.chunk_bytes, 2**62):
        m.chunk_bytes = chunk_bytes
        m.zero_grad()
        xi = x.clone().requires_grad_()
        m(xi, (H, W)).square().sum().backward()
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    for chunked, whole in zip(*grads):
        torch.testing.assert_close(chunked, whole, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("kwargs", [{"window_bias": True}, {}], ids=["vil", "plain"])
@pytest.mark.parametrize("side", [9, 20], ids=["strips", "blocked"])
def test_layout_cached_in_inference_mode_serves_training(kwargs, side):
    """The window layout is cached per map size; one first built under ``torch.inference_mode`` must still be usable
    in a training step (inference tensors cannot be saved for backward)."""
    m = LongShortAttention2d(16, 2, 4, 2, num_prefix_tokens=1, **kwargs)
    m.strip_max_tokens = 100
    x = torch.randn(2, 1 + side * (side + 1), 16)
    window_layout.cache_clear()
    with torch.inference_mode():
        expected = m(x, (side, side + 1))
    assert window_layout.cache_info().currsize == 1
    xi = x.clone().requires_grad_()
    out = m(xi, (side, side + 1))
    out.square().sum().backward()
    assert window_layout.cache_info().hits == 1
    torch.testing.assert_close(out.detach(), expected)
    assert xi.grad.abs().sum() > 0


def test_backward_reaches_every_parameter():
    m = LongShortAttention2d(16, 2, 3, 2, num_prefix_tokens=1, conv_proj=True, conv_dynamic_proj=True)
    x = torch.randn(2, 1 + 7 * 5, 16, requires_grad=True)
    m(x, (7, 5)).square().sum().backward()
    assert x.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


def test_conv_bn_trains_on_batch_statistics_and_folds_in_eval():
    """CvT's dw_bn projection: in training, conv then BatchNorm on the batch statistics, updating the running ones as
    a plain BatchNorm2d does; in eval, the BatchNorm folded into the conv equals conv then BatchNorm on the running
    statistics."""
    conv_bn = ConvBn(nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False), nn.BatchNorm2d(6))
    _randomise(conv_bn)  # running statistics far from the batch ones
    conv, bn = copy.deepcopy(conv_bn)
    x = torch.randn(4, 6, 5, 7, generator=torch.Generator().manual_seed(2)) * 2 + 1
    with torch.no_grad():
        for _ in range(2):  # the second step starts from updated running statistics
            torch.testing.assert_close(conv_bn.train()(x), bn.train()(F.conv2d(x, conv.weight, padding=1, groups=6)))
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                torch.testing.assert_close(getattr(conv_bn[1], name), getattr(bn, name), msg=name)
        assert conv_bn[1].num_batches_tracked == 2
        want = F.batch_norm(
            F.conv2d(x, conv.weight, padding=1, groups=6),
            bn.running_mean,
            bn.running_var,
            bn.weight,
            bn.bias,
            False,
            0.0,
            bn.eps,
        )
        torch.testing.assert_close(conv_bn.eval()(x), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_bn[1].running_mean, bn.running_mean)  # eval leaves them alone


@pytest.mark.parametrize("strips", [False, True], ids=["blocked", "strips"])
def test_attention_dropout_in_training_only(strips):
    """attn_drop drops attention probabilities in training, in both layouts: the output depends on the seed (and is
    the same for the same seed) and differs from eval; with attn_drop=0 training gives the eval output (ViL-style
    projections: no BatchNorm, whose statistics differ between the modes)."""
    H, W = 9, 10
    m = LongShortAttention2d(16, 2, 4, 2, num_prefix_tokens=1, window_bias=True, attn_drop=0.3)
    _randomise(m)
    m.strip_max_tokens = 10**9 if strips else 0
    x = torch.randn(2, 1 + H * W, 16, generator=torch.Generator().manual_seed(2))

    def run(seed):
        torch.manual_seed(seed)
        return m(x, (H, W))

    with torch.no_grad():
        expected = m.eval()(x, (H, W))
        m.train()
        first = run(0)
        torch.testing.assert_close(run(0), first, atol=0, rtol=0)
        assert not torch.allclose(run(1), first)
        assert not torch.allclose(first, expected)
        m.attn_drop = 0.0
        torch.testing.assert_close(run(0), expected)


@pytest.mark.parametrize("qk_head_dim,count", [(32, 12288), (16, 8192), (8, 6144), (1, 4352)])
def test_lmsa_table1_parameter_counts(qk_head_dim, count):
    """LMSA paper Table 1: query/key/value projections of a 64-dim, 2-head attention (query/key widths 64, 32, 16, 2
    in all)."""
    m = LongShortAttention2d(64, 2, 4, 2, qkv_bias=False, qk_head_dim=qk_head_dim)
    assert sum(p.numel() for p in m.qkv.parameters()) == count
    assert m(torch.randn(1, 36, 64), (6, 6)).shape == (1, 36, 64)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"dim": 10, "num_heads": 3}, "divisible by num_heads"),
        ({"window_size": 0}, "window_size"),
        ({"projection_rank": -1}, "projection_rank"),
        ({"qk_head_dim": 0}, "qk_head_dim"),
        ({"qk_head_dim": 2.5}, "qk_head_dim"),
        ({"qk_head_dim": 4, "num_prefix_tokens": 1}, "num_prefix_tokens=0"),
        ({"window_size": 1, "window_bias": True}, "window_bias"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"dim": 16, "num_heads": 2, "window_size": 4, "projection_rank": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        LongShortAttention2d(**args)


@pytest.mark.parametrize("feat_size", [(4, 4), (2, 8), (3, 2)])
def test_a_map_size_that_does_not_fit_the_tokens_is_refused(feat_size):
    """x holds g + H * W tokens: a ``feat_size`` of another count is refused, naming both, before any work (the (3, 3)
    map of these 10 tokens runs)."""
    attention = LongShortAttention2d(16, 2, 4, 2, num_prefix_tokens=1)
    x = torch.randn(2, 1 + 9, 16)
    attention(x, (3, 3))
    with pytest.raises(ValueError, match=rf"\(batch, 1 \+ {feat_size[0]} \* {feat_size[1]}, 16\).*got \(2, 10, 16\)"):
        attention(x, feat_size)


def test_compiles_without_graph_breaks():
    m = LongShortAttention2d(16, 2, 4, 2, num_prefix_tokens=1, conv_proj=True, conv_dynamic_proj=True).eval()
    x = torch.randn(1, 1 + 10 * 9, 16)
    try:
        compiled = torch.compile(m, fullgraph=True, backend="eager")
        with torch.no_grad():
            out = compiled(x, (10, 9))
    except RuntimeError as err:  # no usable dynamo on this platform
        if "Dynamo is not supported" in str(err):
            pytest.skip(str(err))
        raise
    with torch.no_grad():
        torch.testing.assert_close(out, m(x, (10, 9)))


def _fixture(name):
    from safetensors.torch import load_file

    return load_file(FIXTURES / f"{name}.safetensors"), json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.mark.parametrize("name", ["vil_ls_tiny", "vil_ls_tiny_224"])
def test_vil_ls_reproduces_official_fixture(name):
    tensors, meta = _fixture(name)
    stages = meta["stages"]
    model = VilLs(
        img_size=meta["constructor"]["kwargs"]["img_size"],
        num_classes=meta["constructor"]["kwargs"]["num_classes"],
        patch_sizes=[s["patch_size"] for s in stages],
        embed_dims=[s["dim"] for s in stages],
        depths=[s["blocks"] for s in stages],
        num_heads=[s["heads"] for s in stages],
        num_global_tokens=[s["global_tokens"] for s in stages],
        long_short=[s["attention"] == "ls" for s in stages],
        window_size=stages[0]["window_w"],
        projection_rank=stages[0]["dp_rank_r"],
    ).eval()
    official = {k: v for k, v in tensors.items() if not k.startswith("fixture.")}
    # released checkpoints: {'net': state_dict saved from DDP, 'module.' prefix}
    wrapped = {"net": {f"module.{k}": v for k, v in official.items()}, "epoch": 300}
    model.load_state_dict(checkpoint_filter_fn(wrapped, model))
    x = tensors["fixture.input"]
    with torch.no_grad():
        torch.testing.assert_close(model(x), tensors["fixture.logits"], atol=1e-4, rtol=0)
        torch.testing.assert_close(
            model.forward_head(model.forward_features(x), pre_logits=True),
            tensors["fixture.features"],
            atol=1e-4,
            rtol=0,
        )
        for i, stage in enumerate(model.stages):
            x, feat_size = stage(x)
            torch.testing.assert_close(x, tensors[f"fixture.layer{i + 1}_out"], atol=1e-4, rtol=0)
            x = x[:, stage.num_prefix_tokens :].transpose(1, 2).reshape(x.shape[0], -1, *feat_size)


@pytest.mark.parametrize("strips", [True, False])
@pytest.mark.parametrize("w, r, n", [(1, 0, 7), (2, 2, 9), (3, 1, 12), (4, 3, 13)])
def test_one_row_map_is_the_1d_attention(w, r, n, strips, device):
    """The 2-D attention on a 1 x n map is the 1-D attention (``ls_hf``) with the same weights, in float64: one
    window rule (``window_extent``) and one projection (``project_rows``) serve both."""
    from ls_hf.long_short_attention import LongShortSelfAttention

    torch.manual_seed(w + r)
    two_d = LongShortAttention2d(12, 3, w, r).double().eval()
    one_d = LongShortSelfAttention(12, 3, w, r).double().eval()
    with torch.no_grad():
        for p in two_d.parameters():
            p.normal_()
        weights, biases = two_d.qkv.weight.split(two_d.splits), two_d.qkv.bias.split(two_d.splits)
        state = {
            f"{name}.{leaf}": tensor
            for leaf, tensors in (("weight", weights), ("bias", biases))
            for name, tensor in zip(("query", "key", "value"), tensors)
        }
        state |= {
            "output.weight": two_d.proj.weight,
            "output.bias": two_d.proj.bias,
            **{
                f"dual_ln_{which}.{leaf}": getattr(getattr(two_d, f"dual_ln_{which}"), leaf)
                for which in ("local", "global")
                for leaf in ("weight", "bias")
            },
        }
        if r:
            state |= {
                "dynamic_projection.weight": two_d.dynamic_projection.weight,
                "dynamic_projection.bias": two_d.dynamic_projection.bias,
            }
        one_d.load_state_dict(state)
        two_d.strip_max_tokens = 10**6 if strips else 0
        two_d, one_d = two_d.to(device), one_d.to(device)
        x = torch.randn(2, n, 12, dtype=torch.float64, device=device)
        torch.testing.assert_close(two_d(x, (1, n)), one_d(x)[0], atol=1e-12, rtol=0)
