"""Long-Short attention's tile paths: the joint softmax (Eq. 6) with queries grouped by window segment.

Each group of queries is handed its tile, [extra keys; the window keys of its segment], with a small boolean mask
that applies the rules of ``long_short_rules`` (the window, and causally Eq. 5's segments). Three backends of
``long_short_plan.BACKENDS``, each ``attend(module, inputs, layer, layout) -> (context, maps or None)``:

* ``attend_sdpa`` (``"sdpa"``, the default on the CPU, and ``"eager"`` everywhere): every tile gathered in one copy
  and one ``F.scaled_dot_product_attention`` call, whose fused kernels accumulate the softmax in float32. The
  portable path and the reference of the others; bidirectional work and memory O(n (2w + r)).
* ``attend_lean`` (``"lean"``, ``recompute_window_tiles=True`` in training on the CPU): the tiles built one chunk
  of groups at a time, and again in the backward pass (``long_short_kernels.TiledAttention``).
* ``attend_maps`` (``"maps"``, ``output_attentions=True``): the explicit softmax, whose probabilities are returned
  and used.

A causal batch whose rows start at their own positions (left padding: ``JointInputs.offsets``) is re-framed first so
that every row's segments start at the same columns (``_aligned``). This file imports nothing from Transformers or
timm.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .long_short_kernels import TiledAttention, gather_tiles
from .long_short_rules import masked_sdpa, segment_keep, window_extent, window_keep

__all__ = [
    "ExtraKeys",
    "JointInputs",
    "attend_lean",
    "attend_maps",
    "attend_sdpa",
    "global_maps_layout",
    "probabilities",
    "sdpa",
    "take",
]


class ExtraKeys(NamedTuple):
    """Keys a query sees besides its window: the global tokens' and the projected rows (Eq. 3 / Eq. 5), after LN_G."""

    keys: Tensor  # (B, R, H, d_qk)
    values: Tensor  # (B, R, H, d_v)
    valid: Tensor  # (B, R) bool
    segment: Tensor | None = None  # (R,) causal: each row's projection segment (Eq. 5); None: every query sees all
    # the fused path's [window keys; keys] and [window values; values], one tensor each (``JoinedProjectedKeys``),
    # of which keys and values are views; None: the backend joins them
    joined: tuple[Tensor, Tensor] | None = None


class JointInputs(NamedTuple):
    """What every backend takes: queries at positions ``[q_start, q_start + m)`` and the two key sets of their one
    softmax (Eq. 6), the window keys of positions ``[k_start, k_start + L)`` and the ``extra`` keys (global tokens'
    and projected rows). ``offsets``: the rules see position ``p - offsets[b]`` in row b (a left-padded causal row
    counts from its first real token); None: ``p``. ``all_valid``: every key exists (no padding, no missing global
    token), known without reading the masks."""

    q: Tensor  # (B, m, H, d_qk)
    q_start: int
    k: Tensor  # (B, L, H, d_qk)
    v: Tensor  # (B, L, H, d_v)
    k_valid: Tensor  # (B, L) bool
    k_start: int
    extra: ExtraKeys | None
    offsets: Tensor | None = None  # (B,) long
    all_valid: bool = False


class Tiles(NamedTuple):
    """The grouped layout of ``JointInputs``: G groups of Q queries (the first ``skip`` slots padding), each seeing its
    tile [R extra keys; S - R window keys at ``index`` into the window keys, L standing for a zero key]."""

    groups: int
    size: int  # Q
    skip: int
    index: Tensor  # (G, S - R)
    keep: Tensor  # (B, G, Q|1, S) bool, extra keys first


MapsLayout = tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]


def take(x: Tensor, index: Tensor) -> Tensor:
    """The entries ``index`` (B, m) along dim 1 of a (B, L, ...) tensor: (B, m, ...). A gather, which, unlike
    ``take_along_dim``, does not make ``torch.compile`` specialize on L (a recompilation per length)."""
    index = index.view(index.shape + (1,) * (x.dim() - 2))
    return x.gather(1, index.expand(x.shape[0], index.shape[1], *x.shape[2:]))


def pad_seq(x: Tensor, left: int, right: int) -> Tensor:
    """Zero-pad (or crop, for negative amounts) dim 1 of a (B, L, ...) tensor. With symbolic sizes (a traced call) an
    amount that is not known to be 0 pads: no guard on the length."""
    if statically_known_true(left == 0) and statically_known_true(right == 0):
        return x
    return F.pad(x, [0, 0] * (x.dim() - 2) + [left, right])


