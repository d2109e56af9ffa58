"""One attention plan per forward pass: the facts that every Long-Short layer of a call shares, made once.

As Transformers builds its attention masks once in the model and hands them to each layer, a model builds an
``AttentionPlan`` before its first layer (``plan_attention``) and passes it to every layer by keyword; a bare
``LongShortSelfAttention`` builds its own. The plan holds:

* the tokens' validity (``MaskPlan``): the real tokens, the global tokens and their count, the order in which a
  layer attends to them, and causally the left padding before each row's first real token;
* how the joint softmax runs: the name of a backend in ``BACKENDS`` (the one place where it is chosen), and whether
  the layer runs compiled around its kernel;
* the fused path's block masks, one per layer geometry (``long_short_fused.plan_block_mask``);
* the DualLN ``LN_L`` layers whose input can be recovered from their output (one read of every gain).

``AttentionPlan.for_layer`` turns it into what one layer's call takes (``LayerPlan``). Longformer's default global
tokens for the heads (``first_token_global``, ``question_global_mask``) are made here too. This file imports nothing
from Transformers or timm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from . import long_short_blocks, long_short_fused, long_short_tiles
from .long_short_kernels import FUSED_CPU, recoverable_layer_norms
from .long_short_rules import check_attn_implementation, check_flex_call, takes_grad

if TYPE_CHECKING:
    from .long_short_attention import LongShortSelfAttention

__all__ = [
    "BACKENDS",
    "AttentionPlan",
    "LayerPlan",
    "MaskPlan",
    "first_token_global",
    "fused_by_default",
    "plan_attention",
    "question_global_mask",
    "runs_fused",
]

# How the joint softmax (Eq. 6) runs, by name: each takes the module, its ``JointInputs``, its ``LayerPlan`` and the
# caller's maps layout (or None), and returns the context and the attention maps (or None).
BACKENDS: dict[str, Callable] = {
    "sdpa": long_short_tiles.attend_sdpa,
    "lean": long_short_tiles.attend_lean,
    "maps": long_short_tiles.attend_maps,
    "flex": long_short_fused.attend_flex,
}


def fused_by_default(x: Tensor, *, dropout: bool) -> bool:
    """Whether ``attn_implementation="sdpa"`` runs the fused path for the input ``x``: where ``runs_fused`` says
    (float64 stays on SDPA), and with no attention dropout active (FlexAttention has none)."""
    return runs_fused(x) and not dropout


def runs_fused(x: Tensor) -> bool:
    """Whether ``x`` is where and in what the fused path runs by default (``long_short_blocks.FUSED_DEVICES``, the one
    device rule, in ``FUSED_DTYPES``), its layer compiled there."""
    return x.device.type in long_short_blocks.FUSED_DEVICES and x.dtype in long_short_blocks.FUSED_DTYPES


class MaskPlan(NamedTuple):
    """The validity of one call's n tokens, the same for every layer. Bidirectionally with K global tokens the layers
    attend in ``order``: the other tokens first, in their order, then the global ones (the window and the projection
    skip them); without global tokens, in position order."""

    valid: Tensor | None = None  # (B, n) bool, position order: real tokens; None: every token is real
    is_global: Tensor | None = None  # (B, n) bool, position order: real global tokens; None: none
    global_count: int = 0  # K: the most global tokens of a sample (a sample with fewer has the rest masked)
    order: Tensor | None = None  # (B, n) long: the token in each slot of the attention's order; None: positions
    ordered_valid: Tensor | None = None  # (B, n) ``valid`` in that order (with K)
    ordered_global: Tensor | None = None  # (B, n) ``is_global`` in that order (with K)
    local: Tensor | None = None  # (B, n) in that order: real and not global; None: every token
    leading: Tensor | None = None  # (B,) causal: padding before each row's first real token; None: no row has any
    padding: int = 0  # invalid tokens appended for a traced call's global slots (``_mask_plan``); the others cover them


class LayerPlan(NamedTuple):
    """What one layer's call takes of the plan (``AttentionPlan.for_layer``)."""

    attend: Callable  # the backend, from ``BACKENDS``
    output_attentions: bool  # the maps are returned (the global tokens' rows computed from them)
    lean: bool  # the lean kernels: ``LN_L`` written over its input, Eq. 3 a few heads at a time
    joins_keys: bool  # the window keys and the projected rows are built in one tensor each (fused path)
    local_norm: bool  # ``LN_L``'s input is recovered from its output: applied in place (lean) or to the joined keys
    block_mask: BlockMask | None  # the fused path's mask; None: the layer builds it (a call with a cache)


