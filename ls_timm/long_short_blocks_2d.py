"""The 2-D Long-Short window (Zhu et al., "Long-Short Transformer", NeurIPS 2021, Sec. 3.2, 4.3) as FlexAttention's
block-sparse structure, built from the tile geometry and never evaluated over all (query, key) pairs: the 2-D
counterpart of ``ls_hf.long_short_blocks``.

Token order. In raster order a block of 128 queries spans whole map rows and meets keys from every window along them,
so few key blocks can be skipped (``cvt_ls_13`` at 224: 34-100 % of a stage's key blocks visited in raster order,
3.9-17.8x the scores the window keeps, 2026-11). Here the patches are laid out in window-tile order: the map,
padded to multiples of w, is cut into the w x w query blocks of the window rule ("tiles"), each tile's tokens
contiguous (raster order inside it), the tiles in raster order; slot ``i`` holds a token of tile ``i // w^2``. The
keys are [the patches in the same order; the extra keys (projected rows, global tokens)], which every query sees.
Slots outside the map are queries whose outputs are dropped and keys that no query sees.

Block classes. Every query of a tile sees the same keys: the rows ``Y`` and columns ``X`` of the tile's window
(``window_bounds`` on each axis) inside the map. How many patch keys of the slots ``[0, m)`` lie in ``Y x X`` follows
from the tile geometry in O(1) (``_keys_before``), so each (tile, key block) pair gets its count of visible keys. A
FlexAttention query block holds a run of tiles; it visits a key block if one of them sees a key of it, and the block
is full if all of them see all its keys (never for a block cut short by the end of the queries or keys), as
``create_block_mask`` classifies the mask of ``tile_mask_mod``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from ls_hf.long_short_rules import cached_outside_compile, window_bounds, window_rule

__all__ = [
    "cached_tile_block_mask",
    "from_tile_order",
    "tile_block_mask",
    "tile_mask_mod",
    "tile_position",
    "tile_slots",
    "to_tile_order",
]

DEFAULT_BLOCK_SIZE = 128


def _tile_grid(feat_size: tuple[int, int], window: int) -> tuple[int, int]:
    """Tiles per column and per row of an (H, W) map."""
    (H, W), w = feat_size, window
    return -(-H // w), -(-W // w)


def tile_slots(feat_size: tuple[int, int], window: int) -> int:
    """Slots of the patches of an (H, W) map in tile order: the map padded to multiples of ``window``."""
    rows, cols = _tile_grid(feat_size, window)
    return rows * cols * window * window


def tile_position(slot, width: int, window: int):
    """The 2-D position ``(y, x)`` of the patch slot ``slot`` (an int or a tensor, elementwise) of a map ``width``
    wide in tile order; slots of the padding get positions outside the map."""
    w = window
    tile, inner = slot // (w * w), slot % (w * w)
    tiles_per_row = -(-width // w)
    return tile // tiles_per_row * w + inner // w, tile % tiles_per_row * w + inner % w


def tile_mask_mod(feat_size: tuple[int, int], window: int) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """FlexAttention's ``mask_mod`` for the queries and keys of tile order: the key at ``kv_idx`` is seen if it is an
    extra key, or a patch inside the map and inside the query's window on both axes (``window_rule``). The map size
    is a constant of the closure: the fused path compiles its kernel specialised to each map size
    (``flex_attend(static_shapes=True)``), so every division of the positions' arithmetic is by a compile-time
    constant."""
    (H, W), w = feat_size, window
    patches = tile_slots(feat_size, window)

    def window_2d(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        (qy, qx), (ky, kx) = tile_position(q_idx, W, w), tile_position(kv_idx, W, w)
        in_window = window_rule(qy, ky, w, causal=False) & window_rule(qx, kx, w, causal=False)
        return (kv_idx >= patches) | (in_window & (ky < H) & (kx < W))

    return window_2d


def _overlap(low: Tensor, high: Tensor, start: Tensor | int, end: Tensor | int) -> Tensor:
    """The length of ``[low, high) ∩ [start, end)``, elementwise."""
    return (high.clamp(max=end) - low.clamp(min=start)).clamp(min=0)


def _keys_before(
    slots: Tensor, rows: tuple[Tensor, Tensor], cols: tuple[Tensor, Tensor], width: int, window: int
) -> Tensor:
    """How many patch keys of the slots ``[0, slots)`` lie in the rows ``[rows[0], rows[1])`` and the columns
    ``[cols[0], cols[1])`` (both inside the map), broadcast: those of the whole tile rows above the slot's tile, of the
    tiles left of it in its tile row, of its tile's rows above the slot, and of the slot's row left of it."""
    w = window
    y, x = tile_position(slots, width, w)
    top, left = y - y % w, x - x % w  # the slot's tile
    return (
        _overlap(*rows, 0, top) * (cols[1] - cols[0])
        + _overlap(*rows, top, top + w) * _overlap(*cols, 0, left)
        + _overlap(*rows, top, y) * _overlap(*cols, left, left + w)
        + _overlap(*rows, y, y + 1) * _overlap(*cols, left, x)
    )


def _block_classes(
    feat_size: tuple[int, int], window: int, extra: int, q_block: int, kv_block: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """The (query blocks, key blocks) grids of the partial and the full blocks of ``tile_mask_mod``'s mask over the
    keys [patches in tile order; ``extra`` keys], from the tile geometry (this module's docstring)."""
    (H, W), w = feat_size, window
    patches, tile_size = tile_slots(feat_size, w), w * w
    keys = patches + extra
    tile_top, tile_left = tile_position(torch.arange(0, patches, tile_size, device=device)[:, None], W, w)
    rows = tuple(bound.clamp(0, H) for bound in window_bounds(tile_top, w, causal=False))  # (tiles, 1) each
    cols = tuple(bound.clamp(0, W) for bound in window_bounds(tile_left, w, causal=False))
    key_start = torch.arange(0, keys, kv_block, device=device)
    key_end = (key_start + kv_block).clamp(max=keys)
    seen = (
        _keys_before(key_end.clamp(max=patches), rows, cols, W, w)
        - _keys_before(key_start.clamp(max=patches), rows, cols, W, w)
        + key_end.clamp(min=patches)
        - key_start.clamp(min=patches)
    )  # (tiles, key blocks): keys each tile sees
    q_start = torch.arange(0, patches, q_block, device=device)
    first, last = q_start // tile_size, ((q_start + q_block).clamp(max=patches) - 1) // tile_size
    run = torch.minimum(first[:, None] + torch.arange((q_block - 1) // tile_size + 2, device=device), last[:, None])
    counts = seen[run]  # (query blocks, tiles of the block, key blocks), the last tile repeated to fill
    complete = (q_start + q_block <= patches)[:, None] & (key_start + kv_block <= keys)
    full = (counts == key_end - key_start).all(1) & complete
    return (counts > 0).any(1) & ~full, full


def _kv_blocks(grid: Tensor) -> tuple[Tensor, Tensor]:
    """A (query blocks, key blocks) bool grid as ``BlockMask.from_kv_blocks`` takes it: the number of chosen key blocks
    per query block (1, 1, Q) and their indices, ascending, before the others (1, 1, Q, K), int32."""
    counts = grid.sum(-1, dtype=torch.int32)
    indices = torch.argsort(grid.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None], indices[None, None]


def tile_block_mask(
    feat_size: tuple[int, int],
    window: int,
    extra: int,
    *,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    device: torch.device | str | None = None,
) -> BlockMask:
    """The ``BlockMask`` of ``tile_mask_mod(feat_size, window)`` for the patch queries of an (H, W) map and the keys
    [patches; ``extra`` keys], in tile order, built from the tile geometry (O(tiles x key blocks)); equal, block class
    by block class, to ``create_block_mask(tile_mask_mod(...), None, None, P, P + extra, BLOCK_SIZE=block_size)`` with
    ``P = tile_slots(feat_size, window)``. ``block_size``: ``(query block, key block)`` or one int for both."""
    q_block, kv_block = (block_size, block_size) if isinstance(block_size, int) else block_size
    device = torch.device("cpu" if device is None else device)
    partial, full = _block_classes(tuple(feat_size), window, extra, q_block, kv_block, device)
    (kv_num_blocks, kv_indices), (full_kv_num_blocks, full_kv_indices) = _kv_blocks(partial), _kv_blocks(full)
    patches = tile_slots(feat_size, window)
    return BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        full_kv_num_blocks,
        full_kv_indices,
        BLOCK_SIZE=(q_block, kv_block),
        mask_mod=tile_mask_mod(feat_size, window),
        seq_lengths=(patches, patches + extra),
    )


@cached_outside_compile(maxsize=64)
def cached_tile_block_mask(feat_size: tuple[int, int], window: int, extra: int, device: torch.device) -> BlockMask:
    """``tile_block_mask`` (128-token blocks), cached per (map size, window, extra keys, device): every layer of a stage
    shares it. Built outside inference mode, so that one first made there serves training too."""
    with torch.inference_mode(False):
        return tile_block_mask(feat_size, window, extra, device=device)


def to_tile_order(x: Tensor, feat_size: tuple[int, int], window: int, heads: int) -> Tensor:
    """Patch rows (B, H * W, heads * d) in raster order -> (B, heads, P, d) in tile order, zeros in the padding: one
    contiguous copy, heads first, as FlexAttention takes it."""
    (H, W), w = feat_size, window
    B, _, C = x.shape
    rows, cols = _tile_grid(feat_size, window)
    x = x.view(B, H, W, C)
    if (rows * w, cols * w) != (H, W):
        x = F.pad(x, (0, 0, 0, cols * w - W, 0, rows * w - H))
    x = x.view(B, rows, w, cols, w, heads, C // heads).permute(0, 5, 1, 3, 2, 4, 6)
    return x.reshape(B, heads, rows * cols * w * w, C // heads)


def from_tile_order(x: Tensor, feat_size: tuple[int, int], window: int) -> Tensor:
    """(B, heads, P, d) in tile order -> the rows of the map's positions (B, H * W, heads * d) in raster order."""
    (H, W), w = feat_size, window
    B, heads, _, d = x.shape
    rows, cols = _tile_grid(feat_size, window)
    x = x.view(B, heads, rows, cols, w, w, d).permute(0, 2, 4, 3, 5, 1, 6).reshape(B, rows * w, cols * w, heads * d)
    return x[:, :H, :W].reshape(B, H * W, heads * d)
