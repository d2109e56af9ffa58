"""Vision speed and memory: CvT*-LS-13 (timm ``cvt_ls_13``) against Transformers' CvT-13 (full attention), paper
Sec. 4.3, and against timm's models of its size.

* ``cvt_ls_13`` (and the other ``ls_timm`` models, ``vil_ls_medium`` say): built at each resolution with the paper's r
  and w for it (``img_size``; Appendix E);
* ``hf_cvt_13``: ``CvtForImageClassification(CvtConfig())``, whose defaults are CvT-13 (dims 64/192/384, depths
  1/2/10, heads 1/3/6, key/value projections of stride 2);
* any other timm model by name, built for the resolution: ``deit_small_patch16_224`` (DeiT-S: 22 M parameters, beside
  CvT*-LS-13's 20 M), ``swin_small_patch4_window7_224`` (Swin-S, beside ViL-LS-Medium).

Every model has random weights. Inference (Table 5 style): images per second, the median of ``--repeats`` forward
passes under ``torch.inference_mode`` (batch 8 by default), at 224, 384 and 448; the models are built in one process
and take their passes in turn after a warm-up round, so that load from other processes hits them alike
(``timed_with`` in a row: the models timed together). Peak memory: each (model, resolution, mode) on its own (on the
CPU in a forked process: the RSS high-water mark, reset through ``/proc/self/clear_refs``, minus the RSS after
building the model and its input; on CUDA ``max_memory_allocated`` above the memory allocated before the pass).
Training-step memory (Figure 7 style): one forward + backward of the cross-entropy loss at batch 1 as the resolution
grows, a size being skipped once its estimated need exceeds 80 % of the free memory. On the CPU also: GMACs per
image (what the paper calls GFLOPs) from ``torch.utils.flop_counter`` at batch 1, and page faults, the median count
of minor faults in a timed pass (memory glibc's ``malloc`` had handed back to the system, touched again; it costs the
full-attention model most).

    python -m bench.bench_vision --repeats 5    # the full table and sweep (5-20 minutes on 2 cores, by load)
    python -m bench.bench_vision --quick        # 224 only, batch 2: a smoke run
    python -m bench.bench_vision --reparam --resolutions 224 --train-resolutions --out bench/results/vision_cpu_reparam.json
        # cvt_ls_13 with its convs fused for inference (timm.utils.reparameterize_model)
    python -m bench.bench_vision --device cuda --dtype bf16 --batch 32 --resolutions 224 448 --train-resolutions \
        --models cvt_ls_13 hf_cvt_13 deit_small_patch16_224

Writes ``bench/results/vision_<device>[_<dtype>].json``, ``.png`` (time per batch and memory against resolution) and
``_train.png`` (training-step memory) and prints markdown tables with the ratios against the first model.
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
    DTYPES,
    check_device,
    free_bytes,
    interleaved_times,
    isolated,
    peak_memory_above,
    reset_peak_memory,
    results_path,
    run_meta,
    sync,
    write_json,
)
from bench.plot import plot_scaling

MODELS = ("cvt_ls_13", "hf_cvt_13")  # the default --models
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


def build(name: str, resolution: int, reparam: bool = False) -> torch.nn.Module:
    """``hf_cvt_13``, or the timm model ``name`` built for ``resolution`` (``cvt_ls_13``, ``vil_ls_medium``: with the
    paper's r and w for it), random weights; with ``reparam``, its convs fused for inference
    (``reparameterize_model``, as timm's own benchmark script's ``--reparam``)."""
    torch.manual_seed(0)
    if name == "hf_cvt_13":
        return CvtForImageClassification(CvtConfig(num_labels=1000))
    model = timm.create_model(name, img_size=resolution)
    return timm.utils.reparameterize_model(model.eval(), inplace=True) if reparam else model


def logits(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    out = model(images)
    return out if isinstance(out, torch.Tensor) else out.logits


def measure_memory(name: str, resolution: int, batch: int, train: bool, reparam: bool, device: str, dtype) -> dict:
    """Peak memory above the built model and its input over one pass or training step; for inference on the CPU
    also the GMACs of one image (counted on a pass at batch 1 before the measured one)."""
    model = build(name, resolution, reparam).train(train).to(device, dtype)
    images = torch.randn(batch, 3, resolution, resolution, device=device, dtype=dtype)
    if train:
        base = reset_peak_memory(device)
        F.cross_entropy(logits(model, images), torch.zeros(batch, dtype=torch.long, device=device)).backward()
        return {"peak_mem_bytes": peak_memory_above(device, base)}
    result = {}
    with torch.inference_mode():
        if device == "cpu":
            counter = FlopCounterMode(display=False)
            with counter:
                logits(model, images[:1])
            result["gmacs"] = counter.get_total_flops() / 2e9
        base = reset_peak_memory(device)
        logits(model, images)
    return result | {"peak_mem_bytes": peak_memory_above(device, base)}


def measure_times(names, resolution: int, batch: int, repeats: int, reparam: bool, device: str, dtype) -> dict:
    """Inference times of the models ``names``, built in one process and run in turn (``interleaved_times``), and on
    the CPU the median count of minor page faults in a pass (memory the allocator had returned to the system, touched
    again)."""
    models = {name: build(name, resolution, reparam).eval().to(device, dtype) for name in names}
    images = torch.randn(batch, 3, resolution, resolution, device=device, dtype=dtype)
    faults = {name: [] for name in names}

    def step(name):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with torch.inference_mode():
            logits(models[name], images)
        faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    times = interleaved_times({name: (lambda n=name: step(n)) for name in names}, repeats, sync=lambda: sync(device))
    return {
        name: {"times": sorted(times[name])}
        | ({"page_faults": statistics.median(faults[name])} if device == "cpu" else {})
        for name in names
    }


def estimated_bytes(name: str, resolution: int, batch: int, train: bool) -> float:
    """Generous need: 8 KiB (inference) or 80 KiB (training) per stage-1 token and image, as measured at 224, plus
    CvT-13's score matrices (x3 when training)."""
    tokens = (resolution // 4) ** 2
    need = batch * tokens * (80 if train else 8) * 1024
    if name == "hf_cvt_13":  # stage s: heads x N_s queries x N_s / 4 keys (stride-2 keys) x 4 bytes, per image
        need += sum(h * (tokens / 4**s) ** 2 for s, h in enumerate((1, 3, 6))) * batch * (3 if train else 1)
    return need


def run(
    models, resolution: int, batch: int, train: bool, repeats: int, reparam: bool, device: str, dtype
) -> list[dict]:
    """Rows for one resolution and mode: each model's memory on its own (a forked process on the CPU), then
    (inference) the times of those measured side by side in one more (``timed_with``: the models in it). A model
    whose estimated need exceeds 80 % of the free memory is skipped, and the others are timed without it."""
    rows = []
    setting = (resolution, batch, train, reparam, device, dtype)
    for name in models:
        row = {"model": name, "resolution": resolution, "batch": batch, "mode": "train" if train else "inference"}
        need, free = estimated_bytes(name, resolution, batch, train), free_bytes(device)
        if need > 0.8 * free:
            row |= {"status": "skipped", "reason": f"needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"}
        else:
            row |= isolated(device, measure_memory, name, *setting)
        rows.append(row)
    fitting = [row["model"] for row in rows if _ok(row)]
    if not train and fitting:
        timed = isolated(device, measure_times, fitting, resolution, batch, repeats, reparam, device, dtype)
        for row in rows:
            if row["model"] not in fitting:
                continue
            if timed["status"] != "ok":
                row |= {"status": timed["status"], "reason": timed.get("reason", "")}
                continue
            times = timed[row["model"]].pop("times")
            median = times[len(times) // 2]
            row |= timed[row["model"]] | {
                "time_s": median,
                "times_s": times,
                "images_per_s": batch / median,
                "timed_with": fitting,
            }
    for row in rows:
        shown = row.get("reason", "")
        if row["status"] == "ok":
            shown = f"{row['peak_mem_bytes'] / 2**20:8.0f} MiB"
            shown += f" {row['images_per_s']:8.2f} img/s" if "images_per_s" in row else ""
            shown += f" {row['gmacs']:6.2f} GMACs" if "gmacs" in row else ""
        print(f"  {row['mode']:<9} {resolution:>5} {row['model']:<30} {row['status']:<8} {shown}", flush=True)
    return rows


def _get(rows, mode, name, resolution):
    return next((r for r in rows if (r["mode"], r["model"], r["resolution"]) == (mode, name, resolution)), None)


def _ok(row, key: str = "status") -> bool:
    """The row exists, was measured, and has ``key``."""
    return row is not None and row["status"] == "ok" and key in row


def table(rows, mode, models, resolutions) -> str:
    """One markdown row per resolution and model: its ``COLUMNS[mode]`` that were measured, then the first model's
    images/s and peak memory over this one's."""
    first = models[0]
    columns = [column for column in COLUMNS[mode] if any(column[1] in row for row in rows if row["mode"] == mode)]
    ratios = [(label, key) for label, key, *_ in columns if key in ("images_per_s", "peak_mem_bytes")]
    header = [label for label, *_ in columns] + [f"{label}: {first} / this" for label, _ in ratios]
    lines = [f"| {mode} | model | " + " | ".join(header) + " |", "|---" * (len(header) + 2) + "|"]
    for res in resolutions:
        base = _get(rows, mode, first, res)
        for name in models:
            row = _get(rows, mode, name, res)
            if not _ok(row):
                status = row["status"] + (f" ({row['reason']})" if row.get("reason") else "") if row else "-"
                lines.append(f"| {res} | {name} | {status} |" + " |" * (len(header) - 1))
                continue
            cells = [format(row[key] * scale, fmt) if key in row else "-" for _, key, scale, fmt in columns]
            cells += [
                f"{base[key] / row[key]:.2f}x" if name != first and _ok(base, key) and row.get(key) else ""
                for _, key in ratios
            ]
            lines.append(f"| {res} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="224 only, batch 2, 1 timed pass: a smoke run")
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(MODELS),
        help="hf_cvt_13 (Transformers' CvT-13) or timm model names; the ratios are the first model's against each",
    )
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
        help="inference with the timm models' convs fused once (timm.utils.reparameterize_model)",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/vision_<device>.json)")
    args = parser.parse_args(argv)
    check_device(parser, args.device)
    unknown = [name for name in args.models if name != "hf_cvt_13" and not timm.is_model(name)]
    if unknown:
        parser.error(f"--models: neither hf_cvt_13 nor a timm model: {', '.join(unknown)}")
    if min(args.batch, args.repeats) < 1:
        parser.error("--batch and --repeats must be positive")
    if args.quick:
        args.resolutions, args.train_resolutions, args.batch, args.repeats = [224], [224], 2, 1
    if any(r < 16 or r % 16 for r in args.resolutions + args.train_resolutions):
        parser.error("--resolutions and --train-resolutions must be multiples of 16 (the models' total stride).")

    # the ls_timm code measured (it is imported once, before the forks), for tracing results in an uncommitted tree
    source_hash = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(Path(ls_timm.__file__).parent.glob("*.py"))))
    source_hash = source_hash.hexdigest()[:12]
    dtype = DTYPES[args.dtype]
    rows = [
        row
        for r in args.resolutions
        for row in run(args.models, r, args.batch, False, args.repeats, args.reparam, args.device, dtype)
    ]
    rows += [row for r in args.train_resolutions for row in run(args.models, r, 1, True, 0, False, args.device, dtype)]

    meta = run_meta(
        "bench.bench_vision",
        argv,
        device=args.device,
        dtype=args.dtype,
        ls_timm_sources_sha256=source_hash,
        reparam=args.reparam,
        memory="RSS high-water mark (VmHWM) over one pass or training step minus RSS after building the model "
        "and input, forked process per row"
        if args.device == "cpu"
        else "torch.cuda.max_memory_allocated over one pass or training step minus memory_allocated before it",
        time=f"inference: median of {args.repeats} passes, the models in one process taking passes in turn "
        f"after a warm-up round (timed_with), batch {args.batch}; training: one forward + backward at batch 1",
    )
    print(
        f"\n{meta['date']}  {meta['cpu']}  nproc={meta['nproc']}  torch {meta['torch']}  "
        f"{meta.get('gpu', args.device)} {args.dtype}  load average {' '.join(f'{x:.1f}' for x in meta['load_average'])}"
        f"  allocator {meta['allocator_env'] or 'defaults'}\n`{meta['command']}`\nmemory: {meta['memory']}\n"
    )
    for mode, sizes in (("inference", args.resolutions), ("train", args.train_resolutions)):
        if sizes:
            print(table(rows, mode, args.models, sizes))

    suffix = "" if args.dtype == "fp32" else f"_{args.dtype}"
    out = args.out or results_path(f"vision_{args.device}{suffix}", args.quick)
    write_json(out, {"meta": meta, "results": rows})
    written = [out]
    memory_label = "peak CUDA memory above baseline" if args.device == "cuda" else "peak RSS above baseline"
    for mode, path, what in (
        ("inference", out.with_suffix(".png"), f"inference, batch {args.batch}"),
        ("train", out.with_name(out.stem + "_train.png"), "training step, batch 1"),
    ):
        points = [r | {"peer": r["model"], "n": r["resolution"]} for r in rows if r["mode"] == mode]
        if points:
            title = f"{' vs '.join(args.models)}, {what}, {args.device} {args.dtype}"
            plot_scaling(points, path, title, memory_label + " (MiB)", xlabel="image side (pixels)")
            written.append(path)
    print("\nwrote " + ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
