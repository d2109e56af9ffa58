"""Dev accuracy against training steps for LRA runs: ``python -m recipes.lra.plot RUN_DIR ... -o dev.png``.

Each RUN_DIR (or its ``results.json``) is one curve, labelled by its attention, (w, r) and seed, and coloured by its
attention; a finished run's test accuracy joins its label. Works on unfinished runs too (the curve so far).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def label(results: dict) -> str:
    run = results["run"]
    name = run["attention"].replace("_", "-")
    if run["attention"] == "long_short":
        name += f" (w, r) = ({run['window_size']}, {run['projection_rank']})"
    name += f", seed {run['seed']}"
    if "test_accuracy" in results:
        name += f": test {100 * results['test_accuracy']:.1f} %"
    return name


def plot(paths: list[str], output: str, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.8))
    colours = {}
    for path in paths:
        file = Path(path) / "results.json" if Path(path).is_dir() else Path(path)
        if not file.exists():
            raise SystemExit(f"error: {file} does not exist; give run folders (with results.json) or the files.")
        results = json.loads(file.read_text())
        steps = [h["step"] for h in results["history"]]
        colour = colours.setdefault(results["run"]["attention"], f"C{len(colours)}")
        ax.plot(
            steps,
            [100 * h["dev_accuracy"] for h in results["history"]],
            marker=".",
            markersize=3,
            linewidth=1,
            alpha=0.8,
            color=colour,
            label=label(results),
        )
    ax.set_xlabel("training step")
    ax.set_ylabel("dev accuracy (%)")
    ax.set_title(title or f"LRA {results['run']['task']}: dev accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the curves, never over them
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    print(f"wrote {output}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m recipes.lra.plot", description=__doc__)
    p.add_argument("runs", nargs="+", help="run folders (or their results.json)")
    p.add_argument("-o", "--output", default="lra_dev.png")
    p.add_argument("--title")
    args = p.parse_args(argv)
    plot(args.runs, args.output, args.title)


if __name__ == "__main__":
    main()
