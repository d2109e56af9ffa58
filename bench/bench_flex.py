"""Inference of Long-Short attention and vision models: compiled FlexAttention against the SDPA path (the default), side
by side.

One ``LongShortSelfAttention`` (hidden 768, 12 heads, w = 256, r = 64; causal: l = 16, projections included, batch 1)
with the same weights under ``attn_implementation="sdpa"`` (eager, as shipped) and ``"flex_attention"`` wrapped in
``torch.compile`` (compiled once per n; the compile is the warm-up round and is not timed). Forward only, under
``torch.inference_mode``: FlexAttention has no backward on CPU.

With ``--vision``: whole timm models (``cvt_ls_13``, ``vil_ls_medium``; random weights, ``--img-size`` 224, batch
``--batch``) built with each ``attn_implementation``, the SDPA path both eager and compiled (the same module), the
flex model on the package's compiled FlexAttention kernel; all three take their passes in turn.

    python -m bench.bench_flex                       # n = 4096, 8192, 16384, bidirectional
    python -m bench.bench_flex --causal --n 4096 --repeats 2
    python -m bench.bench_flex --vision cvt_ls_13 vil_ls_medium --batch 2 --repeats 5

Prints a markdown table (times, flex / sdpa ratio, max output difference relative to the output scale) and writes
``bench/results/flex_<device>[_causal].json`` (``flex_vision_<device>.json``), after each row. Times are never
asserted anywhere.
"""

from __future__ import annotations

import argparse
import statistics

import timm
import torch

import ls_timm  # noqa: F401  registers the vision models
from bench.common import interleaved_times, results_path, run_meta, sync, write_json
from ls_hf import long_short_blocks
from ls_hf.long_short_attention import LongShortSelfAttention

HIDDEN, HEADS, WINDOW, RANK, SEGMENT = 768, 12, 256, 64, 16
VISION = ("cvt_ls_13", "vil_ls_medium")


def build(causal: bool, device: str) -> dict:
    """The two peers, same weights: {"sdpa": eager module, "flex": compiled module}."""
    torch.manual_seed(0)
    kwargs = {"causal": causal, "segment_length": SEGMENT if causal else None}
    sdpa = LongShortSelfAttention(HIDDEN, HEADS, WINDOW, RANK, **kwargs).to(device).eval()
    flex = LongShortSelfAttention(HIDDEN, HEADS, WINDOW, RANK, **kwargs, attn_implementation="flex_attention")
    flex.load_state_dict(sdpa.state_dict())
    return {"sdpa": sdpa, "flex": torch.compile(flex.to(device).eval(), dynamic=False)}


def build_vision(name: str, img_size: int, device: str) -> dict:
    """The model ``name`` with the same random weights: {"sdpa": eager, "sdpa_compiled": that module compiled,
    "flex": the flex_attention model on the package's compiled kernel (``COMPILED_DEVICES`` takes ``device``; on the
    CPU, torch 2.14 cannot compile the whole model around the 2-D path's tile order)}."""
    torch.manual_seed(0)
    sdpa = timm.create_model(name, img_size=img_size).to(device).eval()
    flex = timm.create_model(name, img_size=img_size, attn_implementation="flex_attention")
    flex.load_state_dict(sdpa.state_dict())
    long_short_blocks.COMPILED_DEVICES = (*long_short_blocks.COMPILED_DEVICES, device)
    return {"sdpa": sdpa, "sdpa_compiled": torch.compile(sdpa, dynamic=False), "flex": flex.to(device).eval()}


