"""CvT*-LS: Convolutional vision Transformer with Long-Short attention (Zhu et al., NeurIPS 2021).

Paper: https://arxiv.org/abs/2107.02192 (Sec. 4.3, Table 5, Appendix E, Table 12). No official code or weights exist;
this follows the paper on the CvT backbone (Wu et al., https://arxiv.org/abs/2103.15808, microsoft/CvT):

* three stages; convolutional token embedding (7x7 stride 4, then 3x3 stride 2 twice; conv then LayerNorm);
* q, k, v: per-branch depthwise 3x3 conv + BatchNorm on the map, then a Linear (CvT's conv projection), all at
  stride 1 so the short-term window sees every token (CvT subsamples k/v by 2 for its full attention);
* Long-Short attention (Eq. 6) with DualLN; the dynamic projection ``W^P`` of Eq. 3 is a depthwise-separable
  conv whose 3x3 depthwise weights are standardised (Appendix E, footnote 2) followed by a Linear to ``r`` scores
  per head (Eq. 3 defines one ``W_i^P`` of rank r per head), one projection shared by keys and values;
* the cls token exists in stage 3 only, joins every patch query's keys and attends to the patch outputs (the
  official Long-Short "post-cls" form); the head reads the final-normed cls token;
* no position encoding; pre-norm blocks, MLP ratio 4, GELU, LayerNorm eps 1e-5; scale head_dim^-0.5.

Paper settings (Appendix E): ``r = [64, 16, 4]``, ``w = [8, 4, 2]`` at 224; ``w = [12, 6, 3]`` at 384;
``r = [128, 32, 8]``, ``w = [16, 8, 4]`` at 448 (picked from ``img_size``; any size works, maps are padded to w).

Parameters, this reading vs the paper (Table 5): CvT*-LS-13 20.17M vs 20.3M; -17 23.54M vs 23.7M; -21 31.90M vs
32.1M; -21S 30.74M vs 30.1M (Table 12's layout: its backbone alone counts 30.41M, so no reading reaches 30.1M).
Separate dynamic projections for keys and values would fit the counts more closely but contradict Eq. 3.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import calculate_drop_path_rates, to_2tuple, to_ntuple
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

from .hierarchical import HierarchicalTransformer, Stage, check_per_stage, feature_cfg
from .long_short_attention_2d import LongShortAttention2d

__all__ = ["PAPER_SETTINGS", "CvtLs"]

# Input side -> (projection ranks r, window sizes w) per stage (Appendix E).
PAPER_SETTINGS = {224: ((64, 16, 4), (8, 4, 2)), 384: ((64, 16, 4), (12, 6, 3)), 448: ((128, 32, 8), (16, 8, 4))}


class CvtLs(HierarchicalTransformer):
    """CvT*-LS.

    Args:
        img_size: picks the paper's ``projection_rank`` / ``window_size`` (the largest ``PAPER_SETTINGS`` side not
            above it) when those are not given; the model itself runs at any input size.
        embed_dims, depths, num_heads: per-stage layout (CvT-13: 64/192/384, 1/2/10, 1/3/6).
        patch_sizes, patch_strides, patch_paddings: convolutional token embeddings.
        projection_rank, window_size: r per head and w, per stage (an int applies to every stage).
        qk_head_dims: optional LMSA query/key head width per stage (``LongShortAttention2d``'s ``qk_head_dim``; stage
            3 must keep the value head width for its cls token).
        use_dual_ln: DualLN (Eq. 7) in every Long-Short layer; False is the paper's ablation (81.3 against 81.9 top-1).
        attn_implementation: the Long-Short layers' ``"sdpa"`` (default) or ``"flex_attention"`` (FlexAttention with a
            block mask: inference on CPU; compiled by the package on CUDA); see ``LongShortAttention2d``.
        compile_attention: on CUDA, compile each Long-Short layer around its attention kernel (default); False
            compiles the kernel alone; see ``LongShortAttention2d``.
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "token",
        embed_dims: Sequence[int] = (64, 192, 384),
        depths: Sequence[int] = (1, 2, 10),
        num_heads: Sequence[int] = (1, 3, 6),
        patch_sizes: Sequence[int] = (7, 3, 3),
        patch_strides: Sequence[int] = (4, 2, 2),
        patch_paddings: Sequence[int] = (2, 1, 1),
        num_global_tokens: Sequence[int] = (0, 0, 1),
        projection_rank: int | Sequence[int] | None = None,
        window_size: int | Sequence[int] | None = None,
        qk_head_dims: Sequence[int | None] | None = None,
        use_dual_ln: bool = True,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        attn_implementation: str = "sdpa",
        compile_attention: bool = True,
        norm_layer: Callable = nn.LayerNorm,
        act_layer: Callable = nn.GELU,
        device=None,
        dtype=None,
    ):
        dd = {"device": device, "dtype": dtype}
        side = max(to_2tuple(img_size))
        paper_rank, paper_window = PAPER_SETTINGS[max([s for s in PAPER_SETTINGS if s <= side], default=224)]
        num_stages = len(depths)
        per_stage = to_ntuple(num_stages)
        projection_rank = per_stage(paper_rank if projection_rank is None else projection_rank)
        window_size = per_stage(paper_window if window_size is None else window_size)
        qk_head_dims = qk_head_dims or (None,) * num_stages
        check_per_stage(
            depths,
            embed_dims=embed_dims,
            num_heads=num_heads,
            patch_sizes=patch_sizes,
            patch_strides=patch_strides,
            patch_paddings=patch_paddings,
            num_global_tokens=num_global_tokens,
            projection_rank=projection_rank,
            window_size=window_size,
            qk_head_dims=qk_head_dims,
        )
        rates = calculate_drop_path_rates(drop_path_rate, list(depths), stagewise=True)  # linspace over all blocks
        stages, in_chs = [], in_chans
        for i in range(num_stages):
            attn = partial(
                LongShortAttention2d,
                dim=embed_dims[i],
                num_heads=num_heads[i],
                window_size=window_size[i],
                projection_rank=projection_rank[i],
                num_prefix_tokens=num_global_tokens[i],
                qkv_bias=qkv_bias,
                qk_head_dim=qk_head_dims[i],
                conv_proj=True,
                conv_dynamic_proj=True,
                use_dual_ln=use_dual_ln,
                attn_drop=attn_drop_rate,
                proj_drop=proj_drop_rate,
                attn_implementation=attn_implementation,
                compile_attention=compile_attention,
                **dd,
            )
            stages.append(
                Stage(
                    in_chs=in_chs,
                    dim=embed_dims[i],
                    kernel_size=patch_sizes[i],
                    stride=patch_strides[i],
                    padding=patch_paddings[i],
                    num_prefix_tokens=num_global_tokens[i],
                    attn_layer=attn,
                    drop_paths=rates[i],
                    mlp_ratio=mlp_ratio,
                    proj_drop=proj_drop_rate,
                    norm_layer=norm_layer,
                    act_layer=act_layer,
                    **dd,
                )
            )
            in_chs = embed_dims[i]
        super().__init__(
            stages=stages,
            strides=patch_strides,
            num_classes=num_classes,
            global_pool=global_pool,
            drop_rate=drop_rate,
            norm_layer=norm_layer,
            **dd,
        )


