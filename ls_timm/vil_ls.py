"""ViL-LS: Vision Longformer with Long-Short attention (Zhu et al., "Long-Short Transformer", NeurIPS 2021).

Paper: https://arxiv.org/abs/2107.02192 (Sec. 4.3, Table 5). Reproduces NVIDIA/transformer-ls ``imagenet/``
(``MsViT`` with ``AttentionLS``, MIT license, Copyright (c) 2021 NVIDIA CORPORATION; built on
microsoft/vision-longformer, MIT, Copyright (c) Microsoft Corporation); its released checkpoints load through
``checkpoint_filter_fn``. Re-implemented for timm in this package.

Layout (official launch scripts): four stages with patch sizes 4, 2, 2, 2, widths 96/192/384/768, heads 3/3/6/12,
one global token in stages 1-3 (fresh per stage) and none in stage 4. Stages 1-2 use Long-Short attention (w = 7 at
224, w = 8 at 384; r = 8 rows per head; the official window bias table); stages 3-4 use full attention with a
Swin-style relative position bias over the whole map plus global<->local biases. Blocks are pre-norm (LN eps 1e-6),
MLP ratio 4 with GELU; the head averages the final-normed stage-4 tokens.
"""

from __future__ import annotations

import math
import os
import pickle
import re
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import calculate_drop_path_rates, to_2tuple
from timm.models import build_model_with_cfg, generate_default_cfgs, load_pretrained, register_model
from torch import Tensor, nn

from .hierarchical import HierarchicalTransformer, Stage, check_per_stage, feature_cfg
from .long_short_attention_2d import LongShortAttention2d, merged_heads

__all__ = ["VilLs"]


def swin_relative_index(height: int, width: int, device=None) -> Tensor:
    """(HW, HW) index into a ((2H - 1)(2W - 1)) table for every pair of raster positions (Swin / ViL formula)."""
    ys, xs = torch.meshgrid(torch.arange(height, device=device), torch.arange(width, device=device), indexing="ij")
    coords = torch.stack([ys.flatten(), xs.flatten()])  # (2, HW)
    rel = coords[:, :, None] - coords[:, None, :]
    return (rel[0] + height - 1) * (2 * width - 1) + rel[1] + width - 1


