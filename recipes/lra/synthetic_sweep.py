"""Where does the dynamic projection alone carry one token? The step at which the synthetic long-range task
(``recipes.lra.synthetic``: one marker in the second half, read from the first token) first reaches a held-out
accuracy of 0.9, over lengths, vocabulary sizes, with and without a global first token, and seeds.

    OMP_NUM_THREADS=1 nice -n 10 nohup python -m recipes.lra.synthetic_sweep > runs/synthetic_sweep.log 2>&1 &
    python -m recipes.lra.synthetic_sweep --report        # the table, in markdown, unfinished runs marked *

The model is the README's: 2 layers, width 64, w = 16, r = 8 (``window``: r = 0), AdamW 1e-3, batch 16, balanced
labels. Every --eval_every steps the accuracy on a fixed held-out set of --eval_size sequences is measured; a run stops
when it reaches --target or after --steps. Runs go cheapest first (shorter sequences first); --lengths,
--vocab_sizes, --seeds, --attentions and --global_first_token pick a part of the grid. Each finished run is appended
to --out as one JSON line, and a restart skips the runs found there; the run in progress is saved at every evaluation
(--checkpoint_dir, outside git) and resumes from its last evaluation.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
from pathlib import Path

import torch

from bench.common import machine
from recipes.lra.synthetic import ATTENTIONS, Task, train

CHOICES = {"yes": (True,), "no": (False,), "both": (True, False)}
NAMES = {"long_short": "Long-Short", "window": "window only", "full": "full attention"}
RUN_KEYS = ("attention", "length", "vocab_size", "global_first_token", "seed", "max_steps")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m recipes.lra.synthetic_sweep",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--vocab_sizes", type=int, nargs="+", default=[32, 64, 256])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--attentions", choices=ATTENTIONS, nargs="+", default=["long_short"])
    p.add_argument("--global_first_token", choices=sorted(CHOICES), default="both")
    p.add_argument("--steps", type=int, default=3000, help="the most training steps of a run")
    p.add_argument("--eval_every", type=int, default=50)
    p.add_argument("--eval_size", type=int, default=256)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("synthetic_sweep.jsonl"))
    p.add_argument("--checkpoint_dir", type=Path, default=Path("runs/synthetic_sweep"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--report",
        action="store_true",
        help="print the table of the runs in --out and --checkpoint_dir (unfinished) and exit",
    )
    return p


def finished(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def reached(run: dict, target: float) -> int | None:
    """The first evaluated step at which the held-out accuracy reached ``target``, or None."""
    return next((h["step"] for h in run["history"] if h["accuracy"] >= target), None)


def checkpoint_path(checkpoint_dir: Path, key: tuple) -> Path:
    """Where the run of ``key`` (values of ``RUN_KEYS``) is saved until it finishes."""
    return checkpoint_dir / ("_".join(map(str, key)) + ".pt")


def sweep(args) -> None:
    done = {tuple(run[k] for k in RUN_KEYS) for run in finished(args.out)}
    grid = itertools.product(
        sorted(args.lengths), CHOICES[args.global_first_token], sorted(args.vocab_sizes), args.attentions, args.seeds
    )
    plan = [
        (attention, Task(length, vocab_size, global_first_token=global_first_token), seed)
        for length, global_first_token, vocab_size, attention, seed in grid
    ]  # every setting checked first
    for attention, task, seed in plan:
        key = (attention, task.length, task.vocab_size, task.global_first_token, seed, args.steps)
        if key in done:
            continue
        checkpoint = checkpoint_path(args.checkpoint_dir, key)
        run = train(
            attention,
            task,
            args.steps,
            eval_every=args.eval_every,
            eval_size=args.eval_size,
            seed=seed,
            target=args.target,
            checkpoint=checkpoint,
        )
        run |= {
            "max_steps": args.steps,
            "target": args.target,
            "reached_at": reached(run, args.target),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_average": os.getloadavg(),
            **machine(),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(json.dumps(run) + "\n")
        checkpoint.unlink()
        print(json.dumps({k: run[k] for k in (*RUN_KEYS, "reached_at", "best_accuracy")}), flush=True)


def unfinished(checkpoint_dir: Path) -> list[dict]:
    """The settings and history of the runs saved in ``checkpoint_dir`` and not finished yet."""
    return [
        {**state["settings"], "history": state["history"]}
        for state in map(torch.load, sorted(checkpoint_dir.glob("*.pt")))
    ]


def report(runs: list[dict]) -> str:
    """One row per length and vocabulary, a column per attention and global first token: each seed's step at which
    the held-out accuracy reached the target; ``> S (a)``: not within S steps, best accuracy a; ``*``: unfinished."""
    cells = {}
    for r in sorted(runs, key=lambda r: r["seed"]):
        best = max(h["accuracy"] for h in r["history"])
        shown = str(r.get("reached_at")) if r.get("reached_at") else f"> {r['history'][-1]['step']:,} ({best:.2f})"
        cells.setdefault((r["length"], r["vocab_size"], r["attention"], r["global_first_token"]), []).append(
            shown + ("" if "reached_at" in r else "*")
        )
    columns = sorted({key[2:] for key in cells}, key=lambda c: (c[1], c[0] != "long_short", c[0]))
    head = [f"{NAMES[a]}, {'first token global' if g else 'no global token'}" for a, g in columns]
    lines = ["| n | vocabulary | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(columns)]
    for n, v in sorted({key[:2] for key in cells}):
        lines.append(f"| {n:,} | {v} | " + " | ".join(" / ".join(cells.get((n, v, *c), ["-"])) for c in columns) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = parser().parse_args(argv)
    if args.report:
        print(report(finished(args.out) + unfinished(args.checkpoint_dir)))
        return
    torch.set_num_threads(args.threads)
    sweep(args)


if __name__ == "__main__":
    main()
