"""How block-sparse the 2-D Long-Short window is for FlexAttention, in raster order and in window-tile order, and how
much the Triton window kernel computes instead.

For every Long-Short stage of the given timm models at the given input sides (its map size, window w and extra keys,
read from the layers' inputs in one forward pass), the visibility of every patch query is evaluated on every key, one
block of queries at a time, with the SDPA path's rule (``window_keep_2d``), in the two token orders:

* raster: keys [the map in raster order; extra keys];
* tile: keys [the map in window-tile order, padded to multiples of w; extra keys] (``ls_timm.long_short_blocks_2d``),
  whose block classes must equal those that ``tile_block_mask`` builds from the tile geometry (checked here).

Per (order, stage) it reports the fraction of (query block, key block) pairs a FlexAttention kernel visits (partial or
full), the fraction of those that are full (no mask_mod call), and the score entries computed (visited blocks x block
size^2) per entry the window rule keeps; the same for the window kernel (``ls_timm.window_kernel_2d``: its programs x
their key steps x query lanes x keys per step, from its ``launch_geometry``); per (order, model, side), the scores
computed by all its Long-Short layers. Hardware-independent: blocks are counted, nothing is timed.

    python -m bench.blocks_2d                                      # cvt_ls_13 and vil_ls_medium at 224 and 448

Writes ``bench/results/blocks_2d.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse

import timm
import torch

import ls_timm  # noqa: F401  (registers the models)
from bench.common import results_path, run_meta, write_json
from ls_timm.long_short_attention_2d import LongShortAttention2d, window_keep_2d
from ls_timm.long_short_blocks_2d import tile_block_mask, tile_position, tile_slots
from ls_timm.window_kernel_2d import KEY_BLOCK, launch_geometry


def stage_shapes(name: str, side: int) -> dict[tuple[tuple[int, int], int, int], int]:
    """The (map size, window, extra keys) of the Long-Short layers of ``name`` at ``side`` x ``side``, and how many
    layers have each."""
    model = timm.create_model(name, img_size=side).eval()
    shapes = {}

    def record(module, args):
        shape = (tuple(args[1]), module.window_size, module.projection_rank + module.num_prefix_tokens)
        shapes[shape] = shapes.get(shape, 0) + 1

    for module in model.modules():
        if isinstance(module, LongShortAttention2d):
            module.register_forward_pre_hook(record)
    with torch.inference_mode():
        model(torch.zeros(1, 3, side, side))
    return shapes


def brute_force_classes(
    positions: torch.Tensor, feat_size: tuple[int, int], window: int, extra: int, block: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The partial and full (query blocks, key blocks) grids of the patch queries at ``positions`` (slots, 2) against
    the keys [the same slots; ``extra`` keys], and how many (query, key) pairs of the map's real queries are kept."""
    slots = len(positions)
    keys = slots + extra
    pad = (-keys) % block
    partial, full, kept = [], [], 0
    real = (positions < torch.tensor(feat_size)).all(-1)
    for start in range(0, slots, block):
        q = positions[start : start + block]
        keep = torch.cat(
            [
                window_keep_2d(q, positions, window, feat_size),
                torch.ones(len(q), extra, dtype=torch.bool),
                torch.zeros(len(q), pad, dtype=torch.bool),
            ],
            1,
        )
        kept += int(keep[real[start : start + block]].sum())
        keep = torch.cat([keep, keep.new_zeros(block - len(q), keep.shape[1])]).view(block, -1, block)
        seen, every = keep.any(-1).any(0), keep.all(-1).all(0)
        partial.append(seen & ~every)
        full.append(every)
    return torch.stack(partial), torch.stack(full), kept