class AttentionPlan(NamedTuple):
    """The facts of one forward pass that every layer shares (this module's docstring)."""

    masks: MaskPlan
    backend: str  # a key of ``BACKENDS``
    compiled: bool  # the layers run compiled around their kernel (``long_short_fused.compiled_attention_layer``)
    block_masks: dict  # (window_size, projection_rank) -> the fused path's ``BlockMask``
    recoverable_norms: frozenset  # the ``LN_L`` layers whose input their output recovers

    def for_layer(self, module: LongShortSelfAttention, *, cached: bool) -> LayerPlan:
        """The plan of ``module``'s call; ``cached``: with a decoding cache."""
        fused = self.backend == "flex"
        joins = fused and bool(module.window_size and module.projection_rank) and not (module.causal and cached)
        norms = [norm for norm in (module.dual_ln_local, module.dual_ln_local_key) if norm is not None]
        local_norm = bool(norms) and all(norm in self.recoverable_norms for norm in norms)
        return LayerPlan(
            attend=BACKENDS[self.backend],
            output_attentions=self.backend == "maps",
            lean=self.backend == "lean",
            joins_keys=joins,
            local_norm=local_norm,
            block_mask=self.block_masks.get((module.window_size, module.projection_rank)),
        )


def plan_attention(
    modules: Sequence[LongShortSelfAttention],
    hidden_states: Tensor,
    *,
    attention_mask: Tensor | None = None,
    global_attention_mask: Tensor | None = None,
    max_global_tokens: int = 64,
    cls_hidden: Tensor | None = None,
    cached_tokens: int | None = None,
    output_attentions: bool = False,
    attn_implementation: str | None = None,
) -> AttentionPlan:
    """The plan of one call of ``modules`` (the attention layers of a model, in any order; the same settings but for
    window size and projection rank) on ``hidden_states`` (B, n, d), after checking the inputs (``ValueError``
    naming the argument and the fix, before any work).

    attention_mask (B, n), 1 for real tokens; with a cache of ``cached_tokens`` earlier tokens (B, cached + n) too.
    global_attention_mask (B, n), 1 for global tokens (bidirectional), counted in one read of the device;
    ``max_global_tokens``: their count in a traced call (``_mask_plan``). cls_hidden (B, 1, d): the official post-CLS
    token. ``attn_implementation``: None takes the first module's.
    """
    module = modules[0]
    attn_implementation = attn_implementation or module.attn_implementation
    check_attn_implementation(attn_implementation)
    valid = _check_inputs(
        module,
        hidden_states,
        attention_mask,
        global_attention_mask=global_attention_mask,
        cls_hidden=cls_hidden,
        cached_tokens=cached_tokens,
    )
    if attn_implementation == "flex_attention" and not output_attentions:
        for layer in modules:
            check_flex_call(
                hidden_states,
                layer.query.weight,
                training=layer.training,
                dropout=layer.attention_dropout,
                dropout_name="attention_dropout",
                dropout_setting="attention_probs_dropout_prob",
            )
    masks = _mask_plan(module, valid, global_attention_mask, max_global_tokens, device=hidden_states.device)
    backend = _backend(modules, hidden_states, output_attentions, attn_implementation)
    cached = cached_tokens is not None
    compiled = (
        backend == "flex"
        and not cached
        and masks.leading is None  # causal left padding: torch 2.11 miscompiled its mask (tests/test_flex_attention.py)
        and module.compile_attention
        and runs_fused(hidden_states)
        and not torch.compiler.is_compiling()
    )
    block_masks = {}
    if backend == "flex" and not cached:
        for layer in modules:
            key = (layer.window_size, layer.projection_rank)
            if key not in block_masks:
                block_masks[key] = long_short_fused.plan_block_mask(
                    layer, masks, hidden_states, has_cls=cls_hidden is not None
                )
    return AttentionPlan(
        masks=masks,
        backend=backend,
        compiled=compiled,
        block_masks=block_masks,
        recoverable_norms=_recoverable_norms(modules, backend, cached=cached),
    )


