"""What the benchmarks share: the machine description, the results' header and file, free memory, peak-RSS
measurement, forked runs and peers timed in turn."""

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # the --dtype choices


def results_path(name: str, quick: bool) -> Path:
    """``bench/results/NAME.json``; a ``--quick`` smoke run writes under ``bench/results/quick/`` (not tracked by git),
    so it never replaces measured results."""
    return (RESULTS / "quick" if quick else RESULTS) / f"{name}.json"


def check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """Refuse ``--device cuda`` where torch finds no CUDA device, before any work."""
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch finds no CUDA device on this machine (a CPU build of torch, or no GPU)")


def machine() -> dict:
    """CPU model, core count, torch version and threads (and the GPU, if any) for the results' header."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"nproc": os.cpu_count(), "cpu": cpu, "torch": torch.__version__, "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


# Environment variables that change the memory allocator. They move CPU timings: glibc's defaults return large freed
# blocks to the system, so the next pass pays page faults to touch them again (see RESULTS.md, "Allocator").
ALLOCATOR_ENV = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_CONF", "MALLOC_MMAP_THRESHOLD_", "TCMALLOC_RELEASE_RATE")


def run_meta(module: str, argv: list[str] | None, **fields) -> dict:
    """The results' header: the machine, the UTC date, the command that ran ``python -m module`` (``argv``, default
    the command line), the allocator's environment variables that are set, and the load average, then the script's
    ``fields``."""
    command = f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv)
    return machine() | {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command.strip(),
        "allocator_env": {name: os.environ[name] for name in ALLOCATOR_ENV if name in os.environ},
        "load_average": os.getloadavg(),
        **fields,
    }


def write_json(path: Path, results: dict) -> None:
    """Write ``results`` (header, rows, performance targets) to ``path``, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))


def free_bytes(device: str = "cpu") -> int:
    """Memory available for a new allocation on ``device``."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak_rss() -> int:
    """Reset this process's RSS high-water mark (``VmHWM``, Linux >= 4.0) to its current RSS and return that RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _proc_status_bytes("VmRSS")


def peak_rss_above(base: int) -> int:
    """The RSS high-water mark since ``reset_peak_rss`` minus the ``base`` it returned."""
    return max(_proc_status_bytes("VmHWM") - base, 0)


def peak_allocated_above(fn: Callable[[], object]) -> int:
    """The peak of tensor memory that ``fn()`` allocates on the CPU above what was held before it, counted by the
    CPU allocator itself (the profiler's allocation events): the CPU analogue of ``torch.cuda.max_memory_allocated``.
    Unlike RSS it leaves out what the C library's heap keeps of freed blocks."""
    from torch._C._profiler import _EventType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocations = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
        stack.extend(node.children)
    if not allocations:
        return 0
    allocations.sort()
    before = allocations[0][2] - allocations[0][1]
    return max(total for *_, total in allocations) - before


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if device == "cuda":
        torch.cuda.synchronize()


def reset_peak_memory(device: str) -> int:
    """Start a peak-memory measurement: the memory held now (CUDA: allocated; CPU: RSS, ``reset_peak_rss``)."""
    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return reset_peak_rss()


def peak_memory_above(device: str, base: int) -> int:
    """The peak memory since ``reset_peak_memory`` minus the ``base`` it returned."""
    sync(device)
    if device == "cuda":
        return max(torch.cuda.max_memory_allocated() - base, 0)
    return peak_rss_above(base)


# What a measurement reports as its result instead of raising: running out of memory, a shape or dtype a kernel does
# not support, a compiler's failure (torch.compile raises RuntimeErrors). Other errors are bugs, and raise.
MEASUREMENT_ERRORS = (RuntimeError, ValueError, TypeError, AssertionError)


def failure(error: BaseException) -> dict:
    """A failed measurement's status ("oom" or "error") and reason (the first line of the error)."""
    message = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
    out_of_memory = isinstance(error, torch.OutOfMemoryError) or "allocate" in message
    return {"status": "oom" if out_of_memory else "error", "reason": message}


def _child(conn, fn, args, threads) -> None:
    if threads:
        torch.set_num_threads(threads)
    try:
        conn.send({"status": "ok", **fn(*args)})
    except MEASUREMENT_ERRORS as error:  # reported in the tables, not raised
        conn.send(failure(error))


def forked(fn, *args, threads: int = 0, fresh: bool = False) -> dict:
    """``{"status": "ok", **fn(*args)}`` computed in a forked process: its own memory high-water mark and OpenMP pool,
    the parent's imports; ``threads`` torch threads (0: torch's default). A killed child is reported as OOM.

    ``fresh``: a new interpreter instead (``fn`` importable by name). A fork inherits the parent's heap and reuses the
    blocks the parent freed without growing its RSS, so the RSS growth of a step is only its own when the parent has
    run no work before (a benchmark's main process), not in a test worker that ran other tests."""
    ctx = multiprocessing.get_context("spawn" if fresh else "fork")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args, threads))
    proc.start()
    send.close()
    try:
        return receive.recv()
    except EOFError:
        return {"status": "oom", "reason": "process killed, out of memory?"}
    finally:
        proc.join()


def isolated(device: str, fn, *args, threads: int = 0) -> dict:
    """``fn(*args)`` in a forked process on CPU (its memory high-water mark is its own), in-process on CUDA (the peak
    counter resets). Returns ``{"status": ..., **result}``."""
    if device != "cuda":
        return forked(fn, *args, threads=threads)
    try:
        return {"status": "ok", **fn(*args)}
    except torch.OutOfMemoryError:
        return {"status": "oom", "reason": "CUDA out of memory"}
    finally:
        torch.cuda.empty_cache()


def interleaved_times(
    steps: dict[str, Callable[[], None]],
    repeats: int,
    sync: Callable[[], None] = lambda: None,
    warmups: int = 1,
) -> dict:
    """Times of the peers' ``steps`` side by side: ``warmups`` warm-up rounds, then ``repeats`` rounds in which every
    peer takes one step in turn, so that a change in machine load hits all of them alike. Returns {peer: times in run
    order}."""
    times = {peer: [] for peer in steps}
    for round_ in range(warmups + repeats):
        for peer, step in steps.items():
            sync()
            start = time.perf_counter()
            step()
            sync()
            if round_ >= warmups:
                times[peer].append(time.perf_counter() - start)
    return times
