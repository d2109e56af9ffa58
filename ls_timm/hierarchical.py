"""The multi-stage backbone shared by ViL-LS and CvT-LS (Zhu et al., NeurIPS 2021, Sec. 4.3, Appendix E).

Each stage embeds the previous map with a convolution and a LayerNorm, optionally prepends its own global (cls)
tokens, runs pre-norm transformer blocks, and hands its patch tokens on as an NCHW map (global tokens are dropped
between stages, as in ViL and CvT). The attention of each stage is chosen by the model file (``vil_ls``,
``cvt_ls``); the 2-D Long-Short math itself lives in ``long_short_attention_2d``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from timm.layers import DropPath, Mlp, register_notrace_function, register_notrace_module, trunc_normal_
from timm.models import checkpoint
from timm.models._features import feature_take_indices
from torch import Tensor, nn

from ls_hf.long_short_plan import AttentionPlan

from .long_short_attention_2d import LongShortAttention2d, plan_attention_2d

__all__ = ["Block", "ConvEmbed", "HierarchicalTransformer", "Stage", "check_per_stage", "feature_cfg", "to_map"]


def check_per_stage(depths: Sequence[int], **per_stage: Sequence) -> None:
    """Raise ``ValueError`` unless every per-stage argument has one entry per stage, as ``depths``."""
    for name, value in per_stage.items():
        if len(value) != len(depths):
            raise ValueError(f"{name} needs one entry per stage ({len(depths)}, as depths), got {len(value)}.")


def feature_cfg(kwargs: dict, num_stages: int) -> dict:
    """timm's ``feature_cfg`` for these models, taking ``out_indices`` from ``kwargs`` (default: every stage).
    Features come from ``forward_intermediates`` (timm's "getter"): a stage returns tokens and its map size, not a
    map, so the "hook" and "fx" feature wrappers cannot take it."""
    feature_cls = kwargs.pop("feature_cls", "getter")
    if feature_cls != "getter":
        raise ValueError(
            f"feature_cls={feature_cls!r} is not supported: these models give their features through "
            f"forward_intermediates; leave feature_cls unset (or 'getter')."
        )
    return {"out_indices": kwargs.pop("out_indices", tuple(range(num_stages))), "feature_cls": feature_cls}


class Block(nn.Module):
    """Pre-norm block: ``x + DropPath(attn(LN(x)))`` then ``x + DropPath(MLP(LN(x)))``; x (B, g + HW, C)."""

    def __init__(
        self,
        dim: int,
        attn: nn.Module,
        mlp_ratio: float,
        drop_path: float,
        proj_drop: float,
        norm_layer: Callable,
        act_layer: Callable,
        device=None,
        dtype=None,
    ):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.norm1 = norm_layer(dim, **dd)
        self.attn = attn
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(dim, **dd)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop, **dd)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor, feat_size: tuple[int, int], plan: AttentionPlan | None = None) -> Tensor:
        """``plan``: the stage's attention plan (Long-Short attention only), made once for all its blocks."""
        attn = self.attn(self.norm1(x), feat_size) if plan is None else self.attn(self.norm1(x), feat_size, plan=plan)
        x = x + self.drop_path1(attn)
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class ConvEmbed(nn.Module):
    """Convolutional token embedding: Conv2d then LayerNorm; (B, C_in, H, W) -> (B, H'W', C), (H', W')."""

    def __init__(
        self,
        in_chs: int,
        dim: int,
        kernel_size: int,
        stride: int,
        padding: int,
        norm_layer: Callable,
        device=None,
        dtype=None,
    ):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.proj = nn.Conv2d(in_chs, dim, kernel_size=kernel_size, stride=stride, padding=padding, **dd)
        self.norm = norm_layer(dim, **dd)

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        x = self.proj(x)
        feat_size = (x.shape[-2], x.shape[-1])
        return self.norm(x.flatten(2).transpose(1, 2)), feat_size


@register_notrace_module  # FX tracing (timm's fx tests, create_feature_extractor) keeps a stage as one leaf
class Stage(nn.Module):
    """Conv embedding, ``num_prefix_tokens`` learned global tokens, then ``len(drop_paths)`` blocks.

    ``attn_layer(dim)`` builds one block's attention. Input (B, C_in, H, W); output tokens (B, g + H'W', C).
    """

    def __init__(
        self,
        in_chs: int,
        dim: int,
        kernel_size: int,
        stride: int,
        padding: int,
        num_prefix_tokens: int,
        attn_layer: Callable[[], nn.Module],
        drop_paths: Sequence[float],
        mlp_ratio: float,
        proj_drop: float,
        norm_layer: Callable,
        act_layer: Callable,
        device=None,
        dtype=None,
    ):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.num_prefix_tokens = num_prefix_tokens
        self.embed = ConvEmbed(
            in_chs=in_chs, dim=dim, kernel_size=kernel_size, stride=stride, padding=padding, norm_layer=norm_layer, **dd
        )
        self.cls_token = nn.Parameter(torch.zeros(1, num_prefix_tokens, dim, **dd)) if num_prefix_tokens else None
        self.blocks = nn.ModuleList(
            [
                Block(
                    dim=dim,
                    attn=attn_layer(),
                    mlp_ratio=mlp_ratio,
                    drop_path=dp,
                    proj_drop=proj_drop,
                    norm_layer=norm_layer,
                    act_layer=act_layer,
                    **dd,
                )
                for dp in drop_paths
            ]
        )
        self.grad_checkpointing = False

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """The blocks' Long-Short attention plan is made once (``plan_attention_2d``) and handed to every block."""
        x, feat_size = self.embed(x)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1)
        attns = [blk.attn for blk in self.blocks]
        plan = None
        if attns and all(isinstance(attn, LongShortAttention2d) for attn in attns):
            plan = plan_attention_2d(attns, x, feat_size)
        for blk in self.blocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, feat_size, plan)
            else:
                x = blk(x, feat_size, plan)
        return x, feat_size


