"""Train and test the paper's LRA model (Sec. 4.1, Appendix B, Table 8); ``python -m recipes.lra --help``.

What the paper leaves out follows the official scripts (``lra/run_tasks.py``, ``lra/run_*.sh``): AdamW with
eps 1e-6 and betas (0.9, 0.999), ``OneCycleLR`` with linear warm-up over ``T_w`` steps and linear decay to the end
(the paper's text says a fixed rate; the scripts decay it), no dropout for ListOps and Text, 0.1 and weight decay 0.01
for Retrieval. The dev split is scored every ``--eval_every`` steps (whole split), the best dev checkpoint is kept,
and the test split is scored once, at the end, with it. Rerunning the same command resumes from ``last.pt``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import platform
import sys
import time
import zipfile
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from recipes.memory import TrainingStep, check_memory

from .data import LISTOPS_VOCAB, SPLITS, ListOpsRules, listops, load_user_data
from .model import ATTENTIONS, LRAClassifier, LRAConfig

# Table 8 (lr 1e-4, batch 32, T_w, T) and the official scripts' lengths, classes, dropout and weight decay. The paper
# gives no schedule for Image; its row is a starting point, not the paper's.
TASKS = {
    "listops": {
        "steps": 5000,
        "warmup": 1000,
        "max_length": 2000,
        "num_classes": 10,
        "dropout": 0.0,
        "weight_decay": 0.0,
        "vocab_size": len(LISTOPS_VOCAB),
    },
    "text": {
        "steps": 20000,
        "warmup": 8000,
        "max_length": 4096,
        "num_classes": 2,
        "dropout": 0.0,
        "weight_decay": 0.0,
        "vocab_size": 257,
    },
    "retrieval": {
        "steps": 30000,
        "warmup": 8000,
        "max_length": 4096,
        "num_classes": 2,
        "dropout": 0.1,
        "weight_decay": 0.01,
        "vocab_size": 257,
    },
    "image": {
        "steps": 20000,
        "warmup": 1000,
        "max_length": 1024,
        "num_classes": 10,
        "dropout": 0.0,
        "weight_decay": 0.0,
        "vocab_size": 257,
    },
}
# Arguments that must match to resume a run (the others, e.g. --threads, may change between invocations).
RUN_KEYS = (
    "task",
    "attention",
    "window_size",
    "projection_rank",
    "steps",
    "warmup",
    "lr",
    "weight_decay",
    "batch_size",
    "seed",
    "data_seed",
    "max_length",
    "dropout",
    "attention_dropout",
    "eval_every",
    "listops_brackets",
    "listops_train",
    "listops_dev",
    "listops_test",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m recipes.lra", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--task", choices=sorted(TASKS), required=True)
    p.add_argument("--output_dir", required=True, help="checkpoints, log and results.json; rerun to resume")
    p.add_argument(
        "--data_dir",
        help="ListOps: cache of the generated splits (default OUTPUT_DIR/../data); other "
        "tasks: the folder with the user's train/dev/test data",
    )
    p.add_argument("--attention", choices=ATTENTIONS, default="long_short")
    p.add_argument("--window_size", type=int, default=8, help="w (segment length of the sliding window)")
    p.add_argument("--projection_rank", type=int, default=32, help="r (rows of the dynamic projection)")
    p.add_argument("--steps", type=int, help="training steps T (default: Table 8)")
    p.add_argument("--warmup", type=int, help="warm-up steps T_w (default: Table 8)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight_decay", type=float, help="AdamW weight decay (default: the official script's)")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--eval_batch_size", type=int, default=64)
    p.add_argument("--eval_every", type=int, default=100, help="score the dev split every this many steps")
    p.add_argument("--max_length", type=int, help="tokens per sequence (default: the task's)")
    p.add_argument("--dropout", type=float, help="dropout (default: the official script's)")
    p.add_argument("--attention_dropout", type=float, help="attention dropout (default: = --dropout)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and batch order")
    p.add_argument("--data_seed", type=int, default=0, help="ListOps generation")
    p.add_argument(
        "--listops_brackets",
        action="store_true",
        help="keep '[OP' and ']' tokens (LRA's released pipeline, behind the paper's numbers, drops them)",
    )
    for split, size in zip(SPLITS, (96_000, 2_000, 2_000)):
        p.add_argument(f"--listops_{split}", type=int, default=size, help=f"generated {split} examples")
    p.add_argument("--device", help="where to train, e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--recompute_window_tiles",
        action="store_true",
        help="memory-lean training on CPU: window tiles built again in the backward pass (no attention dropout)",
    )
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p


def resolve(argv=None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    defaults = TASKS[args.task]
    warmup_given = args.warmup is not None
    for key in ("steps", "warmup", "max_length", "weight_decay", "dropout"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    if args.attention_dropout is None:
        args.attention_dropout = args.dropout
    for key in ("steps", "batch_size", "eval_batch_size", "eval_every", "max_length"):
        if getattr(args, key) < 1:
            parser().error(f"--{key} must be >= 1, got {getattr(args, key)}")
    if args.steps < 4:  # OneCycleLR's two phases need two steps each
        parser().error(f"--steps must be >= 4 (a warm-up and a decay of at least 2 steps each), got {args.steps}")
    if not warmup_given and args.warmup > args.steps - 2:
        args.warmup = min(max(round(defaults["warmup"] * args.steps / defaults["steps"]), 2), args.steps - 2)
        print(
            f"--warmup {args.warmup}: Table 8's {defaults['warmup']} warm-up steps (of {defaults['steps']}) do not fit "
            f"--steps {args.steps}, so the warm-up is the same share of this run (--warmup sets it)."
        )
    if not 2 <= args.warmup <= args.steps - 2:
        parser().error(
            f"--warmup must be in [2, --steps - 2] = [2, {args.steps - 2}] (OneCycleLR's warm-up and decay need 2 "
            f"steps each), got {args.warmup}; pass a --warmup in that range, or more --steps."
        )
    if args.task != "listops" and args.data_dir is None:
        parser().error(f"--data_dir is required for --task {args.task}: the folder with its train/dev/test data")
    if args.threads is not None and args.threads < 1:
        parser().error(f"--threads must be >= 1, got {args.threads}")
    args.device = resolve_device(args.device, parser())
    return args


def resolve_device(name: str | None, parser: argparse.ArgumentParser) -> torch.device:
    """``--device``, checked before any work: cuda if available when not given."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(name)
    except RuntimeError:
        parser.error(f"--device must name a torch device such as cpu or cuda, got {name!r}")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {name}: torch finds no CUDA device here; use --device cpu")
    if chosen.type == "cuda" and chosen.index is not None and chosen.index >= torch.cuda.device_count():
        parser.error(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if chosen.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {name!r}")
    return chosen


def model_config(args) -> LRAConfig:
    return LRAConfig(
        vocab_size=TASKS[args.task]["vocab_size"],
        max_length=args.max_length,
        num_classes=TASKS[args.task]["num_classes"],
        attention=args.attention,
        window_size=args.window_size,
        projection_rank=args.projection_rank,
        dropout=args.dropout,
        attention_dropout=args.attention_dropout,
        dual=args.task == "retrieval",
        recompute_window_tiles=args.recompute_window_tiles,
    )


def listops_rules(args) -> ListOpsRules:
    return ListOpsRules(
        train=args.listops_train, dev=args.listops_dev, test=args.listops_test, brackets=args.listops_brackets
    )


def load_splits(args):
    if args.task == "listops":
        rules = listops_rules(args)
        data_dir = args.data_dir or Path(args.output_dir).resolve().parent / "data"
        splits = listops(data_dir, args.data_seed, rules, progress=not args.no_progress)
    else:
        splits = load_user_data(args.task, args.data_dir, args.max_length, TASKS[args.task]["num_classes"])
    too_long = int(max(ex.lengths().max() for ex in splits.values()))
    if too_long > args.max_length:
        raise ValueError(f"a sequence has {too_long} tokens, more than --max_length {args.max_length}; raise it.")
    return splits


class BatchOrder:
    """Training batches as a function of (seed, step): epoch e visits the examples in the permutation drawn from
    ``[seed, e]``, so a resumed run sees the batches an uninterrupted one would."""

    def __init__(self, size: int, batch_size: int, seed: int):
        self.size, self.batch_size, self.seed, self.perms = size, batch_size, seed, {}

    def __call__(self, step: int) -> np.ndarray:
        pos = step * self.batch_size + np.arange(self.batch_size)
        epoch, within = pos // self.size, pos % self.size
        self.perms = {
            int(e): self.perms.get(int(e))
            if int(e) in self.perms
            else np.random.default_rng([self.seed, int(e)]).permutation(self.size)
            for e in np.unique(epoch)
        }
        return np.array([self.perms[e][i] for e, i in zip(epoch, within)])


def on_device(batch, device: torch.device):
    """A batch of :meth:`Examples.batch` (ids and masks per tower, labels) moved to ``device``: to a GPU from pinned
    memory, without waiting (a copy from pageable memory waits until the GPU has run all it was given)."""
    ids, masks, labels = batch

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)

    return [move(t) for t in ids], [move(t) for t in masks], move(labels)