def first_token_global(reference: torch.Tensor) -> torch.Tensor:
    """Longformer's default for classification: the first token (``<s>``) global. reference (B, n, ...) -> (B, n)."""
    mask = torch.zeros(reference.shape[:2], dtype=torch.long, device=reference.device)
    mask[:, 0] = 1
    return mask


def question_global_mask(input_ids: torch.Tensor, sep_token_id: int | None) -> torch.Tensor:
    """Longformer's default for question answering: the tokens before the first separator (``<s>`` and the question
    of ``<s> question </s></s> context </s>``) global. input_ids (B, n) -> (B, n)."""
    if sep_token_id is None:
        raise ValueError(
            "config.sep_token_id is None, so the question tokens cannot be found; set it (RoBERTa's is 2) or pass "
            "global_attention_mask."
        )
    is_sep = input_ids == sep_token_id
    if not torch.compiler.is_compiling() and not is_sep.any(1).all():
        rows = (~is_sep.any(1)).nonzero().flatten().tolist()
        raise ValueError(
            f"input_ids rows {rows} hold no separator token (sep_token_id={sep_token_id}), so the question tokens "
            f"cannot be found; encode question and context as a pair, or pass global_attention_mask."
        )
    first = is_sep.int().argmax(1)
    return (torch.arange(input_ids.shape[1], device=input_ids.device) < first[:, None]).long()


def _check_inputs(module, hidden_states, attention_mask, *, global_attention_mask, cls_hidden, cached_tokens):
    """Refuse misuse before any work; return the validity of the n new tokens, (B, n) bool, or None when every token
    is real (read once, as Transformers drops an all-ones mask: the layers then take their unpadded path)."""
    width = module.query.in_features
    if hidden_states.dim() != 3 or hidden_states.shape[-1] != width:
        raise ValueError(
            f"hidden_states must be (batch, tokens, {width}), got {tuple(hidden_states.shape)}; add a batch dimension "
            f"with x[None] for a single sequence."
        )
    B, n, _ = hidden_states.shape
    lengths = (n,) if cached_tokens is None else (n, cached_tokens + n)
    if attention_mask is not None and (
        attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] not in lengths
    ):
        cache = "" if cached_tokens is None else f" or (batch, cached + new tokens) = {(B, lengths[1])}"
        raise ValueError(
            f"attention_mask must be (batch, tokens) = {(B, n)}{cache}, 1 for real tokens; got "
            f"{tuple(attention_mask.shape)}: a mask of {attention_mask.shape[-1]} tokens for {n} tokens of "
            f"hidden_states. Pass one entry per token."
        )
    if module.causal and cls_hidden is not None:
        raise ValueError("cls_hidden is only supported by bidirectional attention (causal=False).")
    if cached_tokens is not None and not module.causal:
        raise ValueError("state (decoding cache) is only supported by causal attention (causal=True).")
    if cls_hidden is not None:
        if module.qk_head_dim != module.head_dim:
            raise ValueError("cls_hidden needs qk_head_dim == head_dim: the cls query attends to the token outputs.")
        if tuple(cls_hidden.shape) != (B, 1, width):
            raise ValueError(
                f"cls_hidden must be (batch, 1, {width}) = {(B, 1, width)}, one global token per sample; got "
                f"{tuple(cls_hidden.shape)}."
            )
    if global_attention_mask is not None:
        if module.causal:
            raise ValueError(
                "global_attention_mask needs bidirectional attention: a causal token cannot attend to every token. "
                "Pass global_attention_mask=None to a causal model."
            )
        if cls_hidden is not None:
            raise ValueError("Pass either cls_hidden (official post-CLS token) or global_attention_mask, not both.")
        if tuple(global_attention_mask.shape) != (B, n):
            raise ValueError(
                f"global_attention_mask must have shape (batch, tokens) = {(B, n)}, with 1 for global tokens; got "
                f"{tuple(global_attention_mask.shape)}: one entry per token of hidden_states."
            )
    if attention_mask is None:
        return None
    real = attention_mask[:, -n:].to(device=hidden_states.device) > 0
    if not torch.compiler.is_compiling() and bool(real.all()):
        return None
    return real


