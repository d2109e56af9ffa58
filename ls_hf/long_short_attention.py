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

Visibility is defined once, as functions of token positions (``long_short_rules``); the rest is layout. ``forward``
picks once how the joint softmax runs (``LongShortSelfAttention._backend``), and ``BACKENDS`` maps that choice to a
method that takes the queries and their two key sets (``JointInputs``):

* ``"sdpa"`` (the default on the CPU, and ``attn_implementation="eager"`` everywhere): queries grouped by window
  segment, each group handed with its window keys and the projected rows to ``F.scaled_dot_product_attention`` with a
  small boolean mask: fused kernels on CPU and CUDA, softmax accumulated in float32 by those kernels. Bidirectional
  work and memory are O(n (2w + r)). The portable path and the reference of the others.
* ``"lean"`` (``recompute_window_tiles=True``, training on CPU): the same groups through the kernels of
  ``long_short_kernels``, which keep for the backward pass about what fused dense attention keeps.
* ``"flex"`` (the default on CUDA, and ``attn_implementation="flex_attention"``): one FlexAttention call over the
  keys [tokens; extra keys], with the visibility as a block-sparse mask built from the window geometry
  (``long_short_blocks``), gathering nothing; compiled once per process on CUDA, where the rest of the layer is
  compiled around it (``compiled_attention_layer``).
* ``"maps"`` (``output_attentions=True``): the explicit softmax, whose probabilities are returned and used.