def block_classes(mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial and full (query blocks, key blocks) grids of a ``BlockMask`` (batch 1, one head)."""
    grids = []
    for counts, indices in ((mask.kv_num_blocks, mask.kv_indices), (mask.full_kv_num_blocks, mask.full_kv_indices)):
        counts, indices = counts[0, 0], indices[0, 0].long()
        chosen = torch.arange(indices.shape[-1]) < counts[:, None]
        grids.append(torch.zeros_like(chosen).scatter_(1, indices, chosen))
    return grids[0], grids[1]


def measure(feat_size: tuple[int, int], window: int, extra: int, block: int) -> dict:
    """Both orders' block counts and the window kernel's work for one stage (this module's docstring)."""
    H, W = feat_size
    raster = torch.stack(torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij"), -1).view(-1, 2)
    tile = torch.stack(tile_position(torch.arange(tile_slots(feat_size, window)), W, window), -1)
    rows = {}
    for order, positions in (("raster", raster), ("tile", tile)):
        partial, full, kept = brute_force_classes(positions, feat_size, window, extra, block)
        if order == "tile":
            built = block_classes(tile_block_mask(feat_size, window, extra, block_size=block))
            if not (torch.equal(built[0], partial) and torch.equal(built[1], full)):
                raise AssertionError(f"tile_block_mask differs from the rule at {feat_size}, w={window}, X={extra}")
        visited = int(partial.sum() + full.sum())
        rows[order] = {
            "slots": len(positions),
            "query_blocks": partial.shape[0],
            "key_blocks": partial.shape[1],
            "visited": visited,
            "full": int(full.sum()),
            "visited_fraction": visited / partial.numel(),
            "full_fraction_of_visited": int(full.sum()) / visited,
            "computed": visited * block * block,
            "computed_per_kept": visited * block * block / kept,
        }
    geometry = launch_geometry(feat_size, window, extra)
    computed = geometry.programs * geometry.steps * geometry.block_q * KEY_BLOCK
    rows["window kernel"] = {
        "slots": H * W,
        "programs": geometry.programs,
        "steps": geometry.steps,
        "computed": computed,
        "computed_per_kept": computed / kept,
    }
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["cvt_ls_13", "vil_ls_medium"])
    parser.add_argument("--sides", nargs="+", type=int, default=[224, 448])
    parser.add_argument("--block", type=int, default=128, help="FlexAttention's block size (queries and keys)")
    args = parser.parse_args(argv)
    results = {"meta": run_meta("blocks_2d", argv, block=args.block), "rows": []}
    print(
        "| model | side | map | w | extra keys | layers | order | slots | visited blocks | visited fraction "
        "| full of visited | computed / kept |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    totals = []
    for name in args.models:
        for side in args.sides:
            total = {"model": name, "side": side, "raster": 0, "tile": 0, "window kernel": 0}
            for (feat_size, window, extra), layers in stage_shapes(name, side).items():
                for order, row in measure(feat_size, window, extra, args.block).items():
                    total[order] += layers * row["computed"]
                    results["rows"].append(
                        {
                            "model": name,
                            "side": side,
                            "map": feat_size,
                            "window": window,
                            "extra": extra,
                            "layers": layers,
                            "order": order,
                            **row,
                        }
                    )
                    if order == "window kernel":
                        visited = f"{row['programs']} programs x {row['steps']} steps | - | -"
                    else:
                        visited = (
                            f"{row['visited']} / {row['query_blocks'] * row['key_blocks']} | "
                            f"{row['visited_fraction']:.0%} | {row['full_fraction_of_visited']:.0%}"
                        )
                    print(
                        f"| `{name}` | {side} | {feat_size[0]} x {feat_size[1]} | {window} | {extra} | {layers} | "
                        f"{order} | {row['slots']} | {visited} | {row['computed_per_kept']:.1f}x |"
                    )
            totals.append(total)
    print(
        "\n| model | side | scores computed by all Long-Short layers (millions), raster | tile | window kernel "
        "| tile / raster | window kernel / tile |"
    )
    print("|---|---|---|---|---|---|---|")
    for total in totals:
        print(
            f"| `{total['model']}` | {total['side']} | {total['raster'] / 1e6:.1f} | {total['tile'] / 1e6:.1f} | "
            f"{total['window kernel'] / 1e6:.1f} | {total['tile'] / total['raster']:.2f} | "
            f"{total['window kernel'] / total['tile']:.2f} |"
        )
    results["totals"] = totals
    write_json(results_path("blocks_2d", False), results)


if __name__ == "__main__":
    main()
