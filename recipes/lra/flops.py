"""FLOPs per example of the LRA model, counted by ``torch.utils.flop_counter.FlopCounterMode`` (forward pass, one
example). Table 1 counts multiply-adds (fvcore) on the official input, padded to 2,048 tokens for ListOps; a
multiply-add is 2 FLOPs for ``FlopCounterMode``, so ``macs = flops / 2`` is the number to set beside the paper's.

``python -m recipes.lra.flops --length 2048`` prints one line per attention.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from .model import ATTENTIONS, LRAClassifier, LRAConfig


def _cpu_sdpa(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """The CPU fused attention kernel, counted as torch counts the CUDA ones (every query-key pair of its call)."""
    return sdpa_flop_count(query, key, value)


def count(config: LRAConfig, length: int) -> dict:
    """Forward FLOPs of one example of ``length`` tokens, total and by operator."""
    model = LRAClassifier(config).eval()
    ids = [torch.ones(1, length, dtype=torch.long)] * (2 if config.dual else 1)
    masks = [torch.ones(1, length, dtype=torch.bool)] * len(ids)
    cpu_sdpa = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa}
    with FlopCounterMode(display=False, custom_mapping=cpu_sdpa) as counter:  # (its module tracker needs autograd on)
        model(ids, masks)
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}
    total = counter.get_total_flops()
    return {"flops": total, "gmacs": total / 2e9, "by_op": by_op}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m recipes.lra.flops", description=__doc__)
    p.add_argument("--length", type=int, default=2048, help="tokens per example (ListOps' official input: 2048)")
    p.add_argument("--window_size", type=int, default=8)
    p.add_argument("--projection_rank", type=int, default=32)
    p.add_argument("--num_classes", type=int, default=10)
    p.add_argument("--dual", action="store_true", help="Retrieval's two documents")
    p.add_argument("--json", help="also write the counts here")
    args = p.parse_args(argv)
    rows = {}
    for attention in ATTENTIONS:
        config = LRAConfig(
            vocab_size=16,
            max_length=args.length,
            num_classes=args.num_classes,
            attention=attention,
            window_size=args.window_size,
            projection_rank=args.projection_rank,
            dual=args.dual,
        )
        rows[attention] = count(config, args.length)
        print(
            f"{attention:>11}: {rows[attention]['gmacs']:.3f} G multiply-adds per example "
            f"({rows[attention]['flops'] / 1e9:.3f} GFLOPs) at {args.length} tokens"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "length": args.length,
                    "window_size": args.window_size,
                    "projection_rank": args.projection_rank,
                    "torch": torch.__version__,
                    "counts": rows,
                },
                f,
                indent=1,
            )
    return rows


if __name__ == "__main__":
    main()
