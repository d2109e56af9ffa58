"""The longest sequence whose masked-LM training step fits a memory budget, and the longest that fits a time budget.

The paper's "longer sequences than full attention" claim, measured on this machine: one MLM training step (forward +
backward), 1 layer, base width (hidden 768, 12 heads, intermediate 3072), the full 50,265-token vocabulary, batch 1,
float32 (``--dtype``), for

* ``long-short``: ``LongShortForMaskedLM`` with the package's default configuration (w = 256, r = 64, DualLN) and
  ``recompute_window_tiles=True`` (the memory-lean training path);
* ``roberta-sdpa`` / ``roberta-eager``: ``RobertaForMaskedLM`` with fused SDPA or eager (n x n scores) attention;
* ``longformer``: ``LongformerForMaskedLM`` with attention_window 512, no global token.

Every peer scores its loss on the masked positions only (15 %, drawn once per n): the backbone's last hidden state
at those positions goes through the model's own LM head. The models' ``ForMaskedLM.forward`` would compute logits over
the whole vocabulary at every position (200 KB a token), which would cap every model at about the same n. Attention
dropout is 0 (as in ``bench_models``: CPU SDPA leaves its fused kernel with it).

Each measurement is one step of a freshly built model in its own forked process: peak memory = RSS high-water mark
minus the RSS of the built model (weights and inputs), time = that step's wall time. A watchdog thread ends the
process as soon as the memory growth passes the budget (or, in the time search, the time passes it): the run fails
that budget without finishing. On CUDA (``--device cuda``) every run is in this process: peak memory =
``max_memory_allocated`` above the memory allocated by the built model, the caching allocator held to the budget
(``torch.cuda.set_per_process_memory_fraction``), and a step over the time budget fails it once it ends. Search, per
peer and budget: double n from ``--start`` until a run fails, then bisect (multiples of 512) until the gap is at most
1/8 of the passing n. Runs are shared between the two searches.

    python -m bench.bench_limits                                # every peer, 8 GiB and 30 s
    python -m bench.bench_limits --peers long-short --out bench/results/limits_cpu_ls.json
    python -m bench.bench_limits --device cuda --budgets memory --memory-gib 16

Writes ``bench/results/limits_<device>[_<dtype>].json`` (every run and the limits found) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.bench_models import build_mlm
from bench.common import (
    DTYPES,
    _proc_status_bytes,
    check_device,
    forked,
    free_bytes,
    peak_memory_above,
    peak_rss_above,
    reset_peak_memory,
    reset_peak_rss,
    results_path,
    run_meta,
    sync,
    write_json,
)
from ls_hf import LongShortConfig

PEERS = ("long-short", "roberta-sdpa", "roberta-eager", "longformer")
VOCAB = LongShortConfig().vocab_size  # 50265, RoBERTa's
MASKED_FRACTION = 0.15
GRANULE = 512


def masked_step(peer: str, n: int, device: str = "cpu", dtype: str = "fp32"):
    """One MLM training step of a freshly built 1-layer ``peer``, the loss scored on the masked positions only."""
    torch.manual_seed(0)
    model = build_mlm(peer, n, layers=1, vocab=VOCAB, recompute_window_tiles=True, device=device)
    model = model.to(device, DTYPES[dtype]).train()
    ids = torch.randint(3, VOCAB, (1, n), device=device)
    positions = torch.randperm(n, device=device)[: max(1, round(MASKED_FRACTION * n))].sort().values
    labels = ids[0, positions]

    def step():
        model.zero_grad(set_to_none=True)
        hidden = model.base_model(input_ids=ids).last_hidden_state
        logits = model.lm_head(hidden[0, positions])
        F.cross_entropy(logits, labels).backward()

    return step


def measure(peer: str, n: int, max_bytes: int, max_seconds: float, report: str, dtype: str = "fp32") -> dict:
    """Peak RSS growth and wall time of one ``masked_step`` on the CPU. A watchdog ends the process (after writing
    ``report``) once the growth passes ``max_bytes`` or the step runs past ``max_seconds``."""
    step = masked_step(peer, n, "cpu", dtype)
    base = reset_peak_rss()
    start = time.perf_counter()
    done = threading.Event()

    def watchdog():
        while not done.wait(0.02):
            over_memory = _proc_status_bytes("VmRSS") - base > max_bytes
            if over_memory or time.perf_counter() - start > max_seconds:
                status = "over_memory" if over_memory else "over_time"
                Path(report).write_text(json.dumps({"status": status, "seconds": time.perf_counter() - start}))
                os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    step()
    done.set()
    return {"peak_mem_bytes": peak_rss_above(base), "step_s": time.perf_counter() - start}


def measure_cuda(peer: str, n: int, max_bytes: int, max_seconds: float, dtype: str) -> dict:
    """Peak memory growth and time of one ``masked_step`` on CUDA, in this process, the caching allocator held to
    ``max_bytes`` above the built model: ``{"status": "ok" | "over_memory" | "over_time", ...}``."""
    try:
        step = masked_step(peer, n, "cuda", dtype)
        base = reset_peak_memory("cuda")
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + max_bytes) / total))
        start = time.perf_counter()
        step()
        sync("cuda")
        row = {"peak_mem_bytes": peak_memory_above("cuda", base), "step_s": time.perf_counter() - start}
    except torch.OutOfMemoryError:
        return {"status": "over_memory"}
    finally:
        step = None  # the model freed before the cache is emptied
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    if row["peak_mem_bytes"] > max_bytes:
        return {"status": "over_memory", **row}
    return {"status": "over_time" if row["step_s"] > max_seconds else "ok", **row}


def run(peer: str, n: int, max_bytes: int, max_seconds: float, threads: int, device: str, dtype: str) -> dict:
    """One run, ``{"peer", "n", "status": "ok" | "over_memory" | "over_time" | ..., ...}``: on the CPU ``measure``
    in a forked process, on CUDA ``measure_cuda``."""
    if device == "cuda":
        return {"peer": peer, "n": n, **measure_cuda(peer, n, max_bytes, max_seconds, dtype)}
    with tempfile.TemporaryDirectory() as folder:
        report = os.path.join(folder, "report.json")
        row = forked(measure, peer, n, max_bytes, max_seconds, report, dtype, threads=threads)
        if os.path.exists(report):
            row = json.loads(Path(report).read_text())
    return {"peer": peer, "n": n, **row}


def search(passes, start: int) -> tuple[int | None, int | None]:
    """(longest passing n, shortest failing n): double from ``start`` until ``passes(n)`` is False (or None: unknown,
    the search stops there), then bisect in multiples of ``GRANULE`` until the gap is at most 1/8 of the pass."""
    low, high, n = None, None, start
    while high is None:
        verdict = passes(n)
        if verdict is None:
            return low, None
        if verdict:
            low, n = n, 2 * n
        else:
            high = n
    if low is None:  # even the start fails: halve
        while low is None and high > GRANULE:
            n = high // 2
            verdict = passes(n)
            if verdict is None:
                return None, high
            low, high = (n, high) if verdict else (None, n)
        if low is None:
            return None, high
    while high - low > max(low / 8, GRANULE):
        n = (low + high) // 2 // GRANULE * GRANULE
        verdict = passes(n)
        if verdict is None:
            break
        low, high = (n, high) if verdict else (low, n)
    return low, high


def find_limits(
    peer: str,
    memory_budget: int,
    time_budget: float,
    start: int,
    max_seconds: float,
    threads: int,
    runs: list[dict],
    budgets: tuple[str, ...] = ("time", "memory"),
    device: str = "cpu",
    dtype: str = "fp32",
) -> dict:
    """The time search (runs stopped at ``time_budget``, or at twice the memory budget or 60 % of the free memory),
    then the memory search (runs stopped at ``memory_budget`` or ``max_seconds``), those named in ``budgets``; every
    run goes into ``runs``."""

    def measured(n, max_bytes, seconds):
        for row in runs:  # a finished run answers both questions
            if (
                row["peer"] == peer
                and row["n"] == n
                and (row["status"] == "ok" or row.get("limit") == (max_bytes, seconds))
            ):
                return row
        row = run(peer, n, max_bytes, seconds, threads, device, dtype) | {"limit": (max_bytes, seconds)}
        runs.append(row)
        shown = f"{row['peak_mem_bytes'] / 2**30:6.2f} GiB {row['step_s']:7.1f} s" if row["status"] == "ok" else ""
        print(f"  {peer:<14} n={n:<7} {row['status']:<12} {shown}", flush=True)
        return row

    memory_cap = min(2 * memory_budget, int(0.6 * free_bytes(device)))  # the time search's runs: keep the machine safe

    def within_time(n):
        row = measured(n, memory_cap, time_budget)
        if row["status"] == "ok":
            return row["step_s"] <= time_budget
        return False if row["status"] == "over_time" else None

    def within_memory(n):
        row = measured(n, memory_budget, max_seconds)
        if row["status"] == "ok":
            return row["peak_mem_bytes"] <= memory_budget
        return False if row["status"] == "over_memory" else None

    limits = {"peer": peer}
    for budget, passes in (("time", within_time), ("memory", within_memory)):
        if budget in budgets:
            low, high = search(passes, start)
            limits[budget] = {"longest_pass": low, "shortest_fail": high}
    return limits


def table(limits: list[dict], memory_budget: int, time_budget: float) -> str:
    def cell(found):
        if found is None:
            return "not searched"
        low, high = found["longest_pass"], found["shortest_fail"]
        if high is None:
            return f">= {low} (larger not measured)"
        return f"{low} (fails at {high})" if low else f"< {high}"

    lines = [
        f"| peer | longest n within {memory_budget / 2**30:g} GiB | longest n within {time_budget:g} s |",
        "|---|---|---|",
    ]
    lines += [f"| {row['peer']} | {cell(row.get('memory'))} | {cell(row.get('time'))} |" for row in limits]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    parser.add_argument("--memory-gib", type=float, default=8.0, help="memory budget: peak memory growth (GiB)")
    parser.add_argument("--seconds", type=float, default=30.0, help="time budget of one step (s)")
    parser.add_argument("--start", type=int, default=4096, help="first n of the doubling")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=900.0,
        help="a memory-search run still going after this long ends the search (limit unknown above)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch default)")
    parser.add_argument(
        "--budgets",
        nargs="+",
        default=["time", "memory"],
        choices=("time", "memory"),
        help="which limits to search (default both)",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/limits_<device>.json)")
    args = parser.parse_args(argv)
    check_device(parser, args.device)
    if args.start < GRANULE or args.start % GRANULE:
        parser.error(f"--start must be a positive multiple of {GRANULE}, got {args.start}")
    if min(args.memory_gib, args.seconds, args.max_seconds) <= 0:
        parser.error("--memory-gib, --seconds and --max-seconds must be positive")
    memory_budget = int(args.memory_gib * 2**30)
    runs, limits = [], []
    for peer in args.peers:
        limits.append(
            find_limits(
                peer,
                memory_budget,
                args.seconds,
                args.start,
                args.max_seconds,
                args.threads,
                runs,
                budgets=tuple(args.budgets),
                device=args.device,
                dtype=args.dtype,
            )
        )
    meta = run_meta(
        "bench.bench_limits",
        argv,
        measurement_threads=args.threads or torch.get_num_threads(),
        device=args.device,
        dtype=args.dtype,
        config={
            "layers": 1,
            "hidden": 768,
            "heads": 12,
            "intermediate": 3072,
            "vocab": VOCAB,
            "batch": 1,
            "masked_fraction": MASKED_FRACTION,
            "long_short": "LongShortConfig defaults (w = 256, r = 64), recompute_window_tiles=True",
            "longformer_attention_window": 512,
        },
        budgets={"memory_bytes": memory_budget, "seconds": args.seconds, "max_seconds": args.max_seconds},
        memory="RSS high-water mark (VmHWM) over one training step minus RSS of the built model, forked process per run"
        if args.device == "cpu"
        else "torch.cuda.max_memory_allocated over one training step minus memory_allocated of the built model",
        time="wall time of that one step (no warm-up)",
    )
    text = table(limits, memory_budget, args.seconds)
    where = f"{meta.get('gpu', args.device)} {args.dtype}"
    print(f"\n{meta['date']}  {meta['cpu']}  torch {meta['torch']}  threads {meta['measurement_threads']}  {where}\n")
    print(text)
    suffix = "" if args.dtype == "fp32" else f"_{args.dtype}"
    out = args.out or results_path(f"limits_{args.device}{suffix}", quick=False)
    write_json(out, {"meta": meta, "limits": limits, "runs": runs})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
