"""The paper's character-level comparisons in miniature (Sec. 4.2, Fig. 2 right) on a byte corpus this repo builds.

    python -m recipes.char_lm_miniature corpus                      # builds runs/char_lm_mini/corpus.txt
    python -m recipes.char_lm_miniature run official --seed 0       # one variant; rerun the same line to resume
    python -m recipes.char_lm_miniature report                      # table (markdown) and curves (png)

Corpus: the Python standard library's own sources (every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` outside
``test``/``tests``/``idlelib``/``site-packages``/``encodings`` directories, in sorted path order, each after a
``# file: <path>`` line), cut to its first --bytes bytes (4 MiB): every machine with this Python has it, and the same
Python version gives the same bytes (the sha256 is recorded). ``recipes.char_lm`` splits it in order 90/5/5: with
Python 3.11 validation runs from the end of ``http/server.py`` to ``importlib/_bootstrap_external.py``, test through
the rest of ``importlib`` into ``inspect.py``.

Every variant trains 4 layers of width 256 (4 heads) with w = 128, l = 16, r = 1 for the same budget: the same steps,
blocks of --block bytes and --streams streams per batch (so the same bytes), AdamW at a constant learning rate after
warmup, dropout 0.1, weight decay 0.01 (the official recipe's form, scaled down). The variants:

* ``official``: ``LongShortXLForCausalLM`` (official rules, memory of one block);
* ``official_no_dual_ln``: the same without DualLN (the paper's Fig. 2 right);
* ``paper_rules``: the same model with the paper's window rule and projection input;
* ``causal``: the package's ``LongShortForCausalLM`` (Post-LN, absolute positions, no memory);
* ``full``: the official model with full attention over memory and block (w = memory + block, r = 0).

Validation and test are scored by streaming (--eval_memory bytes of context before every 256 bytes) and block by
block; ``causal`` has no memory and is scored block by block. Runs live in --root (outside git); a run that stopped
resumes from its last checkpoint when started again with the same line.

``report`` writes ``table.md`` (per run: variant, model, DualLN, seed, steps, test and validation BPC streaming and
block by block, training time; per variant with two or more finished seeds, their means) and ``curves.png`` (the
training loss of every run, a colour per variant and a line style per seed). ``run`` notes in ``legs.jsonl`` the step
each session starts from: the Trainer times only its own session, so a resumed run's time says which steps it covers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("runs/char_lm_mini")
# tests, the IDLE application, installed packages and the generated codec tables (encodings/: hex maps, not code)
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "encodings"}
MODEL = [
    "--num_hidden_layers",
    "4",
    "--hidden_size",
    "256",
    "--num_attention_heads",
    "4",
    "--window_size",
    "128",
    "--causal_segment_length",
    "16",
    "--projection_rank",
    "1",
    "--dropout",
    "0.1",
]
VARIANTS = {
    "official": ["--model_type", "long_short_xl"],
    "official_no_dual_ln": ["--model_type", "long_short_xl", "--use_dual_ln", "False"],
    "paper_rules": ["--model_type", "long_short_xl", "--window_rule", "segment", "--projection_input", "normalized"],
    "causal": ["--model_type", "long_short"],
    "full": ["--model_type", "long_short_xl", "--projection_rank", "0", "--window_size", "{window_full}"],
}


def build_corpus(path: Path, size: int) -> dict:
    """Write the corpus (see the module docstring) to ``path``; returns its description."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(stdlib).parts[:-1]))
    chunks, total = [], 0
    for file in files:
        chunk = f"# file: {file.relative_to(stdlib)}\n".encode() + file.read_bytes()
        chunks.append(chunk)
        total += len(chunk)
        if total >= size:
            break
    if total < size:
        raise SystemExit(f"the standard library at {stdlib} holds {total} bytes of sources, fewer than --bytes {size}.")
    data = b"".join(chunks)[:size]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    info = {
        "source": str(stdlib),
        "python": sysconfig.get_python_version(),
        "files": len(chunks),
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    path.with_suffix(".json").write_text(json.dumps(info, indent=1))
    return info


def run_args(variant: str, seed: int, args) -> list[str]:
    """The ``recipes.char_lm`` command line of one run."""
    extra = [a.format(window_full=args.block * 2) for a in VARIANTS[variant]]
    overrides = dict(zip(extra[::2], extra[1::2]))
    model = [a for pair in zip(MODEL[::2], MODEL[1::2]) if pair[0] not in overrides for a in pair]
    out = args.root / f"{variant}-s{seed}"
    return [
        "--train_file",
        str(args.root / "corpus.txt"),
        "--output_dir",
        str(out),
        *model,
        *extra,
        "--max_seq_length",
        str(args.block),
        "--max_positions",
        str(args.block),
        "--per_device_train_batch_size",
        str(args.streams),
        "--max_steps",
        str(args.steps),
        "--learning_rate",
        str(args.lr),
        "--warmup_steps",
        str(args.warmup),
        "--weight_decay",
        "0.01",
        "--logging_steps",
        "25",
        "--save_steps",
        str(args.save_steps),
        "--save_total_limit",
        "1",
        "--eval_memory_length",
        str(args.eval_memory),
        "--eval_block_length",
        "256",
        "--seed",
        str(seed),
        "--disable_tqdm",
        "True",
        "--report_to",
        "none",
        "--dataloader_num_workers",
        "0",
        "--do_train",
        "--do_eval",
        "--do_predict",
    ]


# variant -> what its table row says of the model and the attention (DualLN is read from each run's config)
DESCRIPTIONS = {
    "official": "LongShortXL, official rules",
    "official_no_dual_ln": "LongShortXL, official rules",
    "paper_rules": "LongShortXL, paper rules (Appendix D window, LN_L keys projected)",
    "causal": "LongShortForCausalLM (Post-LN, absolute positions, no memory)",
    "full": "LongShortXL, full attention (w = memory + block, r = 0)",
}
LEGS = "legs.jsonl"  # one line per `run` of a run folder: the step it started from


def start_session(out: Path) -> int:
    """Note in ``out/legs.jsonl`` the step a training session of the run in ``out`` starts from (its last checkpoint's;
    0 for a new run) and return it: the report's train time covers the session that finishes the run."""
    steps = [int(c.name.split("-")[-1]) for c in out.glob("checkpoint-*") if c.name.split("-")[-1].isdigit()]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / LEGS, "a") as legs:
        legs.write(json.dumps({"start_step": max(steps, default=0)}) + "\n")
    return max(steps, default=0)


