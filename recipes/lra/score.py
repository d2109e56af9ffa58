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

from .model import LRAClassifier
from .train import RUN_KEYS, load_splits, model_config, predictions, resolve

SCORED_SPLITS = ("dev", "test")


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
    return {"accuracy": float((labels == predicted).mean()), "label_counts": counts.tolist(),
            "label_accuracy": [float(r / c) if c else None for r, c in zip(right, counts)]}


def reweighted(label_accuracy: list, label_counts: list) -> float:
    """The accuracy a split would have with ``label_counts``' label mix, over the labels it holds."""
    pairs = [(a, c) for a, c in zip(label_accuracy, label_counts) if a is not None]
    return sum(a * c for a, c in pairs) / sum(c for _, c in pairs)


def score_run(run_dir: str | Path, data_dir: str | None = None, batch_size: int = 64,
              device: str | None = None) -> list[dict]:
    """One row per checkpoint (``best.pt``, ``last.pt``) of the run, scored on ``device`` (default: cuda if
    available)."""
    args = run_settings(run_dir, data_dir, device)
    splits = load_splits(args)
    config = model_config(args)
    model = LRAClassifier(config).to(args.device)
    rows = []
    for name in ("best.pt", "last.pt"):
        path = Path(run_dir) / name
        if not path.exists():
            continue
        saved = torch.load(path, weights_only=False, map_location=args.device)
        model.load_state_dict(saved["model"])
        step = saved["step"] if "step" in saved else saved["state"]["step"]
        scores = {split: label_scores(*predictions(model, splits[split], batch_size, max(config.window, 1)),
                                      config.num_classes) for split in SCORED_SPLITS}
        dev, test = scores["dev"], scores["test"]
        rows.append({"run": str(run_dir), "checkpoint": name, "step": step, **scores,
                     "dev_with_test_labels": reweighted(dev["label_accuracy"], test["label_counts"]),
                     "test_with_dev_labels": reweighted(test["label_accuracy"], dev["label_counts"])})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| run | checkpoint (step) | dev | test | dev with test's labels | test with dev's labels |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['checkpoint']} ({r['step']}) | {100 * r['dev']['accuracy']:.2f} | "
              f"{100 * r['test']['accuracy']:.2f} | {100 * r['dev_with_test_labels']:.2f} | "
              f"{100 * r['test_with_dev_labels']:.2f} |" for r in rows]
    for split in SCORED_SPLITS:
        lines.append(f"\n{split}: examples per label, then accuracy (%) per label")
        for run in dict.fromkeys(r["run"] for r in rows):
            mine = [r for r in rows if r["run"] == run]
            lines.append(f"- {run}: {mine[0][split]['label_counts']}")
            lines += [f"  - {r['checkpoint']}: "
                      + ", ".join("-" if a is None else f"{100 * a:.0f}" for a in r[split]["label_accuracy"])
                      for r in mine]
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m recipes.lra.score", description=__doc__)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="--output_dir of a python -m recipes.lra run")
    p.add_argument("--data_dir", help="the runs' --data_dir, if they were given one")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--device", help="where to score, e.g. cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [row for run_dir in args.run_dirs for row in score_run(run_dir, args.data_dir, args.batch_size, args.device)]
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
