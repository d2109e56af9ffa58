"""Long-Short attention (Zhu et al., "Long-Short Transformer", NeurIPS 2021), in plain PyTorch.

One softmax per query over two key/value sets (paper Sec. 3.2-3.4, Eq. 3-7):

* short-term: a segment-wise sliding window. The sequence is cut into segments of ``w`` queries; a
  bidirectional segment attends to itself plus ``e = max(w // 2, 1)`` keys on each side (span 2w for
  even w, as the official code); a causal query attends to the ``w`` keys left of its segment and the
  non-future part of its segment (Appendix D, Fig. 5).
* long-range: the dynamic projection ``P = softmax_n(X W^P)`` (Eq. 3) compresses keys and values to
  ``r`` rows per head that every query sees. Causally (Eq. 5) each segment of ``l`` tokens is projected
  on its own, and a query at position t sees the rows of segments ``s < t // l`` only.
* DualLN (Eq. 7): ``LN_L`` on the window keys/values (which also feed the projection, Sec. 3.4) and
  ``LN_G`` on the projected rows, both over the full width as in the official code.

The fast path groups queries by window segment and hands each group, with its window keys and the
projected rows, to ``F.scaled_dot_product_attention`` with a small boolean mask: O(n (2w + r)) work and
memory, fused kernels on CPU and CUDA, softmax accumulated in float32 by those kernels. Visibility is
defined once, as functions of token positions (``window_keep``, ``segment_keep``); the grouping is only a
layout. This file imports nothing from Transformers or timm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "LongShortSelfAttention",
    "CausalState",
    "validate_long_short_args",
    "window_keep",
    "segment_keep",
]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_long_short_args(
    *,
    hidden_size: int,
    num_heads: int,
    window_size: int,
    projection_rank: int,
    causal: bool = False,
    segment_length: Optional[int] = None,
    qk_head_dim: Optional[int] = None,
    names: Optional[dict] = None,
) -> None:
    """Raise ``ValueError`` naming the offending parameter (``names`` maps ours to the caller's field names)."""
    names = names or {}

    def name(key):
        return names.get(key, key)

    for key, value, low in (
        ("hidden_size", hidden_size, 1),
        ("num_heads", num_heads, 1),
        ("window_size", window_size, 0),
        ("projection_rank", projection_rank, 0),
    ):
        if not _is_int(value) or value < low:
            raise ValueError(f"{name(key)} must be an integer >= {low}, got {value!r}.")
    if hidden_size % num_heads:
        raise ValueError(
            f"{name('hidden_size')} ({hidden_size}) must be divisible by {name('num_heads')} ({num_heads}); "
            f"pick a head count that divides it."
        )
    if qk_head_dim is not None and (not _is_int(qk_head_dim) or qk_head_dim < 1):
        raise ValueError(f"{name('qk_head_dim')} must be None or an integer >= 1, got {qk_head_dim!r}.")
    if not causal:
        if window_size == 0 and projection_rank == 0:
            raise ValueError(
                f"{name('window_size')} and {name('projection_rank')} are both 0, so no query sees any key; "
                f"set at least one of them to a positive integer."
            )
        return
    if window_size < 1:
        raise ValueError(
            f"{name('window_size')} must be >= 1 in causal mode (a token must see itself and its recent past), "
            f"got {window_size}."
        )
    if projection_rank > 0:
        if not _is_int(segment_length) or segment_length < 1:
            raise ValueError(f"{name('segment_length')} must be an integer >= 1, got {segment_length!r}.")
        if segment_length > window_size:
            raise ValueError(
                f"{name('segment_length')} (l={segment_length}) must be at most {name('window_size')} "
                f"(w={window_size}): the window must cover the tokens of the current segment that are not yet "
                f"projected (paper Appendix D). Lower l or raise w."
            )


def window_keep(q_pos: Tensor, k_pos: Tensor, window: int, causal: bool) -> Tensor:
    """Whether the query at ``q_pos[..., i]`` sees the window key at ``k_pos[..., j]``; shape (..., Q, K).

    Bidirectional: keys ``[s - e, s + w + e)`` with ``s = (t // w) * w`` and ``e = max(w // 2, 1)``.
    Causal: keys ``[s - w, t]`` (Appendix D, Fig. 5). Keys outside the sequence are removed by the caller.
    """
    q = q_pos.unsqueeze(-1)
    k = k_pos.unsqueeze(-2)
    start = torch.div(q, window, rounding_mode="floor") * window
    if causal:
        return (k >= start - window) & (k <= q)
    ext = max(window // 2, 1)
    return (k >= start - ext) & (k < start + window + ext)


def segment_keep(q_pos: Tensor, row_segment: Tensor, segment_length: int) -> Tensor:
    """Causal Eq. 5: the query at position t sees the projected rows of segments ``s < t // l``; (..., Q, R)."""
    return row_segment.unsqueeze(-2) < torch.div(q_pos.unsqueeze(-1), segment_length, rounding_mode="floor")


@dataclass
class CausalState:
    """What causal decoding keeps per layer, batch first (so beam search can reorder it).

    ``keys``/``values``/``valid``: window keys (after ``LN_L``) of positions ``[seen - L, seen)``, enough for the
    segment of the next token and the one before it. ``rows_*``: projected rows of every finished segment of
    ``l`` tokens (after ``LN_G``). ``pending``: ``X W^P`` scores of the unfinished segment. A decoding step
    therefore costs O(w + r * seen / l).
    """

    seen: int = 0
    keys: Optional[Tensor] = None  # (B, L, H, d_qk)
    values: Optional[Tensor] = None  # (B, L, H, d_v)
    valid: Optional[Tensor] = None  # (B, L) bool
    rows_k: Optional[Tensor] = None  # (B, N, H, d_qk)
    rows_v: Optional[Tensor] = None  # (B, N, H, d_v)
    rows_valid: Optional[Tensor] = None  # (B, N) bool
    pending: Optional[Tensor] = None  # (B, p, H, r)
    _tensors: tuple = field(default=("keys", "values", "valid", "rows_k", "rows_v", "rows_valid", "pending"), repr=False)

    def map_batch(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Apply ``fn`` to every cached tensor (index_select for beam search, repeat_interleave, ...)."""
        for name in self._tensors:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))


def _pad_seq(x: Tensor, left: int, right: int) -> Tensor:
    """Zero/False-pad (or crop, for negative amounts) dim 1 of a (B, L, ...) tensor."""
    pad = [0, 0] * (x.dim() - 2) + [left, right]
    if x.dtype == torch.bool:
        return F.pad(x.view(torch.uint8), pad).view(torch.bool)
    return F.pad(x, pad)


def _unfold(x: Tensor, x_start: int, first_group: int, groups: int, window: int, before: int, after: int) -> Tensor:
    """Tile dim 1 of ``x`` (positions ``[x_start, x_start + L)``) into ``groups`` windows of positions
    ``[g w - before, g w + w + after)``, zero/False outside ``x``: (B, L, *rest) -> (B, G, *rest, S)."""
    span = before + window + after
    lo = first_group * window - before
    hi = (first_group + groups) * window + after
    x = _pad_seq(x, x_start - lo, hi - x_start - x.shape[1])
    return x.unfold(1, span, window)


def _heads_tiles(x: Tensor, *args) -> Tensor:
    """``_unfold`` for (B, L, H, d) tensors, laid out for attention: (B, G, H, S, d)."""
    return _unfold(x, *args).transpose(-1, -2)


class LongShortSelfAttention(nn.Module):
    """Multi-head Long-Short self-attention with its query/key/value/output projections.

    Args:
        hidden_size: model width d.
        num_heads: heads H; the value head dim is d / H.
        window_size: segment length w of the sliding window (0 disables the short-term branch, bidirectional).
        projection_rank: rows r of the dynamic projection per head (0 disables the long-range branch).
        causal: autoregressive attention (Eq. 5, Appendix D).
        segment_length: projection segment length l (causal only, ``1 <= l <= w``).
        use_dual_ln: DualLN (Eq. 7); off gives the paper's ablation (no LN on keys/values).
        qk_head_dim: LMSA compression: a query/key head dim smaller than the value head dim.
        attention_dropout: dropout on the joint attention probabilities.
        bias: biases on the query/key/value/output projections.
        layer_norm_eps: epsilon of the DualLN layers.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        window_size: int,
        projection_rank: int,
        *,
        causal: bool = False,
        segment_length: Optional[int] = None,
        use_dual_ln: bool = True,
        qk_head_dim: Optional[int] = None,
        attention_dropout: float = 0.0,
        bias: bool = True,
        layer_norm_eps: float = 1e-5,
    ):
        super().__init__()
        validate_long_short_args(
            hidden_size=hidden_size,
            num_heads=num_heads,
            window_size=window_size,
            projection_rank=projection_rank,
            causal=causal,
            segment_length=segment_length,
            qk_head_dim=qk_head_dim,
        )
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qk_head_dim = qk_head_dim or self.head_dim
        self.window_size = window_size
        self.projection_rank = projection_rank
        self.causal = causal
        self.segment_length = segment_length if projection_rank else None
        self.use_dual_ln = use_dual_ln
        self.attention_dropout = attention_dropout

        qk_width = num_heads * self.qk_head_dim
        self.query = nn.Linear(hidden_size, qk_width, bias=bias)
        self.key = nn.Linear(hidden_size, qk_width, bias=bias)
        self.value = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.output = nn.Linear(hidden_size, hidden_size, bias=bias)
        # W^P of Eq. 3: r score columns per head, computed from the layer input.
        self.dynamic_projection = nn.Linear(hidden_size, num_heads * projection_rank) if projection_rank else None
        if use_dual_ln:
            self.dual_ln_local = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
            self.dual_ln_global = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
            if qk_width != hidden_size:  # LMSA: narrower keys get their own DualLN pair
                self.dual_ln_local_key = nn.LayerNorm(qk_width, eps=layer_norm_eps)
                self.dual_ln_global_key = nn.LayerNorm(qk_width, eps=layer_norm_eps)

    # ------------------------------------------------------------------ helpers
    def _dual_ln(self, x: Tensor, which: str, is_key: bool) -> Tensor:
        """LN_L (``which="local"``) or LN_G (``"global"``) over the full width, (B, L, H, d) -> same."""
        if not self.use_dual_ln:
            return x
        name = f"dual_ln_{which}_key" if is_key and hasattr(self, f"dual_ln_{which}_key") else f"dual_ln_{which}"
        return getattr(self, name)(x.flatten(2)).view_as(x)

    def _split(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, -1))

    def _project(self, scores: Tensor, keys: Tensor, values: Tensor, valid: Tensor, segment: int):
        """Eq. 3 / Eq. 5: softmax of ``X W^P`` over each segment of ``segment`` tokens (float32, padding excluded),
        then ``K_bar = P^T LN_L(K)``. scores (B, S*segment, H, r) -> rows (B, S*r, H, d) and their validity."""
        B, n, H, r = scores.shape
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        scores = scores.masked_fill(~valid[:, :, None, None], torch.finfo(scores.dtype).min)
        prob = scores.view(B, n // segment, segment, H, r).softmax(dim=2).to(keys.dtype)
        seg_k = keys.view(B, n // segment, segment, H, -1)
        seg_v = values.view(B, n // segment, segment, H, -1)
        rows_k = torch.einsum("bslhr,bslhd->bsrhd", prob, seg_k).flatten(1, 2)
        rows_v = torch.einsum("bslhr,bslhd->bsrhd", prob, seg_v).flatten(1, 2)
        rows_valid = valid.view(B, n // segment, segment).any(-1).repeat_interleave(r, dim=1)
        return rows_k, rows_v, rows_valid

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor, need_weights: bool):
        """One softmax per query over all its keys. q (B', H, Q, d), k/v (B', H, K, d), keep (B', 1, Q|1, K)."""
        dropout = self.attention_dropout if self.training else 0.0
        if not need_weights:
            return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=keep, dropout_p=dropout), None
        scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        prob = scores.masked_fill(~keep, float("-inf")).softmax(-1)
        prob = F.dropout(prob, dropout, self.training)
        return (prob.to(v.dtype) @ v.to(q.dtype)).to(q.dtype), prob

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor] = None,
        *,
        cls_hidden: Optional[Tensor] = None,
        state: Optional[CausalState] = None,
        output_attentions: bool = False,
    ):
        """Args:
            hidden_states: (B, n, d); with ``state``, the n new tokens that follow ``state.seen`` earlier ones.
            attention_mask: (B, n) with 1/True for real tokens (a longer mask's last n columns are used).
            cls_hidden: (B, 1, d) global token (bidirectional): it joins the projected keys and attends to the
                other tokens' outputs (official LRA/vision "post-CLS"); the output then has 1 + n rows.
            state: ``CausalState`` to read and extend (causal decoding).
            output_attentions: also return the joint probabilities, (B, H, n, R + S): for each query its weights
                over the R projected rows (cls first; causal: all finished segments' rows) and then the S window
                keys of its segment in position order (bidirectional S = w + 2e; causal S = 2w; in a decoding
                step the whole cached window).

        Returns ``(output, attentions or None)``; rows of padded tokens are the output bias (context 0).
        """
        B, n, _ = hidden_states.shape
        if attention_mask is None:
            valid = torch.ones(B, n, dtype=torch.bool, device=hidden_states.device)
        else:
            valid = attention_mask[:, -n:].to(device=hidden_states.device) > 0
        if self.causal and cls_hidden is not None:
            raise ValueError("cls_hidden is only supported by bidirectional attention (causal=False).")
        if state is not None and not self.causal:
            raise ValueError("state (decoding cache) is only supported by causal attention (causal=True).")
        if cls_hidden is not None and self.qk_head_dim != self.head_dim:
            raise ValueError("cls_hidden needs qk_head_dim == head_dim: the cls query attends to the token outputs.")

        q = self._split(self.query(hidden_states))
        k = self._dual_ln(self._split(self.key(hidden_states)), "local", is_key=True)
        v = self._dual_ln(self._split(self.value(hidden_states)), "local", is_key=False)
        scores = self._split(self.dynamic_projection(hidden_states)) if self.projection_rank else None
        if self.causal:
            context, attn = self._causal(q, k, v, scores, valid, state if state is not None else CausalState(), output_attentions)
        else:
            context, attn = self._bidirectional(q, k, v, scores, valid, hidden_states, cls_hidden, output_attentions)
        return self.output(context.flatten(2)), attn

    def _bidirectional(self, q, k, v, scores, valid, x, cls_hidden, need_weights):
        B, n, H, _ = q.shape
        w, r = self.window_size, self.projection_rank
        rows = []  # (keys, values, valid) blocks of the projected set, cls first
        if cls_hidden is not None:  # the raw cls key/value joins the projected rows (official code)
            rows.append((self._split(self.key(cls_hidden)), self._split(self.value(cls_hidden)), valid.new_ones(B, 1)))
        if r:
            rows.append(self._project(scores, k, v, valid, segment=n))
        rows_k = rows_v = rows_valid = None
        if rows:
            rows_k, rows_v, rows_valid = (torch.cat(block, 1) for block in zip(*rows))
            rows_k = self._dual_ln(rows_k, "global", is_key=True)
            rows_v = self._dual_ln(rows_v, "global", is_key=False)
        if w:
            groups, ext = -(-n // w), max(w // 2, 1)
            q_tiles = _heads_tiles(q, 0, 0, groups, w, 0, 0)
            q_valid = _unfold(valid, 0, 0, groups, w, 0, 0)
            k_tiles, v_tiles = (_heads_tiles(t, 0, 0, groups, w, ext, ext) for t in (k, v))
            keep = _unfold(valid, 0, 0, groups, w, ext, ext)[:, :, None, :]  # a segment shares its keys
        else:  # projection only: one group of every query against the projected rows
            q_tiles, q_valid = q.transpose(1, 2)[:, None], valid[:, None]
            k_tiles, v_tiles = (t.new_zeros(B, 1, H, 0, t.shape[-1]) for t in (k, v))
            keep = valid.new_zeros(B, 1, 1, 0)
        context, attn = self._grouped_attention(q_tiles, q_valid, k_tiles, v_tiles, keep, rows_k, rows_v, rows_valid, None, need_weights)
        context, attn = context[:, :n], (attn[:, :, :n] if attn is not None else None)
        context = context * valid[:, :, None, None].to(context.dtype)
        if cls_hidden is not None:
            context = torch.cat([self._cls_output(cls_hidden, context, valid), context], dim=1)
        return context, attn

    def _grouped_attention(self, q_tiles, q_valid, k_tiles, v_tiles, keep, rows_k, rows_v, rows_valid, rows_keep, need_weights):
        """Every group of queries attends to [projected rows; its window keys] in one SDPA call.

        q_tiles (B, G, H, Q, d_qk); q_valid (B, G, Q); k_tiles/v_tiles (B, G, H, S, d); keep (B, G, Q|1, S) window
        visibility; rows_* (B, R, H, d) or None; rows_keep (G, Q, R) causal row visibility or None.
        Returns the context (B, G*Q, H, d_v) and, if asked, the probabilities (B, H, G*Q, R + S).
        """
        B, G, H, Q, _ = q_tiles.shape
        if rows_k is not None:
            R = rows_k.shape[1]
            k_tiles = torch.cat([rows_k.transpose(1, 2)[:, None].expand(B, G, H, R, -1).to(k_tiles.dtype), k_tiles], 3)
            v_tiles = torch.cat([rows_v.transpose(1, 2)[:, None].expand(B, G, H, R, -1).to(v_tiles.dtype), v_tiles], 3)
            row_mask = rows_valid[:, None, None, :]
            if rows_keep is not None:
                row_mask = row_mask & rows_keep
            rows_q = max(row_mask.shape[2], keep.shape[2])
            keep = torch.cat([row_mask.expand(B, G, rows_q, R), keep.expand(B, G, rows_q, -1)], -1)
        # A padded query keeps every key: no all-masked row (no NaN); its output is zeroed afterwards.
        keep = keep | ~q_valid[..., None]
        S = k_tiles.shape[3]
        out, prob = self._attend(
            q_tiles.reshape(B * G, H, Q, -1),
            k_tiles.reshape(B * G, H, S, -1),
            v_tiles.reshape(B * G, H, S, -1),
            keep.reshape(B * G, 1, Q, S),
            need_weights,
        )
        out = out.view(B, G, H, Q, -1).permute(0, 1, 3, 2, 4).flatten(1, 2)
        if prob is not None:
            prob = prob.view(B, G, H, Q, S).transpose(1, 2).flatten(2, 3)
        return out, prob

    def _cls_output(self, cls_hidden, context, valid):
        """The cls token attends to its own raw key/value and to the other tokens' contexts (official post-CLS)."""
        q = self._split(self.query(cls_hidden)).transpose(1, 2)  # (B, H, 1, d)
        keys = torch.cat([self._split(self.key(cls_hidden)), context], 1).transpose(1, 2)
        values = torch.cat([self._split(self.value(cls_hidden)), context], 1).transpose(1, 2)
        keep = torch.cat([valid.new_ones(valid.shape[0], 1), valid], 1)[:, None, None, :]
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=keep)
        return out.transpose(1, 2)

    def _causal(self, q, k, v, scores, valid, state: CausalState, need_weights):
        """Causal attention of n new tokens at positions ``[p0, p0 + n)`` given what ``state`` holds; extends it."""
        B, n, H, _ = q.shape
        w, r, l = self.window_size, self.projection_rank, self.segment_length
        p0, end = state.seen, state.seen + n
        # Window keys of positions [k_start, end): the cached tail and the new tokens.
        k_all, v_all, valid_all = (
            torch.cat([old, new], 1) if old is not None else new
            for old, new in ((state.keys, k), (state.values, v), (state.valid, valid))
        )
        k_start = end - k_all.shape[1]

        # Projected rows: the finished segments' plus those of the segments that the new tokens complete.
        rows_k, rows_v, rows_valid, pending = state.rows_k, state.rows_v, state.rows_valid, None
        if r:
            all_scores = torch.cat([state.pending, scores], 1) if state.pending is not None else scores
            seg_start, done = (p0 // l) * l, (end // l) * l
            if done > seg_start:
                span = slice(seg_start - k_start, done - k_start)
                new_k, new_v, new_valid = self._project(all_scores[:, : done - seg_start], k_all[:, span], v_all[:, span], valid_all[:, span], l)
                new_k = self._dual_ln(new_k, "global", is_key=True)
                new_v = self._dual_ln(new_v, "global", is_key=False)
                if rows_k is not None:
                    new_k, new_v, new_valid = (torch.cat(pair, 1) for pair in ((rows_k, new_k), (rows_v, new_v), (rows_valid, new_valid)))
                rows_k, rows_v, rows_valid = new_k, new_v, new_valid
            pending = all_scores[:, done - seg_start :]

        q_pos = torch.arange(p0, end, device=q.device)
        k_pos = torch.arange(k_start, end, device=q.device)
        if n >= w:  # training / prefill: group the queries by window segment
            g0, groups = p0 // w, -(-end // w) - p0 // w
            q_tiles = _heads_tiles(q, p0, g0, groups, w, 0, 0)
            q_valid = _unfold(valid, p0, g0, groups, w, 0, 0)
            tq_pos = _unfold(q_pos[None], p0, g0, groups, w, 0, 0)[0]
            k_tiles, v_tiles = (_heads_tiles(t, k_start, g0, groups, w, w, 0) for t in (k_all, v_all))
            k_valid = _unfold(valid_all, k_start, g0, groups, w, w, 0)
            tk_pos = _unfold(k_pos[None], k_start, g0, groups, w, w, 0)[0]
            skip = p0 - g0 * w
        else:  # decoding: one group of the new queries against the whole cached window
            q_tiles, q_valid, tq_pos = q.transpose(1, 2)[:, None], valid[:, None], q_pos[None]
            k_tiles, v_tiles = k_all.transpose(1, 2)[:, None], v_all.transpose(1, 2)[:, None]
            k_valid, tk_pos, skip = valid_all[:, None], k_pos[None], 0
        # Fill outside [k_start, end) is invalid; window_keep removes the future and keys left of the window.
        keep = k_valid[:, :, None, :] & window_keep(tq_pos, tk_pos, w, causal=True)
        rows_keep = None
        if rows_k is not None:
            rows_keep = segment_keep(tq_pos, torch.arange(rows_k.shape[1], device=q.device) // r, l)
        context, attn = self._grouped_attention(q_tiles, q_valid, k_tiles, v_tiles, keep, rows_k, rows_v, rows_valid, rows_keep, need_weights)
        context = context[:, skip : skip + n] * valid[:, :, None, None].to(context.dtype)
        attn = attn[:, :, skip : skip + n] if attn is not None else None

        # Keep the keys of the current and the previous window segment, and the unfinished segment's scores.
        keep_from = max(0, (end // w - 1) * w)
        state.keys, state.values, state.valid = (t[:, keep_from - k_start :] for t in (k_all, v_all, valid_all))
        state.rows_k, state.rows_v, state.rows_valid, state.pending = rows_k, rows_v, rows_valid, pending
        state.seen = end
        return context, attn
