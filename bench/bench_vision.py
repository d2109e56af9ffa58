"""Vision speed: CvT*-LS-13 (timm ``cvt_ls_13``) against Transformers' CvT-13 (full attention), paper Sec. 4.3.

* ``cvt_ls_13``: built at each resolution with the paper's r and w for it (``img_size``; Appendix E);
* ``hf_cvt_13``: ``CvtForImageClassification(CvtConfig())``, whose defaults are CvT-13 (dims 64/192/384, depths
  1/2/10, heads 1/3/6, key/value projections of stride 2), random weights.

Inference (Table 5 style): images per second, the median of ``--repeats`` forward passes under
``torch.inference_mode`` (float32, batch 8), at 224, 384 and 448; both models are built in one process and take
their passes in turn after a warm-up round, so that load from other processes hits both alike (a model alone when
the other is skipped at that size, ``timed_with`` in its row). Peak memory: each
(model, resolution, mode) in its own forked process, the RSS high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs``) minus the RSS after building the model and its input, over one pass or step.
Training-step memory (Figure 7 style): one forward + backward of the cross-entropy loss at batch 1 as the resolution
grows, a size being skipped once its estimated need exceeds 80 % of the free memory. GMACs per image (what the paper
calls GFLOPs) come from ``torch.utils.flop_counter`` at batch 1. Page faults: the median count of minor faults in a
timed pass, memory the allocator had handed back to the system and touched again (glibc's default ``malloc`` does
that with large blocks, which costs the full-attention model most; RESULTS.md, "Allocator").

    python -m bench.bench_vision --repeats 5    # the full table and sweep (5-20 minutes on 2 cores, by load)
    python -m bench.bench_vision --quick        # 224 only, batch 2: a smoke run
    python -m bench.bench_vision --train-resolutions --out bench/results/vision_cpu_inference.json  # no sweep
    python -m bench.bench_vision --reparam --resolutions 224 --train-resolutions --out bench/results/vision_cpu_reparam.json
        # cvt_ls_13 with its convs fused for inference (timm.utils.reparameterize_model)
    GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736 python -m bench.bench_vision ...
        # glibc keeping freed memory, as jemalloc or tcmalloc would: no page faults

Writes ``bench/results/vision_cpu.json``, ``vision_cpu.png`` (time per batch and memory against resolution) and
``vision_cpu_train.png`` (training-step memory) and prints markdown tables with the performance targets (PASS/MISS).
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import statistics
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from transformers import CvtConfig, CvtForImageClassification

import ls_timm  # registers cvt_ls_13
from bench.common import (
    forked,
    free_bytes,
    interleaved_times,
    peak_rss_above,
    reset_peak_rss,
    results_path,
    run_meta,
    write_json,
)
from bench.plot import plot_scaling

MODELS = ("cvt_ls_13", "hf_cvt_13")
# (resolution, minimum cvt_ls_13 / hf_cvt_13 throughput): no slower at 224, 1.5x at 448 where attention dominates.
SPEED_TARGETS = ((224, 1.0), (448, 1.5))
# mode -> table columns (label, key, scale, format); a training step is timed once, cold, so only its memory counts.
COLUMNS = {
    "inference": (
        ("img/s", "images_per_s", 1, ".2f"),
        ("peak MiB", "peak_mem_bytes", 2**-20, ".0f"),
        ("GMACs", "gmacs", 1, ".2f"),
        ("k page faults", "page_faults", 1e-3, ".1f"),
    ),
    "train": (("peak MiB", "peak_mem_bytes", 2**-20, ".0f"),),
}


def build(name: str, resolution: int, reparam: bool = False, **kwargs) -> torch.nn.Module:
    """``hf_cvt_13``, or the timm model ``name`` built for ``resolution`` (``cvt_ls_13``, ``vil_ls_medium``: with the
    paper's r and w for it) and ``kwargs`` (a Long-Short model's ``attn_implementation``, say), random weights; with
    ``reparam``, its convs fused for inference (``reparameterize_model``, as timm's own benchmark script's
    ``--reparam``)."""
    torch.manual_seed(0)
    if name == "hf_cvt_13":
        return CvtForImageClassification(CvtConfig(num_labels=1000))
    model = timm.create_model(name, img_size=resolution, **kwargs)
    return timm.utils.reparameterize_model(model.eval(), inplace=True) if reparam else model


# Long-Short vision models built another way, by the suffix of a peer's name: "-eager", ``attn_implementation="eager"``
# (the window tiles on SDPA, not the fused 2-D path); "-kernel", the layers' ``compile_attention=False`` (the attention
# kernel alone compiled); "-triton", the Triton window kernels instead of FlexAttention
# (``LongShortAttention2d.window_kernel_devices``).
VARIANTS = ("-eager", "-kernel", "-triton")


def split_variant(peer: str) -> tuple[str, str]:
    """(model name, ``VARIANTS`` suffix or "") of a peer name such as ``cvt_ls_13-eager``."""
    suffix = next((suffix for suffix in VARIANTS if peer.endswith(suffix)), "")
    return peer.removesuffix(suffix), suffix


def build_peer(peer: str, resolution: int, model: str | None = None) -> torch.nn.Module:
    """``build`` of a peer's model in its variant (``split_variant``), in eval mode; ``model``: the model built under
    the peer's name (a smaller one standing in, say)."""
    name, variant = split_variant(peer)
    net = build(model or name, resolution, **({"attn_implementation": "eager"} if variant == "-eager" else {}))
    for layer in net.modules():
        if isinstance(layer, ls_timm.LongShortAttention2d):
            layer.compile_attention = variant != "-kernel"
            if variant == "-triton":
                layer.window_kernel_devices = ("cpu", "cuda")
    return net.eval()


