"""Measure the memory of real training steps, to calibrate and check the recipes' estimate (``recipes.memory``).

Each configuration is one freshly built model trained for three steps, in its own forked process on one thread:

* ``hf``: a ``LongShortForSequenceClassification`` (``head="classification"``), ``LongShortForMaskedLM``
  (``"masked_lm"``) or ``LongShortForCausalLM`` (``"causal_lm"``) trained by the Transformers ``Trainer`` (its
  default fused AdamW) on random token ids, with or without ``--gradient_checkpointing`` and
  ``recompute_window_tiles``;
* ``xl``: ``LongShortXLForCausalLM`` with its memory, trained by ``recipes.char_lm``'s ``StreamTrainer``;
* ``lra``: the LRA recipe's ``LRAClassifier`` trained by its own loop (AdamW, cross-entropy);
* ``vision``: an ``ls_timm`` model trained as ``recipes.imagenet.train`` trains it (timm's AdamW, Mixup/CutMix,
  soft-target cross-entropy), on random images.

Measured: the peak RSS growth over the three steps above the RSS before the first (the model and the data
resident), read from the kernel's high-water mark: what the OOM killer sees. The estimate is
``recipes.memory.TrainingStep.bytes`` of the same configuration, which likewise leaves out the resident model. Its
coefficients are fitted to the ``grid()`` rows (``--fit``); the ``validation()`` rows, at the recipes' real sizes,
are left out of the fit and show how it extrapolates.

    python -m recipes.memory_calibration            # measure what is not measured yet, then the table
    python -m recipes.memory_calibration --report   # the table of the saved results
    python -m recipes.memory_calibration --fit      # the coefficients fitted to them (recipes.memory.CALIBRATED)

Writes ``recipes/memory_calibration_cpu.json`` (a row per configuration, kept between runs: a configuration
already measured is not run again) and prints a markdown table of estimate against measurement.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from dataclasses import fields, replace
from pathlib import Path

import torch

from bench.common import forked, peak_rss_above, reset_peak_rss, run_meta, write_json

STEPS = 3
RESULTS = Path(__file__).with_name("memory_calibration_cpu.json")


def hf_config(spec: dict):
    """The ``LongShortConfig`` (or ``LongShortXLConfig``) of a configuration."""
    from ls_hf import LongShortConfig, LongShortXLConfig

    d = spec["width"]
    common = {
        "vocab_size": spec.get("vocab", 1000),
        "hidden_size": d,
        "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec.get("heads", max(d // 64, 1)),
        "intermediate_size": spec.get("intermediate", 4 * d),
        "window_size": spec["window"],
        "projection_rank": spec["rank"],
        "causal_segment_length": spec.get("segment", 16),
        "hidden_dropout_prob": spec.get("hidden_dropout", 0.1),
    }
    if spec["family"] == "xl":
        return LongShortXLConfig(**common, memory_length=spec.get("memory", spec["length"]))
    return LongShortConfig(
        **common,
        attention_probs_dropout_prob=spec.get("attention_dropout", 0.1),
        max_position_embeddings=spec["length"] + 2,
        is_decoder=spec["head"] == "causal_lm",
        recompute_window_tiles=spec.get("recompute", False),
        num_labels=2,
    )


def build(spec: dict):
    """(model, ``train()`` running STEPS training steps) of a configuration."""
    torch.manual_seed(0)
    if spec["family"] == "lra":
        return lra_training(spec)
    if spec["family"] == "vision":
        return vision_training(spec)
    B, n = spec["batch"], spec["length"]
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments, default_data_collator

    from ls_hf import LongShortForCausalLM, LongShortForMaskedLM, LongShortForSequenceClassification

    config = hf_config(spec)
    args = TrainingArguments(
        tempfile.mkdtemp(),
        max_steps=STEPS,
        per_device_train_batch_size=B,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
        use_cpu=True,
        gradient_checkpointing=spec.get("checkpointing", False),
        dataloader_pin_memory=False,
        bf16=spec.get("bf16", False),
    )
    ids = torch.randint(3, config.vocab_size, (B * STEPS, n))
    if spec["family"] == "xl":
        from ls_hf import LongShortXLForCausalLM
        from recipes.char_lm import StreamTrainer

        model = LongShortXLForCausalLM(config)
        args.label_names, args.train_sampling_strategy = ["shift_labels"], "sequential"
        data = Dataset.from_dict({"input_ids": ids, "shift_labels": ids}).with_format("torch")
        trainer = StreamTrainer(
            model=model,
            args=args,
            train_dataset=data,
            data_collator=default_data_collator,
            texts={},
            scoring={},
            stream_start="zeros",
        )
        return model, trainer.train
    head = spec["head"]
    model = {
        "classification": LongShortForSequenceClassification,
        "masked_lm": LongShortForMaskedLM,
        "causal_lm": LongShortForCausalLM,
    }[head](config)
    if head == "classification":
        labels = torch.randint(0, 2, (B * STEPS,))
    else:
        labels = ids.clone()
        if head == "masked_lm":
            labels[torch.rand(labels.shape) > 0.15] = -100
    data = Dataset.from_dict({"input_ids": ids, "labels": labels}).with_format("torch")
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
    return model, trainer.train


def lra_config(spec: dict):
    """The ``LRAConfig`` of a configuration (the paper's LRA model by default)."""
    from recipes.lra.model import LRAConfig

    return LRAConfig(
        vocab_size=20,
        max_length=spec["length"],
        num_classes=10,
        window_size=spec["window"],
        projection_rank=spec["rank"],
        hidden_size=spec.get("width", 64),
        num_heads=spec.get("heads", 2),
        intermediate_size=2 * spec.get("width", 64),
        num_layers=spec["layers"],
        dual=spec.get("dual", False),
        recompute_window_tiles=spec.get("recompute", False),
    )


def lra_training(spec: dict):
    """The LRA recipe's model and training loop (``recipes.lra.train``) on random ids."""
    import torch.nn.functional as F

    from recipes.lra.model import LRAClassifier

    config = lra_config(spec)
    model = LRAClassifier(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-6)
    towers = 2 if config.dual else 1
    ids = [torch.randint(1, 20, (spec["batch"], spec["length"])) for _ in range(towers)]
    masks = [torch.ones_like(x, dtype=torch.bool) for x in ids]
    labels = torch.randint(0, 10, (spec["batch"],))

    def train():
        for _ in range(STEPS):
            loss = F.cross_entropy(model(ids, masks), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    return model, train


def vision_model(spec: dict):
    """The timm model of a ``vision`` configuration (an ``ls_timm`` entry at ``img`` pixels, 10 classes)."""
    import timm

    import ls_timm  # noqa: F401  (registers the models)

    torch.manual_seed(0)
    return timm.create_model(spec["model"], num_classes=10, img_size=spec["img"], drop_path_rate=0.1)


def vision_training(spec: dict):
    """The ImageNet recipe's step (``recipes.imagenet.train``: timm's AdamW, Mixup/CutMix, soft-target loss) on
    random images."""
    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy
    from timm.optim import create_optimizer_v2

    model = vision_model(spec).train()
    optimizer = create_optimizer_v2(model, opt="adamw", lr=1e-4, weight_decay=0.1)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=10)
    criterion = SoftTargetCrossEntropy()
    images, targets = torch.randn(spec["batch"], 3, spec["img"], spec["img"]), torch.arange(spec["batch"]) % 10

    def train():
        for _ in range(STEPS):
            mixed, soft = mixup(images.clone(), targets)
            loss = criterion(model(mixed), soft)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    return model, train


def measure(spec: dict) -> dict:
    """Peak RSS growth of STEPS training steps above the RSS before them, and the model's parameter count."""
    model, train = build(spec)
    base = reset_peak_rss()
    train()
    return {"measured_bytes": peak_rss_above(base), "parameters": sum(p.numel() for p in model.parameters())}


def training_step(spec: dict, parameters: int):
    """The estimate's view (``recipes.memory.TrainingStep``) of a configuration with ``parameters`` parameters."""
    from recipes.memory import TrainingStep, long_short_layers

    if spec["family"] == "lra":
        config = lra_config(spec)
        layers = config.attention_layers(spec["length"], lean=config.recompute_window_tiles)
        return TrainingStep(parameters, layers, examples=spec["batch"] * (2 if config.dual else 1))
    if spec["family"] == "vision":
        from recipes.imagenet.train import attention_layers

        return TrainingStep(
            parameters, attention_layers(vision_model(spec), (3, spec["img"], spec["img"])), spec["batch"]
        )
    layers = long_short_layers(hf_config(spec), spec["length"], lean=spec.get("recompute", False))
    return TrainingStep(
        parameters,
        layers,
        spec["batch"],
        vocab=0 if spec["head"] == "classification" else spec.get("vocab", 1000),
        head_tokens=spec["length"],
        checkpointing=spec.get("checkpointing", False),
        half_precision=spec.get("bf16", False),
    )


# Coefficients fixed by what they count rather than fitted: a float32 gradient and AdamW's two moments per parameter;
# per token and vocabulary entry, the float32 logits, their log-softmax and its gradient.
FIXED_COEFFICIENTS = {"parameter": 12.0, "logit": 12.0}


def fit(rows: list[dict]):
    """``recipes.memory.Coefficients`` fitted to ``rows``: non-negative least squares on the relative error over the
    float32 rows, with ``FIXED_COEFFICIENTS`` as they are, then ``half`` by least squares on the bfloat16 rows. The
    estimate is linear in the coefficients, so each one's feature is the estimate with that coefficient 1 and the
    others 0."""
    import numpy as np
    from scipy.optimize import nnls

    from recipes.memory import Coefficients

    names = [field.name for field in fields(Coefficients)]
    free = [name for name in names if name not in FIXED_COEFFICIENTS and name != "half"]
    full = [row for row in rows if not row["spec"].get("bf16")]
    steps = [training_step(row["spec"], row["parameters"]) for row in full]
    measured = np.array([row["measured_bytes"] for row in full], dtype=float)
    fixed = Coefficients(**{name: FIXED_COEFFICIENTS.get(name, 0.0) for name in names})
    known = np.array([step.bytes(fixed) for step in steps])
    units = [Coefficients(**{other: float(other == name) for other in names}) for name in free]
    features = np.array([[step.bytes(unit) for unit in units] for step in steps]) / measured[:, None]
    solution = nnls(features, 1 - known / measured)[0].tolist()
    fitted = Coefficients(**{**FIXED_COEFFICIENTS, **dict(zip(free, solution)), "half": 1.0})
    half = [
        (training_step(row["spec"], row["parameters"]), row["measured_bytes"])
        for row in rows
        if row["spec"].get("bf16")
    ]
    rest = np.array([(m - step.bytes(fitted) + step.activation_bytes(fitted)) / m for step, m in half])
    activations = np.array([step.activation_bytes(fitted) / m for step, m in half])
    return replace(fitted, half=float(activations @ rest / (activations @ activations)))


def usable(rows: list[dict]) -> list[dict]:
    """The rows the fit uses: measured, and not ``validation()`` ones."""
    held_out = {key(spec) for spec in validation()}
    return [row for row in rows if row["status"] == "ok" and key(row["spec"]) not in held_out]


def key(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True)


def grid() -> list[dict]:
    """The configurations measured: widths 128-768, depths 1-4, lengths 512-4096, batches 1-4, each attention path
    (attention dropout: SDPA's unfused kernel; none; ``recompute_window_tiles``), with and without gradient
    checkpointing, three heads, the official character-level model and the LRA model."""
    specs = []
    hf = {"family": "hf", "head": "classification", "window": 128, "rank": 32}
    paths = ({"attention_dropout": 0.1}, {"attention_dropout": 0.0}, {"attention_dropout": 0.0, "recompute": True})
    for path in paths:
        for checkpointing in (False, True):
            for width, layers, length, batch in (
                (128, 2, 1024, 4),
                (256, 1, 2048, 2),
                (256, 4, 1024, 1),
                (512, 2, 2048, 1),
                (768, 1, 4096, 1),
                (384, 2, 512, 4),
            ):
                specs.append(
                    {
                        **hf,
                        **path,
                        "checkpointing": checkpointing,
                        "width": width,
                        "layers": layers,
                        "length": length,
                        "batch": batch,
                    }
                )
    for window, rank in ((64, 16), (256, 64), (32, 8)):
        for path in paths:
            specs.append(
                {**hf, **path, "width": 256, "layers": 2, "length": 2048, "batch": 2, "window": window, "rank": rank}
            )
    for head, vocab in (("masked_lm", 50265), ("masked_lm", 8000), ("causal_lm", 8000), ("causal_lm", 259)):
        for checkpointing in (False, True):
            for width, layers, length, batch in ((128, 2, 512, 2), (256, 2, 1024, 1)):
                specs.append(
                    {
                        **hf,
                        "head": head,
                        "vocab": vocab,
                        "checkpointing": checkpointing,
                        "width": width,
                        "layers": layers,
                        "length": length,
                        "batch": batch,
                    }
                )
    for length in (1024, 4096):  # causal: r n / (2 l) projected rows per query on average
        specs.append(
            {
                **hf,
                "head": "causal_lm",
                "vocab": 259,
                "width": 256,
                "layers": 2,
                "length": length,
                "batch": 1,
                "window": 128,
                "rank": 4,
                "segment": 16,
                "hidden_dropout": 0.2,
                "attention_dropout": 0.2,
            }
        )
    for width, length, memory in ((128, 512, 512), (256, 1024, 512)):
        specs.append(
            {
                "family": "xl",
                "head": "causal_lm",
                "vocab": 259,
                "width": width,
                "layers": 2,
                "length": length,
                "batch": 2,
                "window": 128,
                "rank": 1,
                "memory": memory,
                "hidden_dropout": 0.2,
            }
        )
    for inner in (2, 8):  # other feed-forward widths than 4 d
        for path in paths:
            specs.append(
                {**hf, **path, "intermediate": inner * 256, "width": 256, "layers": 2, "length": 1024, "batch": 2}
            )
    for path in paths[:2]:  # bfloat16 autocast (--bf16)
        for head, vocab in (("classification", 1000), ("masked_lm", 8000)):
            specs.append(
                {
                    **hf,
                    **path,
                    "head": head,
                    "vocab": vocab,
                    "bf16": True,
                    "width": 256,
                    "layers": 2,
                    "length": 2048,
                    "batch": 2,
                }
            )
    for length, batch, dual in ((2000, 32, False), (4096, 8, True), (1024, 16, False)):
        for recompute in (False, True):
            specs.append(
                {
                    "family": "lra",
                    "width": 64,
                    "layers": 2,
                    "length": length,
                    "batch": batch,
                    "window": 8,
                    "rank": 32,
                    "dual": dual,
                    "recompute": recompute,
                }
            )
    return specs


def validation() -> list[dict]:
    """Configurations the fit leaves out, at the recipes' real sizes: roberta-base's shape (12 x 768, w = 256,
    r = 64, dropout 0.1) on 4,096 tokens with gradient checkpointing, 4 of its layers without, its masked LM (2
    layers, the full vocabulary), the CPU example of char_lm, and the ImageNet recipe's models."""
    base = {
        "family": "hf",
        "head": "classification",
        "width": 768,
        "window": 256,
        "rank": 64,
        "length": 4096,
        "batch": 1,
    }
    return [
        {**base, "layers": 12, "checkpointing": True},
        {**base, "layers": 4},
        {**base, "head": "masked_lm", "vocab": 50265, "layers": 2, "checkpointing": True},
        {
            "family": "hf",
            "head": "causal_lm",
            "vocab": 384,
            "width": 256,
            "layers": 4,
            "window": 128,
            "rank": 1,
            "length": 512,
            "batch": 4,
            "hidden_dropout": 0.2,
            "attention_dropout": 0.2,
        },
        {"family": "vision", "model": "cvt_ls_13", "img": 224, "batch": 4},
        {"family": "vision", "model": "vil_ls_small", "img": 224, "batch": 2},
        {"family": "vision", "model": "cvt_ls_13", "img": 64, "batch": 8},
    ]


def describe(spec: dict) -> str:
    """A configuration in a few words, for the table."""
    if spec["family"] == "vision":
        return f"{spec['model']}, {spec['batch']} x {spec['img']} px"
    if spec["family"] == "lra":
        kind = "LRA" + (", dual" if spec.get("dual") else "")
    else:
        kind = {"classification": "classifier", "masked_lm": "masked LM", "causal_lm": "causal LM"}[spec["head"]]
        kind = ("XL " if spec["family"] == "xl" else "") + kind + (f", V={spec['vocab']}" if "vocab" in spec else "")
    inner = f", I={spec['intermediate']}" if "intermediate" in spec else ""
    path = (
        "lean"
        if spec.get("recompute")
        else "attn dropout"
        if spec.get("attention_dropout", 0.1 if spec["family"] == "hf" else 0)
        else "sdpa"
    )
    extras = [name for name, on in (("checkpointing", spec.get("checkpointing")), ("bf16", spec.get("bf16"))) if on]
    return (
        f"{kind}, {spec['layers']} x {spec['width']}{inner}, w={spec['window']} r={spec['rank']}, "
        f"{spec['batch']} x {spec['length']}, {', '.join([path, *extras])}"
    )


def report(rows: list[dict]) -> str:
    """Markdown table: each measured configuration, its estimate and the relative error; the fit's rows, then the
    held-out ones (``validation()``, half precision)."""
    fitted = {key(row["spec"]) for row in usable(rows)}
    lines = ["| configuration | set | measured (MiB) | estimate (MiB) | error |", "|---|---|---|---|---|"]
    measured = [row for row in rows if row["status"] == "ok"]
    for row in sorted(measured, key=lambda row: key(row["spec"]) not in fitted):
        estimate = training_step(row["spec"], row["parameters"]).bytes()
        role = "fit" if key(row["spec"]) in fitted else "held out"
        lines.append(
            f"| {describe(row['spec'])} | {role} | {row['measured_bytes'] / 2**20:.0f} | "
            f"{estimate / 2**20:.0f} | {100 * (estimate / row['measured_bytes'] - 1):+.1f} % |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.memory_calibration", description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", action="store_true", help="measure nothing: the table of the saved results")
    parser.add_argument("--fit", action="store_true", help="measure nothing: the coefficients fitted to them")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    out = Path(args.out)
    saved = json.loads(out.read_text()) if out.is_file() else {"meta": {}, "rows": []}
    if args.fit:
        print(fit(usable(saved["rows"])))
        return
    done = {key(row["spec"]) for row in saved["rows"] if row.get("status") == "ok"}
    for spec in [] if args.report else [spec for spec in grid() + validation() if key(spec) not in done]:
        row = {"spec": spec, **forked(functools.partial(measure, spec), threads=1)}
        saved["rows"] = [r for r in saved["rows"] if key(r["spec"]) != key(spec)] + [row]
        saved["meta"] = run_meta("recipes.memory_calibration", argv, steps=STEPS)
        write_json(out, saved)
        print(json.dumps(row), flush=True)
    print(report(saved["rows"]))


if __name__ == "__main__":
    main()
