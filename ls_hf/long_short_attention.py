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
* global tokens (bidirectional, Longformer's ``global_attention_mask``): every token sees their keys, and they
  attend to every token, in the same softmax; see ``LongShortSelfAttention.forward``.

The fast path groups queries by window segment and hands each group, with its window keys and the
projected rows, to ``F.scaled_dot_product_attention`` with a small boolean mask: fused kernels on CPU and
CUDA, softmax accumulated in float32 by those kernels. Bidirectional work and memory are O(n (2w + r)). With
``recompute_window_tiles=True``, training on CPU builds the tiles one chunk of groups at a time and again in the
backward pass (``_TiledAttention``), so that autograd keeps the keys and values once, not (2w + r) / w times,
``LN_L`` is written over its input and keeps its output only, and the projection (``_DynamicProjection``) keeps
neither its scores nor P.
Causally a query at position t also sees ``r * (t // l)`` projected rows, so the cost is O(n (2w + r n / l)),
quadratic with the small factor r / l (the official causal models use r=1, l=16). Visibility is defined
once, as functions of token positions (``window_keep``, ``segment_keep``); the grouping is only a layout.
``attn_implementation="flex_attention"`` instead hands FlexAttention the keys [extra keys; tokens] and that same
visibility as a block mask, gathering nothing (``_attend_flex``; compile the module for its fused kernel).
This file imports nothing from Transformers or timm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

try:  # FlexAttention runs on CPU from torch 2.6 (this package needs torch >= 2.11 anyway)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:
    create_block_mask = flex_attention = None

# The implementations of the joint softmax: Transformers' names ("eager" and "sdpa" run the same SDPA code).
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")
FLEX_ATTENTION_MIN_TORCH = "2.6"
__all__ = [
    "CausalState",
    "ExtraKeys",
    "LongShortSelfAttention",
    "check_attn_implementation",
    "masked_sdpa",
    "project_rows",
    "segment_keep",
    "validate_long_short_args",
    "window_extent",
    "window_keep",
]


def check_attn_implementation(attn_implementation: str) -> None:
    """Refuse an unknown ``attn_implementation`` (``ValueError``), or ``"flex_attention"`` on a torch without
    FlexAttention (``ImportError`` naming the minimum version), before any work."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}.")
    if attn_implementation == "flex_attention" and flex_attention is None:
        raise ImportError(
            f'attn_implementation="flex_attention" needs torch.nn.attention.flex_attention (torch >= '
            f'{FLEX_ATTENTION_MIN_TORCH}), which torch {torch.__version__} lacks; upgrade torch or use "sdpa".'
        )


def takes_grad(x: Tensor, weight: Tensor) -> bool:
    """Whether autograd records a module's call on ``x``: gradients enabled, and ``x`` or the module's ``weight``
    requires them."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def check_flex_call(x: Tensor, weight: Tensor, *, training: bool, dropout: float, dropout_name: str,
                    dropout_setting: str) -> None:
    """Refuse, before any work, what FlexAttention cannot do: attention dropout in training (``dropout``, the
    module's ``dropout_name``, set by ``dropout_setting``), and backward on CPU (``takes_grad(x, weight)``)."""
    if training and dropout > 0:
        raise ValueError(
            f'attn_implementation="flex_attention" has no attention dropout, but {dropout_name} is {dropout} in '
            f'training mode; set it ({dropout_setting}) to 0 or use attn_implementation="sdpa".'
        )
    if takes_grad(x, weight) and x.device.type == "cpu":
        raise NotImplementedError(
            f'attn_implementation="flex_attention" runs forward only on CPU (torch {torch.__version__} has no '
            f'FlexAttention backward there): train with attn_implementation="sdpa", or run inference under '
            f"torch.no_grad() / torch.inference_mode()."
        )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_long_short_args(
    *,
    hidden_size: int,
    num_heads: int,
    window_size: int,
    projection_rank: int,
    causal: bool = False,
    segment_length: int | None = None,
    qk_head_dim: int | None = None,
    attention_dropout: float = 0.0,
    names: dict | None = None,
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
    if isinstance(attention_dropout, bool) or not isinstance(attention_dropout, (int, float)) \
            or not 0 <= attention_dropout < 1:
        raise ValueError(f"{name('attention_dropout')} is a dropout probability, 0 <= p < 1; "
                         f"got {attention_dropout!r}.")
    if not causal:
        if segment_length is not None:
            raise ValueError(
                f"{name('segment_length')} (l={segment_length}) only applies to causal attention (Eq. 5); pass "
                f"causal=True or leave it out."
            )
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


def window_extent(window: int) -> int:
    """Keys ``e = max(w // 2, 1)`` that a bidirectional segment of ``w`` queries sees on each side beyond itself (span
    2w for even w, as the official LRA and ImageNet code); 1-D here and per axis in ``ls_timm``."""
    return max(window // 2, 1)


def window_keep(q_pos: Tensor, k_pos: Tensor, window: int, causal: bool) -> Tensor:
    """Whether the query at ``q_pos[..., i]`` sees the window key at ``k_pos[..., j]``; shape (..., Q, K).

    Bidirectional: keys ``[s - e, s + w + e)`` with ``s = (t // w) * w`` and ``e = window_extent(w)``.
    Causal: keys ``[s - w, t]`` (Appendix D, Fig. 5). Keys outside the sequence are removed by the caller.
    """
    return _window_rule(q_pos.unsqueeze(-1), k_pos.unsqueeze(-2), window, causal)


def _window_rule(q: Tensor, k: Tensor, window: int, causal: bool) -> Tensor:
    """``window_keep`` on broadcast query and key positions (elementwise, as FlexAttention's mask_mod needs it)."""
    start = torch.div(q, window, rounding_mode="floor") * window
    if causal:
        return (k >= start - window) & (k <= q)
    ext = window_extent(window)
    return (k >= start - ext) & (k < start + window + ext)


def project_rows(
    scores: Tensor, keys: Tensor, values: Tensor, valid: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Eq. 3, the dynamic projection: ``P = softmax(X W^P)`` over the L tokens (in float32, or float64 for float64
    scores; tokens where ``valid`` is False excluded) and the projected rows ``P K``, ``P V``.

    scores (..., H, r, L), keys (..., H, L, d_k), values (..., H, L, d_v), valid (..., L) or None
    -> (..., H, r, d_k) and (..., H, r, d_v), in the dtypes of keys and values. A set without a valid token gets
    finite rows (uniform weights), which the caller marks invalid.
    """
    prob = _projection_weights(scores, valid)
    return (prob @ keys.to(prob.dtype)).to(keys.dtype), (prob @ values.to(prob.dtype)).to(values.dtype)


def _projection_weights(scores: Tensor, valid: Tensor | None, *, in_place: bool = False) -> Tensor:
    """``P`` of Eq. 3: the softmax of ``scores`` (..., H, r, L) over the valid tokens, in float32 at least.
    ``in_place``: built in a single new contiguous tensor (a copy of the scores, masked and turned into the softmax
    in place), which autograd cannot differentiate."""
    dtype = torch.promote_types(scores.dtype, torch.float32)
    if not in_place:
        scores = scores.to(dtype)
        if valid is not None:
            scores = scores.masked_fill(~valid[..., None, None, :], torch.finfo(dtype).min)
        return scores.softmax(-1)
    prob = scores.to(dtype, memory_format=torch.contiguous_format, copy=True)
    if valid is not None:
        prob.masked_fill_(~valid[..., None, None, :], torch.finfo(dtype).min)
    prob.sub_(prob.amax(-1, keepdim=True)).exp_()
    return prob.div_(prob.sum(-1, keepdim=True))


class _DynamicProjection(torch.autograd.Function):
    """``project_rows`` (Eq. 3) on the scores ``X W^P + b`` computed here, a chunk of heads at a time
    (``TILE_CHUNK_BYTES``), so that neither the scores nor P of all heads is ever made: it saves the inputs (the layer
    input, the keys and values that the window attention keeps anyway) and the r rows, and the backward pass builds
    each chunk's P again. There the gradient of P comes from both ``P K`` and ``P V``, the softmax backward
    ``P * (dP - sum_L(P dP))`` takes ``sum_L(P dP)`` from the rows (``g_K . (P K) + g_V . (P V)`` over the features,
    no (r, L) product), and the scores' gradient goes straight into those of X, W^P and b.

    hidden (..., L, D), weight (H r, D), bias (H r) or None, keys (..., H, L, d_k), values (..., H, L, d_v),
    valid (..., L) or None -> (..., H, r, d_k) and (..., H, r, d_v), in the dtypes of keys and values.
    """

    @staticmethod
    def _head_chunks(ctx, hidden):
        """(heads, their columns of W^P) per chunk, sized so that the backward pass's four P-sized temporaries (P, its
        gradient and two products) take at most ``TILE_CHUNK_BYTES``."""
        rank = ctx.rank
        p_bytes = hidden[..., 0].numel() * rank * max(hidden.element_size(), 4)  # one head's P, float32 at least
        step = max(1, TILE_CHUNK_BYTES // max(4 * p_bytes, 1))
        for start in range(0, ctx.heads, step):
            chunk = slice(start, min(start + step, ctx.heads))
            yield chunk, slice(chunk.start * rank, chunk.stop * rank)

    @staticmethod
    def _weights(ctx, hidden, weight, bias, valid, columns):
        """P of the chunk of heads whose ``columns`` of W^P are given, (..., g, r, L), contiguous, in float32 at
        least; the scores are computed under the forward pass's autocast state, so that the backward pass builds the
        same P."""
        with torch.autocast(hidden.device.type, dtype=ctx.autocast_dtype, enabled=ctx.autocast):
            scores = F.linear(hidden, weight[columns], None if bias is None else bias[columns])
        return _projection_weights(scores.unflatten(-1, (-1, ctx.rank)).movedim(-3, -1), valid, in_place=True)

    @staticmethod
    def forward(ctx, hidden, weight, bias, keys, values, valid):
        device = hidden.device.type
        ctx.heads, ctx.rank = keys.shape[-3], weight.shape[0] // keys.shape[-3]
        ctx.autocast, ctx.autocast_dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        rows_k = keys.new_empty(*keys.shape[:-2], ctx.rank, keys.shape[-1], dtype=dtype)
        rows_v = values.new_empty(*rows_k.shape[:-1], values.shape[-1], dtype=dtype)
        for chunk, columns in _DynamicProjection._head_chunks(ctx, hidden):
            prob = _DynamicProjection._weights(ctx, hidden, weight, bias, valid, columns)
            rows_k[..., chunk, :, :] = prob @ keys[..., chunk, :, :].to(dtype)
            rows_v[..., chunk, :, :] = prob @ values[..., chunk, :, :].to(dtype)
        ctx.save_for_backward(hidden, weight, bias, keys, values, valid, rows_k, rows_v)
        return rows_k.to(keys.dtype), rows_v.to(values.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows_k, grad_rows_v):
        hidden, weight, bias, keys, values, valid, rows_k, rows_v = ctx.saved_tensors
        dtype = rows_k.dtype
        grad_rows_k, grad_rows_v = grad_rows_k.to(dtype), grad_rows_v.to(dtype)
        row_dot = torch.linalg.vecdot(grad_rows_k, rows_k) + torch.linalg.vecdot(grad_rows_v, rows_v)
        inputs = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
        grad_inputs = torch.zeros_like(inputs) if ctx.needs_input_grad[0] else None
        grad_weight = torch.empty(weight.shape, dtype=dtype, device=weight.device)
        grad_bias = None if bias is None else torch.empty(bias.shape, dtype=dtype, device=bias.device)
        grad_keys, grad_values = torch.empty_like(keys), torch.empty_like(values)
        for chunk, columns in _DynamicProjection._head_chunks(ctx, hidden):
            prob = _DynamicProjection._weights(ctx, hidden, weight, bias, valid, columns)
            g_k, g_v = grad_rows_k[..., chunk, :, :], grad_rows_v[..., chunk, :, :]
            grad_scores = g_k @ keys[..., chunk, :, :].to(dtype).transpose(-1, -2)
            grad_scores += g_v @ values[..., chunk, :, :].to(dtype).transpose(-1, -2)
            grad_scores.sub_(row_dot[..., chunk, :, None]).mul_(prob)
            if valid is not None:  # the excluded tokens' scores (masked) get no gradient
                grad_scores.masked_fill_(~valid[..., None, None, :], 0)
            grad_keys[..., chunk, :, :] = prob.transpose(-1, -2) @ g_k
            grad_values[..., chunk, :, :] = prob.transpose(-1, -2) @ g_v
            del prob  # before the scores' gradient is laid out as rows (a copy)
            grad_scores = grad_scores.movedim(-1, -3).reshape(-1, columns.stop - columns.start)  # (..., L, g r)
            if grad_inputs is not None:
                grad_inputs.addmm_(grad_scores, weight[columns].to(dtype))
            grad_weight[columns] = grad_scores.T @ inputs
            if grad_bias is not None:
                grad_bias[columns] = grad_scores.sum(0)
            del grad_scores  # before the next chunk's P
        return (None if grad_inputs is None else grad_inputs.view(hidden.shape).to(hidden.dtype),
                grad_weight.to(weight.dtype), None if bias is None else grad_bias.to(bias.dtype), grad_keys,
                grad_values, None)


def segment_keep(q_pos: Tensor, row_segment: Tensor, segment_length: int) -> Tensor:
    """Causal Eq. 5: the query at position t sees the projected rows of segments ``s < t // l``; (..., Q, R)."""
    return _segment_rule(q_pos.unsqueeze(-1), row_segment.unsqueeze(-2), segment_length)


def _segment_rule(q: Tensor, row_segment: Tensor, segment_length: int) -> Tensor:
    """``segment_keep`` on broadcast query positions and row segments (elementwise)."""
    return row_segment < torch.div(q, segment_length, rounding_mode="floor")


class BatchFirstState:
    """A decoding cache whose tensors (named by ``_tensors``) are batch first, so beam search can reorder them."""

    _tensors: tuple = ()

    def map_batch(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Apply ``fn`` to every cached tensor (index_select for beam search, repeat_interleave, ...)."""
        for name in self._tensors:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))


@dataclass
class CausalState(BatchFirstState):
    """What causal decoding keeps per layer, batch first (so beam search can reorder it).

    ``keys``/``values``/``valid``: window keys (after ``LN_L``) of positions ``[seen - L, seen)``, enough for the
    segment of the next token and the one before it. ``rows_*``: projected rows of every finished segment of
    ``l`` tokens (after ``LN_G``). ``pending``: the inputs X of the unfinished segment (its scores ``X W^P`` are
    computed when it is complete). A decoding step therefore costs O(w + r * seen / l).
    """

    seen: int = 0
    keys: Tensor | None = None  # (B, L, H, d_qk)
    values: Tensor | None = None  # (B, L, H, d_v)
    valid: Tensor | None = None  # (B, L) bool
    rows_k: Tensor | None = None  # (B, N, H, d_qk)
    rows_v: Tensor | None = None  # (B, N, H, d_v)
    rows_valid: Tensor | None = None  # (B, N) bool
    pending: Tensor | None = None  # (B, p, D)
    _tensors: tuple = field(
        default=("keys", "values", "valid", "rows_k", "rows_v", "rows_valid", "pending"), repr=False
    )


class ExtraKeys(NamedTuple):
    """Keys a query sees besides its window: the global tokens' and the projected rows (Eq. 3 / Eq. 5), after LN_G."""

    keys: Tensor  # (B, R, H, d_qk)
    values: Tensor  # (B, R, H, d_v)
    valid: Tensor  # (B, R) bool
    segment: Tensor | None = None  # (R,) causal: each row's projection segment (Eq. 5); None: every query sees every row


def _take(x: Tensor, index: Tensor) -> Tensor:
    """The entries ``index`` (B, m) along dim 1 of a (B, L, ...) tensor: (B, m, ...)."""
    return torch.take_along_dim(x, index.view(index.shape + (1,) * (x.dim() - 2)), dim=1)


def _pad_seq(x: Tensor, left: int, right: int) -> Tensor:
    """Zero-pad (or crop, for negative amounts) dim 1 of a (B, L, ...) tensor."""
    if left == 0 and right == 0:
        return x
    return F.pad(x, [0, 0] * (x.dim() - 2) + [left, right])


def _window_index(first_group: int, groups: int, window: int, before: int, after: int, k_start: int, length: int):
    """Key positions of the windows ``[g w - before, g w + w + after)`` of groups ``first_group ..`` (G, S), and their
    indices into keys held for positions ``[k_start, k_start + length)``; a position outside points at index
    ``length`` (the caller's zero row, masked)."""
    offsets = torch.arange(-before, window + after)
    pos = (torch.arange(first_group, first_group + groups) * window)[:, None] + offsets
    inside = (pos >= k_start) & (pos < k_start + length)
    return pos, torch.where(inside, pos - k_start, length)


def _weighted(maps: Tensor, v: Tensor, dtype: torch.dtype) -> Tensor:
    """The probabilities ``maps`` (B', H, Q, K) applied to the values v (B', H, K, d), in ``dtype``."""
    return (maps.to(v.dtype) @ v.to(dtype)).to(dtype)


def _gather(rows: Tensor | None, x: Tensor, index: Tensor) -> Tensor:
    """For each of G groups, the R ``rows`` then the entries of ``x`` (B, L, ...) at ``index`` (G, S), where index L
    stands for a zero entry: (B, G, R + S, ...)."""
    B, L = x.shape[:2]
    G, S = index.shape
    window = x.index_select(1, index.clamp(max=max(L - 1, 0)).flatten()).view(B, G, S, *x.shape[2:])
    outside = index == L
    if outside.any():
        window = window.masked_fill(outside.view(1, G, S, *(1,) * (x.dim() - 2)), 0)
    if rows is None:
        return window
    return torch.cat([rows[:, None].expand(B, G, *rows.shape[1:]), window], 2)


# On CUDA, torch tries cuDNN's attention first for a masked SDPA on recent GPUs, and cuDNN builds an execution plan
# for every new shape (hundreds of milliseconds each). The shapes here change with every padded length and with every
# decoding step, so the mask goes to the other fused kernels instead (memory-efficient, else the math fallback).
SDPA_BACKENDS_WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, dropout_p: float = 0.0) -> Tensor:
    """``F.scaled_dot_product_attention`` of q over the keys where ``keep``, never on cuDNN's backend (CUDA only;
    see ``SDPA_BACKENDS_WITHOUT_CUDNN``)."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p)
    with sdpa_kernel(SDPA_BACKENDS_WITHOUT_CUDNN):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p)


# The fused CPU kernel behind F.scaled_dot_product_attention (torch >= 2.3), called directly so that its log-sum-exp
# is kept for the backward pass (the public function returns only the output). It needs one head dim for q, k and v.
_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
# The gathered keys and values of one chunk of groups in ``_TiledAttention`` (one group of 256 queries at hidden 768,
# w = 256, r = 64), the rows of one chunk in ``_LayerNormInPlace``'s passes and the P of one chunk of heads in
# ``_DynamicProjection``'s: larger chunks trade memory for fewer, larger operations.
TILE_CHUNK_BYTES = 4 * 2**20


class _TiledAttention(torch.autograd.Function):
    """Each group of Q queries attends to its tile, [the R extra rows; its window keys], one chunk of groups at a
    time, saving only the inputs, the output and the log-sum-exp: the backward pass gathers each chunk's tiles again
    (a copy) instead of keeping every tile, which would hold (R + S) / Q copies of the keys and values. On the fused
    CPU kernel (``_FUSED_CPU``), whose backward takes the saved output and log-sum-exp.

    q (B, G*Q, H, d_qk); k, v (B, L, H, d) window keys; rows_k, rows_v (B, R, H, d) or None; index (G, S) into k,
    with L standing for a zero key; keep (B, G, Q|1, R + S) -> (B, G*Q, H, d_v), in q's dtype.
    """

    @staticmethod
    def _chunks(step, q, k, v, rows_k, rows_v, index, bias):
        """(groups, q, k, v, bias) per chunk of ``step`` groups, heads first: (B*g, H, Q, d), (B*g, H, R + S, d) twice
        and (B*g, 1, Q|1, R + S)."""
        G = index.shape[0]
        for start in range(0, G, step):
            groups = slice(start, min(start + step, G))
            tiles = (_gather(rows, x, index[groups]).to(q.dtype).flatten(0, 1).transpose(1, 2)
                     for rows, x in ((rows_k, k), (rows_v, v)))
            yield (groups, q.unflatten(1, (G, -1))[:, groups].flatten(0, 1).transpose(1, 2), *tiles,
                   bias[:, groups].flatten(0, 1).unsqueeze(1))

    @staticmethod
    def forward(ctx, q, k, v, rows_k, rows_v, index, keep):
        B, _, H, _ = q.shape
        G = index.shape[0]
        bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, float("-inf"))
        out = q.new_empty(B, q.shape[1], H, v.shape[-1])
        lse = q.new_empty(B, G, H, q.shape[1] // G, dtype=torch.promote_types(q.dtype, torch.float32))
        tile_bytes = B * bias.shape[-1] * H * (k.shape[-1] + v.shape[-1]) * q.element_size()
        ctx.step = max(1, TILE_CHUNK_BYTES // max(tile_bytes, 1))  # the backward pass takes the same chunks
        for groups, *chunk in _TiledAttention._chunks(ctx.step, q, k, v, rows_k, rows_v, index, bias):
            o, chunk_lse = _FUSED_CPU(*chunk[:3], attn_mask=chunk[3])
            out.unflatten(1, (G, -1))[:, groups] = o.unflatten(0, (B, -1)).transpose(2, 3)
            lse[:, groups] = chunk_lse.unflatten(0, (B, -1))
        ctx.save_for_backward(q, k, v, rows_k, rows_v, index, bias, out, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, rows_k, rows_v, index, bias, out, lse = ctx.saved_tensors
        B, L = k.shape[:2]
        G = index.shape[0]
        R = 0 if rows_k is None else rows_k.shape[1]
        grad_q = torch.empty_like(q, memory_format=torch.contiguous_format)
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        grad_rows = [None if rows is None else torch.zeros_like(rows) for rows in (rows_k, rows_v)]

        def heads_first(x, groups):  # (B, G*Q, H, d) -> the chunk's (B*g, H, Q, d), contiguous as the kernel made it
            return x.unflatten(1, (G, -1))[:, groups].flatten(0, 1).transpose(1, 2).contiguous()

        chunks = _TiledAttention._chunks(ctx.step, q, k, v, rows_k, rows_v, index, bias)
        for groups, *chunk in chunks:
            grads = _FUSED_CPU_BACKWARD(heads_first(grad_out, groups), *chunk[:3], heads_first(out, groups),
                                        lse[:, groups].flatten(0, 1).contiguous(), 0.0, False, attn_mask=chunk[3])
            grad_q.unflatten(1, (G, -1))[:, groups] = grads[0].unflatten(0, (B, -1)).transpose(2, 3)
            read = index[groups].clamp(max=max(L - 1, 0)).flatten()  # as ``_gather``: a zero key's gradient is 0
            for grad, tile_grad, rows_grad in zip((grad_k, grad_v), grads[1:], grad_rows):
                tile_grad = tile_grad.unflatten(0, (B, -1)).transpose(2, 3)  # (B, g, R + S, H, d)
                if rows_grad is not None:
                    rows_grad += tile_grad[:, :, :R].sum(1)
                grad.index_add_(1, read, tile_grad[:, :, R:].flatten(1, 2).to(grad.dtype))
        return grad_q, grad_k, grad_v, *grad_rows, None, None


class _LayerNormInPlace(torch.autograd.Function):
    """LayerNorm over the last dim, written over its input (which nothing else may need: a Linear's fresh output), row
    chunk by row chunk (``TILE_CHUNK_BYTES``): no tensor of the input's size is made or freed. It saves its output
    ``y = gamma * x_hat + beta`` and ``1 / sigma``, and the backward pass recovers ``x_hat = (y - beta) / gamma``:
    DualLN's ``LN_L`` output is kept by the window attention and the projection anyway, so the input (one more copy
    of the keys and values) is not. The backward pass runs in row chunks too, so its temporaries stay small. Needs a
    contiguous input and every ``|gamma| >= LN_MIN_GAMMA`` (``layer_norm_in_place`` checks)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        width = x.shape[-1]
        rows = x.view(-1, width)
        rstd = torch.empty(rows.shape[0], 1, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        step = max(1, TILE_CHUNK_BYTES // (width * max(x.element_size(), 4)))
        for start in range(0, rows.shape[0], step):
            part = slice(start, start + step)
            y, _, rstd[part] = torch.native_layer_norm(rows[part], (width,), weight, bias, eps)
            rows[part] = y
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias, rstd)
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        y, weight, bias, rstd = ctx.saved_tensors
        dtype = torch.promote_types(y.dtype, torch.float32)
        width = y.shape[-1]
        y, grad_y, rstd = y.reshape(-1, width), grad_y.reshape(-1, width), rstd.reshape(-1, 1)
        gamma, beta = weight.to(dtype), bias.to(dtype)
        grad_x = torch.empty_like(y)
        grad_weight = torch.zeros(width, dtype=dtype, device=y.device)
        grad_bias = torch.zeros(width, dtype=dtype, device=y.device)
        step = max(1, TILE_CHUNK_BYTES // (width * max(y.element_size(), 4)))
        for rows in range(0, y.shape[0], step):
            part = slice(rows, rows + step)
            x_hat = (y[part].to(dtype) - beta).div_(gamma)
            g = grad_y[part].to(dtype)
            grad_weight += (g * x_hat).sum(0)
            grad_bias += g.sum(0)
            g = g * gamma
            mean_g = g.mean(-1, keepdim=True)
            mean_gx = (g * x_hat).mean(-1, keepdim=True)
            grad_x[part] = g.sub_(mean_g).sub_(x_hat.mul_(mean_gx)).mul_(rstd[part].to(dtype))
        return grad_x.view_as(ctx.saved_tensors[0]), grad_weight.to(weight.dtype), grad_bias.to(bias.dtype), None


LN_MIN_GAMMA = 1e-3


def layer_norm_in_place(x: Tensor, norm: nn.LayerNorm) -> Tensor:
    """``norm(x)`` written over ``x`` (``_LayerNormInPlace``) when ``x`` is contiguous and the gains allow recovering
    ``x_hat`` from the output (all ``|gamma| >= LN_MIN_GAMMA``, gain and bias present); otherwise ``norm(x)``. The
    caller's ``x`` must be needed by nothing else."""
    if (not x.is_contiguous() or norm.weight is None or norm.bias is None
            or bool((norm.weight.abs() < LN_MIN_GAMMA).any())):
        return norm(x)
    return _LayerNormInPlace.apply(x, norm.weight, norm.bias, norm.eps)


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
        global_projections: separate query/key/value projections for the global tokens' own attention (Longformer's
            ``query_global``/``key_global``/``value_global``); off, they use ``query``/``key``/``value``.
        recompute_window_tiles: in training on CPU, save for the backward pass about what fused dense attention
            saves (``_memory_lean``): the window tiles are built one chunk of groups at a time and again in the
            backward pass (``_TiledAttention``), ``LN_L`` is written over its input and keeps its output only
            (``layer_norm_in_place``), and the projection's scores and weights P are built a few heads at a time,
            and again in the backward pass (``_DynamicProjection``): less memory (``bench/RESULTS.md``), as fast on
            one thread, slower with several threads on a busy CPU. Off by default.
        attn_implementation: ``"sdpa"`` (or ``"eager"``, the same code): grouped ``scaled_dot_product_attention``;
            ``"flex_attention"``: FlexAttention with a block mask (``_attend_flex``), forward only on CPU, no attention
            dropout. Either way ``output_attentions`` and cached decoding steps use the SDPA/explicit path, and so do
            the global tokens' own rows and the cls token's output (dense over the n tokens, no window to mask).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        window_size: int,
        projection_rank: int,
        *,
        causal: bool = False,
        segment_length: int | None = None,
        use_dual_ln: bool = True,
        qk_head_dim: int | None = None,
        attention_dropout: float = 0.0,
        bias: bool = True,
        layer_norm_eps: float = 1e-5,
        global_projections: bool = False,
        attn_implementation: str = "sdpa",
        recompute_window_tiles: bool = False,
    ):
        super().__init__()
        check_attn_implementation(attn_implementation)
        self.attn_implementation = attn_implementation
        self.recompute_window_tiles = recompute_window_tiles
        validate_long_short_args(
            hidden_size=hidden_size,
            num_heads=num_heads,
            window_size=window_size,
            projection_rank=projection_rank,
            causal=causal,
            segment_length=segment_length,
            qk_head_dim=qk_head_dim,
            attention_dropout=attention_dropout,
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
        if global_projections:
            if causal:
                raise ValueError("global_projections serve global tokens, which only bidirectional attention has; "
                                 "leave it False with causal=True.")
            self.global_query = nn.Linear(hidden_size, qk_width, bias=bias)
            self.global_key = nn.Linear(hidden_size, qk_width, bias=bias)
            self.global_value = nn.Linear(hidden_size, hidden_size, bias=bias)
        if use_dual_ln:
            self.dual_ln_local = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
            self.dual_ln_global = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
            if qk_width != hidden_size:  # LMSA: narrower keys get their own DualLN pair
                self.dual_ln_local_key = nn.LayerNorm(qk_width, eps=layer_norm_eps)
                self.dual_ln_global_key = nn.LayerNorm(qk_width, eps=layer_norm_eps)

    # ------------------------------------------------------------------ helpers
    def _dual_ln(self, x: Tensor, which: str, is_key: bool, in_place: bool = False) -> Tensor:
        """LN_L (``which="local"``) or LN_G (``"global"``) over the full width of x (..., H * d); ``in_place``:
        written over x, which nothing else needs, saving its output rather than its input for the backward pass
        (``layer_norm_in_place``)."""
        if not self.use_dual_ln:
            return x
        name = f"dual_ln_{which}_key" if is_key and hasattr(self, f"dual_ln_{which}_key") else f"dual_ln_{which}"
        norm = getattr(self, name)
        return layer_norm_in_place(x, norm) if in_place else norm(x)

    def _local_keys_values(self, hidden_states: Tensor, lean: bool) -> tuple[Tensor, Tensor]:
        """``LN_L(x W_K)`` and ``LN_L(x W_V)`` (Eq. 7), (B, n, H, d). ``lean``: each LayerNorm is written over its
        Linear's output, computed on the (B n) rows so that the output is a tensor of its own rather than a view."""
        B, n, _ = hidden_states.shape
        rows = hidden_states.flatten(0, 1) if lean else hidden_states
        return tuple(
            self._split(self._dual_ln(linear(rows), "local", is_key=is_key, in_place=lean).view(B, n, -1))
            for linear, is_key in ((self.key, True), (self.value, False))
        )

    def _memory_lean(self, hidden_states: Tensor, need_weights: bool) -> bool:
        """Whether this call saves memory for the backward pass (``recompute_window_tiles``): the window tiles go
        through ``_TiledAttention`` (built chunk by chunk, again in the backward pass), ``LN_L`` is written over the
        Linears' outputs and keeps its output only (``layer_norm_in_place``) and the projection is
        ``_DynamicProjection``.
        On CPU when gradients are taken, with one head dim for queries and values, without attention maps or active
        attention dropout. Otherwise every tile is gathered at once, in one kernel call (and autograd keeps them)."""
        return (self.recompute_window_tiles and self.attn_implementation != "flex_attention" and _FUSED_CPU is not None
                and hidden_states.device.type == "cpu" and self.qk_head_dim == self.head_dim and not need_weights
                and not (self.training and self.attention_dropout) and takes_grad(hidden_states, self.query.weight))

    def _split(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, -1))

    def _project(self, hidden: Tensor, keys: Tensor, values: Tensor, valid: Tensor, segment: int,
                 lean: bool = False) -> ExtraKeys:
        """Eq. 3 / Eq. 5 (``project_rows`` on the scores ``X W^P``) on each segment of ``segment`` tokens, then
        ``LN_G``: hidden X (B, S*segment, D), keys/values (B, S*segment, H, d), valid (B, S*segment) -> S*r rows,
        segment-major. ``lean``: through ``_DynamicProjection``, which never holds the scores or P of all heads."""
        B, n, H = keys.shape[:3]
        r, S = self.projection_rank, n // segment

        def heads_first(x):  # (B, n, H, c) -> (B, S, H, segment, c)
            return x.view(B, S, segment, H, -1).transpose(2, 3)

        seg_valid = valid.view(B, S, segment)
        if lean:
            rows = _DynamicProjection.apply(hidden.unflatten(1, (S, segment)), self.dynamic_projection.weight,
                                            self.dynamic_projection.bias, heads_first(keys), heads_first(values),
                                            seg_valid)
        else:
            scores = heads_first(self._split(self.dynamic_projection(hidden))).transpose(-1, -2)
            rows = project_rows(scores, heads_first(keys), heads_first(values), seg_valid)
        rows_k, rows_v = (x.permute(0, 1, 3, 2, 4).flatten(1, 2) for x in rows)  # (B, S*r, H, d)
        return ExtraKeys(
            keys=self._split(self._dual_ln(rows_k.flatten(2), "global", is_key=True)),
            values=self._split(self._dual_ln(rows_v.flatten(2), "global", is_key=False)),
            valid=seg_valid.any(-1).repeat_interleave(r, dim=1),
        )

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor, need_weights: bool, layout: tuple | None = None
    ):
        """One softmax per query over all its keys. q (B', H, Q, d), k/v (B', H, K, d), keep (B', 1, Q|1, K).

        With ``need_weights``, ``layout = (to_maps, from_maps)`` turns the probabilities into the caller's maps and
        back (none: the maps are the probabilities): the output is computed from the returned maps themselves, so a
        gradient taken at them (attribution, ``retain_grad``) is the output's."""
        if not need_weights:
            dropout = self.attention_dropout if self.training else 0.0
            return masked_sdpa(q, k.to(q.dtype), v.to(q.dtype), keep, dropout_p=dropout), None
        maps = self._probabilities(q, k, keep)
        maps = layout[0](maps) if layout else maps
        return _weighted(layout[1](maps) if layout else maps, v, q.dtype), maps

    def _probabilities(self, q: Tensor, k: Tensor, keep: Tensor) -> Tensor:
        """The joint softmax (Eq. 6) over the kept keys, in float32 at least, after dropout: (B', H, Q, K)."""
        dtype = torch.promote_types(q.dtype, torch.float32)
        scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) / math.sqrt(q.shape[-1])
        prob = scores.masked_fill(~keep, float("-inf")).softmax(-1)
        return F.dropout(prob, self.attention_dropout if self.training else 0.0, self.training)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        *,
        global_attention_mask: Tensor | None = None,
        cls_hidden: Tensor | None = None,
        state: CausalState | None = None,
        output_attentions: bool = False,
    ):
        """Args:
            hidden_states: (B, n, d); with ``state``, the n new tokens that follow ``state.seen`` earlier ones.
            attention_mask: (B, n) with 1/True for real tokens (a longer mask's last n columns are used).
            global_attention_mask: (B, n) with 1/True for global tokens (bidirectional; Longformer's meaning; a padded
                token is never global). Every other token sees a global token's key/value ``LN_G(x W_K)``,
                ``LN_G(x W_V)`` (the official LRA cls key) beside the projected rows, in its one softmax; the window
                segments are laid out over the other tokens in their order and the projection (Eq. 3) pools them only,
                so a global token is seen once. A global token attends in one softmax to every real token's
                ``LN_L`` key (itself included; with ``global_projections`` its own projections) and the projected
                rows. Work O(n (2w + r + k)) for k global tokens; no n x n tensor.
            cls_hidden: (B, 1, d) global token (bidirectional): it joins the projected keys and attends to the
                other tokens' outputs (official LRA/vision "post-CLS"); the output then has 1 + n rows. Not with
                ``global_attention_mask``.
            state: ``CausalState`` to read and extend (causal decoding).
            output_attentions: also return the joint probabilities, (B, H, n, R + S): for each query its weights
                over the R projected rows (cls first; causal: all finished segments' rows) and then the S window
                keys of its segment in position order (bidirectional S = w + 2e; causal S = 2w, or the whole cached
                window when fewer than w tokens are fed). With global tokens, K the most global tokens of a sample in
                the batch, (B, H, n, K + R + S + K): columns [the global tokens' keys | R projected rows | S window
                keys | the weights that the K global tokens' queries give this token]; a sample with k < K global
                tokens has them, in position order, in the last k of each K block. A global token's row holds its
                weights over the global tokens and the projected rows (window columns 0); its weight on another token
                t sits in row t's last K columns (Longformer's ``global_attentions``, transposed). Every output row,
                a global token's included, is computed from these maps, so gradients reach them (``retain_grad``).

        Returns ``(output, attentions or None)``; rows of padded tokens are the output bias (context 0).
        """
        width = self.query.in_features
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != width:
            raise ValueError(f"hidden_states must be (batch, tokens, {width}), got {tuple(hidden_states.shape)}; add "
                             f"a batch dimension with x[None] for a single sequence.")
        B, n, _ = hidden_states.shape
        if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[0] != B
                                           or attention_mask.shape[1] < n):
            raise ValueError(f"attention_mask must be (batch, tokens) = {(B, n)} (1 for real tokens), got "
                             f"{tuple(attention_mask.shape)}.")
        if self.attn_implementation == "flex_attention" and not output_attentions:
            check_flex_call(hidden_states, self.query.weight, training=self.training,
                            dropout=self.attention_dropout, dropout_name="attention_dropout",
                            dropout_setting="attention_probs_dropout_prob")
        masked = attention_mask is not None
        if not masked:
            valid = torch.ones(B, n, dtype=torch.bool, device=hidden_states.device)
        else:
            valid = attention_mask[:, -n:].to(device=hidden_states.device) > 0
        if self.causal and cls_hidden is not None:
            raise ValueError("cls_hidden is only supported by bidirectional attention (causal=False).")
        if state is not None and not self.causal:
            raise ValueError("state (decoding cache) is only supported by causal attention (causal=True).")
        if cls_hidden is not None and self.qk_head_dim != self.head_dim:
            raise ValueError("cls_hidden needs qk_head_dim == head_dim: the cls query attends to the token outputs.")
        is_global = None
        if global_attention_mask is not None:
            if self.causal:
                raise ValueError(
                    "global_attention_mask needs bidirectional attention: a causal token cannot attend to every "
                    "token. Pass global_attention_mask=None to a causal model."
                )
            if cls_hidden is not None:
                raise ValueError("Pass either cls_hidden (official post-CLS token) or global_attention_mask, not both.")
            if tuple(global_attention_mask.shape) != (B, n):
                raise ValueError(
                    f"global_attention_mask must have shape (batch, tokens) = {(B, n)}, with 1 for global tokens; "
                    f"got {tuple(global_attention_mask.shape)}."
                )
            is_global = (global_attention_mask.to(device=hidden_states.device) > 0) & valid

        lean = self._memory_lean(hidden_states, output_attentions)
        q = self._split(self.query(hidden_states))
        k, v = self._local_keys_values(hidden_states, lean)
        if self.causal:
            state = state if state is not None else CausalState()
            context, attn = self._causal(q, k, v, hidden_states, valid, masked, state, output_attentions, tiled=lean)
        else:
            context, attn = self._bidirectional(
                hidden_states=hidden_states, q=q, k=k, v=v, valid=valid, masked=masked,
                cls_hidden=cls_hidden, is_global=is_global, need_weights=output_attentions, tiled=lean,
            )
        return self.output(context.flatten(2)), attn

    def _global_keys(self, hidden: Tensor, valid: Tensor) -> ExtraKeys:
        """Global tokens (B, k, d) as every token sees them: ``LN_G`` of their raw key/value (official LRA cls)."""
        return ExtraKeys(
            keys=self._split(self._dual_ln(self.key(hidden), "global", is_key=True)),
            values=self._split(self._dual_ln(self.value(hidden), "global", is_key=False)),
            valid=valid,
        )

    def _bidirectional(self, *, hidden_states, q, k, v, valid, masked, cls_hidden, is_global, need_weights, tiled):
        B, n = q.shape[:2]
        K = int(is_global.sum(1).max()) if is_global is not None else 0
        local, projection_inputs = valid, hidden_states
        if K:  # the other tokens first, in their order, then the global ones (the window and projection skip them)
            order = torch.sort(is_global.to(torch.uint8), dim=1, stable=True).indices
            q, k, v, valid, is_global = (_take(x, order) for x in (q, k, v, valid, is_global))
            projection_inputs = _take(hidden_states, order) if self.projection_rank else None
            local = valid & ~is_global
        extra = []  # global tokens' keys first, then the projected rows
        if cls_hidden is not None:
            extra.append(self._global_keys(cls_hidden, valid.new_ones(B, 1)))
        if K:
            extra.append(self._global_keys(_take(hidden_states, order[:, n - K :]), is_global[:, n - K :]))
        projected = self._project(projection_inputs, k, v, local, segment=n, lean=tiled) if self.projection_rank else None
        if projected is not None:
            extra.append(projected)
        if extra:  # one set: global keys, then projected rows
            extra = ExtraKeys(**{name: torch.cat([getattr(part, name) for part in extra], 1)
                                 for name in ("keys", "values", "valid")})
        else:
            extra = None
        layout = None
        if K:
            g_q, g_k, g_v, g_keep = self._global_inputs(
                hidden_states=hidden_states, order=order, q=q, k=k, v=v, valid=valid, count=K, projected=projected
            )
            if need_weights:
                *layout, global_from_maps = self._global_layout(self._probabilities(g_q, g_k, g_keep), is_global, order)
        width = n if self.window_size else 0  # projection only: no window keys
        context, attn = self._attend_groups(
            q=q, q_valid=local if masked or K else None, q_start=0, k=k[:, :width], v=v[:, :width],
            k_valid=local[:, :width], k_start=0, extra=extra, need_weights=need_weights, layout=layout, tiled=tiled,
        )
        if cls_hidden is not None:
            context = torch.cat([self._cls_output(cls_hidden, context, valid), context], dim=1)
        if K:  # the global tokens' rows (the last K slots in ``order``), then the tokens back in position order
            if need_weights:
                out = _weighted(global_from_maps(attn), g_v, g_q.dtype)
            else:
                out, _ = self._attend(g_q, g_k, g_v, g_keep, need_weights=False)
            rows = is_global[:, n - K :, None, None]
            context = torch.cat([context[:, : n - K], torch.where(rows, out.transpose(1, 2), context[:, n - K :])], 1)
            context = _take(context, torch.argsort(order, dim=1))
        return context, attn

    def _global_inputs(self, *, hidden_states, order, q, k, v, valid, count, projected):
        """In the token ``order`` of ``_bidirectional`` the last ``count`` slots hold the global tokens: each attends
        to the projected rows and every real token in one softmax. Returns their queries, those keys and values
        (heads first, projected rows first) and the keep mask, for ``_attend``."""
        n, K = q.shape[1], count
        if hasattr(self, "global_query"):
            hidden_states = _take(hidden_states, order)
            q_g = self._split(self.global_query(hidden_states[:, n - K :]))
            k = self._split(self._dual_ln(self.global_key(hidden_states), "local", is_key=True))
            v = self._split(self._dual_ln(self.global_value(hidden_states), "local", is_key=False))
        else:
            q_g = q[:, n - K :]
        R = projected.keys.shape[1] if projected is not None else 0
        if R:
            k, v, valid = (torch.cat(pair, 1) for pair in ((projected.keys, k), (projected.values, v),
                                                             (projected.valid, valid)))
        keep = valid[:, None, None, :]
        keep = keep | ~keep.any(-1, keepdim=True)  # a sample of padding only: finite, discarded
        return q_g.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), keep

    @staticmethod
    def _global_layout(prob: Tensor, is_global: Tensor, order: Tensor):
        """``(to_maps, from_maps, global_from_maps)`` for ``output_attentions`` with global tokens. ``to_maps`` puts
        the other tokens' probabilities (B, H, n, K + r + S) and the global tokens' ``prob`` (B, H, K, r + n), both
        in ``order``, into the maps that ``forward`` documents, in position order; ``from_maps`` and
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

    def _attend_groups(
        self, *, q, q_valid, q_start, k, v, k_valid, k_start, extra: ExtraKeys | None, need_weights, layout=None,
        tiled=False,
    ):
        """Queries at positions ``[q_start, q_start + m)`` attend to [extra keys; window keys] in one softmax.

        q (B, m, H, d_qk), q_valid (B, m) or None when all are valid; k/v (B, L, H, d) window keys of positions
        ``[k_start, k_start + L)`` and k_valid (B, L); ``extra``: the R global/projected keys, or None. Queries are
        grouped by window segment, each group seeing its window tile (the fast path), except for fewer than ``w``
        causal queries (a decoding step): they see all keys, masked. Returns the context (B, m, H, d_v), zero for
        invalid queries, and the probabilities (B, H, m, R + S) if asked, or the caller's maps made from them by
        ``layout`` (as in ``_attend``).
        """
        B, m, H, _ = q.shape
        w, L = self.window_size, k.shape[1]
        # FlexAttention, except for weights (explicit softmax below) and decoding steps: fewer than w causal queries
        # see one cached window, a single small tile, where building a block mask costs more than it saves.
        if self.attn_implementation == "flex_attention" and not need_weights and (m >= w or not self.causal):
            return self._attend_flex(q=q, q_valid=q_valid, q_start=q_start, k=k, v=v, k_valid=k_valid,
                                     k_start=k_start, extra=extra), None
        R = extra.keys.shape[1] if extra is not None else 0
        device = q.device
        if w and (m >= w or not self.causal):
            first = q_start // w
            groups = -(-(q_start + m) // w) - first
            skip = q_start - first * w
            before, after = (w, 0) if self.causal else ((window_extent(w),) * 2)
            k_pos, index = _window_index(first, groups, w, before, after, k_start, L)
            q_pos = (torch.arange(first * w, (first + groups) * w)).view(groups, w)
        else:
            groups, skip = 1, 0
            k_pos = torch.arange(k_start, k_start + L)[None]
            index = torch.arange(L)[None]
            q_pos = torch.arange(q_start, q_start + m)[None]
        Q = q_pos.shape[1]
        k_pos, index, q_pos = k_pos.to(device), index.to(device), q_pos.to(device)

        rows = (extra.keys, extra.values, extra.valid) if R else (None, None, None)
        keep = _gather(rows[2], k_valid, index).view(B, groups, 1, -1)  # the keys that exist, extra keys first
        S = keep.shape[-1]
        if L:  # window rule (per query when causal; the tile already bounds a bidirectional window)
            rule = window_keep(q_pos if self.causal or groups == 1 else q_pos[:, :1], k_pos, w, self.causal)
            keep = keep & torch.cat([rule.new_ones(rule.shape[:-1] + (R,)), rule], -1)
        if R and extra.segment is not None:  # causal rows: only finished segments before the query's own (Eq. 5)
            seen = segment_keep(q_pos, extra.segment, self.segment_length)
            keep = keep & torch.cat([seen, seen.new_ones(seen.shape[:-1] + (S - R,))], -1)
        # A row with no visible key (a padded or out-of-range query) keeps all keys: no NaN; it is zeroed below.
        keep = keep | ~keep.any(-1, keepdim=True)

        def to_maps(prob):  # (B * G, H, Q, S) -> (B, H, m, S)
            maps = prob.view(B, groups, H, Q, S).transpose(1, 2).flatten(2, 3)[:, :, skip : skip + m]
            return layout[0](maps) if layout else maps

        def from_maps(maps):  # (B, H, m, S) -> (B * G, H, Q, S), zero rows for the padding queries
            maps = layout[1](maps) if layout else maps
            tiles = _pad_seq(maps.transpose(1, 2), skip, groups * Q - skip - m).view(B, groups, Q, H, S)
            return tiles.transpose(2, 3).flatten(0, 1)

        q = _pad_seq(q, skip, groups * Q - skip - m)
        if tiled:
            context, prob = _TiledAttention.apply(q, k, v, rows[0], rows[1], index, keep)[:, skip : skip + m], None
        else:  # every group's keys and values gathered in one copy, (B, G, R + S, H, d), which autograd keeps
            keys, values = (_gather(part, x, index) for part, x in zip(rows, (k, v)))
            out, prob = self._attend(
                q.view(B * groups, Q, H, -1).transpose(1, 2),
                keys.view(B * groups, S, H, -1).transpose(1, 2),
                values.view(B * groups, S, H, -1).transpose(1, 2),
                keep.view(B * groups, 1, keep.shape[2], S),
                need_weights,
                layout=(to_maps, from_maps),
            )
            context = out.transpose(1, 2).reshape(B, groups * Q, H, -1)[:, skip : skip + m]
        if q_valid is not None:
            context = context * q_valid[:, :, None, None].to(context.dtype)
        return context, prob

    def _attend_flex(self, *, q, q_valid, q_start, k, v, k_valid, k_start, extra: ExtraKeys | None):
        """``_attend_groups`` (same arguments, no weights) on FlexAttention: the keys are [extra keys; window keys]
        and the block mask is ``window_keep`` / ``segment_keep`` on their positions and validity, so nothing is
        gathered. Under ``torch.compile`` this is a fused kernel that skips the blocks no query sees."""
        B, m = q.shape[:2]
        w, L, causal = self.window_size, k.shape[1], self.causal
        R = extra.keys.shape[1] if extra is not None else 0
        keys, values, key_valid = (
            torch.cat([getattr(extra, name), x], 1) if R else x
            for name, x in (("keys", k), ("values", v), ("valid", k_valid))
        )
        # Causal rows come segment-major, r per segment (``_causal``): row j's segment is j // r, computed rather than
        # read from ``extra.segment``, as compiled FlexAttention on CPU cannot read a captured integer tensor (2.14).
        by_segment = R and extra.segment is not None

        def keep(b, h, q_idx, kv_idx):
            t = q_idx + q_start
            seen = key_valid[b, kv_idx]
            if L:  # window keys: position k_start + (kv_idx - R)
                seen = seen & ((kv_idx < R) | _window_rule(t, kv_idx - R + k_start, w, causal))
            if by_segment:  # causal rows: finished segments before the query's own (Eq. 5)
                row_segment = kv_idx // self.projection_rank
                seen = seen & ((kv_idx >= R) | _segment_rule(t, row_segment, self.segment_length))
            return seen

        mask = create_block_mask(keep, B, None, m, R + L, device=q.device)
        # Heads-first copies: compiled on CPU (torch 2.14), FlexAttention refuses a query that is a view of a matmul.
        q, keys, values = (x.to(q.dtype).transpose(1, 2).contiguous() for x in (q, keys, values))
        out = flex_attention(q, keys, values, block_mask=mask)
        context = out.transpose(1, 2)
        if q_valid is not None:  # a query with no visible key gets 0 from FlexAttention; padded queries are zeroed
            context = context * q_valid[:, :, None, None].to(context.dtype)
        return context

    def _cls_output(self, cls_hidden, context, valid):
        """The cls token attends to its own raw key/value and to the other tokens' contexts (official post-CLS)."""
        q = self._split(self.query(cls_hidden)).transpose(1, 2)  # (B, H, 1, d)
        keys = torch.cat([self._split(self.key(cls_hidden)), context], 1).transpose(1, 2)
        values = torch.cat([self._split(self.value(cls_hidden)), context], 1).transpose(1, 2)
        keep = torch.cat([valid.new_ones(valid.shape[0], 1), valid], 1)[:, None, None, :]
        out = masked_sdpa(q, keys.to(q.dtype), values.to(q.dtype), keep)
        return out.transpose(1, 2)

    def _causal(self, q, k, v, hidden, valid, masked, state: CausalState, need_weights, tiled):
        """Causal attention of n new tokens at positions ``[p0, p0 + n)`` given what ``state`` holds; extends it."""
        n = q.shape[1]
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
            all_hidden = torch.cat([state.pending, hidden], 1) if state.pending is not None else hidden
            seg_start, done = (p0 // l) * l, (end // l) * l
            if done > seg_start:
                span = slice(seg_start - k_start, done - k_start)
                new_k, new_v, new_valid, _ = self._project(
                    all_hidden[:, : done - seg_start], k_all[:, span], v_all[:, span], valid_all[:, span], l,
                    lean=tiled,
                )
                if rows_k is not None:
                    new_k, new_v, new_valid = (
                        torch.cat(pair, 1) for pair in ((rows_k, new_k), (rows_v, new_v), (rows_valid, new_valid))
                    )
                rows_k, rows_v, rows_valid = new_k, new_v, new_valid
            pending = all_hidden[:, done - seg_start :]
        extra = None
        if rows_k is not None:
            extra = ExtraKeys(rows_k, rows_v, rows_valid, segment=torch.arange(rows_k.shape[1], device=q.device) // r)
        context, attn = self._attend_groups(
            q=q, q_valid=valid if masked else None, q_start=p0, k=k_all, v=v_all, k_valid=valid_all, k_start=k_start,
            extra=extra, need_weights=need_weights, tiled=tiled,
        )

        # Keep the keys of the current and the previous window segment, and the unfinished segment's inputs.
        keep_from = max(0, (end // w - 1) * w)
        state.keys, state.values, state.valid = (t[:, keep_from - k_start :] for t in (k_all, v_all, valid_all))
        state.rows_k, state.rows_v, state.rows_valid, state.pending = rows_k, rows_v, rows_valid, pending
        state.seen = end
        return context, attn