class RelPosAttention(nn.Module):
    """ViL full attention (stages 3-4): multi-head attention over all ``g + H*W`` tokens with a learned relative
    position bias over the (H, W) map, ``g2l`` (global<->local) and ``g2g`` biases; x (B, g + HW, C)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        feat_size: tuple[int, int],
        num_prefix_tokens: int,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.num_heads = num_heads
        self.feat_size = tuple(feat_size)
        self.num_prefix_tokens = num_prefix_tokens
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias, **dd)
        height, width = self.feat_size
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * height - 1) * (2 * width - 1), num_heads, **dd)
        )
        self.register_buffer("relative_position_index", swin_relative_index(height, width, device), persistent=False)
        if num_prefix_tokens:
            self.g2l_relative_position_bias = nn.Parameter(torch.zeros(2, num_heads, num_prefix_tokens, **dd))
            self.g2g_relative_position_bias = nn.Parameter(
                torch.zeros(num_heads, num_prefix_tokens, num_prefix_tokens, **dd)
            )
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def init_non_persistent_buffers(self) -> None:
        """Rebuild the relative position index, which checkpoints do not hold (timm calls this after a model made on
        the meta device is materialised)."""
        self.relative_position_index = swin_relative_index(*self.feat_size, self.relative_position_index.device)

    def _bias(self) -> Tensor:
        """Additive bias (heads, N, N) in token order [global; map]."""
        n = self.relative_position_index.shape[0]
        bias = self.relative_position_bias_table[self.relative_position_index].permute(2, 0, 1)
        if not self.num_prefix_tokens:
            return bias
        g2l, heads, g = self.g2l_relative_position_bias, self.num_heads, self.num_prefix_tokens
        top = torch.cat([self.g2g_relative_position_bias, g2l[0].unsqueeze(-1).expand(heads, g, n)], -1)
        bottom = torch.cat([g2l[1].unsqueeze(1).expand(heads, n, g), bias], -1)
        return torch.cat([top, bottom], 1)

    def forward(self, x: Tensor, feat_size: tuple[int, int]) -> Tensor:
        if tuple(feat_size) != self.feat_size:
            raise ValueError(
                f"the input gives a {tuple(feat_size)} map where the full-attention bias table was built "
                f"for {self.feat_size}; feed images of the model's img_size or create it with img_size "
                "set to the input size."
            )
        B, N = x.shape[:2]
        q, k, v = self.qkv(x).view(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self._bias().to(q.dtype).unsqueeze(0), dropout_p=self.attn_drop if self.training else 0.0
        )
        return self.proj_drop(self.proj(merged_heads(x)))


class VilLs(HierarchicalTransformer):
    """ViL-LS (official NVIDIA ``MsViT`` with ``AttentionLS``).

    Args:
        img_size: input side; fixes the full-attention bias tables (stages whose ``long_short`` is False).
        patch_sizes, embed_dims, depths, num_heads, num_global_tokens: per-stage layout.
        long_short: per stage, Long-Short attention (True) or full attention with relative bias (False).
        window_size: w of the Long-Short stages; projection_rank: r rows per head (Eq. 3).
        qk_head_dims: optional LMSA query/key head width per stage (``LongShortAttention2d``'s ``qk_head_dim``;
            Long-Short stages without global tokens only).
        use_dual_ln: DualLN (Eq. 7) in the Long-Short stages; False is the paper's ablation.
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
        global_pool: str = "avg",
        patch_sizes: Sequence[int] = (4, 2, 2, 2),
        embed_dims: Sequence[int] = (96, 192, 384, 768),
        depths: Sequence[int] = (1, 2, 8, 1),
        num_heads: Sequence[int] = (3, 3, 6, 12),
        num_global_tokens: Sequence[int] = (1, 1, 1, 0),
        long_short: Sequence[bool] = (True, True, False, False),
        window_size: int = 7,
        projection_rank: int = 8,
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
        norm_layer: Callable | None = None,  # default LayerNorm eps 1e-6
        act_layer: Callable = nn.GELU,
        device=None,
        dtype=None,
    ):
        dd = {"device": device, "dtype": dtype}
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        num_stages = len(depths)
        qk_head_dims = qk_head_dims or (None,) * num_stages
        check_per_stage(
            depths,
            patch_sizes=patch_sizes,
            embed_dims=embed_dims,
            num_heads=num_heads,
            num_global_tokens=num_global_tokens,
            long_short=long_short,
            qk_head_dims=qk_head_dims,
        )
        if num_global_tokens[-1]:
            raise ValueError("num_global_tokens[-1] must be 0: the head averages the last stage's patch tokens.")
        for i, (ls, qk_head_dim) in enumerate(zip(long_short, qk_head_dims)):
            if qk_head_dim is not None and not ls:
                raise ValueError(
                    f"qk_head_dims[{i}]={qk_head_dim} sets the LMSA query/key width of a full-attention "
                    f"stage (long_short[{i}] is False), which has none; use None there."
                )
        side, sides = to_2tuple(img_size), []
        for p in patch_sizes:
            side = (side[0] // p, side[1] // p)
            sides.append(side)
        if min(sides[-1]) < 1:
            raise ValueError(
                f"img_size={img_size} is smaller than the total patch stride "
                f"{math.prod(patch_sizes)}; use a larger img_size."
            )
        rates = calculate_drop_path_rates(drop_path_rate, list(depths), stagewise=True)  # linspace over all blocks
        stages, in_chs = [], in_chans
        for i in range(num_stages):
            if long_short[i]:
                attn = partial(
                    LongShortAttention2d,
                    dim=embed_dims[i],
                    num_heads=num_heads[i],
                    window_size=window_size,
                    projection_rank=projection_rank,
                    num_prefix_tokens=num_global_tokens[i],
                    qkv_bias=qkv_bias,
                    qk_head_dim=qk_head_dims[i],
                    window_bias=True,
                    use_dual_ln=use_dual_ln,
                    attn_drop=attn_drop_rate,
                    proj_drop=proj_drop_rate,
                    attn_implementation=attn_implementation,
                    compile_attention=compile_attention,
                    **dd,
                )
            else:
                attn = partial(
                    RelPosAttention,
                    dim=embed_dims[i],
                    num_heads=num_heads[i],
                    feat_size=sides[i],
                    num_prefix_tokens=num_global_tokens[i],
                    qkv_bias=qkv_bias,
                    attn_drop=attn_drop_rate,
                    proj_drop=proj_drop_rate,
                    **dd,
                )
            stages.append(
                Stage(
                    in_chs=in_chs,
                    dim=embed_dims[i],
                    kernel_size=patch_sizes[i],
                    stride=patch_sizes[i],
                    padding=0,
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
            strides=patch_sizes,
            num_classes=num_classes,
            global_pool=global_pool,
            drop_rate=drop_rate,
            norm_layer=norm_layer,
            **dd,
        )

    @torch.jit.ignore
    def load_pretrained(self, checkpoint_path: str) -> None:
        """timm's ``custom_load`` hook for the released weights: their URLs all end in ``model_best.pth``, so each
        variant's cfg names its own cache file, and the download loads here through timm's loader as a local file
        (``checkpoint_filter_fn``, classifier and input-channel adaptation)."""
        cfg = {**self.pretrained_cfg, "file": checkpoint_path, "custom_load": False}
        load_pretrained(
            self,
            cfg,
            num_classes=self.num_classes,
            in_chans=self.stages[0].embed.proj.in_channels,
            filter_fn=checkpoint_filter_fn,
        )


def checkpoint_filter_fn(state_dict: dict, model: VilLs) -> dict:
    """Official ``MsViT`` checkpoint (``{'net': ...}``, optional ``module.`` prefix) -> ``VilLs`` keys.

    ``layer{s}.0`` (patch embed, cls token) -> ``stages.{s-1}.embed`` / ``.cls_token``; ``layer{s}.{2i+1}`` (attention
    block) and ``layer{s}.{2i+2}`` (MLP block) -> ``stages.{s-1}.blocks.{i}`` (``norm1``/``attn``, ``norm2``/``mlp``);
    ``relative_position_index`` buffers are dropped (rebuilt from the same formulas).
    """
    state_dict = state_dict.get("net", state_dict)
    if any(k.startswith("stages.") for k in state_dict):
        return state_dict
    renames = (
        ("to_dynamic_projection", "dynamic_projection"),
        ("dual_ln_full", "dual_ln_local"),
        ("dual_ln_dp", "dual_ln_global"),
        ("local_relative_position_bias_table", "relative_position_bias_table"),
    )
    out = {}
    for key, value in state_dict.items():
        key = key.removeprefix("module.")
        if key.endswith("relative_position_index"):
            continue
        match = re.match(r"layer(\d+)\.(\d+)\.(.+)", key)
        if match:
            stage, index, rest = int(match[1]) - 1, int(match[2]), match[3]
            if index == 0:
                rest = rest if rest == "cls_token" else "embed." + rest.replace("norm_embed", "norm")
            else:
                rest = re.sub(r"^norm\.", "norm1." if index % 2 else "norm2.", rest)
                rest = f"blocks.{(index - 1) // 2}.{rest}"
            key = f"stages.{stage}.{rest}"
        for old, new in renames:
            key = key.replace(old, new)
        out[key] = value
    return out


def _create_vil_ls(variant: str, pretrained: bool = False, **kwargs) -> VilLs:
    file = (kwargs.get("pretrained_cfg_overlay") or {}).get("file") if pretrained else None
    if file is not None and not os.path.isfile(file):
        raise FileNotFoundError(
            f"{variant}: pretrained_cfg_overlay file {file!r}: no such file; give the path of the "
            f"downloaded weights (the official release's model_best.pth)."
        )
    try:
        return build_model_with_cfg(
            VilLs,
            variant,
            pretrained,
            pretrained_filter_fn=checkpoint_filter_fn,
            feature_cfg=feature_cfg(kwargs, 4),
            **kwargs,
        )
    except (KeyError, RuntimeError, pickle.UnpicklingError) as err:  # a file torch cannot read, or other weights
        if file is None:
            raise
        raise ValueError(
            f"{variant}: {file!r} holds no {variant} weights that can be read ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]}); give the official model_best.pth of this model or a "
            f"timm checkpoint of it."
        ) from err
    except OSError as err:  # urllib's URLError and the other download failures
        if not pretrained:
            raise
        raise OSError(
            f"{variant}: the pretrained weights could not be downloaded ({err}). Load a downloaded copy instead: "
            f"timm.create_model({variant!r}, pretrained=True, pretrained_cfg_overlay=dict(file='model_best.pth')), "
            f"or the ImageNet recipe's --pretrained-file model_best.pth."
        ) from None


def _cfg(url: str = "", **kwargs) -> dict:
    return {
        "url": url,
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": (7, 7),
        "fixed_input_size": True,
        "crop_pct": 0.875,
        "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "stages.0.embed.proj",
        "classifier": "head",
        "license": "mit",
        "paper_ids": "arXiv:2107.02192",
        "paper_name": "Long-Short Transformer: Efficient Transformers for Language and Vision",
        "origin_url": "https://github.com/NVIDIA/transformer-ls",
        **kwargs,
    }


def _released(dropbox_key: str, file_name: str, **kwargs) -> dict:
    """The cfg of official weights: downloaded to their own cache ``file_name`` and loaded by ``load_pretrained``."""
    return _cfg(
        url=(f"https://www.dropbox.com/s/{dropbox_key}/model_best.pth?dl=1", file_name), custom_load=True, **kwargs
    )


default_cfgs = generate_default_cfgs(
    {
        "vil_ls_small": _cfg(),
        "vil_ls_medium.nv_in1k": _released("ng14pebstaaydug", "vil_ls_medium_nv_in1k.pth"),
        "vil_ls_medium_384.nv_in1k": _released(
            "390tzi2ll3sfibl", "vil_ls_medium_384_nv_in1k.pth", input_size=(3, 384, 384), pool_size=(12, 12)
        ),
        "vil_ls_base.nv_in1k": _released("80u5p5eh4txad10", "vil_ls_base_nv_in1k.pth"),
    }
)


@register_model
def vil_ls_small(pretrained: bool = False, **kwargs) -> VilLs:
    """ViL-Small layout (depths 1, 2, 8, 1) with LS attention in stages 1-2; no released weights. 24.67M params."""
    model_args = {"depths": (1, 2, 8, 1)}
    return _create_vil_ls("vil_ls_small", pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vil_ls_medium(pretrained: bool = False, **kwargs) -> VilLs:
    """ViL-LS-Medium, 224 (depths 1, 4, 16, 1; w = 7, r = 8): 39.80M params (paper 39.8M), 83.8% top-1."""
    model_args = {"depths": (1, 4, 16, 1)}
    return _create_vil_ls("vil_ls_medium", pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vil_ls_medium_384(pretrained: bool = False, **kwargs) -> VilLs:
    """ViL-LS-Medium at 384 (w = 8; larger full-attention tables): 39.95M params (paper 39.9M), 84.4% top-1."""
    model_args = {"depths": (1, 4, 16, 1), "img_size": 384, "window_size": 8}
    return _create_vil_ls("vil_ls_medium_384", pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vil_ls_base(pretrained: bool = False, **kwargs) -> VilLs:
    """ViL-LS-Base, 224 (depths 1, 8, 24, 1; w = 7, r = 8): 55.83M params (paper 55.8M), 84.1% top-1."""
    model_args = {"depths": (1, 8, 24, 1)}
    return _create_vil_ls("vil_ls_base", pretrained=pretrained, **dict(model_args, **kwargs))