@dataclass
class Run:
    """One run folder ``<variant>-s<seed>``: its config, training log (last checkpoint while it trains) and results."""

    variant: str
    seed: int | None
    use_dual_ln: bool | None
    step: int
    max_steps: int
    curve: tuple[list[int], list[float]]  # steps, training loss in bits per byte
    metrics: dict  # all_results.json: empty until the run finished
    resumed_from: int  # the step the session that finished it started from (0: one session)

    @property
    def finished(self) -> bool:
        return bool(self.metrics)


def load_runs(root: Path) -> list[Run]:
    """Every run folder in ``root`` with a training log, in ``VARIANTS`` order and then by seed."""
    runs = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        states = (
            [folder / "trainer_state.json"]
            if (folder / "trainer_state.json").is_file()
            else sorted(folder.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[-1]))
        )
        if not states:
            continue
        state = json.loads(states[-1].read_text())
        log = [entry for entry in state["log_history"] if "loss" in entry]
        config_file = states[-1].parent / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        results = folder / "all_results.json"
        legs = folder / LEGS
        starts = [json.loads(line)["start_step"] for line in legs.read_text().splitlines()] if legs.is_file() else [0]
        variant, _, seed = folder.name.rpartition("-s")
        if not variant or not seed.isdigit():
            variant, seed = folder.name, None
        runs.append(
            Run(
                variant=variant,
                seed=None if seed is None else int(seed),
                use_dual_ln=config.get("use_dual_ln"),
                step=state["global_step"],
                max_steps=state["max_steps"],
                curve=([e["step"] for e in log], [e["loss"] / math.log(2) for e in log]),
                metrics=json.loads(results.read_text()) if results.is_file() else {},
                resumed_from=starts[-1],
            )
        )
    order = list(VARIANTS)
    return sorted(
        runs,
        key=lambda r: (
            order.index(r.variant) if r.variant in order else len(order),
            r.variant,
            -1 if r.seed is None else r.seed,
        ),
    )


def scores(metrics: dict) -> dict:
    """Test and validation BPC, streaming and block by block (``causal`` runs have only blocks: their ``*_bpc``)."""
    stream = "eval_block_bpc" in metrics  # long_short_xl runs score both ways
    keys = {
        "test_stream": "test_bpc" if stream else None,
        "test_blocks": "test_block_bpc" if stream else "test_bpc",
        "val_stream": "eval_bpc" if stream else None,
        "val_blocks": "eval_block_bpc" if stream else "eval_bpc",
    }
    return {name: metrics[key] for name, key in keys.items() if key in metrics}


