"""The 2-D window as FlexAttention's block-sparse structure (``ls_timm.long_short_blocks_2d``): the window-tile order
(to it and back) and its mask_mod against the SDPA path's rule in raster order (``window_keep_2d``), and the BlockMask
built from the tile geometry against the one FlexAttention builds by evaluating the mask_mod on every (query, key)
pair, block class by block class, over a grid of map sizes (sides that w does not divide included), windows, extra
keys and block sizes.

Eager FlexAttention ignores the block classes; the outputs of the fused path against the SDPA path are in
test_timm_flex_attention.py (the compiled cases there are where a wrong class would show). Checked, never timed.
"""

import itertools

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from ls_timm.long_short_attention_2d import window_keep_2d
from ls_timm.long_short_blocks_2d import (
    cached_tile_block_mask,
    from_tile_order,
    tile_block_mask,
    tile_mask_mod,
    tile_position,
    tile_slots,
    to_tile_order,
)

CPU = torch.device("cpu")
SIDES = (1, 3, 7, 8, 10, 13)
BLOCKS = (8, 16, (16, 8), (8, 32), 128)


def raster_positions(H: int, W: int) -> torch.Tensor:
    return torch.stack(torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij"), -1).view(-1, 2)


def assert_same_blocks(got, expected):
    """Equal partial and full blocks: the same counts per query block and the same key blocks among them."""
    assert got.seq_lengths == expected.seq_lengths and got.BLOCK_SIZE == expected.BLOCK_SIZE
    for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        count = getattr(expected, counts)
        torch.testing.assert_close(getattr(got, counts), count, rtol=0, atol=0)
        chosen = torch.arange(getattr(expected, indices).shape[-1]) < count[..., None]
        assert torch.equal(getattr(got, indices)[chosen], getattr(expected, indices)[chosen])


@pytest.mark.parametrize("window", [1, 2, 3, 4, 7, 8])
def test_block_mask_equals_create_block_mask(window):
    """Every map size of the grid, each with one of the (extra keys, block size) pairs in turn: the block classes from
    the tile geometry equal those of ``create_block_mask`` over the same mask_mod."""
    classes = {"partial": 0, "full": 0, "none": 0}
    extra_and_blocks = itertools.cycle(itertools.product((0, 1, 9), BLOCKS))
    for (H, W), (extra, block) in zip(itertools.product(SIDES, SIDES), extra_and_blocks):
        slots = tile_slots((H, W), window)
        expected = create_block_mask(
            tile_mask_mod((H, W), window), None, None, slots, slots + extra, device=CPU, BLOCK_SIZE=block
        )
        got = tile_block_mask((H, W), window, extra, block_size=block)
        assert_same_blocks(got, expected)
        partial, full = int(got.kv_num_blocks.sum()), int(got.full_kv_num_blocks.sum())
        classes["partial"] += partial
        classes["full"] += full
        classes["none"] += got.kv_indices.numel() - partial - full
    assert min(classes.values()) > 0  # the grid has blocks of every class


@pytest.mark.parametrize("H,W,w", [(7, 9, 3), (8, 8, 4), (5, 11, 2), (6, 4, 7), (9, 9, 1), (12, 10, 8)])
def test_tile_order_is_the_window_rule(H, W, w):
    """``to_tile_order`` puts each patch in the slot ``tile_position`` names (zeros in the padding), heads first, and
    ``from_tile_order`` takes it back; the mask_mod, read back in raster order, is the SDPA path's 2-D rule plus the
    extra keys, and no query sees a padding slot."""
    extra, slots = 3, tile_slots((H, W), w)
    assert slots % (w * w) == 0 and slots >= H * W
    y, x = tile_position(torch.arange(slots), W, w)
    inside = (y < H) & (x < W)
    assert int(inside.sum()) == H * W
    numbered = torch.arange(1.0, H * W + 1, dtype=torch.float64).view(1, H * W, 1)  # raster row + 1
    assert torch.equal(
        to_tile_order(numbered, (H, W), w, heads=1)[0, 0, :, 0], torch.where(inside, y * W + x + 1, 0).double()
    )
    rows = torch.randn(2, H * W, 3 * 4, dtype=torch.float64)
    tiles = to_tile_order(rows, (H, W), w, heads=3)
    for head in range(3):
        assert torch.equal(tiles[:, head], to_tile_order(rows[..., 4 * head : 4 * head + 4], (H, W), w, heads=1)[:, 0])
    assert torch.equal(from_tile_order(tiles, (H, W), w), rows)

    mask = create_mask(tile_mask_mod((H, W), w), None, None, slots, slots + extra, device=CPU)[0, 0]
    raster = raster_positions(H, W)
    expected = torch.cat([window_keep_2d(raster, raster, w, (H, W)), torch.ones(H * W, extra, dtype=torch.bool)], 1)
    slot_of = from_tile_order(torch.arange(slots, dtype=torch.float64).view(1, 1, slots, 1), (H, W), w)[0, :, 0].long()
    keys = torch.cat([slot_of, torch.arange(slots, slots + extra)])
    assert torch.equal(mask[slot_of][:, keys], expected)
    assert not mask[:, :slots][:, ~inside].any()


def test_block_mask_is_cached_per_shape():
    """One BlockMask per (map size, window, extra keys, device), shared by every layer of a stage."""
    first = cached_tile_block_mask((9, 7), 3, 5, CPU)
    assert cached_tile_block_mask((9, 7), 3, 5, CPU) is first
    assert cached_tile_block_mask((9, 7), 3, 4, CPU) is not first
    with torch.inference_mode():  # built outside inference mode: usable in training afterwards
        made_there = cached_tile_block_mask((11, 7), 3, 5, CPU)
    assert not made_there.kv_num_blocks.is_inference()