def _create_cvt_ls(variant: str, pretrained: bool = False, **kwargs) -> CvtLs:
    return build_model_with_cfg(CvtLs, variant, pretrained, feature_cfg=feature_cfg(kwargs, 3), **kwargs)


def _cfg(url: str = "", **kwargs) -> dict:
    return {
        "url": url,
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.875,
        "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "stages.0.embed.proj",
        "classifier": "head",
        "license": "mit",
        "paper_ids": "arXiv:2107.02192",
        "paper_name": "Long-Short Transformer: Efficient Transformers for Language and Vision",
        **kwargs,
    }


default_cfgs = generate_default_cfgs(
    {
        "cvt_ls_13": _cfg(),
        "cvt_ls_17": _cfg(),
        "cvt_ls_21": _cfg(),
        "cvt_ls_21s": _cfg(),
    }
)


@register_model
def cvt_ls_13(pretrained: bool = False, **kwargs) -> CvtLs:
    """CvT*-LS-13: CvT-13 stages (64/192/384 wide, depths 1/2/10, heads 1/3/6). 20.17M params (paper 20.3M)."""
    model_args = {"embed_dims": (64, 192, 384), "depths": (1, 2, 10), "num_heads": (1, 3, 6)}
    return _create_cvt_ls("cvt_ls_13", pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def cvt_ls_17(pretrained: bool = False, **kwargs) -> CvtLs:
    """CvT*-LS-17 (Table 12): 128/256/384 wide, depths 3/4/10, heads 2/4/6. 23.54M params (paper 23.7M)."""
    model_args = {"embed_dims": (128, 256, 384), "depths": (3, 4, 10), "num_heads": (2, 4, 6)}
    return _create_cvt_ls("cvt_ls_17", pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def cvt_ls_21(pretrained: bool = False, **kwargs) -> CvtLs:
    """CvT*-LS-21: CvT-21 stages (64/192/384 wide, depths 1/4/16, heads 1/3/6). 31.90M params (paper 32.1M)."""
    model_args = {"embed_dims": (64, 192, 384), "depths": (1, 4, 16), "num_heads": (1, 3, 6)}
    return _create_cvt_ls("cvt_ls_21", pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def cvt_ls_21s(pretrained: bool = False, **kwargs) -> CvtLs:
    """CvT*-LS-21S (Table 12): 128/256/384 wide, depths 3/4/14, heads 2/4/6. 30.74M params (paper 30.1M)."""
    model_args = {"embed_dims": (128, 256, 384), "depths": (3, 4, 14), "num_heads": (2, 4, 6)}
    return _create_cvt_ls("cvt_ls_21s", pretrained=pretrained, **dict(model_args, **kwargs))
