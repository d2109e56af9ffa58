"""Long-Short attention's visibility as FlexAttention's block-sparse structure (Zhu et al., NeurIPS 2021, Sec. 3.2-3.3,
Eq. 5, Appendix D), built from the window geometry and never evaluated over all (query, key) pairs.

Key layout: ``L`` window keys first, at key indices ``[0, L)``, holding the tokens at positions
``[k_start, k_start + L)``; then ``R`` extra keys at ``[L, L + R)``: the global tokens' keys and the projected rows
(bidirectional, every query sees every valid one), or causally the projected rows, segment-major with ``r`` rows per
segment of ``l`` tokens (Eq. 5). Bidirectional extra keys may come as ``extra_key_copies`` equal copies, each seen by
one band of ``queries_per_copy`` consecutive queries (the last copy by every query after): each query still sees
each extra key once (``extra_key_copies``). The queries hold the positions ``[q_start, q_start + m)``. With
``offsets`` (B,), row b's logical positions are its physical ones minus ``offsets[b]``, queries and keys alike, so
that a left-padded row counts its windows and segments from its first real token.

The rules are those of ``long_short_rules``: ``window_bounds`` (the window keys ``[lo, hi)`` of a query),
``window_rule`` and ``segment_rule``. ``long_short_mask_mod`` applies them per (query, key) pair, as FlexAttention's
``mask_mod``; ``long_short_block_mask`` applies them to the first and last query of each query block, which bound
every query's keys in between (the window's ends do not decrease with the position), and builds the ``BlockMask``
from them, both ways (the key blocks of each query block, the query blocks of each key block). ``flex_attend`` runs
FlexAttention, compiled once per process on CUDA; ``long_short_flex_attend`` runs it with a given mask, inside a
compiled layer's graph on CUDA and as a compile boundary elsewhere. This file imports nothing from Transformers or
timm.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch._functorch.config
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from .long_short_rules import (
    cached_outside_compile,
    finished_segments,
    is_int,
    segment_rule,
    window_bounds,
    window_rule,
)

__all__ = [
    "FLEX_MIN_HEAD_DIM",
    "FUSED_DEVICES",
    "FUSED_DTYPES",
    "KeyLayout",
    "compile_in_package",
    "compiled_flex_attention",
    "extra_key_copies",
    "flex_attend",
    "long_short_block_mask",
    "long_short_flex_attend",
    "long_short_mask_mod",
]

# Compiled FlexAttention on CUDA refuses head dims below this ("NYI: embedding dimension ... at least 16").
FLEX_MIN_HEAD_DIM = 16
# The dtypes compiled FlexAttention takes on CUDA (Triton's kernel fails to build for float64, torch 2.11).
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The one device rule: where attn_implementation="sdpa" (the default) runs the fused FlexAttention path, its kernel
# compiled (``flex_attend``) and, with ``compile_attention``, the rest of the layer compiled around it, the kernel
# inside the layer's graph. Elsewhere the grouped SDPA path is faster (on the CPU eager FlexAttention materialises
# every score, and compiled it ran CvT-LS 1.5x and ViL-LS 2.7x slower than the SDPA layouts, 2026-11).
FUSED_DEVICES = ("cuda",)


def contiguous_inputs(device: torch.device) -> bool:
    """Whether compiled FlexAttention on ``device`` gets contiguous copies of its inputs: inductor's CPU kernel refuses
    views (torch 2.14); its CUDA kernel reads them where they lie."""
    return device.type == "cpu"


DEFAULT_BLOCK_SIZE = 128
# Queries per copy of the bidirectional extra keys (``extra_key_copies``): 8 query blocks of ``DEFAULT_BLOCK_SIZE``.
EXTRA_KEY_BAND = 1024


def extra_key_copies(num_queries: int, queries_per_copy: int = EXTRA_KEY_BAND) -> int:
    """How many copies of the bidirectional extra keys the fused path gives FlexAttention for ``num_queries``
    queries: one per band of ``queries_per_copy`` queries. Every query sees the extra keys, so one copy would sit in
    one key block that every query block sees, and FlexAttention's backward pass, which loops over a key block's
    query blocks in one program, would spend most of its time on that loop alone (at 65,536 tokens, 512 query blocks:
    the backward pass took 8.5x the forward pass's time on an H100). A copy per band makes that loop as short as a
    window block's, for the same forward work and each query's same softmax; the copies' gradients add up."""
    return -(-num_queries // queries_per_copy)


# ---------------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class KeyLayout:
    """Where the keys are and which rule each follows (this module's docstring): ``num_window_keys`` (L) window keys
    holding positions ``[k_start, k_start + L)``, then ``num_extra_keys`` (R) extra keys, for queries from position
    ``q_start``. ``segment_length`` (l) and ``projection_rank`` (r), causal only: the extra keys are projected rows,
    r per segment of l tokens, seen by Eq. 5; without them every query sees every extra key, or with
    ``extra_key_copies`` C > 1 the R / C keys of copy ``min(q_idx // queries_per_copy, C - 1)``. ``window_size`` 0:
    no window keys. A malformed layout raises ``ValueError`` naming the field."""

    window_size: int
    causal: bool
    num_window_keys: int
    num_extra_keys: int = 0
    q_start: int = 0
    k_start: int = 0
    segment_length: int | None = None
    projection_rank: int | None = None
    extra_key_copies: int = 1
    queries_per_copy: int = EXTRA_KEY_BAND

    def __post_init__(self):
        for name in ("window_size", "num_window_keys", "num_extra_keys", "q_start", "k_start"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}.")
        for name in ("extra_key_copies", "queries_per_copy"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        copies, extra = self.extra_key_copies, self.num_extra_keys
        if copies > 1 and (self.segment_length is not None or extra == 0 or extra % copies):
            raise ValueError(
                f"extra_key_copies ({copies}) > 1 needs bidirectional extra keys (no segment_length) in equal "
                f"copies: num_extra_keys ({extra}) must be a positive multiple of it; pass extra_key_copies=1 "
                f"otherwise."
            )
        if self.window_size == 0 and self.num_window_keys:
            raise ValueError(
                f"window_size is 0 (no short-term window), so num_window_keys must be 0, got "
                f"{self.num_window_keys}; pass window keys only with a window_size >= 1."
            )
        if self.num_window_keys + self.num_extra_keys == 0:
            raise ValueError("num_window_keys and num_extra_keys are both 0: no query has a key to attend to.")
        if (self.segment_length is None) != (self.projection_rank is None):
            raise ValueError(
                f"segment_length and projection_rank describe the causal projected rows (Eq. 5) "
                f"together; pass both or neither, got segment_length={self.segment_length!r}, "
                f"projection_rank={self.projection_rank!r}."
            )
        if self.segment_length is None:
            return
        if not self.causal:
            raise ValueError(
                "segment_length (Eq. 5) applies to causal attention only; bidirectional queries see "
                "every extra key: pass causal=True or leave segment_length and projection_rank out."
            )
        for name in ("segment_length", "projection_rank"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.num_extra_keys % self.projection_rank:
            raise ValueError(
                f"num_extra_keys ({self.num_extra_keys}) must be a multiple of projection_rank "
                f"({self.projection_rank}): the causal projected rows come {self.projection_rank} per "
                f"segment (Eq. 5)."
            )

    @property
    def num_keys(self) -> int:
        return self.num_window_keys + self.num_extra_keys

    @property
    def keys_per_copy(self) -> int:
        return self.num_extra_keys // self.extra_key_copies


def _batch_size(layout: KeyLayout, key_valid: Tensor | None, offsets: Tensor | None) -> int:
    """The batch size that ``key_valid`` / ``offsets`` give (1 without them, broadcast over the batch), after checking
    their shapes and dtypes (``ValueError`` naming the argument)."""
    batch = None
    if key_valid is not None:
        if key_valid.dtype != torch.bool or key_valid.dim() != 2 or key_valid.shape[1] != layout.num_keys:
            raise ValueError(
                f"key_valid must be a bool tensor (batch, num_window_keys + num_extra_keys) = (batch, "
                f"{layout.num_keys}), True for the keys that exist; got {key_valid.dtype} "
                f"{tuple(key_valid.shape)}."
            )
        batch = key_valid.shape[0]
    if offsets is not None:
        if (
            offsets.dim() != 1
            or offsets.dtype.is_floating_point
            or offsets.dtype == torch.bool
            or offsets.shape[0] != (batch or offsets.shape[0])
        ):
            raise ValueError(
                f"offsets must be an integer tensor (batch,) = ({batch or 'batch'},), each row's shift "
                f"of positions; got {offsets.dtype} {tuple(offsets.shape)}."
            )
        batch = offsets.shape[0]
    return 1 if batch is None else batch


# -------------------------------------------------------------------------------------------------- mask_mod
@cached_outside_compile(maxsize=64)
def mask_geometry(layout: KeyLayout, device: torch.device) -> Tensor:
    """``[num_window_keys, q_start, k_start, keys_per_copy, extra_key_copies - 1]`` of ``layout``, the parts of it
    that change with the length, as an int32 tensor on ``device`` for the mask_mod to read: as a tensor, not as Python
    ints, the compiled kernel, which takes the mask as an input, serves every length (it fails to lower the ints that
    a mask captures once it recompiles with symbolic lengths, torch 2.14). Cached per layout and device, built outside
    inference mode (a cached mask serves later calls in training too)."""
    with torch.inference_mode(False):
        numbers = (layout.num_window_keys, layout.q_start, layout.k_start, layout.keys_per_copy)
        return torch.tensor([*numbers, layout.extra_key_copies - 1], dtype=torch.int32, device=device)


def long_short_mask_mod(
    layout: KeyLayout,
    *,
    key_valid: Tensor | None = None,
    offsets: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` for ``layout``.

    Query ``q_idx`` is at position ``t = q_start + q_idx - offsets[b]``. It sees the window key ``kv_idx < L`` (at
    ``k_start + kv_idx - offsets[b]``) by ``window_rule``, and the extra key ``kv_idx >= L``: always, or, with a
    ``segment_length`` l and ``projection_rank`` r, by ``segment_rule`` for the row's segment ``(kv_idx - L) // r``,
    or, with ``extra_key_copies``, where its copy is the query's (``copy_seen``). Keys where ``key_valid`` (B, L + R)
    is False are never seen. ``device``: where the attention runs (by default ``key_valid``'s or ``offsets``', else
    the CPU).
    """
    _batch_size(layout, key_valid, offsets)
    device = _mask_device(device, key_valid, offsets)
    window, causal, has_window = layout.window_size, layout.causal, layout.num_window_keys > 0
    segment_length, rank = layout.segment_length, layout.projection_rank
    copied, queries_per_copy = layout.extra_key_copies > 1, layout.queries_per_copy
    geometry = mask_geometry(layout, device)

    def long_short_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        window_keys, q_start, k_start = geometry[0], geometry[1], geometry[2]
        shift = 0 if offsets is None else offsets[b]
        t = q_idx + (q_start - shift)
        is_window = kv_idx < window_keys
        seen = ~is_window
        if segment_length is not None:
            seen = seen & segment_rule(t, (kv_idx - window_keys) // rank, segment_length)
        elif copied:  # the query's copy, [first, first + keys per copy): no division by the run-time keys per copy
            keys_per_copy = geometry[3]
            first = window_keys + copy_seen(q_idx, queries_per_copy, geometry[4]) * keys_per_copy
            seen = seen & (kv_idx >= first) & (kv_idx < first + keys_per_copy)
        if has_window:
            seen = seen | (is_window & window_rule(t, kv_idx + (k_start - shift), window, causal))
        if key_valid is not None:
            seen = seen & key_valid[b, kv_idx]
        return seen

    return long_short_mask


def copy_seen(q_idx, queries_per_copy: int, last_copy):
    """The copy of the extra keys that query ``q_idx`` sees: its band of ``queries_per_copy`` queries, the queries
    past the last band in the last copy."""
    return torch.clamp(q_idx // queries_per_copy, max=last_copy)


def _mask_device(device: torch.device | str | None, *tensors: Tensor | None) -> torch.device:
    """``device``, else that of the first of ``tensors`` given, else the CPU."""
    for tensor in tensors:
        device = tensor.device if device is None and tensor is not None else device
    return torch.device("cpu" if device is None else device)


# ------------------------------------------------------------------------------------------------- BlockMask
# A ``BlockMask``'s tensors: per query block the key blocks it sees partly and fully, then per key block the query
# blocks that see it so (FlexAttention's backward pass reads those), each as a count and the indices.
_MASK_TENSORS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


class _BlockGeometry(NamedTuple):
    """Per (query block, key block), from the window geometry alone (every key valid): the key-index spans
    ``[window_start, window_end)`` and ``[extra_start, extra_end)`` of the block that some query of the block sees
    (empty spans have end == start), and whether every query of the block sees every key of it (``full``; never for a
    block cut short by the end of the queries or keys). ``key_start``/``key_end`` (key blocks): each block's keys."""

    window_start: Tensor
    window_end: Tensor
    extra_start: Tensor
    extra_end: Tensor
    full: Tensor
    key_start: Tensor
    key_end: Tensor


def _block_geometry(
    layout: KeyLayout, num_queries: int, q_block: int, kv_block: int, device: torch.device, shift: int | Tensor = 0
) -> _BlockGeometry:
    """``_BlockGeometry`` on the (query blocks, key blocks) grid of ``layout`` for ``num_queries`` queries, positions
    shifted by ``-shift``: 0, or each row's offset as a (B, 1, 1) tensor (then (B, query blocks, key blocks) grids). A
    query's visible keys form one interval per kind whose ends do not decrease with its position, so the block's
    first query ``a`` and last query ``z`` give their union ``[lo(a), hi(z))`` and intersection ``[lo(z), hi(a))``."""
    m, L, R = num_queries, layout.num_window_keys, layout.num_extra_keys
    q_shift, k_shift = layout.q_start - shift, layout.k_start - shift
    first = torch.arange(0, m, q_block, device=device)[:, None]  # (query blocks, 1)
    last = torch.clamp(first + q_block, max=m) - 1
    key_start = torch.arange(0, L + R, kv_block, device=device)  # (key blocks,)
    key_end = torch.clamp(key_start + kv_block, max=L + R)
    complete = (first + q_block <= m) & (key_start + kv_block <= L + R)

    def spans(part_start, part_end, union, inter):
        """The block's keys in ``[part_start, part_end)`` that some query sees (clipped to the block), and whether
        all of them are seen by every query (an empty part counts as seen)."""
        start = torch.maximum(key_start, part_start)
        end = torch.minimum(key_end, part_end)
        seen_start = torch.maximum(start, union[0])
        seen_end = torch.maximum(torch.minimum(end, union[1]), seen_start)
        all_seen = (end <= start) | ((start >= inter[0]) & (end <= inter[1]))
        return seen_start, seen_end, all_seen

    zero = torch.zeros((), dtype=torch.long, device=device)
    if L:
        (low_a, high_a), (low_z, high_z) = (
            window_bounds(t + q_shift, layout.window_size, layout.causal) for t in (first, last)
        )
        window = spans(zero, zero + L, (low_a - k_shift, high_z - k_shift), (low_z - k_shift, high_a - k_shift))
    else:
        window = (key_start, key_start, torch.ones((), dtype=torch.bool, device=device))
    if layout.segment_length is None:  # the extra keys of the query's copy (every one without copies)
        per_copy, last_copy = layout.keys_per_copy, layout.extra_key_copies - 1
        copy_a, copy_z = (copy_seen(t, layout.queries_per_copy, last_copy) for t in (first, last))
        union = (L + per_copy * copy_a, L + per_copy * (copy_z + 1))
        intersection = (L + per_copy * copy_z, L + per_copy * (copy_a + 1))
    else:  # rows [0, r * finished segments) of the segment-major projected rows (Eq. 5)
        rows_a, rows_z = (
            torch.clamp(layout.projection_rank * finished_segments(t + q_shift, layout.segment_length), 0, R)
            for t in (first, last)
        )
        union, intersection = (zero + L, L + rows_z), (zero + L, L + rows_a)
    extra = spans(zero + L, zero + L + R, union, intersection)
    spans_and_full = torch.broadcast_tensors(*window[:2], *extra[:2], complete & window[2] & extra[2])
    return _BlockGeometry(*spans_and_full, key_start, key_end)


# The geometry of a layout without offsets, per shape: a second call with the same shape reuses it.
_cached_block_geometry = cached_outside_compile(maxsize=32)(_block_geometry)


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """A (B, query blocks, key blocks) bool grid as ``BlockMask.from_kv_blocks`` takes it: the number of chosen key
    blocks per query block (B, 1, Q) and their indices, ascending, followed by the others (B, 1, Q, K), int32 (the
    stable descending argsort of the grid, as ``create_block_mask`` orders them, by two cumulative sums)."""
    chosen = blocks.to(torch.int32)
    counts = chosen.sum(-1, dtype=torch.int32)
    rank = torch.where(blocks, chosen.cumsum(-1) - 1, counts[..., None] + (1 - chosen).cumsum(-1) - 1)
    key_blocks = torch.arange(blocks.shape[-1], dtype=torch.int32, device=blocks.device).expand_as(chosen)
    indices = torch.empty_like(chosen).scatter_(-1, rank.long(), key_blocks)
    return counts[:, None].contiguous(), indices[:, None].contiguous()


def long_short_block_mask(
    layout: KeyLayout,
    *,
    num_queries: int,
    key_valid: Tensor | None = None,
    offsets: Tensor | None = None,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    device: torch.device | str | None = None,
) -> BlockMask:
    """The ``BlockMask`` of ``long_short_mask_mod(layout, key_valid=..., offsets=...)`` (its mask_mod) for
    ``num_queries`` queries, built from the window geometry: O(blocks) per call, the geometry cached per shape (without
    offsets), and without padding or offsets the whole mask, which every layer and call of that shape then shares.
    FlexAttention calls the mask_mod only on partial blocks: those cut by the window's edges, padding, the
    ends of the queries or keys, and the causal projected rows. Equal, block class by block class, to
    ``create_block_mask(mask_mod, B, None, num_queries, L + R, BLOCK_SIZE=block_size)``.

    ``block_size``: ``(query block, key block)``, or one int for both. Batch size: the rows of ``key_valid`` /
    ``offsets``, else 1 (broadcast over the batch); one head (broadcast over the heads). ``device``: by default
    ``key_valid``'s or ``offsets``', else the CPU.
    """
    if not is_int(num_queries) or num_queries < 1:
        raise ValueError(f"num_queries must be an integer >= 1, got {num_queries!r}.")
    q_block, kv_block = (block_size, block_size) if is_int(block_size) else tuple(block_size)
    if not (is_int(q_block) and is_int(kv_block) and q_block >= 1 and kv_block >= 1):
        raise ValueError(f"block_size must be an integer >= 1 or a pair of them, got {block_size!r}.")
    _batch_size(layout, key_valid, offsets)
    device = _mask_device(device, key_valid, offsets)
    if key_valid is None and offsets is None:
        return _unpadded_block_mask(layout, num_queries, q_block, kv_block, device)
    return _block_mask(layout, num_queries, q_block, kv_block, device, key_valid=key_valid, offsets=offsets)


def _block_mask(
    layout: KeyLayout,
    num_queries: int,
    q_block: int,
    kv_block: int,
    device: torch.device,
    *,
    key_valid: Tensor | None = None,
    offsets: Tensor | None = None,
) -> BlockMask:
    """``long_short_block_mask`` after its checks."""
    batch = _batch_size(layout, key_valid, offsets)
    if offsets is None:
        grids = _cached_block_geometry(layout, num_queries, q_block, kv_block, device)
    else:  # each row's geometry at its offset, computed on the device without reading the offsets back
        grids = _block_geometry(layout, num_queries, q_block, kv_block, device, shift=offsets.to(device)[:, None, None])
    if key_valid is None:
        seen = (grids.window_end > grids.window_start) | (grids.extra_end > grids.extra_start)
        full = grids.full
    else:  # count the valid keys of each span: a prefix sum over each row's keys
        counts = F.pad(key_valid.cumsum(-1, dtype=torch.int32), (1, 0))

        def valid_keys(start, end):  # per row, the valid keys in [start, end): (B, rows, cols)
            shape = (batch, *start.shape[-2:])
            start, end = (x.expand(shape).reshape(batch, -1) for x in (start, end))
            return (counts.gather(1, end) - counts.gather(1, start)).view(shape)

        seen = (valid_keys(grids.window_start, grids.window_end) + valid_keys(grids.extra_start, grids.extra_end)) > 0
        key_blocks_valid = valid_keys(grids.key_start[..., None, :], grids.key_end[..., None, :])
        full = grids.full & (key_blocks_valid == (grids.key_end - grids.key_start)[..., None, :])
    partial, full = (x.expand(batch, *x.shape[-2:]) for x in (seen & ~full, full))
    # per query block the key blocks it sees, and per key block the query blocks that see it (the backward pass's)
    by_query, by_key = ([*_ordered(x), *_ordered(full_x)] for x, full_x in ((partial, full), (partial.mT, full.mT)))
    return BlockMask(
        seq_lengths=(num_queries, layout.num_keys),
        **dict(zip(_MASK_TENSORS, [*by_query, *by_key])),
        BLOCK_SIZE=(q_block, kv_block),
        mask_mod=long_short_mask_mod(layout, key_valid=key_valid, offsets=offsets, device=device),
    )


# The mask of a layout without padding or offsets (training on packed or equal-length sequences), per shape.
_unpadded_block_mask = cached_outside_compile(maxsize=32)(_block_mask)


# ---------------------------------------------------------------------------------------------- FlexAttention
# Compilations that each function the package compiles (``compile_in_package``) may make before dynamo falls back to
# running it uncompiled (for FlexAttention: the unfused kernel, which materialises every score): one per grad mode,
# batch size, stride pattern, mask closure and layer configuration a process meets, and compiled with static shapes
# (the 2-D path), per input shape (8, dynamo's default, was reached by one process training and evaluating several
# models).
RECOMPILE_LIMIT = 64


def compile_in_package(
    fn: Callable, *, activation_memory_budget: float | None = None, static_shapes: bool = False
) -> Callable:
    """``torch.compile(fn)``, called with dynamo's recompile limit raised to ``RECOMPILE_LIMIT`` while it runs. Its
    compilations count against a limit of its own, not against those of any other compiled function in the process.
    Dynamo's ``nested_graph_breaks`` is on while it runs: a compile boundary deep in ``fn`` (the attention kernel's
    call, three calls down in the layer) splits it into one graph before and one after, not a graph before and after in
    every frame on the way (about 6 forward graphs a layer, each with its guards and its autograd node, to 2). Dynamo
    guards on module hooks while it runs (off by default: ``skip_nnmodule_hook_guards``): the code compiled for one
    module serves another of the same settings, and a module whose Linear has a forward hook, or loses it, gets code of
    its own that runs its hooks. ``activation_memory_budget``: compiled by inductor with torch's setting of that name
    (``inductor_with_memory_budget``), whose code dynamo keeps apart from the default backend's. ``static_shapes``:
    every new input shape compiles code specialised to it (``torch.compile(dynamic=False)``), for inputs of few shapes
    (images); by default the sizes become symbolic after the first that differs, so that text of any length compiles a
    few times at most."""
    backend = (
        "inductor"
        if activation_memory_budget is None
        else functools.partial(inductor_with_memory_budget, budget=activation_memory_budget)
    )
    compiled = torch.compile(fn, backend=backend, dynamic=False if static_shapes else None)
    # made once: entering a patch made anew costs about 3x as much host time (70 us a call on a 2-core CPU)
    settings = torch._dynamo.config.patch(
        recompile_limit=RECOMPILE_LIMIT, nested_graph_breaks=True, skip_nnmodule_hook_guards=False
    )

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with settings:
            return compiled(*args, **kwargs)

    return run


def inductor_with_memory_budget(graph: torch.fx.GraphModule, example_inputs: list, *, budget: float) -> Callable:
    """A ``torch.compile`` backend: inductor, partitioning forward and backward with torch's
    ``activation_memory_budget`` at ``budget`` (below 1: the backward pass recomputes what it would otherwise keep,
    the cheapest first, until what is kept fits). Equal ``torch.compile`` backends share compiled code, so code
    compiled with a budget needs a backend of its own."""
    from torch._inductor.compile_fx import compile_fx

    with torch._functorch.config.patch(activation_memory_budget=budget):
        return compile_fx(graph, example_inputs)


@functools.cache
def compiled_flex_attention(static_shapes: bool = False) -> Callable:
    """``flex_attention`` compiled once per process (as Transformers' flex integration does): the fused kernel, which
    skips the blocks that no query sees. It is compiled as a function of its own (``compile_in_package``, with its
    ``static_shapes``)."""
    flex = flex_attention  # bound now: a later patch of this module's name does not reach it

    def long_short_flex_attention(query, key, value, **kwargs):  # the keywords of ``flex_call``
        return flex_call(flex, query, key, value, **kwargs)

    return compile_in_package(long_short_flex_attention, static_shapes=static_shapes)


def flex_call(flex: Callable, query, key, value, *, score_mod, block_mask, scale, return_lse: bool, tokens_first=False):
    """``flex(query, key, value, ...)``: the output, or with ``return_lse`` the output and the log-sum-exp (asked for
    as FlexAttention's auxiliary output). ``tokens_first``: query, key and value are (B, m, H, E) and the output is
    (B, m, H, Ev); ``flex`` gets them heads first as views (contiguous copies where ``contiguous_inputs``), and
    its output, laid out as the query, is handed back as a view too."""
    if tokens_first:
        query, key, value = (x.transpose(1, 2) for x in (query, key, value))
        if contiguous_inputs(query.device):
            query, key, value = (x.contiguous() for x in (query, key, value))
    if return_lse:
        out, aux = flex(
            query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True)
        )
    else:
        out = flex(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale)
    if tokens_first:
        out = out.transpose(1, 2)
    return (out, aux.lse) if return_lse else out


def long_short_flex_attend(
    query: Tensor, key: Tensor, value: Tensor, block_mask: BlockMask, *, return_lse: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """``flex_attend`` of query (B, m, H, E) over key and value (B, L + R, H, .) with ``block_mask``
    (``long_short_block_mask``): (B, m, H, Ev), and with ``return_lse`` each query's log-sum-exp of its scores
    (B, H, m) float32 too. Token-major, as the projections make them (``flex_attend``'s ``tokens_first``), turned heads
    first inside the kernel's region.

    Inside a ``torch.compile`` region (the package's compiled layer, or the caller's) on ``FUSED_DEVICES`` the kernel
    joins the region's graph, the mask one of its inputs: one graph a layer, forward and backward. Elsewhere the call
    is a compile boundary (``_flex_attend_outside_graph``)."""
    if torch.compiler.is_compiling() and query.device.type in FUSED_DEVICES:
        return flex_attend(query, key, value, block_mask, return_lse=return_lse, tokens_first=True)
    return _flex_attend_outside_graph(query, key, value, block_mask, return_lse=return_lse)


@torch.compiler.disable
def _flex_attend_outside_graph(query, key, value, block_mask, *, return_lse) -> Tensor | tuple[Tensor, Tensor]:
    """``long_short_flex_attend`` as a compile boundary: inside a compiled region the region breaks here, and the mask
    runs on the package's compiled kernel, as outside one. Every tensor that crosses the boundary is token-major and
    contiguous, where a heads-first view would make torch 2.11's AOTAutograd copy each of their gradients into a
    contiguous tensor in the backward pass (four copies of the layer's width per layer). Lowered inside a larger
    graph, FlexAttention miscompiles some of these masks on the CPU (inductor's CPU kernel, torch 2.14: with a cls
    key, or without window keys but with padding)."""
    return flex_attend(query, key, value, block_mask, return_lse=return_lse, tokens_first=True)


def _pad_head_dim(x: Tensor) -> Tensor:
    """x (..., E) on CUDA zero-padded to ``FLEX_MIN_HEAD_DIM`` features when narrower: dot products and the weighted
    values' first E features are unchanged. The CPU kernel takes any head dim."""
    return F.pad(x, (0, FLEX_MIN_HEAD_DIM - x.shape[-1])) if x.is_cuda and x.shape[-1] < FLEX_MIN_HEAD_DIM else x


def flex_attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    block_mask: BlockMask,
    *,
    score_mod: Callable | None = None,
    scale: float | None = None,
    compiled: bool | None = None,
    return_lse: bool = False,
    tokens_first: bool = False,
    static_shapes: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """FlexAttention of query (B, H, m, E) over key (B, H, K, E) and value (B, H, K, Ev) with ``block_mask`` and an
    optional ``score_mod``: (B, H, m, Ev). A query that sees no key gets 0. ``tokens_first``: query (B, m, H, E), key
    and value (B, K, H, .) and the output (B, m, H, Ev) instead, turned heads first and back inside the compiled
    kernel's region (``flex_call``), so that its inputs and output stay contiguous.

    ``compiled``: use ``compiled_flex_attention`` (default: on ``FUSED_DEVICES`` in ``FUSED_DTYPES``; inside a
    function being compiled, the plain ``flex_attention``, which the outer compilation fuses). ``scale``: default
    ``1 / sqrt(E)``. On CUDA head dims below ``FLEX_MIN_HEAD_DIM`` are zero-padded to it, which is exact, and the
    output is cut back to Ev. ``return_lse``: also each query's log-sum-exp of its scores, (B, H, m) float32 (-inf
    for a query that sees no key); gradients flow through it on CUDA. ``static_shapes``: the compiled kernel is
    specialised to each shape it meets (``compiled_flex_attention(static_shapes=True)``), its mask's arithmetic on
    the sizes done at compile time.
    """
    if compiled is None:
        compiled = query.device.type in FUSED_DEVICES and query.dtype in FUSED_DTYPES
    # compiled for the CPU, FlexAttention returns no log-sum-exp (torch 2.14): there it runs uncompiled
    compiled = compiled and not torch.compiler.is_compiling() and not (return_lse and query.device.type == "cpu")
    kernel = compiled_flex_attention(static_shapes) if compiled else functools.partial(flex_call, flex_attention)
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    value_dim = value.shape[-1]
    query, key, value = (_pad_head_dim(x) for x in (query, key, value))
    if compiled and contiguous_inputs(query.device):
        query, key, value = (x.contiguous() for x in (query, key, value))
    out = kernel(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        return_lse=return_lse,
        tokens_first=tokens_first,
    )
    if return_lse:
        out, lse = out
        return out[..., :value_dim], lse
    return out[..., :value_dim]