def compare(peers: dict, x: torch.Tensor, device: str, repeats: int) -> dict:
    """The peers' outputs on x (the round that compiles) and their interleaved times; ratios to the eager SDPA path
    and each output's largest difference from its output, over the largest output."""
    with torch.inference_mode():
        outputs = {name: module(x) for name, module in peers.items()}  # also compiles for this shape
        times = interleaved_times(
            {name: (lambda m=module: m(x)) for name, module in peers.items()}, repeats, lambda: sync(device)
        )
    outputs = {name: out[0] if isinstance(out, tuple) else out for name, out in outputs.items()}
    scale = outputs["sdpa"].abs().max().item()
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "times_s": times,
        "median_s": medians,
        **{f"{name}_over_sdpa": medians[name] / medians["sdpa"] for name in peers if name != "sdpa"},
        "max_rel_diff": {
            name: (out - outputs["sdpa"]).abs().max().item() / scale for name, out in outputs.items() if name != "sdpa"
        },
    }


def run_length(peers: dict, n: int, device: str, repeats: int) -> dict:
    x = torch.randn(1, n, HIDDEN, generator=torch.Generator().manual_seed(n)).to(device)
    row = compare(peers, x, device, repeats)
    return {"n": n, **row, "max_rel_diff": row["max_rel_diff"]["flex"]}


def run_vision(args, argv) -> None:
    """``--vision``: each model's three peers on one batch, a row per model."""
    meta = run_meta(
        "bench_flex", argv, vision=args.vision, img_size=args.img_size, batch=args.batch, repeats=args.repeats
    )
    rows = []
    print(
        "| model | SDPA path (s) | compiled SDPA path (s) | compiled flex (s) | compiled SDPA / SDPA | flex / SDPA | "
        "flex / compiled SDPA | max |diff| / max |out| (flex) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.vision:
        x = torch.randn(args.batch, 3, args.img_size, args.img_size, generator=torch.Generator().manual_seed(0))
        row = {
            "model": name,
            **compare(build_vision(name, args.img_size, args.device), x.to(args.device), args.device, args.repeats),
        }
        rows.append(row)
        med = row["median_s"]
        print(
            f"| {name} | {med['sdpa']:.3f} | {med['sdpa_compiled']:.3f} | {med['flex']:.3f} | "
            f"{row['sdpa_compiled_over_sdpa']:.2f}x | {row['flex_over_sdpa']:.2f}x | "
            f"{med['flex'] / med['sdpa_compiled']:.2f}x | {row['max_rel_diff']['flex']:.1e} |",
            flush=True,
        )
        write_json(results_path(f"flex_vision_{args.device}", quick=False), {"meta": meta, "rows": rows})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384], help="sequence lengths")
    parser.add_argument("--causal", action="store_true", help="causal prefill (l = 16) instead of bidirectional")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up/compile round")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vision", nargs="+", choices=VISION, help="time these timm models instead")
    parser.add_argument("--img-size", type=int, default=224, help="--vision: image side")
    parser.add_argument("--batch", type=int, default=2, help="--vision: images per pass")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.n) or args.repeats < 1 or args.batch < 1 or args.img_size < 32:
        parser.error("--n values, --repeats and --batch must be >= 1, --img-size >= 32")
    if args.vision:
        return run_vision(args, argv)
    peers = build(args.causal, args.device)
    name = f"flex_{args.device}" + ("_causal" if args.causal else "")
    meta = run_meta(
        "bench_flex",
        argv,
        causal=args.causal,
        repeats=args.repeats,
        module={"hidden": HIDDEN, "heads": HEADS, "window": WINDOW, "rank": RANK},
    )
    rows = []
    print("| n | SDPA path (s) | compiled flex (s) | flex / SDPA | max |diff| / max |out| |")
    print("|---|---|---|---|---|")
    for n in args.n:
        row = run_length(peers, n, args.device, args.repeats)
        rows.append(row)
        print(
            f"| {n} | {row['median_s']['sdpa']:.3f} | {row['median_s']['flex']:.3f} | "
            f"{row['flex_over_sdpa']:.2f}x | {row['max_rel_diff']:.1e} |",
            flush=True,
        )
        write_json(results_path(name, quick=False), {"meta": meta, "rows": rows})  # after each n: a cut run keeps it


if __name__ == "__main__":
    main()