def logits(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    out = model(images)
    return out if isinstance(out, torch.Tensor) else out.logits


def measure_memory(name: str, resolution: int, batch: int, train: bool, reparam: bool) -> dict:
    """Peak RSS above the built model and its input over one step, and for inference the GMACs of one image (counted
    on a pass at batch 1 before the measured one)."""
    model = build(name, resolution, reparam).train(train)
    images = torch.randn(batch, 3, resolution, resolution)
    if train:
        base = reset_peak_rss()
        F.cross_entropy(logits(model, images), torch.zeros(batch, dtype=torch.long)).backward()
        return {"peak_mem_bytes": peak_rss_above(base)}
    counter = FlopCounterMode(display=False)
    with torch.inference_mode():
        with counter:
            logits(model, images[:1])
        base = reset_peak_rss()
        logits(model, images)
    return {"peak_mem_bytes": peak_rss_above(base), "gmacs": counter.get_total_flops() / 2e9}


def measure_times(names, resolution: int, batch: int, repeats: int, reparam: bool) -> dict:
    """Inference times of the models ``names``, built in one process and run in turn (``interleaved_times``), and the
    median count of minor page faults in a pass (memory the allocator had returned to the system, touched again)."""
    models = {name: build(name, resolution, reparam).eval() for name in names}
    images = torch.randn(batch, 3, resolution, resolution)
    faults = {name: [] for name in names}

    def step(name):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with torch.inference_mode():
            logits(models[name], images)
        faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    times = interleaved_times({name: (lambda n=name: step(n)) for name in names}, repeats)
    return {name: {"times": sorted(times[name]), "page_faults": statistics.median(faults[name])} for name in names}


def estimated_bytes(name: str, resolution: int, batch: int, train: bool) -> float:
    """Generous need: 8 KiB (inference) or 80 KiB (training) per stage-1 token and image, as measured at 224, plus
    CvT-13's score matrices (x3 when training)."""
    tokens = (resolution // 4) ** 2
    need = batch * tokens * (80 if train else 8) * 1024
    if name == "hf_cvt_13":  # stage s: heads x N_s queries x N_s / 4 keys (stride-2 keys) x 4 bytes, per image
        need += sum(h * (tokens / 4**s) ** 2 for s, h in enumerate((1, 3, 6))) * batch * (3 if train else 1)
    return need


def run(resolution: int, batch: int, train: bool, repeats: int, reparam: bool = False) -> list[dict]:
    """Rows for one resolution and mode: each model's memory in its own forked process, then (inference) the times
    of those measured side by side in one more (``timed_with``: the models in it). A model whose estimated need
    exceeds 80 % of the free memory is skipped, and the other is then timed alone."""
    rows = []
    for name in MODELS:
        row = {"model": name, "resolution": resolution, "batch": batch, "mode": "train" if train else "inference"}
        need, free = estimated_bytes(name, resolution, batch, train), free_bytes("cpu")
        if need > 0.8 * free:
            row |= {"status": "skipped", "reason": f"needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"}
        else:
            row |= forked(measure_memory, name, resolution, batch, train, reparam)
        rows.append(row)
    fitting = [row["model"] for row in rows if _ok(row)]
    if not train and fitting:
        timed = forked(measure_times, fitting, resolution, batch, repeats, reparam)
        for row in rows:
            if row["model"] not in fitting:
                continue
            if timed["status"] != "ok":
                row |= {"status": timed["status"], "reason": timed.get("reason", "")}
                continue
            times = timed[row["model"]]["times"]
            row |= {
                "time_s": times[len(times) // 2],
                "times_s": times,
                "images_per_s": batch / times[len(times) // 2],
                "page_faults": timed[row["model"]]["page_faults"],
                "timed_with": fitting,
            }
    for row in rows:
        shown = row.get("reason", "")
        if row["status"] == "ok":
            shown = f"{row['peak_mem_bytes'] / 2**20:8.0f} MiB"
            shown += f" {row['images_per_s']:7.2f} img/s" if "images_per_s" in row else ""
            shown += f" {row['gmacs']:6.2f} GMACs" if "gmacs" in row else ""
        print(f"  {row['mode']:<9} {resolution:>5} {row['model']:<10} {row['status']:<8} {shown}", flush=True)
    return rows


def _get(rows, mode, name, resolution):
    return next((r for r in rows if (r["mode"], r["model"], r["resolution"]) == (mode, name, resolution)), None)


def _ok(row, key: str = "status") -> bool:
    """The row exists, was measured, and has ``key``."""
    return row is not None and row["status"] == "ok" and key in row


def table(rows, mode, resolutions) -> str:
    """One markdown row per resolution: each model's ``COLUMNS[mode]`` and their cvt_ls_13 / hf_cvt_13 ratios."""
    columns = COLUMNS[mode]
    header = [f"{m} {label}" for m in MODELS for label, *_ in columns] + [f"{label} LS/HF" for label, *_ in columns]
    lines = [f"| {mode} | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
    for res in resolutions:
        found = [_get(rows, mode, m, res) for m in MODELS]
        cells = [
            format(row[key] * scale, fmt) if _ok(row, key) else row["status"] if row and not _ok(row) else "-"
            for row in found
            for _, key, scale, fmt in columns
        ]
        cells += [
            f"{found[0][key] / found[1][key]:.2f}x" if all(_ok(row, key) for row in found) else "-"
            for _, key, *_ in columns
        ]
        lines.append(f"| {res} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def check_targets(rows, resolutions) -> list[dict]:
    """Throughput targets at 224 and 448; less peak inference memory than CvT-13 at every measured size."""
    checks = [(f"{res}: cvt_ls_13 / hf_cvt_13 images/s", res, "images_per_s", target) for res, target in SPEED_TARGETS]
    checks += [(f"{res}: cvt_ls_13 / hf_cvt_13 peak memory", res, "peak_mem_bytes", 1.0) for res in resolutions]
    results = []
    for name, res, key, target in checks:
        ls, hf = (_get(rows, "inference", m, res) for m in MODELS)
        value = ls[key] / hf[key] if _ok(ls, key) and _ok(hf, key) else None
        passed = value is not None and (value >= target if key == "images_per_s" else value < target)
        verdict = "n/a" if value is None else "PASS" if passed else "MISS"
        results.append({"check": name, "value": value, "target": target, "verdict": verdict})
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="224 only, batch 2, 1 timed pass: a smoke run")
    parser.add_argument("--resolutions", type=int, nargs="*", default=[224, 384, 448], help="inference sizes")
    parser.add_argument("--batch", type=int, default=8, help="inference batch")
    parser.add_argument("--repeats", type=int, default=5, help="timed inference passes after one warm-up")
    parser.add_argument(
        "--train-resolutions",
        type=int,
        nargs="*",
        default=[224, 448, 672, 896, 1120],
        help="training-step memory sweep at batch 1 (none: no sweep); sizes that do not fit: skipped",
    )
    parser.add_argument(
        "--reparam",
        action="store_true",
        help="inference with cvt_ls_13's convs fused once (timm.utils.reparameterize_model)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/vision_cpu.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.resolutions, args.train_resolutions, args.batch, args.repeats = [224], [224], 2, 1
    if any(r % 16 for r in args.resolutions + args.train_resolutions):
        parser.error("--resolutions and --train-resolutions must be multiples of 16 (the models' total stride).")

    # the ls_timm code measured (it is imported once, before the forks), for tracing results in an uncommitted tree
    source_hash = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(Path(ls_timm.__file__).parent.glob("*.py"))))
    source_hash = source_hash.hexdigest()[:12]
    rows = [row for r in args.resolutions for row in run(r, args.batch, False, args.repeats, args.reparam)]
    rows += [row for r in args.train_resolutions for row in run(r, 1, True, 0)]

    meta = run_meta(
        "bench_vision",
        argv,
        ls_timm_sources_sha256=source_hash,
        reparam=args.reparam,
        memory="RSS high-water mark (VmHWM) over one pass or training step minus RSS after building the model "
        "and input, forked process per row",
        time=f"inference: median of {args.repeats} passes, both models in one process taking passes in turn "
        f"after a warm-up round (one alone where the other is skipped: timed_with), batch {args.batch}, "
        "float32; training: one forward + backward at batch 1",
    )
    targets = check_targets(rows, args.resolutions)
    print(
        f"\n{meta['date']}  {meta['cpu']}  nproc={meta['nproc']}  torch {meta['torch']}  "
        f"load average {' '.join(f'{x:.1f}' for x in meta['load_average'])}  "
        f"allocator {meta['allocator_env'] or 'defaults'}\nmemory: {meta['memory']}\n"
    )
    for mode, sizes in (("inference", args.resolutions), ("train", args.train_resolutions)):
        if sizes:
            print(table(rows, mode, sizes))
    for target in targets:
        value = "n/a" if target["value"] is None else f"{target['value']:.2f}"
        print(
            f"{target['verdict']:<5} {target['check']}: {value} (target {'>=' if 'images' in target['check'] else '<'} "
            f"{target['target']})"
        )

    out = args.out or results_path("vision_cpu", args.quick)
    write_json(out, {"meta": meta, "results": rows, "targets": targets})
    written = [out]
    for mode, path, what in (
        ("inference", out.with_suffix(".png"), f"inference, batch {args.batch}"),
        ("train", out.with_name(out.stem + "_train.png"), "training step, batch 1"),
    ):
        points = [r | {"peer": r["model"], "n": r["resolution"]} for r in rows if r["mode"] == mode]
        if points:
            plot_scaling(
                points,
                path,
                f"CvT*-LS-13 vs CvT-13 (Transformers), {what}, CPU float32",
                "peak RSS above baseline (MiB)",
                xlabel="image side (pixels)",
            )
            written.append(path)
    print("\nwrote " + ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