Causally a query at position t also sees ``r * (t // l)`` projected rows, so the cost is O(n (2w + r n / l)),
quadratic with the small factor r / l (the official causal models use r=1, l=16). A causal call with a
``CausalState`` is a prefill or a decoding step: fewer than ``w`` new queries see the cached window as one tile.
This file imports nothing from Transformers or timm.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import long_short_blocks
from .long_short_blocks import FUSED_DTYPES, KeyLayout, compile_in_package, extra_key_copies, long_short_flex_attend
from .long_short_kernels import (
    FUSED_CPU,
    DynamicProjection,
    ExtraKeysAttention,
    JoinedProjectedKeys,
    TiledAttention,
    gather_tiles,
    in_copies,
    layer_norm_in_place,
    recoverable_layer_norms,
    segments_heads_first,
)
from .long_short_rules import (
    KeptForSameInputs,
    check_attn_implementation,
    check_flex_call,
    masked_sdpa,
    project_rows,
    projection_scores,
    projection_weights,
    segment_keep,
    takes_grad,
    validate_long_short_args,
    window_extent,
    window_keep,
)

__all__ = [
    "BACKENDS",
    "COMPILED_LAYER_DEVICES",
    "FUSED_DEVICES",
    "BatchFirstState",
    "CausalState",
    "ExtraKeys",
    "JointInputs",
    "LongShortSelfAttention",
    "compiled_attention_layer",
    "compiles_layer",
    "fused_by_default",
]

# Where attn_implementation="sdpa" (the default) runs the fused FlexAttention path: one block-sparse kernel per layer
# and direction, compiled once per process. Elsewhere the grouped SDPA path is faster (the CPU: bench/RESULTS.md).
FUSED_DEVICES = ("cuda",)
# Where the fused path compiles the rest of the layer around its attention kernel (``compiled_attention_layer``: the
# projections, DualLN, Eq. 3, the output projection), unless the module is built with ``compile_attention=False``.
COMPILED_LAYER_DEVICES = ("cuda",)
# The share of the compiled layer's activation memory (against what it keeps by default) that it keeps with
# ``recompute_window_tiles=True``: torch's min-cut partitioner then recomputes P in the backward pass, and the
# Linears' outputs where ``LN_L`` is not applied with the joined keys (``_joins_local_norm``; bench/RESULTS.md).
RECOMPUTE_MEMORY_BUDGET = 0.3
# The count of global tokens for the last pair of masks (``most_global_tokens``).
_GLOBAL_COUNT = KeptForSameInputs()


def fused_by_default(x: Tensor, *, dropout: bool) -> bool:
    """Whether ``attn_implementation="sdpa"`` runs the fused path for the input ``x``: on ``FUSED_DEVICES``, in
    ``FUSED_DTYPES`` (float64 stays on SDPA), and with no attention dropout active (FlexAttention has none)."""
    return x.device.type in FUSED_DEVICES and x.dtype in FUSED_DTYPES and not dropout


@torch.compiler.disable
def most_global_tokens(is_global: Tensor, global_attention_mask: Tensor, attention_mask: Tensor | None) -> int:
    """The most global tokens of a sample: ``is_global`` (B, n) bool, as the layer makes it from the two masks,
    counted once while the same masks come again unchanged. A model passes the same two to every layer: one read of
    the device a forward pass, where a read per layer would stall the host at every layer. Run outside any
    compilation, as the count is a read anyway: the kept counts are this function's state, not a traced graph's."""
    return _GLOBAL_COUNT.get((global_attention_mask, attention_mask), lambda: int(is_global.sum(1).max()))


def compiles_layer(x: Tensor, *, compile_attention: bool) -> bool:
    """Whether a fused-path call on the input ``x`` runs its layer compiled around the attention kernel: with the
    module's ``compile_attention``, on ``COMPILED_LAYER_DEVICES`` in ``FUSED_DTYPES``, and not inside a compilation
    of the caller's (which takes the layer into its own graph)."""
    return (
        compile_attention
        and x.device.type in COMPILED_LAYER_DEVICES
        and x.dtype in FUSED_DTYPES
        and not torch.compiler.is_compiling()
    )


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
    ``l`` tokens (after ``LN_G``), r per segment in segment order. ``pending``: the inputs X of the unfinished segment
    (its scores ``X W^P`` are computed when it is complete). A decoding step therefore costs O(w + r * seen / l).
    ``offsets``: each row's first real token (a row of padding only so far: ``seen``), from which its window and
    projection segments are counted; None while every row starts at position 0.
    """

    seen: int = 0
    keys: Tensor | None = None  # (B, L, H, d_qk)
    values: Tensor | None = None  # (B, L, H, d_v)
    valid: Tensor | None = None  # (B, L) bool
    rows_k: Tensor | None = None  # (B, N, H, d_qk)
    rows_v: Tensor | None = None  # (B, N, H, d_v)
    rows_valid: Tensor | None = None  # (B, N) bool
    pending: Tensor | None = None  # (B, p, D)
    offsets: Tensor | None = None  # (B,) long
    _tensors: tuple = field(
        default=("keys", "values", "valid", "rows_k", "rows_v", "rows_valid", "pending", "offsets"), repr=False
    )


class ExtraKeys(NamedTuple):
    """Keys a query sees besides its window: the global tokens' and the projected rows (Eq. 3 / Eq. 5), after LN_G."""

    keys: Tensor  # (B, R, H, d_qk)
    values: Tensor  # (B, R, H, d_v)
    valid: Tensor  # (B, R) bool
    segment: Tensor | None = (
        None  # (R,) causal: each row's projection segment (Eq. 5); None: every query sees every row
    )
    # the fused path's [window keys; keys] and [window values; values], one tensor each (``JoinedProjectedKeys``),
    # of which keys and values are views; None: the backend joins them
    joined: tuple[Tensor, Tensor] | None = None


def _take(x: Tensor, index: Tensor) -> Tensor:
    """The entries ``index`` (B, m) along dim 1 of a (B, L, ...) tensor: (B, m, ...). A gather, which, unlike
    ``take_along_dim``, does not make ``torch.compile`` specialize on L (a recompilation per length)."""
    index = index.view(index.shape + (1,) * (x.dim() - 2))
    return x.gather(1, index.expand(x.shape[0], index.shape[1], *x.shape[2:]))


def _pad_seq(x: Tensor, left: int, right: int) -> Tensor:
    """Zero-pad (or crop, for negative amounts) dim 1 of a (B, L, ...) tensor."""
    if left == 0 and right == 0:
        return x
    return F.pad(x, [0, 0] * (x.dim() - 2) + [left, right])


def _concatenated(parts: list[ExtraKeys]) -> ExtraKeys | None:
    """The extra keys of ``parts`` as one set, in order; None without parts."""
    if len(parts) < 2:
        return parts[0] if parts else None
    return ExtraKeys(
        **{name: torch.cat([getattr(part, name) for part in parts], 1) for name in ("keys", "values", "valid")}
    )


def _window_index(first_group: int, groups: int, window: int, before: int, after: int, k_start: int, length: int):
    """Key positions of the windows ``[g w - before, g w + w + after)`` of groups ``first_group ..`` (G, S), and their
    indices into keys held for positions ``[k_start, k_start + length)``; a position outside points at index
    ``length`` (the caller's zero row, masked)."""
    offsets = torch.arange(-before, window + after)
    pos = (torch.arange(first_group, first_group + groups) * window)[:, None] + offsets
    inside = (pos >= k_start) & (pos < k_start + length)
    return pos, torch.where(inside, pos - k_start, length)


def _shift_rows(x: Tensor, shift: Tensor, width: int) -> Tensor:
    """A (B, L, ...) tensor laid into ``width`` slots along dim 1, row b moved right by ``shift[b]``; the other slots
    zero (False)."""
    B, L = x.shape[:2]
    source = torch.arange(width, device=x.device)[None] - shift[:, None]
    source = torch.where((source >= 0) & (source < L), source, L)
    return _take(torch.cat([x, x.new_zeros(B, 1, *x.shape[2:])], 1), source)


def _weighted(maps: Tensor, v: Tensor, dtype: torch.dtype) -> Tensor:
    """The probabilities ``maps`` (B', H, Q, K) applied to the values v (B', H, K, d), in ``dtype``."""
    return (maps.to(v.dtype) @ v.to(dtype)).to(dtype)


class JointInputs(NamedTuple):
    """What every backend takes: queries at positions ``[q_start, q_start + m)`` and the two key sets of their one
    softmax (Eq. 6), the window keys of positions ``[k_start, k_start + L)`` and the ``extra`` keys (global tokens'
    and projected rows). ``offsets``: the rules see position ``p - offsets[b]`` in row b (a left-padded causal row
    counts from its first real token); None: ``p``. ``all_valid``: every key exists (no padding, no missing global
    token), known without reading the masks. ``mask_source``: the masks and flags that the keys' validity follows
    from (``long_short_flex_attend``'s ``key_valid_source``)."""

    q: Tensor  # (B, m, H, d_qk)
    q_start: int
    k: Tensor  # (B, L, H, d_qk)
    v: Tensor  # (B, L, H, d_v)
    k_valid: Tensor  # (B, L) bool
    k_start: int
    extra: ExtraKeys | None
    offsets: Tensor | None = None  # (B,) long
    all_valid: bool = False
    # what the keys' validity is a function of besides the layout (``forward``'s ``mask_source``), or None
    mask_source: tuple | None = None


class Tiles(NamedTuple):
    """The grouped layout of ``JointInputs``: G groups of Q queries (the first ``skip`` slots padding), each seeing its
    tile [R extra keys; S - R window keys at ``index`` into the window keys, L standing for a zero key]."""

    groups: int
    size: int  # Q
    skip: int
    index: Tensor  # (G, S - R)
    keep: Tensor  # (B, G, Q|1, S) bool, extra keys first


MapsLayout = tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]


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
        recompute_window_tiles: in training, save for the backward pass about what fused dense attention saves. On
            CPU (the ``"lean"`` backend, ``long_short_kernels``): the window tiles are built one chunk of groups at
            a time and again in the backward pass, ``LN_L`` is written over its input and keeps its output only, and
            the projection's scores and weights P are built a few heads at a time, and again in the backward pass:
            less memory (``bench/RESULTS.md``), as fast on one thread, slower with several threads on a busy CPU. Where
            the fused path compiles the layer (CUDA), its backward pass computes P again instead (and the keys' and
            values' Linear outputs where they are kept: ``_joins_local_norm``) (``compiled_attention_layer(recompute=
            True)``). Off by default.
        attn_implementation: ``"sdpa"`` (Transformers' default): the fastest exact path where the tensors are,
            FlexAttention with a block-sparse mask on CUDA (``FUSED_DEVICES``; the grouped SDPA path while attention
            dropout is active), grouped ``scaled_dot_product_attention`` elsewhere; ``"eager"``: grouped
            ``scaled_dot_product_attention`` everywhere (the portable reference); ``"flex_attention"``: FlexAttention
            everywhere, forward only on CPU, no attention dropout. Any way, ``output_attentions`` and cached decoding
            steps use the SDPA/explicit path, and so do the global tokens' own rows and the cls token's output (dense
            over the n tokens, no window to mask). ``forward`` takes it too, for a model whose choice changes after it
            is built.
        compile_attention: where the fused path runs on ``COMPILED_LAYER_DEVICES`` (CUDA), compile the rest of the
            layer around its attention kernel (``compiled_attention_layer``: the projections, DualLN, Eq. 3, the output
            projection), shared by every layer of the same settings in the process: fewer kernel launches, and what
            the backward pass needs recomputed rather than kept where that is cheaper. Not for calls with a decoding
            cache, nor inside a ``torch.compile`` of the caller's. False: only the attention kernel is compiled.
        long_range_in_kernel: on the fused path, bidirectional queries attend to the extra keys (projected rows, cls
            and global keys) inside the FlexAttention kernel, beside their window (the default). False: apart, in a
            dense softmax over those R keys merged with the kernel's window softmax by their log-sum-exps
            (``_merged_with_extra_keys``), the same one softmax (Eq. 6). Every query sees the extra keys, so inside
            the kernel their key block is visited by every query block, one after the other, in FlexAttention's
            backward pass (its gradients of keys and values are computed per key block); apart, the kernel's work is
            the window's alone, evenly spread.
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
        compile_attention: bool = True,
        long_range_in_kernel: bool = True,
    ):
        super().__init__()
        check_attn_implementation(attn_implementation)
        self.attn_implementation = attn_implementation
        self.recompute_window_tiles = recompute_window_tiles
        self.compile_attention = compile_attention
        self.long_range_in_kernel = long_range_in_kernel
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
        if global_projections and causal:
            raise ValueError(
                "global_projections serve global tokens, which only bidirectional attention has; "
                "leave it False with causal=True."
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
        self.global_query = self.global_key = self.global_value = None
        if global_projections:
            self.global_query = nn.Linear(hidden_size, qk_width, bias=bias)
            self.global_key = nn.Linear(hidden_size, qk_width, bias=bias)
            self.global_value = nn.Linear(hidden_size, hidden_size, bias=bias)
        # DualLN (Eq. 7): LN_L (local) and LN_G (global) over the full width; LMSA's narrower keys get their own pair.
        self.dual_ln_local = self.dual_ln_global = self.dual_ln_local_key = self.dual_ln_global_key = None
        if use_dual_ln:
            self.dual_ln_local = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
            self.dual_ln_global = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
            if qk_width != hidden_size:
                self.dual_ln_local_key = nn.LayerNorm(qk_width, eps=layer_norm_eps)
                self.dual_ln_global_key = nn.LayerNorm(qk_width, eps=layer_norm_eps)

    # ------------------------------------------------------------------ dispatch
    def _backend(self, hidden_states: Tensor, output_attentions: bool, attn_implementation: str) -> str:
        """The one place that picks how the joint softmax runs: a key of ``BACKENDS``, from the call and from where
        its tensors are (a model built on the CPU and moved to the GPU gets the GPU's choice).

        ``"maps"`` when attention maps are asked for. ``"flex"`` for ``attn_implementation="flex_attention"``, and for
        ``"sdpa"`` (Transformers' default) where ``fused_by_default`` says (CUDA, not float64, no active attention
        dropout); not for a causal call of fewer than ``w`` tokens (a decoding step: its queries see one cached
        window, a single small tile, where building a block mask costs more than it saves). ``"lean"`` with
        ``recompute_window_tiles`` when it saves memory (training on CPU: gradients taken, one head dim for queries and
        values, no active attention dropout). Else ``"sdpa"``; ``"eager"`` always takes it, the portable reference."""
        if output_attentions:
            return "maps"
        decoding_step = self.causal and hidden_states.shape[1] < self.window_size
        dropout = self.training and self.attention_dropout > 0
        fused_default = attn_implementation == "sdpa" and fused_by_default(hidden_states, dropout=dropout)
        if (attn_implementation == "flex_attention" or fused_default) and not decoding_step:
            return "flex"
        lean = (
            self.recompute_window_tiles
            and FUSED_CPU is not None
            and hidden_states.device.type == "cpu"
            and self.qk_head_dim == self.head_dim
            and not dropout
            and takes_grad(hidden_states, self.query.weight)
        )
        return "lean" if lean else "sdpa"

    # ------------------------------------------------------------------ helpers
    def _dual_ln_norm(self, *, local: bool, is_key: bool) -> nn.LayerNorm | None:
        """LN_L (``local``) or LN_G of the keys (``is_key``, their own under LMSA) or values; None without DualLN."""
        if not self.use_dual_ln:
            return None
        norm, key_norm = (
            (self.dual_ln_local, self.dual_ln_local_key) if local else (self.dual_ln_global, self.dual_ln_global_key)
        )
        return key_norm if is_key and key_norm is not None else norm

    def _dual_ln(self, x: Tensor, *, local: bool, is_key: bool, lean: bool = False) -> Tensor:
        """LN_L (``local``) or LN_G over the full width of x (..., H * d), the keys' own pair under LMSA; ``lean``:
        written over x, which nothing else needs, saving its output rather than its input for the backward pass
        (``layer_norm_in_place``)."""
        norm = self._dual_ln_norm(local=local, is_key=is_key)
        if norm is None:
            return x
        return layer_norm_in_place(x, norm) if lean else norm(x)

    def _local_keys_values(self, hidden_states: Tensor, lean: bool, normalize: bool = True) -> tuple[Tensor, Tensor]:
        """``LN_L(x W_K)`` and ``LN_L(x W_V)`` (Eq. 7), (B, n, H, d). ``lean``: each LayerNorm is written over its
        Linear's output, computed on the (B n) rows so that the output is a tensor of its own rather than a view.
        ``normalize=False``: ``x W_K`` and ``x W_V``, whose ``LN_L`` comes later (``_joins_local_norm``)."""
        B, n, _ = hidden_states.shape
        rows = hidden_states.flatten(0, 1) if lean else hidden_states
        keys_values = []
        for linear, is_key in ((self.key, True), (self.value, False)):
            x = linear(rows)
            if normalize:
                x = self._dual_ln(x, local=True, is_key=is_key, lean=lean)
            keys_values.append(self._split(x.view(B, n, -1)))
        return tuple(keys_values)

    def _normalized_local(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``LN_L`` of the Linears' outputs k, v (B, n, H, d) that ``_local_keys_values(normalize=False)`` gave."""
        return tuple(
            self._split(self._dual_ln(x.flatten(2), local=True, is_key=is_key)) for x, is_key in ((k, True), (v, False))
        )

    def _extra_key_copies(self, num_queries: int) -> int:
        """How many copies of the extra keys the fused path's kernel takes for ``num_queries`` queries: one per band
        of ``EXTRA_KEY_BAND`` queries bidirectionally with the extra keys in the kernel (``extra_key_copies``: a
        backward pass as parallel for them as for the window keys), else 1."""
        if self.causal or not self.long_range_in_kernel:
            return 1
        return extra_key_copies(num_queries, long_short_blocks.EXTRA_KEY_BAND)

    def _joins_keys(self, backend: str, *, cached: bool) -> bool:
        """Whether the fused path builds the window keys and the projected rows in one tensor each (``_joined_extra``):
        bidirectionally (with the extra keys in the kernel or apart); causally without a cache, where besides a segment
        must be finished and no row may start with padding (``_causal`` knows)."""
        return backend == "flex" and bool(self.window_size and self.projection_rank) and not (self.causal and cached)

    def _joins_local_norm(self, backend: str, *, cached: bool) -> bool:
        """Whether the joined keys take ``LN_L`` too (``JoinedProjectedKeys`` given its gains), so that the key and
        value Linears' outputs are not kept for ``LN_L``'s backward pass: with DualLN, where the keys are joined
        (``_joins_keys``), with autograd recording, outside a compilation of the caller's, and where ``LN_L``'s input
        can be recovered from its output (``recoverable_layer_norms``: the gains read again only after they changed,
        one read for every layer's)."""
        return (
            self.dual_ln_local is not None
            and self._joins_keys(backend, cached=cached)
            and torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and recoverable_layer_norms(
                self._dual_ln_norm(local=True, is_key=True), self._dual_ln_norm(local=True, is_key=False)
            )
        )

    def _split(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, -1))

    def _project(
        self, hidden: Tensor, keys: Tensor, values: Tensor, valid: Tensor | None, segment: int, lean: bool = False
    ) -> ExtraKeys:
        """Eq. 3 / Eq. 5 (``project_rows`` on the scores ``X W^P``) on each segment of ``segment`` tokens, then
        ``LN_G``: hidden X (B, S*segment, D), keys/values (B, S*segment, H, d), valid (B, S*segment), or None when
        every token is valid -> S*r rows, segment-major. ``lean``: through ``DynamicProjection``, which never holds
        the scores or P of all heads."""
        B, n = keys.shape[:2]
        S = n // segment
        seg_valid = None if valid is None else valid.view(B, S, segment)
        keys_first, values_first = segments_heads_first(keys, S), segments_heads_first(values, S)
        if lean:
            rows = DynamicProjection.apply(
                hidden.unflatten(1, (S, segment)),
                self.dynamic_projection.weight,
                self.dynamic_projection.bias,
                keys_first,
                values_first,
                seg_valid,
            )
        else:
            rows = project_rows(self._projection_scores(hidden, S), keys_first, values_first, seg_valid)
        rows_k, rows_v = (x.permute(0, 1, 3, 2, 4).flatten(1, 2) for x in rows)  # (B, S*r, H, d)
        return ExtraKeys(
            keys=self._split(self._dual_ln(rows_k.flatten(2), local=False, is_key=True)),
            values=self._split(self._dual_ln(rows_v.flatten(2), local=False, is_key=False)),
            valid=self._rows_valid(seg_valid, B, S, keys.device),
        )

    def _projection_scores(self, hidden: Tensor, segments: int) -> Tensor:
        """The scores ``X W^P`` of Eq. 3 of hidden X (B, S*l, D) in S segments: (B, S, H, r, l), each segment's l
        scores contiguous (``projection_scores``)."""
        scores = projection_scores(self.dynamic_projection, hidden)  # (B, H r, S l)
        return scores.unflatten(1, (self.num_heads, -1)).unflatten(-1, (segments, -1)).permute(0, 3, 1, 2, 4)

    def _rows_valid(self, seg_valid: Tensor | None, batch: int, segments: int, device: torch.device) -> Tensor:
        """(B, S*r): a projected row exists where its segment (valid (B, S, l), or None: all valid) has a valid
        token."""
        if seg_valid is None:
            return torch.ones(batch, segments * self.projection_rank, dtype=torch.bool, device=device)
        return seg_valid.any(-1).repeat_interleave(self.projection_rank, dim=1)

    def _joined_extra(
        self,
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
        hidden X (B, m, D), the first m of the n tokens, valid (B, m) or None as ``_project``'s, then ``LN_G``;
        ``segment``: causal, Eq. 5 over each of its m / l segments of l tokens (the caller marks each row's
        segment). ``local_norm``: keys and values are the Linears' outputs, and ``LN_L`` is applied there (the
        normalized window keys are the joined tensors' first n rows). ``copies``: the joined tensors hold that many
        copies of [prefix; rows] (``extra_key_copies``); the returned keys and values are the first."""
        B, n = keys.shape[:2]
        S = 1 if segment is None else hidden.shape[1] // segment
        seg_valid = None if valid is None else valid.view(B, S, -1)
        weights = projection_weights(self._projection_scores(hidden, S), seg_valid)
        joined = []
        for name, window, is_key in (("keys", keys, True), ("values", values, False)):
            local, norm = (self._dual_ln_norm(local=is_local, is_key=is_key) for is_local in (True, False))
            local_args = (local.weight, local.bias) if local_norm else (None, None)
            norm_args = (None, None, 0.0) if norm is None else (norm.weight, norm.bias, norm.eps)
            before = None if prefix is None else getattr(prefix, name)
            joined.append(JoinedProjectedKeys.apply(window, before, weights, *local_args, *norm_args, copies))
        rows_valid = self._rows_valid(seg_valid, B, S, keys.device)
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

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor) -> Tensor:
        """One fused softmax per query over the kept keys, with attention dropout in training. q (B', H, Q, d),
        k/v (B', H, K, d), keep (B', 1, Q|1, K)."""
        dropout = self.attention_dropout if self.training else 0.0
        return masked_sdpa(q, k.to(q.dtype), v.to(q.dtype), keep, dropout_p=dropout)

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
        attn_implementation: str | None = None,
    ) -> tuple[Tensor, Tensor | None]:
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
            attn_implementation: this call's implementation (Transformers models pass their config's, which
                ``set_attn_implementation`` changes); None: the one the module was built with.

        Returns ``(output, attentions or None)``; rows of padded tokens are the output bias (context 0).
        """
        if attn_implementation is None:
            attn_implementation = self.attn_implementation
        else:
            check_attn_implementation(attn_implementation)
        valid, is_global = self._check_inputs(
            hidden_states,
            attention_mask,
            global_attention_mask=global_attention_mask,
            cls_hidden=cls_hidden,
            state=state,
            flex=attn_implementation == "flex_attention" and not output_attentions,
        )
        backend = self._backend(hidden_states, output_attentions, attn_implementation)
        compiled = (
            backend == "flex"
            and state is None
            and compiles_layer(hidden_states, compile_attention=self.compile_attention)
        )
        attend = (
            compiled_attention_layer(recompute=self.recompute_window_tiles)
            if compiled
            else LongShortSelfAttention._attend
        )
        global_count = 0 if is_global is None else most_global_tokens(is_global, global_attention_mask, attention_mask)
        return attend(
            self,
            hidden_states,
            valid=valid,
            is_global=is_global,
            global_count=global_count,
            cls_hidden=cls_hidden,
            state=state,
            backend=backend,
            local_norm_joined=self._joins_local_norm(backend, cached=state is not None),
            # a model's layers get the same masks: the fused path builds their padded block mask once for all
            mask_source=None if state is not None else (attention_mask, global_attention_mask, cls_hidden is not None),
        )

    def _attend(
        self,
        hidden_states,
        *,
        valid,
        is_global,
        global_count,
        cls_hidden,
        state,
        backend,
        local_norm_joined=False,
        mask_source=None,
    ) -> tuple[Tensor, Tensor | None]:
        """The layer after ``forward``'s checks and choice of backend: the projections, the attention and the output
        projection (as ``compiled_attention_layer`` runs it). ``global_count``: the most global tokens of a sample
        (counted before, so that the compiled layer's shapes follow from its arguments). ``local_norm_joined``:
        ``LN_L`` is applied where the keys are joined (``_joins_local_norm``, decided before, as it reads the
        gains). ``mask_source``: the masks and flags that the keys' validity follows from, besides the layout (None
        with a cache, whose keys' validity is the cache's too)."""
        q = self._split(self.query(hidden_states))
        k, v = self._local_keys_values(hidden_states, lean=backend == "lean", normalize=not local_norm_joined)
        if self.causal:
            context, attn = self._causal(
                q=q,
                k=k,
                v=v,
                hidden=hidden_states,
                valid=valid,
                state=state,
                backend=backend,
                local_norm=local_norm_joined,
                mask_source=mask_source,
            )
        else:
            context, attn = self._bidirectional(
                q=q,
                k=k,
                v=v,
                hidden_states=hidden_states,
                valid=valid,
                cls_hidden=cls_hidden,
                is_global=is_global,
                global_count=global_count,
                backend=backend,
                local_norm=local_norm_joined,
                mask_source=mask_source,
            )
        return self.output(context.flatten(2)), attn

    def _check_inputs(self, hidden_states, attention_mask, *, global_attention_mask, cls_hidden, state, flex):
        """Refuse misuse before any work; return the query validity (B, n) bool, or None when every token is real,
        and the global tokens (B, n) bool or None."""
        width = self.query.in_features
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != width:
            raise ValueError(
                f"hidden_states must be (batch, tokens, {width}), got {tuple(hidden_states.shape)}; add "
                f"a batch dimension with x[None] for a single sequence."
            )
        B, n, _ = hidden_states.shape
        if attention_mask is not None and (
            attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < n
        ):
            raise ValueError(
                f"attention_mask must be (batch, tokens) = {(B, n)} (1 for real tokens), got "
                f"{tuple(attention_mask.shape)}."
            )
        if flex:
            check_flex_call(
                hidden_states,
                self.query.weight,
                training=self.training,
                dropout=self.attention_dropout,
                dropout_name="attention_dropout",
                dropout_setting="attention_probs_dropout_prob",
            )
        valid = None if attention_mask is None else attention_mask[:, -n:].to(device=hidden_states.device) > 0
        if self.causal and cls_hidden is not None:
            raise ValueError("cls_hidden is only supported by bidirectional attention (causal=False).")
        if state is not None and not self.causal:
            raise ValueError("state (decoding cache) is only supported by causal attention (causal=True).")
        if cls_hidden is not None and self.qk_head_dim != self.head_dim:
            raise ValueError("cls_hidden needs qk_head_dim == head_dim: the cls query attends to the token outputs.")
        if global_attention_mask is None:
            return valid, None
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
        is_global = global_attention_mask.to(device=hidden_states.device) > 0
        return valid, is_global if valid is None else is_global & valid

    def _global_keys(self, hidden: Tensor, valid: Tensor) -> ExtraKeys:
        """Global tokens (B, k, d) as every token sees them: ``LN_G`` of their raw key/value (official LRA cls)."""
        return ExtraKeys(
            keys=self._split(self._dual_ln(self.key(hidden), local=False, is_key=True)),
            values=self._split(self._dual_ln(self.value(hidden), local=False, is_key=False)),
            valid=valid,
        )

    def _bidirectional(
        self,
        *,
        q,
        k,
        v,
        hidden_states,
        valid,
        cls_hidden,
        is_global,
        global_count,
        backend,
        local_norm=False,
        mask_source=None,
    ):
        """``local_norm``: k, v are the Linears' outputs, normalized by ``LN_L`` where they are joined with the
        projected rows (``_joins_local_norm``). ``mask_source``: as ``JointInputs``'."""
        B, n = q.shape[:2]
        K = global_count
        masked = valid is not None
        if not masked:
            valid = torch.ones(B, n, dtype=torch.bool, device=hidden_states.device)
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
        width = n if self.window_size else 0  # projection only: no window keys
        projected, extra = None, _concatenated(extra)  # one set: global keys, then projected rows
        if self.projection_rank:
            projection_valid = local if masked or K else None
            if self._joins_keys(backend, cached=False):  # rows in one tensor with the window keys
                extra, projected = self._joined_extra(
                    projection_inputs,
                    k,
                    v,
                    projection_valid,
                    prefix=extra,
                    local_norm=local_norm,
                    copies=self._extra_key_copies(n),
                )
                k, v = (x[:, :n] for x in extra.joined)
            else:
                projected = self._project(projection_inputs, k, v, projection_valid, segment=n, lean=backend == "lean")
                extra = _concatenated([part for part in (extra, projected) if part is not None])
        layout = None
        if K:
            g_q, g_k, g_v, g_keep = self._global_inputs(
                hidden_states=hidden_states, order=order, q=q, k=k, v=v, valid=valid, count=K, projected=projected
            )
            if backend == "maps":
                *layout, global_from_maps = self._global_layout(self._probabilities(g_q, g_k, g_keep), is_global, order)
        inputs = JointInputs(
            q=q,
            q_start=0,
            k=k[:, :width],
            v=v[:, :width],
            k_valid=local[:, :width],
            k_start=0,
            extra=extra,
            all_valid=not masked and not K,
            mask_source=mask_source,
        )
        context, attn = self._joint_softmax(
            inputs, q_valid=local if masked or K else None, backend=backend, layout=layout
        )
        if cls_hidden is not None:
            context = torch.cat([self._cls_output(cls_hidden, context, valid), context], dim=1)
        if K:  # the global tokens' rows (the last K slots in ``order``), then the tokens back in position order
            if backend == "maps":
                out = _weighted(global_from_maps(attn), g_v, g_q.dtype)
            else:
                out = self._sdpa(g_q, g_k, g_v, g_keep)
            rows = is_global[:, n - K :, None, None]
            context = torch.cat([context[:, : n - K], torch.where(rows, out.transpose(1, 2), context[:, n - K :])], 1)
            context = _take(context, torch.argsort(order, dim=1))
        return context, attn

    def _global_inputs(self, *, hidden_states, order, q, k, v, valid, count, projected):
        """In the token ``order`` of ``_bidirectional`` the last ``count`` slots hold the global tokens: each attends
        to the projected rows and every real token in one softmax. Returns their queries, those keys and values
        (heads first, projected rows first) and the keep mask, for ``_sdpa`` or ``_probabilities``."""
        n, K = q.shape[1], count
        if self.global_query is not None:
            hidden_states = _take(hidden_states, order)
            q_g = self._split(self.global_query(hidden_states[:, n - K :]))
            k = self._split(self._dual_ln(self.global_key(hidden_states), local=True, is_key=True))
            v = self._split(self._dual_ln(self.global_value(hidden_states), local=True, is_key=False))
        else:
            q_g = q[:, n - K :]
        R = projected.keys.shape[1] if projected is not None else 0
        if R:
            k, v, valid = (
                torch.cat(pair, 1) for pair in ((projected.keys, k), (projected.values, v), (projected.valid, valid))
            )
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

    def _joint_softmax(
        self, inputs: JointInputs, *, q_valid: Tensor | None, backend: str, layout: MapsLayout | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Queries attend to [extra keys; window keys] in one softmax (Eq. 6), on ``BACKENDS[backend]``.

        q_valid (B, m), or None when every query is real; ``layout``: the caller's maps made from the probabilities
        and read back (``"maps"`` only; none: the maps are the probabilities). Returns the context (B, m, H, d_v),
        zero for invalid queries, and the maps (``"maps"``) or None."""
        m, w = inputs.q.shape[1], self.window_size
        if inputs.offsets is None or backend == "flex" or not w or m < w:
            context, maps = BACKENDS[backend](self, inputs, layout)
        else:  # a left-padded causal batch grouped by window segment: every row's segments at the same columns
            inputs, shift = self._aligned(inputs)
            slots = torch.arange(m, device=shift.device)[None] + shift[:, None]  # (B, m): query j's slot
            width = inputs.q.shape[1]

            def to_maps(maps):  # (B, H, slots, S) -> (B, H, m, S)
                return torch.take_along_dim(maps, slots[:, None, :, None], dim=2)

            def from_maps(maps):  # (B, H, m, S) -> (B, H, slots, S), zero rows for the other slots
                return _shift_rows(maps.transpose(1, 2), shift, width).transpose(1, 2)

            context, maps = BACKENDS[backend](self, inputs, (to_maps, from_maps))
            context = _take(context, slots)
        if q_valid is not None:
            context = context * q_valid[:, :, None, None].to(context.dtype)
        return context, maps

    def _tiles(self, inputs: JointInputs) -> Tiles:
        """The grouped layout: queries grouped by window segment, each group seeing its window tile, except for fewer
        than ``w`` causal queries (a decoding step) and a projection-only attention: one group that sees all keys,
        masked. The keep mask applies the window rule (per query when causal; a bidirectional tile already bounds
        its window) and the segment rule of causal rows (Eq. 5), per row with ``inputs.offsets`` (whose groups
        ``_aligned`` has made to start at the same columns in every row)."""
        q, q_start, k_start, extra = inputs.q, inputs.q_start, inputs.k_start, inputs.extra
        B, m = q.shape[:2]
        w, L = self.window_size, inputs.k.shape[1]
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
        k_pos, index, q_pos = k_pos.to(device), index.to(device), q_pos.to(device)
        if inputs.offsets is not None:  # each row's rules count from its own first position (B, G, Q) and (B, G, S)
            q_pos, k_pos = (pos - inputs.offsets[:, None, None] for pos in (q_pos, k_pos))

        keep = gather_tiles(extra.valid if R else None, inputs.k_valid, index).view(B, groups, 1, -1)  # extra first
        S = keep.shape[-1]
        if L:
            rule = window_keep(q_pos if self.causal or groups == 1 else q_pos[..., :1], k_pos, w, self.causal)
            keep = keep & torch.cat([rule.new_ones(rule.shape[:-1] + (R,)), rule], -1)
        if R and extra.segment is not None:
            seen = segment_keep(q_pos, extra.segment, self.segment_length)
            keep = keep & torch.cat([seen, seen.new_ones(seen.shape[:-1] + (S - R,))], -1)
        # A row with no visible key (a padded or out-of-range query) keeps all keys: no NaN; it is zeroed later.
        keep = keep | ~keep.any(-1, keepdim=True)
        return Tiles(groups=groups, size=q_pos.shape[-1], skip=skip, index=index, keep=keep)

    def _aligned(self, inputs: JointInputs) -> tuple[JointInputs, Tensor]:
        """``inputs`` re-framed so that every row's window and projection segments start at the same columns: row b
        moves right by ``shift[b] = P - 1 - offsets[b] % P`` (P = lcm(w, l), or w without causal rows) in a frame that
        starts ``P - 1`` positions earlier, so that its rules count from ``offsets[b] - offsets[b] % P``, a whole number
        of segments. Returns those inputs and ``shift`` (query j of row b sits at slot ``j + shift[b]``)."""
        period = math.lcm(self.window_size, self.segment_length) if self.segment_length else self.window_size
        within = inputs.offsets % period
        shift = period - 1 - within
        q, k, v, k_valid = (
            _shift_rows(x, shift, x.shape[1] + period - 1) for x in (inputs.q, inputs.k, inputs.v, inputs.k_valid)
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

    @staticmethod
    def _group_queries(inputs: JointInputs, tiles: Tiles) -> Tensor:
        """The queries in the tiles' slots, (B, G*Q, H, d_qk): the first ``skip`` slots and those past the queries
        zero."""
        m = inputs.q.shape[1]
        return _pad_seq(inputs.q, tiles.skip, tiles.groups * tiles.size - tiles.skip - m)

    def _gathered(self, inputs: JointInputs, tiles: Tiles) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Every group's queries and tile, gathered in one copy, heads first: q (B*G, H, Q, d_qk), keys and values
        (B*G, H, S, d) and keep (B*G, 1, Q|1, S)."""
        q = self._group_queries(inputs, tiles)
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

    @staticmethod
    def _ungroup(out: Tensor, inputs: JointInputs, tiles: Tiles) -> Tensor:
        """(B*G, H, Q, d) per group -> the context of the m queries, (B, m, H, d)."""
        B, m, H = inputs.q.shape[:3]
        return out.transpose(1, 2).reshape(B, tiles.groups * tiles.size, H, -1)[:, tiles.skip : tiles.skip + m]

    def _attend_sdpa(self, inputs: JointInputs, layout: MapsLayout | None) -> tuple[Tensor, None]:
        """``"sdpa"``: every group's keys and values gathered in one copy, (B, G, R + S, H, d), which autograd keeps,
        and one fused attention call."""
        tiles = self._tiles(inputs)
        q, keys, values, keep = self._gathered(inputs, tiles)
        return self._ungroup(self._sdpa(q, keys, values, keep), inputs, tiles), None

    def _attend_maps(self, inputs: JointInputs, layout: MapsLayout | None) -> tuple[Tensor, Tensor]:
        """``"maps"``: the explicit softmax on the gathered tiles. The output is computed from the returned maps
        themselves (through ``layout``, the caller's maps), so a gradient taken at them is the output's."""
        tiles = self._tiles(inputs)
        q, keys, values, keep = self._gathered(inputs, tiles)
        B, m, H = inputs.q.shape[:3]
        G, Q, S = tiles.groups, tiles.size, keep.shape[-1]

        def to_maps(prob):  # (B * G, H, Q, S) -> (B, H, m, S)
            maps = prob.view(B, G, H, Q, S).transpose(1, 2).flatten(2, 3)[:, :, tiles.skip : tiles.skip + m]
            return layout[0](maps) if layout else maps

        def from_maps(maps):  # (B, H, m, S) -> (B * G, H, Q, S), zero rows for the padding queries
            maps = layout[1](maps) if layout else maps
            rows = _pad_seq(maps.transpose(1, 2), tiles.skip, G * Q - tiles.skip - m).view(B, G, Q, H, S)
            return rows.transpose(2, 3).flatten(0, 1)

        maps = to_maps(self._probabilities(q, keys, keep))
        return self._ungroup(_weighted(from_maps(maps), values, q.dtype), inputs, tiles), maps

    def _attend_lean(self, inputs: JointInputs, layout: MapsLayout | None) -> tuple[Tensor, None]:
        """``"lean"``: the tiles built one chunk of groups at a time, and again in the backward pass
        (``TiledAttention``)."""
        tiles = self._tiles(inputs)
        extra, m = inputs.extra, inputs.q.shape[1]
        rows_k, rows_v = (extra.keys, extra.values) if extra is not None else (None, None)
        q = self._group_queries(inputs, tiles)
        context = TiledAttention.apply(q, inputs.k, inputs.v, rows_k, rows_v, tiles.index, tiles.keep)
        return context[:, tiles.skip : tiles.skip + m], None

    def _attend_flex(self, inputs: JointInputs, layout: MapsLayout | None) -> tuple[Tensor, None]:
        """``"flex"``: FlexAttention over the keys [window keys; extra keys] with the visibility as a block-sparse
        mask built from the window geometry (``long_short_block_mask``, never an n x n evaluation), so nothing is
        gathered (``long_short_flex_attend``). On CUDA the kernel is compiled once per process and skips the blocks
        that no query sees. A query with no visible key gets 0."""
        q, extra = inputs.q, inputs.extra
        R = extra.keys.shape[1] if extra is not None else 0
        if R and inputs.k.shape[1] and not self.causal and not self.long_range_in_kernel:
            return self._merged_with_extra_keys(inputs), None
        copies = self._extra_key_copies(q.shape[1]) if R else 1
        if not R:
            keys, values = inputs.k, inputs.v
        elif extra.joined is not None:  # built as one tensor each with the window keys (``_joined_extra``), in copies
            keys, values = extra.joined
        else:
            keys, values = (
                torch.cat([x, in_copies(e, copies)], 1) for x, e in ((inputs.k, extra.keys), (inputs.v, extra.values))
            )
        key_valid = None if inputs.all_valid else inputs.k_valid
        if R and key_valid is not None:
            key_valid = torch.cat([key_valid, in_copies(extra.valid, copies)], 1)
        causal_rows = R and extra.segment is not None  # r rows per segment of l tokens, seen by Eq. 5
        key_layout = KeyLayout(
            window_size=self.window_size,
            causal=self.causal,
            num_window_keys=inputs.k.shape[1],
            num_extra_keys=R * copies,
            q_start=inputs.q_start,
            k_start=inputs.k_start,
            segment_length=self.segment_length if causal_rows else None,
            projection_rank=self.projection_rank if causal_rows else None,
            extra_key_copies=copies,
            queries_per_copy=long_short_blocks.EXTRA_KEY_BAND,
        )
        keys, values = (x.to(q.dtype) for x in (keys, values))
        out = long_short_flex_attend(
            q,
            keys,
            values,
            key_layout,
            offsets=inputs.offsets,
            key_valid=key_valid,
            key_valid_source=inputs.mask_source,
        )
        return out, None

    def _merged_with_extra_keys(self, inputs: JointInputs) -> Tensor:
        """``_attend_flex`` with the extra keys (seen by every query) apart from the kernel: FlexAttention over the
        window keys alone gives its output ``o_w`` and log-sum-exp ``lse_w``, ``ExtraKeysAttention`` over the R extra
        keys ``o_e`` and ``lse_e``; the one softmax over both sets (Eq. 6) is their sum weighted by
        ``sigmoid(lse_w - lse_e) = e^lse_w / (e^lse_w + e^lse_e)`` and its complement, in float32 at least. A query
        that sees no key gets 0."""
        q, extra = inputs.q, inputs.extra
        key_layout = KeyLayout(
            window_size=self.window_size, causal=False, num_window_keys=inputs.k.shape[1], q_start=inputs.q_start
        )
        k, v, extra_k, extra_v = (x.to(q.dtype) for x in (inputs.k, inputs.v, extra.keys, extra.values))
        key_valid = None if inputs.all_valid else inputs.k_valid
        out_w, lse_w = long_short_flex_attend(
            q, k, v, key_layout, key_valid=key_valid, return_lse=True, key_valid_source=inputs.mask_source
        )
        q, out_w, extra_k, extra_v = (x.transpose(1, 2) for x in (q, out_w, extra_k, extra_v))  # heads first
        keep = extra.valid[:, None, None, :]
        out_e, lse_e = ExtraKeysAttention.apply(q, extra_k, extra_v, keep, 1 / math.sqrt(q.shape[-1]))
        # e^lse_w / (e^lse_w + e^lse_e), with -inf (no key seen) made finite: no NaN in either pass
        lse_w, lse_e = (
            torch.where(torch.isfinite(x), x, torch.finfo(x.dtype).min) for x in (lse_w.to(lse_e.dtype), lse_e)
        )
        weight_w = torch.sigmoid(lse_w - lse_e)[..., None]
        out_w, out_e = (x.to(weight_w.dtype) for x in (out_w, out_e))
        out = out_e + weight_w * (out_w - out_e)
        return out.to(q.dtype).transpose(1, 2)

    def _cls_output(self, cls_hidden, context, valid):
        """The cls token attends to its own raw key/value and to the other tokens' contexts (official post-CLS)."""
        q = self._split(self.query(cls_hidden)).transpose(1, 2)  # (B, H, 1, d)
        keys = torch.cat([self._split(self.key(cls_hidden)), context], 1).transpose(1, 2)
        values = torch.cat([self._split(self.value(cls_hidden)), context], 1).transpose(1, 2)
        keep = torch.cat([valid.new_ones(valid.shape[0], 1), valid], 1)[:, None, None, :]
        out = masked_sdpa(q, keys.to(q.dtype), values.to(q.dtype), keep)
        return out.transpose(1, 2)

    def _causal(
        self, *, q, k, v, hidden, valid, state: CausalState | None, backend, local_norm=False, mask_source=None
    ):
        """Causal attention of n new tokens at positions ``[p0, p0 + n)`` given what ``state`` holds; extends it (None:
        a forward pass without a cache, from position 0). ``local_norm``: k, v are the Linears' outputs, normalized by
        ``LN_L`` where they are joined with the projected rows (``_joins_local_norm``), and here otherwise.
        ``mask_source``: as ``JointInputs``'.

        Each row counts its window and projection segments from its first real token (``_first_real``), so a row's
        output does not depend on left padding beside it: the same rule in a full forward and in every cached call."""
        B, n = q.shape[:2]
        w, r, l = self.window_size, self.projection_rank, self.segment_length
        cached, state = state is not None, state if state is not None else CausalState()
        p0, end = state.seen, state.seen + n
        q_valid, offsets = valid, self._first_real(valid, state)
        all_valid = q_valid is None and p0 == 0  # every key is a real token
        seg_start, done = ((p0 // l) * l, (end // l) * l) if r else (0, 0)
        joins = self._joins_keys(backend, cached=cached) and offsets is None and done > seg_start
        if local_norm and not joins:
            k, v = self._normalized_local(k, v)
        if valid is None:
            valid = torch.ones(B, n, dtype=torch.bool, device=hidden.device)
        # Window keys of positions [k_start, end): the cached tail and the new tokens.
        k_all, v_all, valid_all = (
            torch.cat([old, new], 1) if old is not None else new
            for old, new in ((state.keys, k), (state.values, v), (state.valid, valid))
        )
        k_start = end - k_all.shape[1] if state.keys is not None else p0  # an int, not a symbolic 0, when compiled

        # Projected rows, r per segment in segment order: the finished segments' plus those the new tokens complete.
        rows_k, rows_v, rows_valid, pending = state.rows_k, state.rows_v, state.rows_valid, None
        joined = None
        if r:
            all_hidden = torch.cat([state.pending, hidden], 1) if state.pending is not None else hidden
            if offsets is None:
                if joins:  # rows and window keys in one tensor
                    joined, projected = self._joined_extra(
                        all_hidden[:, :done],
                        k_all,
                        v_all,
                        None if all_valid else valid_all[:, :done],
                        None,
                        l,
                        local_norm=local_norm,
                    )
                    rows_k, rows_v, rows_valid = projected.keys, projected.values, projected.valid
                    k_all, v_all = (x[:, : k_all.shape[1]] for x in joined.joined)
                elif done > seg_start:
                    span = slice(seg_start - k_start, done - k_start)
                    new_k, new_v, new_valid = self._project(
                        all_hidden[:, : done - seg_start],
                        k_all[:, span],
                        v_all[:, span],
                        None if all_valid else valid_all[:, span],
                        l,
                        lean=backend == "lean",
                    )[:3]
                    if rows_k is not None:
                        new_k, new_v, new_valid = (
                            torch.cat(pair, 1) for pair in ((rows_k, new_k), (rows_v, new_v), (rows_valid, new_valid))
                        )
                    rows_k, rows_v, rows_valid = new_k, new_v, new_valid
                pending = all_hidden[:, done - seg_start :]
            else:
                rows_k, rows_v, rows_valid = self._project_per_row(
                    state=state,
                    hidden=all_hidden,
                    keys=k_all,
                    values=v_all,
                    valid=valid_all,
                    k_start=k_start,
                    end=end,
                    offsets=offsets,
                    lean=backend == "lean",
                )
                pending = all_hidden[:, max(0, all_hidden.shape[1] - l + 1) :]  # every row's unfinished segment
        extra = None
        if rows_k is not None:
            segment = torch.arange(rows_k.shape[1], device=q.device) // r
            # built whole: under torch.compile, ``_replace``'s tuple cannot be rebuilt across a graph break (torch 2.11)
            extra = ExtraKeys(rows_k, rows_v, rows_valid, segment, joined=None if joined is None else joined.joined)
        inputs = JointInputs(
            q=q,
            q_start=p0,
            k=k_all,
            v=v_all,
            k_valid=valid_all,
            k_start=k_start,
            extra=extra,
            offsets=offsets,
            all_valid=all_valid,
            mask_source=mask_source,
        )
        context, attn = self._joint_softmax(inputs, q_valid=q_valid, backend=backend)

        # Keep the keys of the current and the previous window segment of every row, and the unfinished segment's
        # inputs.
        keep_from = max(k_start, (end // w - 1) * w if offsets is None else end - 2 * w + 1)
        state.keys, state.values, state.valid = (t[:, keep_from - k_start :] for t in (k_all, v_all, valid_all))
        state.rows_k, state.rows_v, state.rows_valid, state.pending = rows_k, rows_v, rows_valid, pending
        state.seen, state.offsets = end, offsets
        return context, attn

    @staticmethod
    def _first_real(valid: Tensor | None, state: CausalState) -> Tensor | None:
        """Each row's first real token, the position its segments count from (B,): a row of padding only so far gets
        the position after this call's tokens, and moves to its first real token when one comes. None while every
        row's first token is real (checked once, in the first call; under ``torch.compile``, which cannot branch on
        values, the offsets are kept even when all are 0, which gives the same results). ``valid`` None: every new
        token is real."""
        if (state.seen == 0 and valid is None) or (state.seen > 0 and state.offsets is None):
            return None
        if valid is None:
            return torch.where(state.offsets == state.seen, state.seen, state.offsets)
        leading = (valid.cumsum(1) == 0).sum(1)  # this call's padding before the row's first real token
        if state.seen == 0:
            return leading if torch.compiler.is_compiling() or bool(leading.any()) else None
        return torch.where(state.offsets == state.seen, state.seen + leading, state.offsets)

    def _project_per_row(self, *, state, hidden, keys, values, valid, k_start, end, offsets, lean):
        """Eq. 5 for rows whose segments start at their own ``offsets``: the segments of l tokens that the new tokens
        complete in each row, projected (``_project``) and written into the row's segment slots (r rows per segment,
        segment s at slots ``[s r, (s + 1) r)``); a row's slots past its finished segments are invalid.
        hidden (B, A, D) holds the inputs of positions ``[end - A, end)``, keys/values/valid those of
        ``[k_start, end)``."""
        B, A = hidden.shape[:2]
        l, r = self.segment_length, self.projection_rank
        p0 = state.seen
        if end // l == 0:  # no segment can have ended yet
            return state.rows_k, state.rows_v, state.rows_valid
        first = torch.div(p0 - offsets, l, rounding_mode="floor").clamp(min=0)
        last = torch.div(end - offsets, l, rounding_mode="floor").clamp(min=0)
        count = (end - p0) // l + 1  # at most so many segments of a row end among the new tokens
        segment = first[:, None] + torch.arange(count, device=offsets.device)  # (B, count)
        done = segment < last[:, None]
        position = (offsets[:, None, None] + segment[..., None] * l + torch.arange(l, device=offsets.device)).flatten(
            1
        )  # (B, count l)
        token_done = done.repeat_interleave(l, dim=1)
        at_hidden = torch.where(token_done, position - (end - A), 0)
        at_keys = torch.where(token_done, position - k_start, 0)
        new = self._project(
            _take(hidden, at_hidden),
            _take(keys, at_keys),
            _take(values, at_keys),
            _take(valid, at_keys) & token_done,
            l,
            lean=lean,
        )
        width = r * (end // l)
        slot = torch.where(done, segment, end // l)[..., None] * r + torch.arange(r, device=offsets.device)
        slot = slot.flatten(1)  # (B, count r); the segments not done write to a spare slot, dropped
        merged = []
        for old, part in ((state.rows_k, new.keys), (state.rows_v, new.values), (state.rows_valid, new.valid)):
            grown = part.new_zeros(B, width + r, *part.shape[2:])
            if old is not None:
                grown = torch.cat([old, grown[:, old.shape[1] :]], 1)
            index = slot.view(B, -1, *(1,) * (part.dim() - 2)).expand_as(part)
            merged.append(grown.scatter(1, index, part)[:, :width])
        return merged


@functools.cache
def compiled_attention_layer(recompute: bool = False) -> Callable:
    """``LongShortSelfAttention._attend`` compiled once per process (``compile_in_package``): the fused path's layer,
    one graph with its attention kernel inside on ``long_short_blocks.KERNEL_IN_GRAPH_DEVICES`` (CUDA), the block
    mask's tensors taken from their caches by one operator (``long_short_flex_attend``); elsewhere compiled regions
    before and after the kernel's call, a compile boundary. Every module of the same settings shares the compilations
    (the parameters are inputs of the compiled code, not constants); the lengths become symbolic after the first one
    that differs.

    ``recompute`` (``recompute_window_tiles=True``): compiled with torch's ``activation_memory_budget`` at
    ``RECOMPUTE_MEMORY_BUDGET``, so that its backward pass computes P (Eq. 3) again rather than keeping it (and the
    keys' and values' Linear outputs where they are kept): about what fused dense attention keeps
    (``bench.profile_attention --saved``)."""
    budget = RECOMPUTE_MEMORY_BUDGET if recompute else None
    return compile_in_package(LongShortSelfAttention._attend, activation_memory_budget=budget)


# How the joint softmax runs, by the name ``LongShortSelfAttention._backend`` picks; each takes the module, the
# ``JointInputs`` and the caller's maps layout, and returns the context and the maps (or None).
BACKENDS = {
    "sdpa": LongShortSelfAttention._attend_sdpa,
    "lean": LongShortSelfAttention._attend_lean,
    "flex": LongShortSelfAttention._attend_flex,
    "maps": LongShortSelfAttention._attend_maps,
}
