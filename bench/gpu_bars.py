"""The GPU bars: Long-Short against its peers on one GPU in bfloat16, every bar with its measured values, its ratio and
PASS/MISS in one table at the end, all within a time budget that includes compilation.

Each section measures its peers setting by setting (a length and batch, a context, a resolution), side by side in one
process (``bench.common.side_by_side``: warm-up rounds, where compilation happens, each peer's peak memory over one
step, then timed rounds taken in turn, the median kept), each setting from a fresh compilation state
(``fresh_compilation``), as a process that trains at those shapes alone compiles them:

* attention: ``bench.bench_attention``'s layer (hidden 768, 12 heads, w = 256, r = 64), forward + backward at 4,096,
  16,384 and 65,536 tokens (batch 1) and at 4,096 tokens (batch 8): Long-Short's default (on CUDA its fused
  FlexAttention path, the rest of the layer compiled around the kernel), dense SDPA (the flash kernel) and
  FlexAttention's own sliding window (+-w, compiled) (Long-Short's other paths on CUDA, the kernel alone compiled and
  the grouped SDPA path: ``python -m bench.bench_attention --device cuda --dtype bf16 --peers long-short
  long-short-kernel long-short-eager``);
* masked LM: a training step (forward, backward and AdamW's update) of ``bench.bench_models``' base-width models
  (12 x 768) in tokens/s, at 4,096 tokens (batch 8), 16,384 (batch 2) and 8,192 (batch 4): Long-Short and RoBERTa
  (SDPA), and at 8,192 ModernBERT-base too (its config's 22 layers and widths, random weights,
  ``modernbert_attention``: flash attention 2 when installed, else SDPA);
* vision: inference at 224 and 448, batch 32: ``cvt_ls_13`` (also with ``attn_implementation="eager"``, its window
  tiles on SDPA instead of the fused 2-D path, and on the Triton window kernel instead of FlexAttention, ``-triton``:
  ``LongShortAttention2d.window_kernel_devices``) and ``vil_ls_medium`` against Transformers' CvT-13
  (``hf_cvt_13``) and timm's nearest peers by parameters and MACs, ``deit_small_patch16_224`` (DeiT-S: 22 M
  parameters, 4.6 GMACs, beside CvT*-LS-13's 20 M) and ``swin_small_patch4_window7_224`` (Swin-S: 50 M, 8.7 GMACs, as
  ViL-LS-Medium);
* decoding: ``bench.bench_models.measure_generation``, ms per token after 512 and 8,192 tokens of context, with and
  without the cache (2 layers, w = 256, l = 16, r = 1, as the earlier GPU measurement);
* LRA ListOps: ``recipes.lra``'s trainer (its float32 model, batch 32), Long-Short against full attention: seconds per
  step over the second half of a short run (the first half holds compilation).

Compilation runs beside the measurement (``CompilingAhead``): every peer that compiles, in each setting, runs that
setting in a process of its own, ``--jobs`` at a time (half the cores, at most 8), in the order the settings are
measured; the code they compile stays in inductor's and Triton's caches on disk, where the measuring process finds it
instead of compiling it. A setting is measured once its own processes have ended, and its timed steps are taken with
the others stopped; nothing those processes do is measured. The sections run in turn (the bars that matter most first),
each ending at its share of the budget added to the earlier sections' (time a section leaves passes to the next); a
section that runs out of its time is stopped where it is, its bars marked "not run". The table and JSON are written
after each section, so a run stopped from outside keeps what it measured. Times are never asserted anywhere.

    python -m bench.gpu_bars                 # CUDA, bf16, compiling ahead and measuring within --budget-s (270 s)
    python -m bench.gpu_bars --sections attention --budget-s 150   # one section (or several) alone
    python -m bench.gpu_bars --jobs 0        # no compiling ahead: each setting compiles as it is measured
    python -m bench.gpu_bars --smoke         # the same sections and bars on the CPU with tiny shapes (float32,
                                             # forward-only attention: FlexAttention has no CPU backward; the
                                             # smallest members of the timm families): checks the logic
    python -m bench.gpu_bars --smoke --cpu-as-cuda --sections attention vision --jobs 2   # the CPU taking CUDA's
                                             # choices, so that there is code to compile ahead

Writes ``bench/results/gpu_bars_<device>.json`` and ``.md`` (``--smoke``: under ``bench/results/quick/``; ``--out``
another path), and a copy of both into ``--copy-to``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from bench import bench_attention, bench_models, bench_vision
from bench.common import (
    DTYPES,
    MEASUREMENT_ERRORS,
    failure,
    results_path,
    run_meta,
    side_by_side,
    take_cuda_choices_on_cpu,
    write_json,
)
from recipes.lra import train as lra_train

ATTENTION_PEERS = ("long-short", "sdpa", "flex-window")
# (length label, batch, peers) in the order run; lengths from Plan.attention_lengths
ATTENTION_RUNS = (
    ("4k", 1, ATTENTION_PEERS),
    ("4k", 8, ("long-short", "sdpa")),
    ("16k", 1, ATTENTION_PEERS),
    ("64k", 1, ATTENTION_PEERS),
)
MLM_RUNS = (
    ("4k", 8, ("long-short", "roberta-sdpa")),
    ("16k", 2, ("long-short", "roberta-sdpa")),
    ("8k", 4, ("long-short", "roberta-sdpa", "modernbert")),
)
VISION_MODELS = ("cvt_ls_13", "hf_cvt_13", "deit_small_patch16_224", "vil_ls_medium", "swin_small_patch4_window7_224")
# Long-Short vision models run another way (``bench.bench_vision.VARIANTS``): with ``attn_implementation="eager"``, the
# window tiles on SDPA instead of the fused 2-D path; on the Triton window kernels instead of FlexAttention
# (``cvt_ls_13`` alone, whose bars have targets: each compiled peer costs the vision section's time)
VISION_VARIANTS = ("cvt_ls_13-eager", "cvt_ls_13-triton")
LRA_ATTENTIONS = ("long_short", "full")
DECODING_PEERS = ("cached", "uncached")  # in the order of Plan.decode_tokens


@dataclass(frozen=True)
class Plan:
    """What each section measures: ``GPU`` is the bars' own plan, ``SMOKE`` the same sections with tiny shapes."""

    device: str
    dtype: str  # a key of bench.common.DTYPES
    warmups: int
    repeats: int
    attention: bench_attention.Shape  # its window and rank serve the masked LMs too
    attention_lengths: dict[str, int]
    backward: bool  # attention forward + backward (the CPU: forward only)
    mlm_lengths: dict[str, int]
    mlm_width: dict | None  # None: bench_models.BASE, and ModernBERT's own
    mlm_layers: int
    modernbert_layers: int
    vocab: int
    decode_contexts: dict[str, int]
    decode_layers: int
    # timed steps with the cache, without it: without it the layer compiles again in the first two (the lengths made
    # symbolic), which the median of 8 leaves out
    decode_tokens: tuple[int, int]
    resolutions: dict[str, int]
    image_batch: int
    vision_models: dict[str, str]  # a bar's model name -> the model built for it
    lra_half_steps: int
    lra_batch: int
    lra_examples: tuple[int, int, int]  # generated ListOps train / dev / test expressions