def _mask_plan(module, valid, global_attention_mask, max_global_tokens: int, *, device: torch.device) -> MaskPlan:
    """The ``MaskPlan`` of a call: bidirectionally the global tokens, their count and the attention's order;
    causally each row's leading padding (``LongShortSelfAttention._first_real``).

    The global tokens are counted in one read of the device. A traced call (``torch.export``, ONNX, ``torch.compile``)
    cannot read it: there the count is ``max_global_tokens`` (a sample's later global tokens attend as ordinary ones),
    and as many invalid tokens are appended (``padding``), so that the K global slots at the end of the attention's
    order never depend on how the length compares with K."""
    if module.causal:
        leading = None
        if valid is not None:
            leading = (valid.cumsum(1) == 0).sum(1)  # this call's padding before the row's first real token
            if not torch.compiler.is_compiling() and not bool(leading.any()):
                leading = None
        return MaskPlan(valid=valid, leading=leading)
    if global_attention_mask is None:
        return MaskPlan(valid=valid, local=valid)
    is_global = global_attention_mask.to(device=device) > 0
    if valid is not None:
        is_global = is_global & valid
    padding = 0
    if torch.compiler.is_compiling():
        count = padding = max_global_tokens
        is_global = F.pad(is_global & (is_global.cumsum(1) <= count), (0, padding))
        valid = F.pad(torch.ones_like(is_global[:, :-padding]) if valid is None else valid, (0, padding))
    else:
        count = int(is_global.sum(1).max())
    if not count:
        return MaskPlan(valid=valid, is_global=is_global, local=valid)
    n = is_global.shape[1]  # the other tokens first, in their order, then the global ones: a unique key each
    order = torch.argsort(is_global.long() * n + torch.arange(n, device=device), dim=1)
    ordered_valid = torch.ones_like(is_global) if valid is None else valid
    ordered_valid, ordered_global = (x.gather(1, order) for x in (ordered_valid, is_global))
    return MaskPlan(
        valid=valid,
        is_global=is_global,
        global_count=count,
        order=order,
        ordered_valid=ordered_valid,
        ordered_global=ordered_global,
        local=ordered_valid & ~ordered_global,
        padding=padding,
    )


def _backend(modules, hidden_states: Tensor, output_attentions: bool, attn_implementation: str) -> str:
    """The one place that picks how the joint softmax runs: a key of ``BACKENDS``, from the call and from where its
    tensors are (a model built on the CPU and moved to the GPU gets the GPU's choice).

    ``"maps"`` when attention maps are asked for. ``"flex"`` for ``attn_implementation="flex_attention"``, and for
    ``"sdpa"`` (Transformers' default) where ``fused_by_default`` says (CUDA, not float64, no active attention
    dropout); not for a causal call of fewer tokens than a window (a decoding step: its queries see one cached
    window, a single small tile, where building a block mask costs more than it saves). ``"lean"`` with
    ``recompute_window_tiles`` when it saves memory (training on CPU: gradients taken, one head dim for queries and
    values, no active attention dropout). Else ``"sdpa"``; ``"eager"`` always takes it, the portable reference."""
    module = modules[0]
    if output_attentions:
        return "maps"
    decoding_step = module.causal and hidden_states.shape[1] < max(layer.window_size for layer in modules)
    dropout = module.training and module.attention_dropout > 0
    fused_default = attn_implementation == "sdpa" and fused_by_default(hidden_states, dropout=dropout)
    if (attn_implementation == "flex_attention" or fused_default) and not decoding_step:
        return "flex"
    lean = (
        module.recompute_window_tiles
        and FUSED_CPU is not None
        and hidden_states.device.type == "cpu"
        and module.qk_head_dim == module.head_dim
        and not dropout
        and takes_grad(hidden_states, module.query.weight)
    )
    return "lean" if lean else "sdpa"


def _recoverable_norms(modules, backend: str, *, cached: bool) -> frozenset[nn.LayerNorm]:
    """The ``LN_L`` layers whose input their output recovers (``recoverable_layer_norms``), read in one read of the
    device for every layer, where a path writes ``LN_L`` over its input or applies it to the joined keys: the lean
    backend, and the fused path with autograd recording, outside a compilation of the caller's."""
    if backend not in ("lean", "flex") or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return frozenset()
    if backend == "flex" and cached:
        return frozenset()
    norms = [
        norm for module in modules for norm in (module.dual_ln_local, module.dual_ln_local_key) if norm is not None
    ]
    return recoverable_layer_norms(norms)