def table(runs: list[Run]) -> str:
    """The markdown table: a row per run, and per variant with two or more finished seeds a row of their means."""
    columns = ["test_stream", "test_blocks", "val_stream", "val_blocks"]
    header = (
        "| variant | model and attention | DualLN | seed | steps | test BPC (stream) | test BPC (blocks) | "
        "val BPC (stream) | val BPC (blocks) | train time (min) |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]

    def row(variant, dual_ln, seed, steps, values: dict, minutes: str) -> str:
        dual = {True: "on", False: "off"}.get(dual_ln, "-")
        cells = " | ".join(f"{values[c]:.3f}" if c in values else "-" for c in columns)
        return f"| {variant} | {DESCRIPTIONS.get(variant, '-')} | {dual} | {seed} | {steps} | {cells} | {minutes} |"

    for variant in dict.fromkeys(r.variant for r in runs):
        group = [r for r in runs if r.variant == variant]
        for r in group:
            minutes = "-"
            if r.finished:
                minutes = f"{r.metrics['train_runtime'] / 60:.1f}"
                if r.resumed_from:
                    minutes += f" (steps {r.resumed_from}-{r.step})"
            steps = f"{r.step}" if r.finished else f"{r.step} of {r.max_steps} (running or stopped)"
            lines.append(
                row(variant, r.use_dual_ln, "-" if r.seed is None else r.seed, steps, scores(r.metrics), minutes)
            )
        done = [r for r in group if r.finished]
        if len(done) >= 2:
            per_run = [scores(r.metrics) for r in done]
            means = {c: sum(s[c] for s in per_run) / len(per_run) for c in columns if all(c in s for s in per_run)}
            timed = [r for r in done if not r.resumed_from]
            minutes = f"{sum(r.metrics['train_runtime'] for r in timed) / 60 / len(timed):.1f}" if timed else "-"
            seeds = ", ".join(str(r.seed) for r in done)
            dual = {r.use_dual_ln for r in done}
            lines.append(
                row(
                    variant,
                    dual.pop() if len(dual) == 1 else None,
                    f"mean of {seeds}",
                    ", ".join(dict.fromkeys(str(r.step) for r in done)),
                    means,
                    minutes,
                )
            )
    return "\n".join(lines)


def plot(runs: list[Run], path: Path) -> list[str]:
    """``path``: the training curves of every run (a colour per variant, a line style per seed); returns their
    labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(r.variant for r in runs))
    seeds = sorted({r.seed for r in runs if r.seed is not None})
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = []
    for r in runs:
        label = f"{r.variant}, seed {r.seed}" + ("" if r.finished else f" (to step {r.step})")
        style = ["-", "--", ":", "-."][seeds.index(r.seed) % 4 if r.seed in seeds else 0]
        ax.plot(*r.curve, style, color=f"C{variants.index(r.variant) % 10}", label=label, linewidth=1)
        labels.append(label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (bits per byte, mean over 25 steps)")
    ax.set_ylim(top=4)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return labels


def report(root: Path) -> str:
    """``root/table.md`` (``table``) and ``root/curves.png`` (``plot``) from every run folder in ``root``."""
    runs = load_runs(root)
    if not runs:
        raise SystemExit(
            f"no run in {root} has a training log yet; start one with `python -m "
            f"recipes.char_lm_miniature run official --seed 0`."
        )
    plot(runs, root / "curves.png")
    text = table(runs)
    (root / "table.md").write_text(text + "\n")
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="where the corpus and the runs live (outside git)")
    sub = parser.add_subparsers(dest="command", required=True)
    corpus = sub.add_parser("corpus", help="build the corpus")
    corpus.add_argument("--bytes", type=int, default=4 << 20)
    run = sub.add_parser("run", help="train and score one variant (resumes a stopped run)")
    run.add_argument("variant", choices=sorted(VARIANTS))
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--steps", type=int, default=1000)
    run.add_argument("--block", type=int, default=256, help="bytes per training block (and memory)")
    run.add_argument("--streams", type=int, default=8, help="streams per batch")
    run.add_argument("--lr", type=float, default=1e-3)
    run.add_argument("--warmup", type=int, default=200)
    run.add_argument("--save_steps", type=int, default=250)
    run.add_argument("--eval_memory", type=int, default=2048, help="bytes of context when streaming")
    run.add_argument("--dry_run", action="store_true", help="print the recipe's command line only")
    sub.add_parser("report", help="write table.md and curves.png from the runs")
    args = parser.parse_args(argv)
    if args.command == "corpus":
        print(json.dumps(build_corpus(args.root / "corpus.txt", args.bytes), indent=1))
    elif args.command == "run":
        if not (args.root / "corpus.txt").is_file():
            raise SystemExit(f"no corpus in {args.root}: run `python -m recipes.char_lm_miniature corpus` first.")
        argv = run_args(args.variant, args.seed, args)
        print("python -m recipes.char_lm " + " ".join(argv), flush=True)
        if not args.dry_run:
            from recipes import char_lm

            start_session(args.root / f"{args.variant}-s{args.seed}")
            char_lm.main(argv)
    else:
        print(report(args.root))


if __name__ == "__main__":
    main()
