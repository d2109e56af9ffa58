"""Inference prefill of Long-Short attention: compiled FlexAttention against the SDPA path (the default), side by side.

One ``LongShortSelfAttention`` (hidden 768, 12 heads, w = 256, r = 64; causal: l = 16, projections included, batch 1)
with the same weights under ``attn_implementation="sdpa"`` (eager, as shipped) and ``"flex_attention"`` wrapped in
``torch.compile`` (compiled once per n; the compile is the warm-up round and is not timed). Forward only, under
``torch.inference_mode``: FlexAttention has no backward on CPU.

    python -m bench.bench_flex                       # n = 4096, 8192, 16384, bidirectional
    python -m bench.bench_flex --causal --n 4096 --repeats 2

Prints a markdown table (times, flex / sdpa ratio, max output difference relative to the output scale) and writes
``bench/results/flex_<device>[_causal].json`` (after each n). Times are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import interleaved_times, results_path, run_meta, write_json
from ls_hf.long_short_attention import LongShortSelfAttention

HIDDEN, HEADS, WINDOW, RANK, SEGMENT = 768, 12, 256, 64, 16


def build(causal: bool, device: str) -> dict:
    """The two peers, same weights: {"sdpa": eager module, "flex": compiled module}."""
    torch.manual_seed(0)
    kwargs = {"causal": causal, "segment_length": SEGMENT if causal else None}
    sdpa = LongShortSelfAttention(HIDDEN, HEADS, WINDOW, RANK, **kwargs).to(device).eval()
    flex = LongShortSelfAttention(HIDDEN, HEADS, WINDOW, RANK, **kwargs, attn_implementation="flex_attention")
    flex.load_state_dict(sdpa.state_dict())
    return {"sdpa": sdpa, "flex": torch.compile(flex.to(device).eval(), dynamic=False)}


def run_length(peers: dict, n: int, device: str, repeats: int) -> dict:
    x = torch.randn(1, n, HIDDEN, generator=torch.Generator().manual_seed(n)).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.inference_mode():
        outputs = {name: module(x)[0] for name, module in peers.items()}  # also compiles flex for this n
        times = interleaved_times({name: (lambda m=module: m(x)) for name, module in peers.items()}, repeats, sync)
    scale = outputs["sdpa"].abs().max().item()
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "n": n,
        "times_s": times,
        "median_s": medians,
        "flex_over_sdpa": medians["flex"] / medians["sdpa"],
        "max_rel_diff": (outputs["flex"] - outputs["sdpa"]).abs().max().item() / scale,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384], help="sequence lengths")
    parser.add_argument("--causal", action="store_true", help="causal prefill (l = 16) instead of bidirectional")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up/compile round")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.n) or args.repeats < 1:
        parser.error("--n values and --repeats must be >= 1")
    peers = build(args.causal, args.device)
    name = f"flex_{args.device}" + ("_causal" if args.causal else "")
    meta = run_meta("bench_flex", argv, causal=args.causal, repeats=args.repeats,
                    module={"hidden": HIDDEN, "heads": HEADS, "window": WINDOW, "rank": RANK})
    rows = []
    print("| n | SDPA path (s) | compiled flex (s) | flex / SDPA | max |diff| / max |out| |")
    print("|---|---|---|---|---|")
    for n in args.n:
        row = run_length(peers, n, args.device, args.repeats)
        rows.append(row)
        print(f"| {n} | {row['median_s']['sdpa']:.3f} | {row['median_s']['flex']:.3f} | "
              f"{row['flex_over_sdpa']:.2f}x | {row['max_rel_diff']:.1e} |", flush=True)
        write_json(results_path(name, quick=False), {"meta": meta, "rows": rows})  # after each n: a cut run keeps it


if __name__ == "__main__":
    main()