@torch.no_grad()
def predictions(model, examples, batch_size: int, multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """(labels, logits) over a whole split, in batches of similar lengths (outputs do not depend on padding), on the
    model's device."""
    model.eval()
    where = next(model.parameters()).device
    order = np.argsort(examples.lengths().max(0), kind="stable")
    labels, logits = [], []
    for start in range(0, len(order), batch_size):
        ids, masks, batch_labels = on_device(examples.batch(order[start : start + batch_size], multiple), where)
        labels.append(batch_labels.cpu().numpy())
        logits.append(model(ids, masks).float().cpu().numpy())
    model.train()
    return np.concatenate(labels), np.concatenate(logits)


def evaluate(model, examples, batch_size: int, multiple: int) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) over a whole split."""
    labels, logits = predictions(model, examples, batch_size, multiple)
    loss = F.cross_entropy(torch.from_numpy(logits).double(), torch.from_numpy(labels))
    return float((logits.argmax(-1) == labels).mean()), float(loss)


def better(record: dict, best: dict) -> bool:
    """Whether an evaluation beats the best so far: a higher dev accuracy, or the same accuracy with a lower dev
    loss (before the first evaluation, and in runs saved before the loss was recorded, the best has no loss)."""
    return (record["dev_accuracy"], -record["dev_loss"]) > (best["dev_accuracy"], -best.get("dev_loss", math.inf))


def save(obj, path: Path) -> None:
    """``torch.save`` through a temporary file. ``obj`` holds tensors, numbers, strings and containers only, what
    ``torch.load(weights_only=True)`` reads."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load(path: Path, device: torch.device | str) -> dict:
    """A checkpoint of this recipe, read with ``torch.load(weights_only=True)``: tensors and plain data only, so a
    file from elsewhere cannot run code. A file holding anything else, or that cannot be read (``damaged``), exits
    with a message saying so."""
    try:
        return torch.load(path, weights_only=True, map_location=device)
    except pickle.UnpicklingError as err:
        if not zipfile.is_zipfile(path):  # not torch's format: bytes lost or overwritten
            damaged(path, err)
        raise SystemExit(
            f"error: {path} holds objects other than tensors and plain data ({str(err).splitlines()[0]})"
            f"; this recipe writes no such checkpoint and does not load it. Remove it, or use another "
            f"folder."
        ) from err
    except (RuntimeError, OSError, EOFError) as err:  # a zip cut short, a file of zeros, an empty file
        damaged(path, err)


