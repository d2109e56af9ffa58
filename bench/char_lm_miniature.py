"""The paper's character-level comparisons in miniature (Sec. 4.2, Fig. 2 right) on a byte corpus this repo builds.

    python -m bench.char_lm_miniature corpus                      # builds runs/char_lm_mini/corpus.txt
    python -m bench.char_lm_miniature run official --seed 0       # one variant; rerun the same line to resume
    python -m bench.char_lm_miniature report                      # table (markdown) and curves (png)

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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
from pathlib import Path

ROOT = Path("runs/char_lm_mini")
# tests, the IDLE application, installed packages and the generated codec tables (encodings/: hex maps, not code)
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "encodings"}
MODEL = ["--num_hidden_layers", "4", "--hidden_size", "256", "--num_attention_heads", "4", "--window_size", "128",
         "--causal_segment_length", "16", "--projection_rank", "1", "--dropout", "0.1"]
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
    info = {"source": str(stdlib), "python": sysconfig.get_python_version(), "files": len(chunks), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}
    path.with_suffix(".json").write_text(json.dumps(info, indent=1))
    return info


def run_args(variant: str, seed: int, args) -> list[str]:
    """The ``recipes.char_lm`` command line of one run."""
    extra = [a.format(window_full=args.block * 2) for a in VARIANTS[variant]]
    overrides = dict(zip(extra[::2], extra[1::2]))
    model = [a for pair in zip(MODEL[::2], MODEL[1::2]) if pair[0] not in overrides for a in pair]
    out = args.root / f"{variant}-s{seed}"
    return [
        "--train_file", str(args.root / "corpus.txt"), "--output_dir", str(out), *model, *extra,
        "--max_seq_length", str(args.block), "--max_positions", str(args.block),
        "--per_device_train_batch_size", str(args.streams), "--max_steps", str(args.steps),
        "--learning_rate", str(args.lr), "--warmup_steps", str(args.warmup), "--weight_decay", "0.01",
        "--logging_steps", "25", "--save_steps", str(args.save_steps), "--save_total_limit", "1",
        "--eval_memory_length", str(args.eval_memory), "--eval_block_length", "256",
        "--seed", str(seed), "--disable_tqdm", "True", "--report_to", "none", "--dataloader_num_workers", "0",
        "--do_train", "--do_eval", "--do_predict",
    ]


def report(root: Path) -> str:
    """A markdown table of every finished run in ``root`` and ``curves.png`` (training loss in bits against step)."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, fig = [], plt.figure(figsize=(7, 4.5))
    for run in sorted(p for p in root.iterdir() if (p / "trainer_state.json").is_file() or
                      list(p.glob("checkpoint-*/trainer_state.json"))):
        state_file = run / "trainer_state.json"
        if not state_file.is_file():
            state_file = max(run.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name[11:]))
        state = json.loads(state_file.read_text())
        log = state["log_history"]
        steps = [e["step"] for e in log if "loss" in e]
        plt.plot(steps, [e["loss"] / math.log(2) for e in log if "loss" in e], label=run.name, linewidth=1)
        results = run / "all_results.json"
        metrics = json.loads(results.read_text()) if results.is_file() else {}
        rows.append((run.name, state["global_step"], metrics))
    plt.xlabel("step")
    plt.ylabel("training loss (bits per byte)")
    plt.ylim(top=4)
    plt.grid(alpha=0.3)
    plt.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(root / "curves.png", dpi=120)

    def cell(metrics, key):
        return f"{metrics[key]:.3f}" if key in metrics else "-"

    lines = ["| run | steps | val BPC (stream) | val BPC (blocks) | test BPC (stream) | test BPC (blocks) | train time (s) |",
             "|---|---|---|---|---|---|---|"]
    for name, steps, m in rows:
        stream = "eval_block_bpc" in m  # long_short_xl runs score both ways; causal runs only block by block
        lines.append(f"| {name} | {steps} | {cell(m, 'eval_bpc') if stream else '-'} | "
                     f"{cell(m, 'eval_block_bpc' if stream else 'eval_bpc')} | {cell(m, 'test_bpc') if stream else '-'} | "
                     f"{cell(m, 'test_block_bpc' if stream else 'test_bpc')} | {m.get('train_runtime', 0):.0f} |")
    table = "\n".join(lines)
    (root / "table.md").write_text(table + "\n")
    return table


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
            raise SystemExit(f"no corpus in {args.root}: run `python -m bench.char_lm_miniature corpus` first.")
        argv = run_args(args.variant, args.seed, args)
        print("python -m recipes.char_lm " + " ".join(argv), flush=True)
        if not args.dry_run:
            from recipes import char_lm

            char_lm.main(argv)
    else:
        print(report(args.root))


if __name__ == "__main__":
    main()