@register_notrace_function  # feat_size is a stage's output, a traced value under FX
def to_map(x: Tensor, num_prefix_tokens: int, feat_size: tuple[int, int]) -> Tensor:
    """Patch tokens (B, g + HW, C) -> NCHW map (B, C, H, W) (global tokens dropped)."""
    return x[:, num_prefix_tokens:].transpose(1, 2).reshape(x.shape[0], -1, *feat_size)


class HierarchicalTransformer(nn.Module):
    """timm model API over a list of ``Stage``s, a final LayerNorm and a linear classifier.

    ``forward_features`` returns the normed last-stage map (B, C, H, W) when that stage has no global tokens (ViL),
    else its normed tokens (B, g + HW, C) (CvT's cls token). ``global_pool``: ``'avg'`` (mean over patches),
    ``'token'`` (first global token) or ``''``.
    """

    def __init__(
        self,
        stages: list[Stage],
        strides: Sequence[int],
        num_classes: int,
        global_pool: str,
        drop_rate: float,
        norm_layer: Callable,
        device=None,
        dtype=None,
    ):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        dims = [s.embed.proj.out_channels for s in stages]
        self.num_classes = num_classes
        self.stages = nn.Sequential(*stages)
        self._set_last_stage()
        reductions = [math.prod(strides[: i + 1]) for i in range(len(strides))]
        self.feature_info = [
            {"num_chs": d, "reduction": r, "module": f"stages.{i}"} for i, (d, r) in enumerate(zip(dims, reductions))
        ]
        self.norm = norm_layer(dims[-1], **dd)
        self.head_drop = nn.Dropout(drop_rate)
        self._check_pool(global_pool, num_classes)
        self.global_pool = global_pool
        self.head = nn.Linear(dims[-1], num_classes, **dd) if num_classes > 0 else nn.Identity()
        self.apply(self._init_weights)
        for stage in stages:
            if stage.cls_token is not None:
                trunc_normal_(stage.cls_token, std=0.02)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        for name, p in m.named_parameters(recurse=False):
            if "relative_position" in name:
                trunc_normal_(p, std=0.02)

    def _set_last_stage(self) -> None:
        """The head's input follows the last stage: its width and global tokens."""
        self.num_features = self.head_hidden_size = self.stages[-1].embed.proj.out_channels
        self.num_prefix_tokens = self.stages[-1].num_prefix_tokens

    def _check_pool(self, global_pool: str, num_classes: int) -> None:
        if global_pool not in ("avg", "token", ""):
            raise ValueError(f"global_pool must be 'avg', 'token' or '', got {global_pool!r}.")
        if global_pool == "token" and not self.num_prefix_tokens:
            raise ValueError("global_pool='token' needs a global token in the last stage; use 'avg'.")
        if global_pool == "" and num_classes and not self.num_prefix_tokens:
            raise ValueError(
                "global_pool='' leaves an unpooled (B, C, H, W) map, which a classifier cannot take; "
                "use num_classes=0 for the map, or global_pool='avg'."
            )

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {n for n, _ in self.named_parameters() if "cls_token" in n or "relative_position" in n}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        return {
            "stem": r"^stages\.0\.(?:embed|cls_token)",
            "blocks": r"^stages\.(\d+)"
            if coarse
            else [
                (r"^stages\.(\d+)\.(?:embed|cls_token)", (0,)),
                (r"^stages\.(\d+)\.blocks\.(\d+)", None),
                (r"^norm", (99999,)),
            ],
        }

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for stage in self.stages:
            stage.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        global_pool = self.global_pool if global_pool is None else global_pool
        self._check_pool(global_pool, num_classes)
        self.num_classes, self.global_pool = num_classes, global_pool
        weight = next(self.stages.parameters())  # the norm may be pruned (nn.Identity)
        self.head = (
            nn.Linear(self.num_features, num_classes, device=weight.device, dtype=weight.dtype)
            if num_classes > 0
            else nn.Identity()
        )
        self.head.train(self.training)

    def _final(self, x: Tensor, feat_size: tuple[int, int]) -> Tensor:
        x = self.norm(x)
        return x if self.num_prefix_tokens else to_map(x, 0, feat_size)

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ):
        """Stage outputs as NCHW maps (the last one normed if ``norm``), and the ``forward_features`` output."""
        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt must be 'NCHW', got {output_fmt!r}.")
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        stages = self.stages if not stop_early else self.stages[: max_index + 1]
        intermediates, last = [], len(self.stages) - 1
        for i, stage in enumerate(stages):
            x, feat_size = stage(x)
            if i in take_indices:
                tokens = self.norm(x) if norm and i == last else x
                intermediates.append(to_map(tokens, stage.num_prefix_tokens, feat_size))
            if i < last:
                x = to_map(x, stage.num_prefix_tokens, feat_size)
        if intermediates_only:
            return intermediates
        if len(stages) <= last:  # stopped early: the map of the last stage run
            return x, intermediates
        return self._final(x, feat_size), intermediates

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Drop the stages after the last of ``indices``; then the final norm and the head, which are sized for the
        last stage, go too (as in timm's models), else as ``prune_norm`` / ``prune_head`` ask."""
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        prune_end = max_index < len(self.stages) - 1
        self.stages = self.stages[: max_index + 1]
        self._set_last_stage()
        if prune_norm or prune_end:
            self.norm = nn.Identity()
        if prune_head or prune_end:
            self.reset_classifier(0, "")
        return take_indices

    def forward_features(self, x: Tensor) -> Tensor:
        for i, stage in enumerate(self.stages):
            x, feat_size = stage(x)
            if i < len(self.stages) - 1:
                x = to_map(x, stage.num_prefix_tokens, feat_size)
        return self._final(x, feat_size)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.global_pool == "avg":  # forward_features gives a map exactly when the last stage has no global token
            x = x[:, self.num_prefix_tokens :].mean(1) if self.num_prefix_tokens else x.mean((2, 3))
        elif self.global_pool == "token":
            x = x[:, 0]
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))