def damaged(path: Path, err: Exception) -> NoReturn:
    """Exit naming ``path``, a file of the run's folder that cannot be read, and how to go on."""
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__  # EOFError: no message
    raise SystemExit(
        f"error: {path} cannot be read ({reason}): the file is damaged, e.g. by a stop while it was written. This "
        f"recipe keeps no earlier checkpoint to resume from: to start the run afresh, delete "
        f"{path.parent / 'last.pt'}, {path.parent / 'best.pt'} and {path.parent / 'results.json'}, or use another "
        f"--output_dir."
    ) from err


def saved_settings(results: dict | None, last: dict | None) -> dict | None:
    """The settings of the run already in an output folder: those of ``results.json`` (written at every evaluation
    and at the end), else those of ``last.pt``."""
    for saved in (results, last):
        if saved is not None and "run" in saved:
            return saved["run"]
    return None


def check_training_memory(model: LRAClassifier, args) -> None:
    """Exit before any work when a training step cannot fit the device's memory (``recipes.memory``: batches of
    --batch_size examples of up to --max_length tokens), naming --batch_size and --recompute_window_tiles."""
    config = model.config
    parameters = sum(p.numel() for p in model.parameters())

    def step(batch_size: int, checkpointing: bool, lean: bool) -> TrainingStep:
        return TrainingStep(
            parameters,
            config.attention_layers(args.max_length, lean=lean),
            examples=(2 if config.dual else 1) * batch_size,
        )  # Retrieval: two documents each

    lean = config.recompute_window_tiles and not config.attention_dropout
    fixes = {"batch_size": "--batch_size"}
    if config.attention != "full":
        fixes["lean"] = "--recompute_window_tiles" + (" --attention_dropout 0" if config.attention_dropout else "")
    settings = {"batch_size": args.batch_size, "checkpointing": False, "lean": lean}
    check_memory(step, settings, args.device, fixes, error=lambda message: SystemExit(f"error: {message}"))


