"""Long-Short attention's fused path: one FlexAttention call per layer over [window keys; extra keys], the default on
CUDA (``long_short_blocks.FUSED_DEVICES``) and ``attn_implementation="flex_attention"``'s everywhere.

* ``attend_flex``, the ``"flex"`` backend: the visibility as a block-sparse mask built from the window geometry
  (``long_short_blocks``), never an n x n evaluation, so nothing is gathered. Its mask comes from the plan, built
  once per forward pass for every layer of the same geometry (``plan_block_mask``); a call with a decoding cache
  builds its own.
* ``joined_extra``: the window keys and the projected rows (Eq. 3 / Eq. 5, then ``LN_G``) built in one tensor each
  (``JoinedProjectedKeys``), which the kernel reads where they lie.
* ``compiled_attention_layer``: the rest of the layer (projections, DualLN, Eq. 3, the output projection) compiled
  around the kernel, once per process.

This file imports nothing from Transformers or timm.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from .long_short_blocks import (
    EXTRA_KEY_BAND,
    KeyLayout,
    compile_in_package,
    extra_key_copies,
    long_short_block_mask,
    long_short_flex_attend,
)
from .long_short_kernels import JoinedProjectedKeys, in_copies
from .long_short_rules import projection_weights
from .long_short_tiles import ExtraKeys, JointInputs

__all__ = [
    "RECOMPUTE_MEMORY_BUDGET",
    "attend_flex",
    "compiled_attention_layer",
    "copies_of_extra_keys",
    "joined_extra",
    "plan_block_mask",
]

# The share of the compiled layer's activation memory (against what it keeps by default) that it keeps with
# ``recompute_window_tiles=True``: torch's min-cut partitioner then recomputes P in the backward pass, and the
# Linears' outputs where ``LN_L`` is not applied with the joined keys (bench/RESULTS.md, "recompute_window_tiles").
RECOMPUTE_MEMORY_BUDGET = 0.3


def copies_of_extra_keys(module, num_queries: int) -> int:
    """How many copies of the extra keys the kernel takes for ``num_queries`` queries: bidirectionally one per band
    of ``EXTRA_KEY_BAND`` queries (``extra_key_copies``: a backward pass as parallel for them as for the window keys),
    causally 1."""
    return 1 if module.causal else extra_key_copies(num_queries, EXTRA_KEY_BAND)


def _key_layout(
    module, *, num_queries: int, num_window_keys: int, num_extra: int, causal_rows: bool, q_start=0, k_start=0
) -> KeyLayout:
    """The ``KeyLayout`` of a call: ``num_window_keys`` window keys, then ``num_extra`` extra keys in their copies;
    ``causal_rows``: the extra keys are projected rows seen by Eq. 5."""
    copies = copies_of_extra_keys(module, num_queries) if num_extra else 1
    return KeyLayout(
        window_size=module.window_size,
        causal=module.causal,
        num_window_keys=num_window_keys,
        num_extra_keys=num_extra * copies,
        q_start=q_start,
        k_start=k_start,
        segment_length=module.segment_length if causal_rows else None,
        projection_rank=module.projection_rank if causal_rows else None,
        extra_key_copies=copies,
        queries_per_copy=EXTRA_KEY_BAND,
    )


def plan_block_mask(module, masks, hidden_states: Tensor, *, has_cls: bool) -> BlockMask:
    """The block mask of ``module``'s uncached call on hidden_states (B, n, d) with the ``MaskPlan`` ``masks``: the
    window keys, then [cls key; the K global tokens' keys; r projected rows] bidirectionally, or the projected rows of
    the finished segments causally (each row's counted from its first real token), valid as the layer makes them."""
    B, n = hidden_states.shape[0], hidden_states.shape[1] + masks.padding
    w, r = module.window_size, module.projection_rank
    offsets = None
    if module.causal:
        l, offsets = module.segment_length, masks.leading
        segments = n // l if r else 0
        layout = _key_layout(
            module, num_queries=n, num_window_keys=n, num_extra=r * segments, causal_rows=bool(segments)
        )
        key_valid = masks.valid
        if key_valid is not None and segments:
            key_valid = torch.cat([key_valid, _causal_rows_valid(key_valid, offsets, l, segments, r)], 1)
    else:
        K, width = masks.global_count, n if w else 0
        layout = _key_layout(
            module, num_queries=n, num_window_keys=width, num_extra=int(has_cls) + K + r, causal_rows=False
        )
        key_valid = None
        if masks.valid is not None or K:
            local = masks.local
            extra = [local.new_ones(B, 1)] if has_cls else []
            if K:
                extra.append(masks.ordered_global[:, n - K :])
            if r:
                extra.append(local.any(-1, keepdim=True).repeat_interleave(r, dim=1))
            key_valid = local[:, :width]
            if extra:
                key_valid = torch.cat([key_valid, in_copies(torch.cat(extra, 1), layout.extra_key_copies)], 1)
    return long_short_block_mask(
        layout, num_queries=n, key_valid=key_valid, offsets=offsets, device=hidden_states.device
    )


def _causal_rows_valid(valid: Tensor, offsets: Tensor | None, l: int, segments: int, r: int) -> Tensor:
    """Which of the ``segments * r`` projected rows of an uncached causal call exist (Eq. 5): segment s of row b, its
    tokens ``[offsets[b] + s l, offsets[b] + (s + 1) l)`` (offsets None: 0), exists where it is finished within the
    call and holds a valid token. valid (B, n) -> (B, segments * r), r rows per segment."""
    B, n = valid.shape
    if offsets is None:
        return valid[:, : segments * l].view(B, segments, l).any(-1).repeat_interleave(r, dim=1)
    segment = torch.arange(segments, device=valid.device)
    done = segment[None] < torch.div(n - offsets, l, rounding_mode="floor")[:, None]  # (B, S)
    position = offsets[:, None, None] + segment[None, :, None] * l + torch.arange(l, device=valid.device)
    tokens = valid.gather(1, torch.where(done[..., None], position, 0).flatten(1)).view(B, segments, l)
    return (tokens & done[..., None]).any(-1).repeat_interleave(r, dim=1)


def joined_extra(
    module,
    hidden: Tensor,
    keys: Tensor,
    values: Tensor,
    valid: Tensor | None,
    prefix: ExtraKeys | None,
    segment: int | None = None,
    *,
    local_norm: bool = False,
    copies: int = 1,
) -> tuple[ExtraKeys, ExtraKeys]:
    """The fused path's extra keys [prefix; projected rows] built with the window keys (B, n, H, d) in one tensor
    each (``JoinedProjectedKeys``), and the projected rows alone, as views of those tensors. The rows: Eq. 3 over
    hidden X (B, m, D), the first m of the n tokens, valid (B, m) or None (every token valid), then ``LN_G``;
    ``segment``: causal, Eq. 5 over each of its m / l segments of l tokens (the caller marks each row's segment).
    ``local_norm``: keys and values are the Linears' outputs, and ``LN_L`` is applied there (the normalized window
    keys are the joined tensors' first n rows). ``copies``: the joined tensors hold that many copies of [prefix;
    rows] (``extra_key_copies``); the returned keys and values are the first."""
    B, n = keys.shape[:2]
    S = 1 if segment is None else hidden.shape[1] // segment
    seg_valid = None if valid is None else valid.view(B, S, -1)
    weights = projection_weights(module._projection_scores(hidden, S), seg_valid)
    joined = []
    for name, window, is_key in (("keys", keys, True), ("values", values, False)):
        local, norm = (module._dual_ln_norm(local=is_local, is_key=is_key) for is_local in (True, False))
        local_args = (local.weight, local.bias) if local_norm else (None, None)
        norm_args = (None, None, 0.0) if norm is None else (norm.weight, norm.bias, norm.eps)
        before = None if prefix is None else getattr(prefix, name)
        joined.append(JoinedProjectedKeys.apply(window, before, weights, *local_args, *norm_args, copies))
    rows_valid = module._rows_valid(seg_valid, B, S, keys.device)
    start = n + (0 if prefix is None else prefix.keys.shape[1])
    end = start + rows_valid.shape[1]
    joined_k, joined_v = joined
    projected = ExtraKeys(keys=joined_k[:, start:end], values=joined_v[:, start:end], valid=rows_valid)
    extra = ExtraKeys(
        keys=joined_k[:, n:end],
        values=joined_v[:, n:end],
        valid=rows_valid if prefix is None else torch.cat([prefix.valid, rows_valid], 1),
        joined=(joined_k, joined_v),
    )
    return extra, projected


def attend_flex(module, inputs: JointInputs, layer, layout=None) -> tuple[Tensor, None]:
    """``"flex"``: FlexAttention over the keys [window keys; extra keys] with the visibility as a block-sparse mask
    (the plan's, or built here from the keys' validity), so nothing is gathered (``long_short_flex_attend``). On CUDA
    the kernel is compiled once per process and skips the blocks that no query sees. A query with no visible key
    gets 0."""
    q, extra = inputs.q, inputs.extra
    R = extra.keys.shape[1] if extra is not None else 0
    copies = copies_of_extra_keys(module, q.shape[1]) if R else 1
    if not R:
        keys, values = inputs.k, inputs.v
    elif extra.joined is not None:  # built as one tensor each with the window keys (``joined_extra``), in copies
        keys, values = extra.joined
    else:
        keys, values = (
            torch.cat([x, in_copies(e, copies)], 1) for x, e in ((inputs.k, extra.keys), (inputs.v, extra.values))
        )
    block_mask = layer.block_mask
    if block_mask is None:
        key_valid = None if inputs.all_valid else inputs.k_valid
        if R and key_valid is not None:
            key_valid = torch.cat([key_valid, in_copies(extra.valid, copies)], 1)
        key_layout = _key_layout(
            module,
            num_queries=q.shape[1],
            num_window_keys=inputs.k.shape[1],
            num_extra=R,
            causal_rows=bool(R) and extra.segment is not None,  # r rows per segment of l tokens, seen by Eq. 5
            q_start=inputs.q_start,
            k_start=inputs.k_start,
        )
        block_mask = long_short_block_mask(
            key_layout, num_queries=q.shape[1], key_valid=key_valid, offsets=inputs.offsets, device=q.device
        )
    keys, values = (x.to(q.dtype) for x in (keys, values))
    return long_short_flex_attend(q, keys, values, block_mask), None


@functools.cache
def compiled_attention_layer(layer: Callable, *, recompute: bool = False, static_shapes: bool = False) -> Callable:
    """``layer`` (a Long-Short module's layer function, ``LongShortSelfAttention._attend`` or ``ls_timm``'s
    ``LongShortAttention2d._layer``) compiled once per process (``compile_in_package``): the fused path's layer,
    one graph with its attention kernel inside on ``FUSED_DEVICES`` (CUDA), the block mask an input; elsewhere
    compiled regions before and after the kernel's call, a compile boundary. Every module of the same settings
    shares the compilations (the parameters are inputs of the compiled code, not constants). ``static_shapes``: code
    specialised to each input shape (images); else the lengths become symbolic after the first that differs.

    ``recompute`` (``recompute_window_tiles=True``): compiled with torch's ``activation_memory_budget`` at
    ``RECOMPUTE_MEMORY_BUDGET``, so that its backward pass computes P (Eq. 3) again rather than keeping it (and the
    keys' and values' Linear outputs where they are kept): about what fused dense attention keeps."""
    budget = RECOMPUTE_MEMORY_BUDGET if recompute else None
    return compile_in_package(layer, activation_memory_budget=budget, static_shapes=static_shapes)
