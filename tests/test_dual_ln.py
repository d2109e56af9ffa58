"""DualLN at initialisation (paper Sec. 3.3, Fig. 2 left): without it the projected keys/values, averages of many
tokens' keys/values, are much shorter than the window ones, so the softmax favours the window; with it both have the
same norm. Measured in every Long-Short layer of freshly initialised text and image models.

Measured ratios (seed 0) without DualLN: ls_hf bidirectional 1.63-1.85, RoBERTa-style causal 1.53-1.71, official
char-LM model 3.69-3.76, CvT*-LS-13 4.4-12.1, ViL-LS-small 6.3-7.0; with DualLN 0.999-1.003 everywhere. The RoBERTa-
style models stay lowest because every token carries the same token-type embedding (type_vocab_size=1), a third of
the embedding variance at initialisation, which averaging keeps."""

import pytest
import timm
import torch
import torch.nn.functional as F

import ls_timm  # noqa: F401  (registers the timm models)
from ls_hf import (
    LongShortConfig,
    LongShortForCausalLM,
    LongShortModel,
    LongShortSelfAttention,
    LongShortXLConfig,
    LongShortXLForCausalLM,
)
from ls_hf.modeling_long_short_xl import LongShortXLAttention
from ls_timm.long_short_attention_2d import LongShortAttention2d


def _norm_ratio(window: torch.Tensor, rows: torch.Tensor) -> float:
    """Average norm of the window vectors over the average norm of the projected rows (both (..., width))."""
    return (window.norm(dim=-1).mean() / rows.norm(dim=-1).mean()).item()


def _pool(scores: torch.Tensor, x: torch.Tensor, segment: int) -> torch.Tensor:
    """Eq. 3 / 5 by definition: per segment of ``segment`` tokens and head, ``softmax(X W^P)^T x``.
    scores (B, n, H, r), x (B, n, H, d) -> rows (B, n / segment * r, H * d)."""
    B, n, H, r = scores.shape
    prob = scores.view(B, n // segment, segment, H, r).softmax(2)
    rows = torch.einsum("bslhr,bslhd->bsrhd", prob, x.view(B, n // segment, segment, H, -1))
    return rows.reshape(B, -1, H * x.shape[-1])


def _layer_norm(module, x):
    return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps) if module else x


def text_ratios(model, attention_class, ids):
    """(key ratio, value ratio) of every Long-Short layer of an ``ls_hf`` model on ``ids``."""
    seen = []
    handles = [
        m.register_forward_pre_hook(lambda m, a, k: seen.append((m, a[0])), with_kwargs=True)
        for m in model.modules()
        if isinstance(m, attention_class)
    ]
    with torch.no_grad():
        model(ids)
        ratios = []
        for module, x in seen:
            H = module.num_heads
            local = getattr(module, "dual_ln_local", None) if module.use_dual_ln else None
            glob = getattr(module, "dual_ln_global", None) if module.use_dual_ln else None
            if isinstance(module, LongShortXLAttention):  # the block's pre-LN input; official raw projection input
                raw_k, raw_v = module.key(x), module.value(x)
                sources = (raw_k, raw_v) if module.projection_input == "raw" else None
            else:
                raw_k, raw_v, sources = module.key(x), module.value(x), None
            k, v = _layer_norm(local, raw_k), _layer_norm(local, raw_v)
            sources = sources or (k, v)
            segment = module.segment_length if getattr(module, "causal", True) else x.shape[1]
            scores = module.dynamic_projection(x).unflatten(-1, (H, -1))
            rows = [_layer_norm(glob, _pool(scores, s.unflatten(-1, (H, -1)), segment)) for s in sources]
            ratios.append((_norm_ratio(k, rows[0]), _norm_ratio(v, rows[1])))
    for handle in handles:
        handle.remove()
    return ratios


def image_ratios(model, images):
    """(key ratio, value ratio) of every ``LongShortAttention2d`` layer of an ``ls_timm`` model on ``images``."""
    seen = []
    handles = [
        m.register_forward_pre_hook(lambda m, a: seen.append((m, *a)))
        for m in model.modules()
        if isinstance(m, LongShortAttention2d) and m.projection_rank
    ]
    with torch.no_grad():
        model(images)
        ratios = []
        for module, x, feat_size in seen:
            patches = x[:, module.num_prefix_tokens :]
            x_map = None
            if module.conv_proj is not None or module.dp_conv is not None:
                x_map = patches.transpose(1, 2).reshape(x.shape[0], -1, *feat_size)
            _, k, v = module._qkv(patches, x_map)
            rows_k, rows_v = module._project(patches, x_map, k, v)
            ratios.append((_norm_ratio(k, rows_k), _norm_ratio(v, rows_v)))
    for handle in handles:
        handle.remove()
    return ratios


def _text_models(use_dual_ln):
    common = {
        "vocab_size": 259,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 1024,
        "use_dual_ln": use_dual_ln,
    }
    yield (
        "bidirectional",
        LongShortModel(LongShortConfig(**common, window_size=16, projection_rank=8, max_position_embeddings=600)),
        LongShortSelfAttention,
    )
    yield (
        "causal",
        LongShortForCausalLM(
            LongShortConfig(
                **common,
                window_size=128,
                projection_rank=1,
                causal_segment_length=16,
                is_decoder=True,
                max_position_embeddings=600,
            )
        ),
        LongShortSelfAttention,
    )
    yield (
        "official",
        LongShortXLForCausalLM(LongShortXLConfig(**common, window_size=128, memory_length=0)),
        LongShortXLAttention,
    )


@pytest.mark.parametrize("use_dual_ln", [True, False], ids=["dual_ln", "no_dual_ln"])
def test_text_models(use_dual_ln):
    torch.manual_seed(0)
    ids = torch.randint(3, 259, (2, 512))
    for name, model, attention_class in _text_models(use_dual_ln):
        ratios = text_ratios(model.eval(), attention_class, ids)
        assert len(ratios) == 4, name
        for layer, pair in enumerate(ratios):
            for ratio in pair:
                if use_dual_ln:
                    assert abs(ratio - 1) <= 0.05, (name, layer, ratios)
                else:
                    assert ratio > 1.5, (name, layer, ratios)


@pytest.mark.parametrize("use_dual_ln", [True, False], ids=["dual_ln", "no_dual_ln"])
@pytest.mark.parametrize("name", ["cvt_ls_13", "vil_ls_small"])
def test_image_models(name, use_dual_ln):
    torch.manual_seed(0)
    model = timm.create_model(name, use_dual_ln=use_dual_ln).eval()
    ratios = image_ratios(model, torch.randn(1, 3, 224, 224))
    assert len(ratios) == sum(1 for m in model.modules() if isinstance(m, LongShortAttention2d) and m.projection_rank)
    for layer, pair in enumerate(ratios):
        for ratio in pair:
            if use_dual_ln:
                assert abs(ratio - 1) <= 0.05, (layer, ratios)
            else:
                assert ratio > 1.5, (layer, ratios)