def machine(where: torch.device) -> str:
    if where.type == "cuda":
        return f"{torch.cuda.get_device_name(where)}, torch {torch.__version__}"
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main(argv=None):
    args = resolve(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.output_dir)
    results_path, last_path, best_path = out / "results.json", out / "last.pt", out / "best.pt"
    run = {key: getattr(args, key) for key in RUN_KEYS}
    try:
        results = json.loads(results_path.read_text()) if results_path.exists() else None
    except ValueError as err:
        damaged(results_path, err)
    last = load(last_path, "cpu") if last_path.exists() else None
    saved = saved_settings(results, last)
    if saved is not None and saved != run:
        changed = {k: (saved.get(k), v) for k, v in run.items() if saved.get(k) != v}
        raise SystemExit(
            f"error: {out} holds a run with other settings {changed} (saved, given); use another "
            f"--output_dir or the saved settings."
        )
    if results is not None and "test_accuracy" in results:
        print(f"{results_path} holds a finished run with these settings: test accuracy {results['test_accuracy']:.4f}")
        return results

    try:
        config = model_config(args)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    torch.manual_seed(args.seed)
    model = LRAClassifier(config)
    check_training_memory(model, args)
    try:
        splits = load_splits(args)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(args.device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=args.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=args.warmup / args.steps, anneal_strategy="linear"
    )
    state = {"step": 0, "history": [], "best": {"step": None, "dev_accuracy": -1.0}, "train_seconds": 0.0}
    if last is not None:
        model.load_state_dict(last["model"])
        optimizer.load_state_dict(last["optimizer"])
        scheduler.load_state_dict(last["scheduler"])
        torch.set_rng_state(last["rng"])
        if args.device.type == "cuda" and "cuda_rng" in last:
            torch.cuda.set_rng_state(last["cuda_rng"], args.device)
        state = last["state"]
    multiple = max(config.window, 1)
    order = BatchOrder(len(splits["train"]), args.batch_size, args.seed)
    info = {
        "run": run,
        "model": config.to_dict(),
        "machine": machine(args.device),
        "parameters": sum(p.numel() for p in model.parameters()),
        "split_sizes": {split: len(ex) for split, ex in splits.items()},
    }

    bar = tqdm(
        total=args.steps,
        initial=state["step"],
        disable=args.no_progress,
        desc=f"{args.task} {args.attention}",
        dynamic_ncols=True,
        file=sys.stdout,
    )
    losses, tick = [], time.perf_counter()
    model.train()
    while state["step"] < args.steps:
        ids, masks, labels = on_device(splits["train"].batch(order(state["step"]), multiple), args.device)
        loss = F.cross_entropy(model(ids, masks), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        state["step"] += 1
        losses.append(loss.detach())  # read at the next evaluation: a read every step would stall the host
        bar.update(1)
        if state["step"] % args.eval_every == 0 or state["step"] == args.steps:
            state["train_seconds"] += time.perf_counter() - tick
            dev, dev_loss = evaluate(model, splits["dev"], args.eval_batch_size, multiple)
            record = {
                "step": state["step"],
                "train_loss": torch.stack(losses).mean().item(),
                "dev_accuracy": dev,
                "dev_loss": dev_loss,
                "lr": scheduler.get_last_lr()[0],
                "train_seconds": round(state["train_seconds"], 1),
            }
            state["history"].append(record)
            losses = []
            if better(record, state["best"]):
                state["best"] = {"step": state["step"], "dev_accuracy": dev, "dev_loss": dev_loss}
                save({"model": model.state_dict(), "config": config.to_dict(), "step": state["step"]}, best_path)
            rngs = {"rng": torch.get_rng_state()}
            if args.device.type == "cuda":
                rngs["cuda_rng"] = torch.cuda.get_rng_state(args.device)
            save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    **rngs,
                    "state": state,
                    "run": run,
                },
                last_path,
            )
            results_path.write_text(json.dumps({**info, **state}, indent=1))
            bar.set_postfix(
                loss=f"{record['train_loss']:.3f}", dev=f"{dev:.4f}", best=f"{state['best']['dev_accuracy']:.4f}"
            )
            bar.write(
                f"step {state['step']}/{args.steps}: train loss {record['train_loss']:.4f}, dev accuracy "
                f"{dev:.4f}, dev loss {dev_loss:.4f}; best dev accuracy {state['best']['dev_accuracy']:.4f} at "
                f"step {state['best']['step']}",
                file=sys.stdout,
            )
            tick = time.perf_counter()
    bar.close()

    model.load_state_dict(load(best_path, args.device)["model"])
    test, _ = evaluate(model, splits["test"], args.eval_batch_size, multiple)
    results = {
        **info,
        **state,
        "test_accuracy": test,
        "tested_checkpoint_step": state["best"]["step"],
        "finished_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    results_path.write_text(json.dumps(results, indent=1))
    print(f"best dev {state['best']['dev_accuracy']:.4f} at step {state['best']['step']}; test {test:.4f}")
    return results