def shift_rows(x: Tensor, shift: Tensor, width: int) -> Tensor:
    """A (B, L, ...) tensor laid into ``width`` slots along dim 1, row b moved right by ``shift[b]``; the other slots
    zero (False)."""
    B, L = x.shape[:2]
    source = torch.arange(width, device=x.device)[None] - shift[:, None]
    source = torch.where((source >= 0) & (source < L), source, L)
    return take(torch.cat([x, x.new_zeros(B, 1, *x.shape[2:])], 1), source)


def weighted(maps: Tensor, v: Tensor, dtype: torch.dtype) -> Tensor:
    """The probabilities ``maps`` (B', H, Q, K) applied to the values v (B', H, K, d), in ``dtype``."""
    return (maps.to(v.dtype) @ v.to(dtype)).to(dtype)


def sdpa(module, q: Tensor, k: Tensor, v: Tensor, keep: Tensor) -> Tensor:
    """One fused softmax per query over the kept keys, with ``module``'s attention dropout in training. q (B', H, Q,
    d), k/v (B', H, K, d), keep (B', 1, Q|1, K)."""
    dropout = module.attention_dropout if module.training else 0.0
    return masked_sdpa(q, k.to(q.dtype), v.to(q.dtype), keep, dropout_p=dropout)


def probabilities(module, q: Tensor, k: Tensor, keep: Tensor) -> Tensor:
    """The joint softmax (Eq. 6) over the kept keys, in float32 at least, after ``module``'s dropout: (B', H, Q, K)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    prob = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    return F.dropout(prob, module.attention_dropout if module.training else 0.0, module.training)


def _window_index(first_group: int, groups: int, window: int, before: int, after: int, k_start: int, length: int):
    """Key positions of the windows ``[g w - before, g w + w + after)`` of groups ``first_group ..`` (G, S), and their
    indices into keys held for positions ``[k_start, k_start + length)``; a position outside points at index
    ``length`` (the caller's zero row, masked)."""
    offsets = torch.arange(-before, window + after)
    pos = (torch.arange(first_group, first_group + groups) * window)[:, None] + offsets
    inside = (pos >= k_start) & (pos < k_start + length)
    return pos, torch.where(inside, pos - k_start, length)


def _tiles(module, inputs: JointInputs) -> Tiles:
    """The grouped layout: queries grouped by window segment, each group seeing its window tile, except for fewer
    than ``w`` causal queries (a decoding step) and a projection-only attention: one group that sees all keys,
    masked. The keep mask applies the window rule (per query when causal; a bidirectional tile already bounds
    its window) and the segment rule of causal rows (Eq. 5), per row with ``inputs.offsets`` (whose groups
    ``_aligned`` has made to start at the same columns in every row)."""
    q, q_start, k_start, extra = inputs.q, inputs.q_start, inputs.k_start, inputs.extra
    B, m = q.shape[:2]
    w, L, causal = module.window_size, inputs.k.shape[1], module.causal
    R = extra.keys.shape[1] if extra is not None else 0
    device = q.device
    if w and (not causal or torch.compiler.is_exporting() or m >= w):  # exported: uncached (``_causal_exported``)
        first = q_start // w
        # two groups at least: a traced graph then serves lengths below w too (one more all-padding group there)
        groups = torch.sym_max((q_start + m + w - 1) // w - first, 2)
        skip = q_start - first * w
        before, after = (w, 0) if causal else ((window_extent(w),) * 2)
        k_pos, index = _window_index(first, groups, w, before, after, k_start, L)
        q_pos = (torch.arange(first * w, (first + groups) * w)).view(groups, w)
    else:
        groups, skip = 1, 0
        k_pos = torch.arange(k_start, k_start + L)[None]
        index = torch.arange(L)[None]
        q_pos = torch.arange(q_start, q_start + m)[None]
    k_pos, index, q_pos = k_pos.to(device), index.to(device), q_pos.to(device)
    if inputs.offsets is not None:  # each row's rules count from its own first position (B, G, Q) and (B, G, S)
        q_pos, k_pos = (pos - inputs.offsets[:, None, None] for pos in (q_pos, k_pos))

    keep = gather_tiles(extra.valid if R else None, inputs.k_valid, index).view(B, groups, 1, -1)  # extra first
    S = keep.shape[-1]
    if L:
        rule = window_keep(q_pos if causal or groups == 1 else q_pos[..., :1], k_pos, w, causal)
        keep = keep & torch.cat([rule.new_ones(rule.shape[:-1] + (R,)), rule], -1)
    if R and extra.segment is not None:
        seen = segment_keep(q_pos, extra.segment, module.segment_length)
        keep = keep & torch.cat([seen, seen.new_ones(seen.shape[:-1] + (S - R,))], -1)
    # A row with no visible key (a padded or out-of-range query) keeps all keys: no NaN; it is zeroed later.
    keep = keep | ~keep.any(-1, keepdim=True)
    return Tiles(groups=groups, size=q_pos.shape[-1], skip=skip, index=index, keep=keep)


def _aligned(module, inputs: JointInputs) -> tuple[JointInputs, Tensor]:
    """``inputs`` re-framed so that every row's window and projection segments start at the same columns: row b
    moves right by ``shift[b] = P - 1 - offsets[b] % P`` (P = lcm(w, l), or w without causal rows) in a frame that
    starts ``P - 1`` positions earlier, so that its rules count from ``offsets[b] - offsets[b] % P``, a whole number
    of segments. Returns those inputs and ``shift`` (query j of row b sits at slot ``j + shift[b]``)."""
    w, l = module.window_size, module.segment_length
    period = math.lcm(w, l) if l else w
    within = inputs.offsets % period
    shift = period - 1 - within
    q, k, v, k_valid = (
        shift_rows(x, shift, x.shape[1] + period - 1) for x in (inputs.q, inputs.k, inputs.v, inputs.k_valid)
    )
    return inputs._replace(
        q=q,
        q_start=inputs.q_start - period + 1,
        k=k,
        v=v,
        k_valid=k_valid,
        k_start=inputs.k_start - period + 1,
        offsets=inputs.offsets - within,
    ), shift


def _rows_aligned(attend: Callable) -> Callable:
    """A tile backend that first re-frames a left-padded causal batch grouped by window segment (``_aligned``), so
    that every row's segments sit at the same columns, and takes each query's context back from its slot."""

    @functools.wraps(attend)
    def run(module, inputs: JointInputs, layer, layout: MapsLayout | None):
        m, w = inputs.q.shape[1], module.window_size
        if inputs.offsets is None or not w or m < w:
            return attend(module, inputs, layer, layout)
        inputs, shift = _aligned(module, inputs)
        slots = torch.arange(m, device=shift.device)[None] + shift[:, None]  # (B, m): query j's slot
        width = inputs.q.shape[1]

        def to_maps(maps):  # (B, H, slots, S) -> (B, H, m, S)
            return torch.take_along_dim(maps, slots[:, None, :, None], dim=2)

        def from_maps(maps):  # (B, H, m, S) -> (B, H, slots, S), zero rows for the other slots
            return shift_rows(maps.transpose(1, 2), shift, width).transpose(1, 2)

        context, maps = attend(module, inputs, layer, (to_maps, from_maps))
        return take(context, slots), maps

    return run


def _group_queries(inputs: JointInputs, tiles: Tiles) -> Tensor:
    """The queries in the tiles' slots, (B, G*Q, H, d_qk): the first ``skip`` slots and those past the queries zero."""
    m = inputs.q.shape[1]
    return pad_seq(inputs.q, tiles.skip, tiles.groups * tiles.size - tiles.skip - m)


def _gathered(inputs: JointInputs, tiles: Tiles) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Every group's queries and tile, gathered in one copy, heads first: q (B*G, H, Q, d_qk), keys and values
    (B*G, H, S, d) and keep (B*G, 1, Q|1, S)."""
    q = _group_queries(inputs, tiles)
    B, _, H, _ = q.shape
    G, Q, S = tiles.groups, tiles.size, tiles.keep.shape[-1]
    extra = inputs.extra
    rows = (extra.keys, extra.values) if extra is not None else (None, None)
    keys, values = (gather_tiles(part, x, tiles.index) for part, x in zip(rows, (inputs.k, inputs.v)))
    return (
        q.view(B * G, Q, H, -1).transpose(1, 2),
        keys.view(B * G, S, H, -1).transpose(1, 2),
        values.view(B * G, S, H, -1).transpose(1, 2),
        tiles.keep.view(B * G, 1, tiles.keep.shape[2], S),
    )


def _ungroup(out: Tensor, inputs: JointInputs, tiles: Tiles) -> Tensor:
    """(B*G, H, Q, d) per group -> the context of the m queries, (B, m, H, d)."""
    B, m, H = inputs.q.shape[:3]
    out = out.transpose(1, 2).reshape(B, tiles.groups * tiles.size, H, -1)
    if torch.compiler.is_compiling():  # a crop, which adds no guard on the length (a slice would)
        return pad_seq(out, -tiles.skip, tiles.skip + m - tiles.groups * tiles.size)
    return out[:, tiles.skip : tiles.skip + m]


@_rows_aligned
def attend_sdpa(module, inputs: JointInputs, layer, layout: MapsLayout | None) -> tuple[Tensor, None]:
    """``"sdpa"``: every group's keys and values gathered in one copy, (B, G, R + S, H, d), which autograd keeps,
    and one fused attention call."""
    tiles = _tiles(module, inputs)
    q, keys, values, keep = _gathered(inputs, tiles)
    return _ungroup(sdpa(module, q, keys, values, keep), inputs, tiles), None


@_rows_aligned
def attend_maps(module, inputs: JointInputs, layer, layout: MapsLayout | None) -> tuple[Tensor, Tensor]:
    """``"maps"``: the explicit softmax on the gathered tiles. The output is computed from the returned maps
    themselves (through ``layout``, the caller's maps), so a gradient taken at them is the output's."""
    tiles = _tiles(module, inputs)
    q, keys, values, keep = _gathered(inputs, tiles)
    B, m, H = inputs.q.shape[:3]
    G, Q, S = tiles.groups, tiles.size, keep.shape[-1]

    def to_maps(prob):  # (B * G, H, Q, S) -> (B, H, m, S)
        maps = prob.view(B, G, H, Q, S).transpose(1, 2).flatten(2, 3)[:, :, tiles.skip : tiles.skip + m]
        return layout[0](maps) if layout else maps

    def from_maps(maps):  # (B, H, m, S) -> (B * G, H, Q, S), zero rows for the padding queries
        maps = layout[1](maps) if layout else maps
        rows = pad_seq(maps.transpose(1, 2), tiles.skip, G * Q - tiles.skip - m).view(B, G, Q, H, S)
        return rows.transpose(2, 3).flatten(0, 1)

    maps = to_maps(probabilities(module, q, keys, keep))
    return _ungroup(weighted(from_maps(maps), values, q.dtype), inputs, tiles), maps


@_rows_aligned
def attend_lean(module, inputs: JointInputs, layer, layout: MapsLayout | None) -> tuple[Tensor, None]:
    """``"lean"``: the tiles built one chunk of groups at a time, and again in the backward pass
    (``TiledAttention``)."""
    tiles = _tiles(module, inputs)
    extra, m = inputs.extra, inputs.q.shape[1]
    rows_k, rows_v = (extra.keys, extra.values) if extra is not None else (None, None)
    q = _group_queries(inputs, tiles)
    context = TiledAttention.apply(q, inputs.k, inputs.v, rows_k, rows_v, tiles.index, tiles.keep)
    return context[:, tiles.skip : tiles.skip + m], None


def global_maps_layout(prob: Tensor, is_global: Tensor, order: Tensor):
    """``(to_maps, from_maps, global_from_maps)`` for ``output_attentions`` with global tokens. ``to_maps`` puts
    the other tokens' probabilities (B, H, n, K + r + S) and the global tokens' ``prob`` (B, H, K, r + n), both
    in ``order``, into the maps that ``LongShortSelfAttention.forward`` documents, in position order; ``from_maps`` and
    ``global_from_maps`` read each back from those maps, so that both kinds of output are computed from them."""
    K, n = prob.shape[2], order.shape[1]
    r = prob.shape[-1] - n
    g_valid = is_global[:, n - K :]
    g_cols = g_valid[:, None, None, :].to(prob.dtype)

    def to_maps(attn):
        tail = prob[..., r:].transpose(-1, -2) * g_cols * (~is_global)[:, None, :, None]  # (B, H, n, K)
        own = torch.cat([prob[..., r + n - K :] * g_cols, prob[..., :r]], -1)  # (B, H, K, K + r)
        own = torch.where(g_valid[:, None, :, None], F.pad(own, (0, attn.shape[-1] - K - r)), attn[:, :, n - K :])
        maps = torch.cat([torch.cat([attn[:, :, : n - K], own], 2), tail], -1)
        return torch.take_along_dim(maps, torch.argsort(order, dim=1)[:, None, :, None], dim=2)

    def in_order(maps, slots=order):
        return torch.take_along_dim(maps, slots[:, None, :, None], dim=2)

    def global_from_maps(maps):  # -> (B, H, K, r + n): the global tokens' own rows and the other rows' tails
        own = in_order(maps, order[:, n - K :])
        tail = in_order(maps[..., -K:]).transpose(-1, -2)
        tokens = torch.where(is_global[:, None, None, :], F.pad(own[..., :K], (n - K, 0)), tail)
        return torch.cat([own[..., K : K + r], tokens], -1)

    return to_maps, lambda maps: in_order(maps)[..., :-K], global_from_maps