GPU = Plan(
    device="cuda",
    dtype="bf16",
    warmups=2,
    repeats=5,
    attention=bench_attention.SHAPE,
    attention_lengths={"4k": 4096, "16k": 16384, "64k": 65536},
    backward=True,
    mlm_lengths={"4k": 4096, "16k": 16384, "8k": 8192},
    mlm_width=None,
    mlm_layers=12,
    modernbert_layers=bench_models.ModernBertConfig().num_hidden_layers,
    vocab=1024,
    decode_contexts={"512": 512, "8k": 8192},
    decode_layers=2,
    decode_tokens=(32, 8),
    resolutions={"224": 224, "448": 448},
    image_batch=32,
    vision_models={name: name for name in VISION_MODELS},
    lra_half_steps=40,
    lra_batch=32,
    lra_examples=(320, 32, 32),
)
SMOKE = Plan(
    device="cpu",
    dtype="fp32",
    warmups=0,
    repeats=1,
    attention=bench_attention.Shape(hidden=32, heads=2, window=16, rank=4),
    backward=False,
    attention_lengths={"4k": 64, "16k": 128, "64k": 256},
    mlm_lengths={"4k": 64, "16k": 128, "8k": 96},
    mlm_width={"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64},
    mlm_layers=1,
    modernbert_layers=1,
    vocab=64,
    decode_contexts={"512": 16, "8k": 48},
    decode_layers=1,
    decode_tokens=(3, 2),
    resolutions={"224": 64, "448": 96},
    image_batch=2,
    vision_models={
        "cvt_ls_13": "cvt_ls_13",
        "hf_cvt_13": "hf_cvt_13",
        "deit_small_patch16_224": "deit_tiny_patch16_224",
        "vil_ls_medium": "vil_ls_small",
        "swin_small_patch4_window7_224": "swin_tiny_patch4_window7_224",
    },
    lra_half_steps=2,
    lra_batch=2,
    lra_examples=(8, 4, 4),
)


# ------------------------------------------------------------------------------------------------------ bars
class Bar(NamedTuple):
    """``ratio = numerator / denominator``, two measurements' ``quantity``, held against ``target`` by ``relation``
    (">=" or "<="; "" for a row shown for reference, without a bar)."""

    what: str
    section: str
    quantity: str
    numerator: str  # measurement keys: "section/peer/setting"
    denominator: str
    relation: str = ""
    target: float | None = None


def _attention(peer: str, length: str, batch: int = 1) -> str:
    return f"attention/{peer}/{length} x{batch}"


def _mlm(peer: str, length: str) -> str:
    batch = next(batch for label, batch, _ in MLM_RUNS if label == length)
    return f"masked LM/{peer}/{length} x{batch}"


BARS = (
    *(
        Bar(
            f"attention fwd+bwd {n}, batch 1: Long-Short / FlexAttention sliding window, time",
            "attention",
            "time_s",
            _attention("long-short", n),
            _attention("flex-window", n),
            "<=",
            1.3,
        )
        for n in ("4k", "16k", "64k")
    ),
    Bar(
        "attention fwd+bwd 16k, batch 1: flash SDPA / Long-Short, time (speedup)",
        "attention",
        "time_s",
        _attention("sdpa", "16k"),
        _attention("long-short", "16k"),
        ">=",
        2.5,
    ),
    Bar(
        "attention fwd+bwd 64k, batch 1: flash SDPA / Long-Short, time (speedup)",
        "attention",
        "time_s",
        _attention("sdpa", "64k"),
        _attention("long-short", "64k"),
        ">=",
        15.0,
    ),
    Bar(
        "attention fwd+bwd 4k, batch 8: flash SDPA / Long-Short, time (speedup)",
        "attention",
        "time_s",
        _attention("sdpa", "4k", 8),
        _attention("long-short", "4k", 8),
        ">=",
        1.5,
    ),
    *(
        Bar(
            f"attention fwd+bwd {n}, batch 1: Long-Short / flash SDPA, peak memory",
            "attention",
            "peak_mem_bytes",
            _attention("long-short", n),
            _attention("sdpa", n),
            "<=",
            1.3,
        )
        for n in ("4k", "16k", "64k")
    ),
    Bar(
        "MLM step 12 x 768, 4k x 8: Long-Short / RoBERTa-SDPA, tokens/s",
        "masked LM",
        "tokens_per_s",
        _mlm("long-short", "4k"),
        _mlm("roberta-sdpa", "4k"),
        ">=",
        1.3,
    ),
    Bar(
        "MLM step 12 x 768, 16k x 2: Long-Short / RoBERTa-SDPA, tokens/s",
        "masked LM",
        "tokens_per_s",
        _mlm("long-short", "16k"),
        _mlm("roberta-sdpa", "16k"),
        ">=",
        3.0,
    ),
    Bar(
        "MLM step, 8k x 4: Long-Short (12 layers) / ModernBERT-base (22 layers), tokens/s",
        "masked LM",
        "tokens_per_s",
        _mlm("long-short", "8k"),
        _mlm("modernbert", "8k"),
    ),
    Bar(
        "MLM step 12 x 768, 8k x 4: Long-Short / RoBERTa-SDPA, tokens/s",
        "masked LM",
        "tokens_per_s",
        _mlm("long-short", "8k"),
        _mlm("roberta-sdpa", "8k"),
    ),
    *(
        Bar(
            f"decoding after {c} tokens: without / with the cache, time per token",
            "decoding",
            "per_token_s",
            f"decoding/uncached/{c}",
            f"decoding/cached/{c}",
            ">=",
            1.0,
        )
        for c in ("512", "8k")
    ),
    Bar(
        "cached decoding: per-token time after 8k / after 512 tokens",
        "decoding",
        "per_token_s",
        "decoding/cached/8k",
        "decoding/cached/512",
        "<=",
        bench_models.DECODE_TARGET,
    ),
    # the paper's Table 5: CvT*-LS-13 0.083 s against CvT-13's 0.122 s at 224 (V100, batch 32)
    Bar(
        "vision 224, batch 32: cvt_ls_13 / CvT-13 (Transformers), images/s",
        "vision",
        "images_per_s",
        "vision/cvt_ls_13/224",
        "vision/hf_cvt_13/224",
        ">=",
        round(0.122 / 0.083, 2),
    ),
    Bar(
        "vision 448, batch 32: cvt_ls_13 / CvT-13 (Transformers), images/s",
        "vision",
        "images_per_s",
        "vision/cvt_ls_13/448",
        "vision/hf_cvt_13/448",
        ">=",
        dict(bench_vision.SPEED_TARGETS)[448],
    ),
    *(
        Bar(
            f"vision {r}, batch 32: cvt_ls_13 / DeiT-S (timm), images/s",
            "vision",
            "images_per_s",
            f"vision/cvt_ls_13/{r}",
            f"vision/deit_small_patch16_224/{r}",
        )
        for r in ("224", "448")
    ),
    *(
        Bar(
            f'vision {r}, batch 32: cvt_ls_13 / its SDPA path (attn_implementation="eager"), images/s',
            "vision",
            "images_per_s",
            f"vision/cvt_ls_13/{r}",
            f"vision/cvt_ls_13-eager/{r}",
        )
        for r in ("224", "448")
    ),
    *(
        Bar(
            f"vision {r}, batch 32: cvt_ls_13 with the Triton window kernel / with FlexAttention, images/s",
            "vision",
            "images_per_s",
            f"vision/cvt_ls_13-triton/{r}",
            f"vision/cvt_ls_13/{r}",
        )
        for r in ("224", "448")
    ),
    *(
        Bar(
            f"vision {r}, batch 32: cvt_ls_13 with the Triton window kernel / CvT-13 (Transformers), images/s",
            "vision",
            "images_per_s",
            f"vision/cvt_ls_13-triton/{r}",
            f"vision/hf_cvt_13/{r}",
        )
        for r in ("224", "448")
    ),
    *(
        Bar(
            f"vision {r}, batch 32: vil_ls_medium / Swin-S (timm), images/s",
            "vision",
            "images_per_s",
            f"vision/vil_ls_medium/{r}",
            f"vision/swin_small_patch4_window7_224/{r}",
        )
        for r in ("224", "448")
    ),
    Bar(
        "LRA ListOps training step: full attention / Long-Short, time",
        "LRA ListOps",
        "step_s",
        "LRA ListOps/full/listops",
        "LRA ListOps/long_short/listops",
        ">=",
        1.0,
    ),
)
# quantity -> (unit, scale) for the table
UNITS = {
    "time_s": ("ms", 1e3),
    "host_s": ("ms on the host", 1e3),
    "peak_mem_bytes": ("MiB", 2**-20),
    "tokens_per_s": ("tokens/s", 1.0),
    "per_token_s": ("ms/token", 1e3),
    "images_per_s": ("images/s", 1.0),
    "step_s": ("ms/step", 1e3),
}


def shown_value(value: float | None, quantity: str) -> str:
    """``value`` in the table's unit for ``quantity``: "-" when missing."""
    if value is None:
        return "-"
    unit, scale = UNITS[quantity]
    value *= scale
    return f"{value:,.0f} {unit}" if abs(value) >= 1000 else f"{value:.3g} {unit}"


def verdict(ratio: float | None, relation: str, target: float | None) -> str:
    """PASS or MISS of ``ratio`` against ``target`` (``relation`` ">=" or "<="); "ref" for a row without a bar,
    "not run" without a ratio."""
    if ratio is None:
        return "not run"
    if not relation:
        return "ref"
    return "PASS" if (ratio >= target if relation == ">=" else ratio <= target) else "MISS"


def bar_rows(measurements: dict[str, dict], notes: dict[str, str], sections: list[str] | None = None) -> list[dict]:
    """Every bar's row (of ``sections`` only, when given) from the ``measurements`` (key -> result with ``status``) and
    the sections' ``notes`` (why a bar whose measurements are absent was not run)."""
    rows = []
    for bar in BARS if sections is None else [bar for bar in BARS if bar.section in sections]:
        found = [measurements.get(key, {}) for key in (bar.numerator, bar.denominator)]
        values = [result.get(bar.quantity) if result.get("status") == "ok" else None for result in found]
        ratio = values[0] / values[1] if None not in values and values[1] else None
        shown = [
            f"{key.split('/')[1]} {shown_value(value, bar.quantity)}"
            for key, value in zip((bar.numerator, bar.denominator), values)
        ]
        if ratio is not None:
            reason = ""
        elif None not in values:
            reason = f"the {bar.quantity} it divides by is 0"
        else:
            failed = [
                f"{result['status']}: {result.get('reason', '')}"
                for result in found
                if result and result["status"] != "ok"
            ]
            reason = failed[0] if failed else notes.get(bar.section, "not measured")
        rows.append(
            {
                "bar": bar.what,
                "measured": " / ".join(shown),
                "values": values,
                "target": f"{bar.relation} {bar.target:g}x" if bar.relation else "",
                "ratio": ratio,
                "verdict": verdict(ratio, bar.relation, bar.target),
                "reason": reason,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| bar | measured | bar | ratio | verdict |", "|---|---|---|---|---|"]
    for row in rows:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        result = row["verdict"] + (f" ({row['reason']})" if row["reason"] else "")
        lines.append(f"| {row['bar']} | {row['measured']} | {row['target'] or '-'} | {ratio} | {result} |")
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------------------- sections
class Setting(NamedTuple):
    """One setting of a section: its ``peers``, measured side by side by ``run(peers, record, timed)``, which hands
    each peer's result to ``record(peer, result)`` and takes its timed steps inside ``timed()`` (where
    ``CompilingAhead`` stops its processes); the result's key is ``section/peer/label`` (``key``)."""

    section: str
    label: str
    peers: tuple[str, ...]
    run: Callable[[tuple[str, ...], Callable[[str, dict], None], Callable], None]

    def key(self, peer: str) -> str:
        return f"{self.section}/{peer}/{self.label}"


def attention_settings(plan: Plan) -> list[Setting]:
    return [
        Setting("attention", f"{label} x{batch}", peers, functools.partial(_measure_attention, plan, label, batch))
        for label, batch, peers in ATTENTION_RUNS
    ]


def _measure_attention(plan: Plan, label: str, batch: int, peers: tuple[str, ...], record, timed) -> None:
    dtype = DTYPES[plan.dtype]
    n, shape = plan.attention_lengths[label], dataclasses.replace(plan.attention, batch=batch)
    modules = {peer: bench_attention.build_peer(peer, shape).to(plan.device, dtype) for peer in peers}
    x, grad = bench_attention.inputs(n, plan.device, dtype, shape)
    steps = {
        peer: functools.partial(bench_attention.step, module, x, grad, plan.backward)
        for peer, module in modules.items()
    }
    for peer, result in side_by_side(steps, plan.device, plan.repeats, plan.warmups, timed).items():
        record(peer, result | {"n": n, "batch": batch})


def mlm_settings(plan: Plan) -> list[Setting]:
    return [
        Setting("masked LM", f"{label} x{batch}", peers, functools.partial(_measure_mlm, plan, label, batch))
        for label, batch, peers in MLM_RUNS
    ]


def _measure_mlm(plan: Plan, label: str, batch: int, peers: tuple[str, ...], record, timed) -> None:
    n = plan.mlm_lengths[label]
    steps = {
        peer: bench_models.training_step(
            peer,
            n,
            plan.modernbert_layers if peer == "modernbert" else plan.mlm_layers,
            plan.vocab,
            device=plan.device,
            dtype=plan.dtype,
            batch=batch,
            width=plan.mlm_width,
            window=plan.attention.window,
            rank=plan.attention.rank,
            optimizer_step=True,
        )
        for peer in peers
    }
    for peer, result in side_by_side(steps, plan.device, plan.repeats, plan.warmups, timed).items():
        if result["status"] == "ok":
            result["tokens_per_s"] = batch * n / result["time_s"]
        if peer == "modernbert":
            result["attn_implementation"] = bench_models.modernbert_attention(plan.device)
        record(peer, result | {"n": n, "batch": batch})


def decoding_settings(plan: Plan) -> list[Setting]:
    return [
        Setting("decoding", label, DECODING_PEERS, functools.partial(_measure_decoding, plan, context))
        for label, context in plan.decode_contexts.items()
    ]


def _measure_decoding(plan: Plan, context: int, peers: tuple[str, ...], record, timed) -> None:
    for peer, tokens in zip(DECODING_PEERS, plan.decode_tokens):
        if peer not in peers:
            continue
        try:
            with timed():
                result = {
                    "status": "ok",
                    **bench_models.measure_generation(
                        context,
                        tokens,
                        peer == "cached",
                        plan.decode_layers,
                        plan.vocab,
                        plan.device,
                        plan.dtype,
                        width=plan.mlm_width,
                        window=plan.attention.window,
                    ),
                }
        except MEASUREMENT_ERRORS as error:  # reported in the table, not raised
            result = failure(error)
        record(peer, result | {"context": context})


def _infer(model: torch.nn.Module, images: torch.Tensor) -> None:
    with torch.inference_mode():
        bench_vision.logits(model, images)


def vision_settings(plan: Plan) -> list[Setting]:
    return [
        Setting(
            "vision", label, (*VISION_MODELS, *VISION_VARIANTS), functools.partial(_measure_vision, plan, resolution)
        )
        for label, resolution in plan.resolutions.items()
    ]


def _measure_vision(plan: Plan, resolution: int, peers: tuple[str, ...], record, timed) -> None:
    dtype = DTYPES[plan.dtype]
    models = {}
    variants = {name: bench_vision.split_variant(name) for name in peers}  # e.g. cvt_ls_13-eager: cvt_ls_13, -eager
    for name, (model, _) in variants.items():  # built in its variant's way (bench_vision.build_peer)
        models[name] = bench_vision.build_peer(name, resolution, plan.vision_models[model]).to(plan.device, dtype)
    images = torch.randn(plan.image_batch, 3, resolution, resolution, device=plan.device, dtype=dtype)
    steps = {name: functools.partial(_infer, model, images) for name, model in models.items()}
    for name, result in side_by_side(steps, plan.device, plan.repeats, plan.warmups, timed).items():
        if result["status"] == "ok":
            result["images_per_s"] = plan.image_batch / result["time_s"]
        record(
            name,
            result
            | {
                "model": plan.vision_models[variants[name][0]],
                "variant": variants[name][1] or None,
                "resolution": resolution,
                "batch": plan.image_batch,
            },
        )


def lra_settings(plan: Plan) -> list[Setting]:
    return [Setting("LRA ListOps", "listops", LRA_ATTENTIONS, functools.partial(_measure_lra, plan))]


def _measure_lra(plan: Plan, peers: tuple[str, ...], record, timed) -> None:
    """``recipes.lra``'s trainer for 2 x ``lra_half_steps`` steps, scoring the dev split after each half; the step
    time is the second half's (the first holds compilation), from the trainer's own ``train_seconds``."""
    half = plan.lra_half_steps
    train, dev, test = plan.lra_examples
    with tempfile.TemporaryDirectory() as folder:
        for attention in peers:
            argv = [
                "--task",
                "listops",
                "--attention",
                attention,
                "--output_dir",
                f"{folder}/{attention}",
                "--data_dir",
                f"{folder}/data",
                "--steps",
                str(2 * half),
                "--warmup",
                "2",
                "--eval_every",
                str(half),
                "--batch_size",
                str(plan.lra_batch),
                "--eval_batch_size",
                "32",
                "--listops_train",
                str(train),
                "--listops_dev",
                str(dev),
                "--listops_test",
                str(test),
                "--device",
                plan.device,
                "--no_progress",
            ]
            with timed():
                results = lra_train.main(argv)
            first_half = results["history"][0]["train_seconds"]  # rounded to 0.1 s by the trainer
            record(
                attention,
                {
                    "status": "ok",
                    "step_s": (results["train_seconds"] - first_half) / half,
                    "steps": 2 * half,
                    "first_half_s": first_half,
                    "batch": plan.lra_batch,
                    "command": "python -m recipes.lra " + " ".join(argv),
                },
            )


class Section(NamedTuple):
    name: str
    settings: Callable[[Plan], list[Setting]]
    share: float  # of the budget: the section ends at the sum of its and the earlier sections' shares
    compiled: frozenset[str]  # the peers whose steps compile code (torch.compile): what ``CompilingAhead`` runs
    # its timed steps compile too (decoding's new lengths, the trainer's first half): it waits for every process
    # compiling ahead to end, instead of stopping them, as a stopped process may hold a lock of inductor's caches
    compiles_while_timing: bool = False


# In the order measured, the bars that matter most first; each ends at its share of the budget added to the earlier
# ones', time a section leaves passing to the next. Compiling runs beside them from the start, so the first sections'
# shares hold their peers' compilation: on one H200 a compiling process took 40-100 s (FlexAttention's window at 64k
# 59 s, vil_ls_medium at 448 98 s), 8 at a time, and one of attention's 7 had not finished after 80 s. The peers that compile: those on the package's fused path (compiled
# on CUDA) and FlexAttention's window; RoBERTa, ModernBERT (Transformers 5 compiles none of its layers), the timm and
# Transformers vision models and the SDPA paths run eagerly.
SECTIONS = (
    Section("attention", attention_settings, 0.40, frozenset({"long-short", "flex-window"})),
    Section("masked LM", mlm_settings, 0.20, frozenset({"long-short"})),
    Section("vision", vision_settings, 0.22, frozenset({"cvt_ls_13", "vil_ls_medium", "cvt_ls_13-triton"})),
    Section("decoding", decoding_settings, 0.09, frozenset(DECODING_PEERS), compiles_while_timing=True),
    Section("LRA ListOps", lra_settings, 0.09, frozenset({"long_short"}), compiles_while_timing=True),
)


# The default budget, compiling and measuring: with Python's start, within 5 minutes
BUDGET_S = 270.0


def fresh_compilation() -> None:
    """Forget what this process compiled (``torch._dynamo.reset``): the next setting compiles as a process that runs
    its shapes alone does, code specialised to them, and so finds in inductor's caches what ``CompilingAhead``'s
    processes compiled for it."""
    torch._dynamo.reset()


def compiled_keys(section: Section, setting: Setting) -> list[str]:
    """The measurement keys of ``setting``'s peers that compile."""
    return [setting.key(peer) for peer in setting.peers if peer in section.compiled]


def compile_units(plan: Plan, names: list[str] | None = None) -> list[str]:
    """The keys of the peers that compile, in every setting of the sections of ``names`` (default all), in the order
    they are measured."""
    return [
        key
        for section in SECTIONS
        if names is None or section.name in names
        for setting in section.settings(plan)
        for key in compiled_keys(section, setting)
    ]


# the measuring process's id, in a compiling process's environment (``end_with_parent``)
PARENT_VARIABLE = "GPU_BARS_MEASURING_PROCESS"


class CompilingAhead:
    """Each unit (a measurement key: one peer in one setting) compiled in a process of its own (``python -m
    bench.gpu_bars --compile-only KEY`` with ``flags``), ``jobs`` at a time, in the given order, from a thread of
    this process while it measures: a process's steps compile what the measurement will run and leave it in
    inductor's and Triton's caches on disk, where the measuring process (``fresh_compilation``) reads it instead of
    compiling. The processes share the machine's cores (inductor's compile threads, ``TORCHINDUCTOR_COMPILE_THREADS``,
    split among them); nothing they do is measured. A setting first waits for its own units (``wait``), then takes its
    timed steps with every process stopped (``paused``: SIGSTOP to its process group, inductor's workers included),
    so that their cores and GPU work stay out of the timings. ``close`` stops those still running and returns a
    note: how many finished, failed or were stopped, and in what time."""

    def __init__(self, units: list[str], flags: list[str], *, jobs: int):
        self.flags, self.jobs = flags, jobs
        self.pending, self.running, self.failed, self.took = list(units), {}, [], {}
        self.began, self.units, self.is_paused, self.closed = time.perf_counter(), len(units), False, False
        self.env = os.environ | {
            "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, (os.cpu_count() or 1) // jobs)),
            PARENT_VARIABLE: str(os.getpid()),
        }
        self.logs = tempfile.TemporaryDirectory()
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._schedule, name="compiling ahead", daemon=True)
        self.thread.start()

    def _schedule(self) -> None:
        with self.changed:
            while not self.closed and (self.pending or self.running):
                if not self.is_paused:
                    self._reap()
                    while self.pending and len(self.running) < self.jobs:
                        self._start(self.pending.pop(0))
                    self.changed.notify_all()
                self.changed.wait(None if self.is_paused else 0.1)
            self.changed.notify_all()

    def _start(self, key: str) -> None:
        log = open(Path(self.logs.name) / f"{len(self.pending)}.log", "w+")  # noqa: SIM115  closed when it ends
        command = [sys.executable, "-m", "bench.gpu_bars", "--compile-only", key, *self.flags]
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.running[key] = (process, log, time.perf_counter())

    def _reap(self) -> None:
        for key, (process, log, started) in list(self.running.items()):
            if process.poll() is None:
                continue
            if process.returncode == 0:
                self.took[key] = time.perf_counter() - started
            else:
                log.seek(0)
                self.failed.append(f"{key}: {log.read()[-300:].strip()}")
            log.close()
            del self.running[key]

    def _signal_all(self, signum: int) -> None:
        for process, _, _ in self.running.values():
            with contextlib.suppress(ProcessLookupError):  # ended since the last look
                os.killpg(process.pid, signum)

    def wait(self, keys: list[str]) -> float:
        """Wait until none of ``keys`` is compiling or waiting to; returns the seconds waited."""
        began = time.perf_counter()
        with self.changed:
            while not self.closed and any(key in self.running or key in self.pending for key in keys):
                self.changed.wait(0.1)
        return time.perf_counter() - began

    def wait_all(self) -> float:
        """Wait until every unit has ended; returns the seconds waited."""
        with self.changed:
            units = [*self.pending, *self.running]
        return self.wait(units)

    @contextlib.contextmanager
    def paused(self):
        """Every compiling process stopped, and none started, inside the block."""
        with self.changed:
            self.is_paused = True
            self._signal_all(signal.SIGSTOP)
        try:
            yield
        finally:
            with self.changed:
                self._signal_all(signal.SIGCONT)
                self.is_paused = False
                self.changed.notify_all()

    def close(self) -> str:
        with self.changed:
            self.closed = True
            self._reap()
            self._signal_all(signal.SIGKILL)  # out of time: stopped with their children (inductor's workers)
            for process, log, _ in self.running.values():
                process.wait()
                log.close()
            self.changed.notify_all()
        self.thread.join()
        self.logs.cleanup()
        note = f"{len(self.took)} of {self.units} compiled in {time.perf_counter() - self.began:.0f} s"
        note += f", {self.jobs} at a time, beside the measurement"
        if self.took:
            longest = max(self.took, key=self.took.get)
            note += f" (the longest {longest}: {self.took[longest]:.0f} s; all of them {sum(self.took.values()):.0f} s)"
        if self.running or self.pending:
            note += f"; {len(self.running) + len(self.pending)} stopped or not started at the end of the budget"
        return note + "".join(f"; failed {reason}" for reason in self.failed)


class OutOfTime(BaseException):
    """A section's time is up (a BaseException, so that no ``except Exception`` of a measurement catches it)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise ``OutOfTime`` in this (the main) thread once ``seconds`` have passed; at once if none are left."""
    if seconds <= 0:
        raise OutOfTime

    def alarm(signum, frame):
        raise OutOfTime

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def cache_counts() -> Counter:
    """Graphs inductor found in its cache and compiled, so far in this process."""
    counted = torch._dynamo.utils.counters["inductor"]
    return Counter(found=counted["fxgraph_cache_hit"], compiled=counted["fxgraph_cache_miss"])


def run_sections(
    plan: Plan,
    budget_s: float,
    names: list[str] | None = None,
    ahead: CompilingAhead | None = None,
    after_section: Callable[[dict[str, dict], dict[str, str]], None] = lambda measurements, notes: None,
) -> tuple[dict[str, dict], dict[str, str]]:
    """Every section (or those of ``names``) within its time (``SECTIONS``: its share of ``budget_s``, the shares of
    the sections run scaled to add up to 1, and what the earlier ones left), each setting after its units compiling
    ``ahead`` ended and from a fresh compilation state (``fresh_compilation``); ``after_section`` gets what was
    measured after each section. Returns the measurements by key and a note per section run (how long it ran, or
    why it stopped)."""
    sections = [section for section in SECTIONS if names is None or section.name in names]
    total_share = sum(section.share for section in sections)
    measurements, notes, start, share_so_far = {}, {}, time.perf_counter(), 0.0
    timed = ahead.paused if ahead else contextlib.nullcontext

    def record(setting: Setting, peer: str, result: dict) -> None:
        key = setting.key(peer)
        measurements[key] = result
        shown = " ".join(shown_value(result[quantity], quantity) for quantity in UNITS if quantity in result)
        print(f"  {key:<48} {result['status']:<6} {shown} {result.get('reason', '')}", flush=True)

    for section in sections:
        share_so_far += section.share / total_share
        began = time.perf_counter()
        left = start + share_so_far * budget_s - began
        print(f"{section.name}: up to {max(left, 0):.0f} s", flush=True)
        try:
            with time_limit(left):
                for setting in section.settings(plan):
                    waited, counted, set_began = 0.0, cache_counts(), time.perf_counter()
                    if ahead:
                        keys = compiled_keys(section, setting)
                        waited = ahead.wait_all() if section.compiles_while_timing else ahead.wait(keys)
                    fresh_compilation()
                    setting.run(setting.peers, functools.partial(record, setting), timed)
                    graphs = cache_counts() - counted
                    print(
                        f"  {section.name} {setting.label}: {time.perf_counter() - set_began:.0f} s, {waited:.0f} of "
                        f"them waiting for compilation ahead; graphs from the cache {graphs['found']}, compiled "
                        f"{graphs['compiled']}",
                        flush=True,
                    )
            notes[section.name] = f"ran in {time.perf_counter() - began:.0f} s"
        except OutOfTime:
            notes[section.name] = f"its time ran out ({max(left, 0):.0f} s of the {budget_s:g} s budget)"
        except Exception as error:  # noqa: BLE001  a section that breaks, even on a bug, leaves the others to run
            notes[section.name] = f"failed: {type(error).__name__}: {failure(error)['reason']}"
        print(f"{section.name}: {notes[section.name]}", flush=True)
        after_section(measurements, notes)
    return measurements, notes


def end_with_parent() -> None:
    """End this process group (inductor's workers with it) once the process that started it (``CompilingAhead``, which
    names itself in ``PARENT_VARIABLE``) is gone: a compiling process runs in a session of its own, where a signal that
    ends the measuring process does not reach."""
    parent = int(os.environ.get(PARENT_VARIABLE, os.getppid()))

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="end with parent", daemon=True).start()


def compile_only(plan: Plan, key: str) -> None:
    """The setting of ``key`` with its one peer, as the measurement runs it but for one timed round, its results
    dropped: what it compiles stays in inductor's caches (``CompilingAhead``). Exits 1 if the peer failed."""
    end_with_parent()
    section_name, peer, label = key.split("/", 2)
    section = next(section for section in SECTIONS if section.name == section_name)
    setting = next(setting for setting in section.settings(plan) if setting.label == label)

    def check(peer: str, result: dict) -> None:
        if result["status"] != "ok":
            sys.exit(f"{key}: {result['status']}: {result.get('reason', '')}")

    setting.run((peer,), check, contextlib.nullcontext)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the CPU, tiny shapes: checks the script in seconds")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"seconds for compiling ahead and all sections (default {BUDGET_S:g}; --smoke: 600)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path, .md beside it (default bench/results/[quick/]gpu_bars_<device>.json)",
    )
    parser.add_argument("--copy-to", type=Path, default=None, help="a folder that gets a copy of the JSON and .md")
    parser.add_argument(
        "--sections",
        nargs="+",
        default=None,
        choices=[section.name for section in SECTIONS],
        help="run these sections only, in their usual order, the budget shared among them (default: all)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="processes compiling ahead at once (CompilingAhead; 0: none, each setting compiles as it is measured; "
        "default: half the cores, at most 8; --smoke: 0)",
    )
    parser.add_argument(
        "--cpu-as-cuda",
        action="store_true",
        help="with --smoke: the CPU takes CUDA's choices (the fused path compiled), so that there is code to compile",
    )
    parser.add_argument("--compile-only", metavar="KEY", default=None, help=argparse.SUPPRESS)  # CompilingAhead's
    args = parser.parse_args(argv)
    plan = SMOKE if args.smoke else GPU
    budget_s = args.budget_s if args.budget_s is not None else 600.0 if args.smoke else BUDGET_S
    jobs = args.jobs if args.jobs is not None else 0 if args.smoke else min(8, max(1, (os.cpu_count() or 2) // 2))
    if budget_s < 0:
        parser.error(f"--budget-s must be >= 0, got {budget_s:g}")
    if jobs < 0:
        parser.error(f"--jobs must be >= 0 (0: no compiling ahead), got {jobs}")
    if args.cpu_as_cuda and not args.smoke:
        parser.error("--cpu-as-cuda goes with --smoke (the CPU plan); on a GPU, CUDA makes its own choices")
    if plan.device == "cuda" and not torch.cuda.is_available():
        parser.error("torch finds no CUDA device here; --smoke runs the same sections on the CPU with tiny shapes")
    if args.compile_only is not None and args.compile_only not in compile_units(plan):
        parser.error(
            f"--compile-only takes section/peer/setting of a peer that compiles (compile_units), got "
            f"{args.compile_only!r}"
        )
    out = args.out or results_path(f"gpu_bars_{plan.device}", quick=args.smoke)
    if out.suffix != ".json":
        parser.error(f"--out must name a .json file, got {str(out)!r}")
    if args.cpu_as_cuda:
        take_cuda_choices_on_cpu()
    if args.compile_only is not None:
        compile_only(dataclasses.replace(plan, repeats=1), args.compile_only)
        return []

    units = compile_units(plan, args.sections)
    ahead = None
    if jobs and units and budget_s:
        flags = [flag for flag, on in (("--smoke", args.smoke), ("--cpu-as-cuda", args.cpu_as_cuda)) if on]
        print(f"compiling ahead: {len(units)} peers' settings, {jobs} at a time, beside the measurement", flush=True)
        ahead = CompilingAhead(units, flags, jobs=jobs)
    compiled_ahead = "under way" if ahead else "none" if jobs else "none (--jobs 0)"

    def report(measurements: dict[str, dict], notes: dict[str, str], final: bool = False) -> list[dict]:
        """The table and JSON of what was measured so far, written after each section: a run stopped from outside
        leaves its last complete section's."""
        rows = bar_rows(measurements, notes, sections=args.sections)
        meta = run_meta(
            "gpu_bars",
            argv,
            device=plan.device,
            dtype=plan.dtype,
            budget_s=budget_s,
            plan=asdict(plan),
            sections=notes,
            compiled_ahead=compiled_ahead,
            time=f"median of {plan.repeats} steps after {plan.warmups} warm-up rounds, the peers of one "
            "setting stepped in turn in one process (LRA: the trainer's seconds over its second half)",
            memory="peak tensor memory over one step above what was held before it "
            "(bench.common.peak_step_memory: CUDA's max_memory_allocated, the CPU allocator's count)",
        )
        text = "\n".join(
            [
                f"{meta['date']}, {meta.get('gpu', meta['cpu'])}, torch {meta['torch']}, {plan.device} {plan.dtype}"
                + (" (smoke: tiny shapes)" if args.smoke else ""),
                f"command: `{meta['command']}`; time: {meta['time']}; memory: {meta['memory']}.",
                f"compiled ahead: {compiled_ahead}.",
                "sections: " + "; ".join(f"{name} {note}" for name, note in notes.items()) + ".",
                "",
                table(rows),
            ]
        )
        write_json(out, {"meta": meta, "measurements": measurements, "bars": rows})
        out.with_suffix(".md").write_text(text)
        written = [out, out.with_suffix(".md")]
        if args.copy_to and args.copy_to.resolve() != out.parent.resolve():
            args.copy_to.mkdir(parents=True, exist_ok=True)
            written += [Path(shutil.copy(path, args.copy_to)) for path in written]
        if final:
            print("\n" + text)
            print("wrote " + ", ".join(map(str, written)), file=sys.stderr)
        return rows

    try:
        measurements, notes = run_sections(plan, budget_s, args.sections, ahead, after_section=report)
    finally:
        if ahead:
            compiled_ahead = ahead.close()
            print(f"compiling ahead: {compiled_ahead}", flush=True)
    return report(measurements, notes, final=True)


if __name__ == "__main__":
    main()
