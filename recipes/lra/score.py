"""Score trained LRA runs again, label by label: ``python -m recipes.lra.score RUN_DIR [RUN_DIR ...]``.

For the best-dev and the last checkpoint of each run: dev and test accuracy, the accuracy on each label, and each
split's accuracy re-weighted to the other split's label mix (the sum over labels of the split's accuracy on the label
times the other split's share of it). A model that gets some labels right far more often than others scores higher
on the split that holds more of them; the re-weighted numbers show how much of a dev/test gap that explains.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from .data import fresh_listops
from .model import LRAClassifier
from .train import RUN_KEYS, listops_rules, load, load_splits, model_config, predictions, resolve

SCORED_SPLITS = ("dev", "test")
CHECKPOINTS = ("best.pt", "last.pt")


def run_settings(run_dir: str | Path, data_dir: str | None = None, device: str | None = None) -> argparse.Namespace:
    """The arguments a run was trained with, from its ``results.json``, on ``device``."""
    path = Path(run_dir) / "results.json"
    if not path.exists():
        raise SystemExit(f"error: {path} not found; RUN_DIR must be a --output_dir of python -m recipes.lra.")
    run = json.loads(path.read_text())["run"]
    argv = ["--output_dir", str(run_dir)] + (["--data_dir", data_dir] if data_dir else [])
    argv += ["--device", device] if device else []
    for key in RUN_KEYS:
        value = run[key]
        if isinstance(value, bool):
            argv += [f"--{key}"] if value else []
        elif value is not None:
            argv += [f"--{key}", str(value)]
    return resolve(argv)


def label_scores(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> dict:
    """Accuracy, examples per label and accuracy per label (None for a label the split does not hold)."""
    counts = np.bincount(labels, minlength=num_classes)
    right = np.bincount(labels[labels == predicted], minlength=num_classes)
    return {
        "accuracy": float((labels == predicted).mean()),
        "label_counts": counts.tolist(),
        "label_accuracy": [float(r / c) if c else None for r, c in zip(right, counts)],
    }


def reweighted(label_accuracy: list, label_counts: list) -> float:
    """The accuracy a split would have with ``label_counts``' label mix, over the labels it holds."""
    pairs = [(a, c) for a, c in zip(label_accuracy, label_counts) if a is not None]
    return sum(a * c for a, c in pairs) / sum(c for _, c in pairs)


def score_run(
    run_dir: str | Path,
    data_dir: str | None = None,
    batch_size: int = 64,
    device: str | None = None,
    fresh: int = 0,
    fresh_seed: int = 1,
    checkpoints: tuple[str, ...] = CHECKPOINTS,
) -> list[dict]:
    """One row per checkpoint (of ``best.pt``, ``last.pt``) of the run, scored on ``device`` (default: cuda if
    available); with ``fresh``, also on that many new ListOps expressions (``fresh_listops``)."""
    args = run_settings(run_dir, data_dir, device)
    if fresh and args.task != "listops":
        raise SystemExit(f"error: --fresh draws new ListOps expressions; {run_dir} is a {args.task} run.")
    if fresh and fresh_seed == args.data_seed:
        raise SystemExit(f"error: --fresh_seed {fresh_seed} is {run_dir}'s --data_seed: give another generator seed.")
    splits = load_splits(args)
    if fresh:
        splits["fresh"] = fresh_listops(fresh_seed, fresh, listops_rules(args), exclude=splits["train"])
    config = model_config(args)
    model = LRAClassifier(config).to(args.device)
    rows = []
    for name in checkpoints:
        path = Path(run_dir) / name
        if not path.exists():
            continue
        saved = load(path, args.device)
        model.load_state_dict(saved["model"])
        step = saved["step"] if "step" in saved else saved["state"]["step"]
        scores = {}
        for split in (split for split in SCORED_SPLITS + ("fresh",) if split in splits):
            labels, logits = predictions(model, splits[split], batch_size, max(config.window, 1))
            scores[split] = label_scores(labels, logits.argmax(-1), config.num_classes)
        dev, test = scores["dev"], scores["test"]
        rows.append(
            {
                "run": str(run_dir),
                "checkpoint": name,
                "step": step,
                **scores,
                "dev_with_test_labels": reweighted(dev["label_accuracy"], test["label_counts"]),
                "test_with_dev_labels": reweighted(test["label_accuracy"], dev["label_counts"]),
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    fresh = f" fresh ({sum(rows[0]['fresh']['label_counts'])}) |" if "fresh" in rows[0] else ""
    lines = [
        f"| run | checkpoint (step) | dev | test | dev with test's labels | test with dev's labels |{fresh}",
        "|---|---|---|---|---|---|" + ("---|" if fresh else ""),
    ]
    lines += [
        f"| {r['run']} | {r['checkpoint']} ({r['step']}) | {100 * r['dev']['accuracy']:.2f} | "
        f"{100 * r['test']['accuracy']:.2f} | {100 * r['dev_with_test_labels']:.2f} | "
        f"{100 * r['test_with_dev_labels']:.2f} |" + (f" {100 * r['fresh']['accuracy']:.2f} |" if fresh else "")
        for r in rows
    ]
    for split in SCORED_SPLITS + (("fresh",) if fresh else ()):
        lines.append(f"\n{split}: examples per label, then accuracy (%) per label")
        for run in dict.fromkeys(r["run"] for r in rows):
            mine = [r for r in rows if r["run"] == run]
            lines.append(f"- {run}: {mine[0][split]['label_counts']}")
            lines += [
                f"  - {r['checkpoint']}: "
                + ", ".join("-" if a is None else f"{100 * a:.0f}" for a in r[split]["label_accuracy"])
                for r in mine
            ]
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m recipes.lra.score", description=__doc__)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="--output_dir of a python -m recipes.lra run")
    p.add_argument("--data_dir", help="the runs' --data_dir, if they were given one")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--device", help="where to score, e.g. cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--checkpoint", choices=("best", "last", "both"), default="both", help="which ones to score")
    p.add_argument(
        "--fresh",
        type=int,
        default=0,
        metavar="N",
        help="ListOps: also score N new expressions by the runs' rules, none from their training split",
    )
    p.add_argument("--fresh_seed", type=int, default=1, help="--fresh: generator seed (not the runs' --data_seed)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.fresh < 0:
        p.error(f"--fresh must be >= 0, got {args.fresh}")
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoints = CHECKPOINTS if args.checkpoint == "both" else (f"{args.checkpoint}.pt",)
    rows = [
        row
        for run_dir in args.run_dirs
        for row in score_run(
            run_dir, args.data_dir, args.batch_size, args.device, args.fresh, args.fresh_seed, checkpoints
        )
    ]
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
