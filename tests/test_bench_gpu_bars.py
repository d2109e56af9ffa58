"""bench.gpu_bars: the verdicts and ratios from given numbers, every bar's row, the time guard, compiling ahead in
processes of their own beside the measurement (what they compile is what the measurement runs; they are stopped while
it times), and the whole script on the CPU with tiny shapes (``--smoke``). Times are measured there, never
asserted."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import timm
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import ls_timm  # noqa: F401  (registers the cvt_ls_* and vil_ls_* models)
from bench import gpu_bars
from bench.common import side_by_side
from bench.cuda_lowered import compile_on_cpu
from bench.gpu_bars import BARS, UNITS, CompilingAhead, bar_rows, compile_units, table, time_limit, verdict


def test_verdict_on_made_up_numbers():
    assert verdict(1.3, "<=", 1.3) == verdict(2.5, ">=", 2.5) == verdict(0.5, "<=", 1.3) == "PASS"
    assert verdict(1.31, "<=", 1.3) == verdict(2.49, ">=", 2.5) == verdict(16.0, "<=", 15.0) == "MISS"
    assert verdict(0.7, "", None) == "ref"
    assert verdict(None, ">=", 1.5) == verdict(None, "", None) == "not run"


def _made_up_measurements() -> dict:
    """Every key a bar reads, each with its own made-up value of every quantity (1, 2, 3, ... in key order)."""
    keys = sorted({key for bar in BARS for key in (bar.numerator, bar.denominator)})
    return {key: {"status": "ok", **dict.fromkeys(UNITS, float(i + 1))} for i, key in enumerate(keys)}


def test_every_bar_has_a_row_with_its_ratio_and_verdict():
    measurements = _made_up_measurements()
    rows = bar_rows(measurements, notes={})
    assert [row["bar"] for row in rows] == [bar.what for bar in BARS] and len({bar.what for bar in BARS}) == len(BARS)
    for row, bar in zip(rows, BARS):
        values = [measurements[key][bar.quantity] for key in (bar.numerator, bar.denominator)]
        assert row["values"] == values and row["ratio"] == values[0] / values[1] and row["reason"] == ""
        assert row["verdict"] == verdict(row["ratio"], bar.relation, bar.target) != "not run"
    assert {row["verdict"] for row in rows} == {"PASS", "MISS", "ref"}
    text = table(rows)
    assert all(bar.what in text for bar in BARS) and text.count("\n") == len(BARS) + 2


def test_ratios_from_given_numbers():
    """The attention bars against FlexAttention's window (<= 1.3x its time) and flash SDPA (>= 2.5x at 16k)."""
    measurements = _made_up_measurements()
    at_16k = {"long-short": 2.8e-3, "flex-window": 2.0e-3, "sdpa": 7.0e-3}
    for peer, seconds in at_16k.items():
        measurements[f"attention/{peer}/16k x1"] = {"status": "ok", "time_s": seconds, "peak_mem_bytes": 2**30}
    rows = {row["bar"]: row for row in bar_rows(measurements, notes={})}
    window = rows["attention fwd+bwd 16k, batch 1: Long-Short / FlexAttention sliding window, time"]
    assert window["ratio"] == pytest.approx(1.4) and window["verdict"] == "MISS" and window["target"] == "<= 1.3x"
    assert window["measured"] == "long-short 2.8 ms / flex-window 2 ms"
    flash = rows["attention fwd+bwd 16k, batch 1: flash SDPA / Long-Short, time (speedup)"]
    assert flash["ratio"] == pytest.approx(2.5) and flash["verdict"] == "PASS"
    memory = rows["attention fwd+bwd 16k, batch 1: Long-Short / flash SDPA, peak memory"]
    assert memory["ratio"] == 1.0 and memory["measured"] == "long-short 1,024 MiB / sdpa 1,024 MiB"


def test_a_missing_or_failed_measurement_says_why():
    measurements = _made_up_measurements()
    measurements["attention/sdpa/64k x1"] = {"status": "oom", "reason": "CUDA out of memory"}
    del measurements["LRA ListOps/full/listops"]
    measurements["decoding/cached/512"]["per_token_s"] = 0.0
    rows = {row["bar"]: row for row in bar_rows(measurements, notes={"LRA ListOps": "its time ran out"})}
    oom = rows["attention fwd+bwd 64k, batch 1: flash SDPA / Long-Short, time (speedup)"]
    assert oom["verdict"] == "not run" and oom["reason"] == "oom: CUDA out of memory" and oom["ratio"] is None
    assert rows["LRA ListOps training step: full attention / Long-Short, time"]["reason"] == "its time ran out"
    zero = rows["cached decoding: per-token time after 8k / after 512 tokens"]
    assert zero["verdict"] == "not run" and "is 0" in zero["reason"]


def test_time_limit_stops_a_section_and_restores_the_alarm():
    handler = signal.getsignal(signal.SIGALRM)
    with pytest.raises(gpu_bars.OutOfTime), time_limit(0.2):
        for _ in range(1000):  # 10 s unless the alarm stops it
            time.sleep(0.01)
    with pytest.raises(gpu_bars.OutOfTime), time_limit(0):
        pytest.fail("a section with no time left must not start")
    with time_limit(5):
        pass
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) is handler


def test_side_by_side_reports_a_failing_peer_and_measures_the_others():
    x = torch.randn(64, 64)

    def broken():
        raise RuntimeError("this peer breaks")

    results = side_by_side({"matmul": lambda: x @ x, "broken": broken}, "cpu", repeats=3, warmups=1)
    assert results["broken"] == {"status": "error", "reason": "this peer breaks"}
    ok = results["matmul"]
    assert ok["status"] == "ok" and len(ok["times_s"]) == 3 and ok["time_s"] == sorted(ok["times_s"])[1]
    assert 0 < ok["host_s"] <= max(ok["times_s"])  # the time until the step returned, within the step's
    assert ok["peak_mem_bytes"] >= 64 * 64 * 4  # the product's output


def test_side_by_side_takes_its_memory_and_timed_steps_inside_timed():
    """Warm-up steps (where compilation happens) outside ``timed()``, the memory step and the timed rounds inside."""
    inside, steps_taken = [False], []

    @contextlib.contextmanager
    def timed():
        inside[0] = True
        yield
        inside[0] = False

    side_by_side({"peer": lambda: steps_taken.append(inside[0])}, "cpu", repeats=3, warmups=2, timed=timed)
    assert steps_taken == [False, False, True, True, True, True] and not inside[0]


def test_both_plans_build_models_that_exist():
    """The GPU plan's models are those the smoke run stands in for, and timm knows each of them."""
    gpu, smoke = gpu_bars.GPU.vision_models, gpu_bars.SMOKE.vision_models
    assert set(gpu) == set(smoke) == set(gpu_bars.VISION_MODELS) and all(gpu[name] == name for name in gpu)
    assert all(timm.is_model(name) for name in {*gpu.values(), *smoke.values()} - {"hf_cvt_13"})


def test_compile_units_are_the_compiling_peers_of_every_setting():
    """One unit per setting and peer that compiles, each a measurement key a setting records, in the order they are
    measured."""
    units = compile_units(gpu_bars.GPU)
    keys = {
        setting.key(peer): section
        for section in gpu_bars.SECTIONS
        for setting in section.settings(gpu_bars.GPU)
        for peer in setting.peers
    }
    assert set(units) <= set(keys) and len(set(units)) == len(units)
    assert {key for key, section in keys.items() if key.split("/")[1] in section.compiled} == set(units)
    assert units == [key for key in keys if key in units] and Counter(key.split("/")[0] for key in units) == {
        "attention": 7,  # Long-Short in 4 settings, FlexAttention's window in 3
        "masked LM": 3,
        "decoding": 4,
        "vision": 6,  # cvt_ls_13 (FlexAttention, the Triton window kernel) and vil_ls_medium, at 224 and 448
        "LRA ListOps": 1,
    }
    assert compile_units(gpu_bars.GPU, ["decoding"]) == [key for key in units if key.startswith("decoding/")]


def _state_of(pid: int) -> str:
    """The process's state letter (T: stopped, Z: ended, not yet reaped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_compiling_ahead_reports_failures_and_stops_what_runs_at_its_close():
    ahead = CompilingAhead(["attention/no-such-peer/4k x1"], ["--smoke"], jobs=1)
    ahead.wait(["attention/no-such-peer/4k x1"])
    note = ahead.close()
    assert note.startswith("0 of 1 compiled") and "failed attention/no-such-peer/4k x1" in note
    assert "--compile-only takes section/peer/setting" in note  # the child's own error, from its log
    began = time.perf_counter()
    ahead = CompilingAhead(compile_units(gpu_bars.SMOKE)[:3], ["--smoke"], jobs=2)  # 2 start, 1 waits
    time.sleep(1)
    note = ahead.close()
    assert note.startswith("0 of 3") and "3 stopped or not started at the end of the budget" in note
    assert time.perf_counter() - began < 30  # stopped, not waited for


def test_compiling_processes_are_stopped_while_the_measurement_times():
    """Inside ``paused()`` every compiling process is stopped and none starts; after it they run on and finish."""
    units = compile_units(gpu_bars.SMOKE, ["decoding"])[:2]
    ahead = CompilingAhead(units, ["--smoke"], jobs=1)
    try:
        while not ahead.running:
            time.sleep(0.05)
        with ahead.paused():
            process, *_ = ahead.running[units[0]]
            time.sleep(0.5)  # the scheduler's turn: it must start nothing
            assert _state_of(process.pid) == "T" and list(ahead.running) == units[:1] and ahead.pending == units[1:]
        assert process.poll() is not None or _state_of(process.pid) != "T"
        assert ahead.wait_all() >= 0 and not ahead.running and not ahead.pending
    finally:
        note = ahead.close()
    assert note.startswith("2 of 2 compiled"), note


def test_compiling_processes_end_with_the_measuring_process(monkeypatch, tmp_path):
    """A compiling process, in a session of its own, ends when the process that started it is killed (this unit
    compiles for 30 s or more on the CPU taking CUDA's choices, with an empty cache: it ends well before)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    script = (
        "import time; from bench import gpu_bars; "
        "ahead = gpu_bars.CompilingAhead(['attention/long-short/4k x1'], ['--smoke', '--cpu-as-cuda'], jobs=1); "
        "time.sleep(0.5); print(*(p.pid for p, *_ in ahead.running.values()), flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    try:
        for _ in range(200):  # its watch looks every 0.5 s, once it has imported the bench
            if not Path(f"/proc/{child}").exists() or _state_of(child) == "Z":
                break
            time.sleep(0.1)
        else:
            pytest.fail("the compiling process outlived its parent")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child, signal.SIGKILL)


def test_code_compiled_ahead_is_what_the_measurement_runs(monkeypatch, tmp_path):
    """A unit compiled in a process of its own (the CPU taking CUDA's choices there and here, an empty inductor cache):
    the same setting measured here after ``fresh_compilation`` finds every graph in the cache and compiles none."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    unit = "attention/long-short/4k x1"
    ahead = CompilingAhead([unit], ["--smoke", "--cpu-as-cuda"], jobs=1)
    ahead.wait([unit])
    note = ahead.close()
    assert note.startswith("1 of 1 compiled"), note
    compile_on_cpu(monkeypatch)
    setting = next(
        setting for setting in gpu_bars.attention_settings(gpu_bars.SMOKE) if setting.key("long-short") == unit
    )
    results = {}
    counters = torch._dynamo.utils.counters
    counters.clear()
    gpu_bars.fresh_compilation()
    try:
        setting.run(("long-short",), results.__setitem__, contextlib.nullcontext)
    finally:
        gpu_bars.fresh_compilation()
    assert results["long-short"]["status"] == "ok"
    assert counters["inductor"]["fxgraph_cache_hit"] >= 2 and counters["inductor"]["fxgraph_cache_miss"] == 0


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # FlexAttention's window, on the CPU
def test_smoke_run_measures_every_bar_on_the_cpu(tmp_path, capsys):
    """The whole script on the CPU with tiny shapes: every section runs, every bar gets a ratio and a verdict, the JSON
    and the table are written, and a copy lands in --copy-to."""
    out = tmp_path / "bars" / "gpu_bars.json"
    rows = gpu_bars.main(["--smoke", "--out", str(out), "--copy-to", str(tmp_path / "copy")])
    assert [row["bar"] for row in rows] == [bar.what for bar in BARS]
    assert all(row["verdict"] in ("PASS", "MISS", "ref") for row in rows), [r for r in rows if r["ratio"] is None]
    saved = json.loads(out.read_text())
    assert saved["bars"] == json.loads(json.dumps(rows)) and saved["meta"]["device"] == "cpu"
    assert all(note.startswith("ran in") for note in saved["meta"]["sections"].values())
    assert {key.split("/")[0] for key in saved["measurements"]} == {name for name, *_ in gpu_bars.SECTIONS}
    assert (tmp_path / "copy" / "gpu_bars.json").read_text() == out.read_text()
    assert out.with_suffix(".md").read_text() == (tmp_path / "copy" / "gpu_bars.md").read_text()
    assert table(rows) in capsys.readouterr().out


def test_chosen_sections_run_alone(tmp_path):
    """``--sections``: those sections run, with the whole budget between them, and the table holds their bars only;
    with ``--jobs``, after their peers that compile ran in processes of their own (on the CPU they compile nothing)."""
    rows = gpu_bars.main(["--smoke", "--sections", "decoding", "--jobs", "2", "--out", str(tmp_path / "bars.json")])
    saved = json.loads((tmp_path / "bars.json").read_text())
    assert saved["meta"]["compiled_ahead"].startswith("4 of 4 compiled")
    assert [row["bar"] for row in rows] == [bar.what for bar in BARS if bar.section == "decoding"]
    assert all(row["verdict"] in ("PASS", "MISS") for row in rows)
    assert list(saved["meta"]["sections"]) == ["decoding"]
    assert {key.split("/")[0] for key in saved["measurements"]} == {"decoding"}


def test_what_was_measured_is_handed_on_after_each_section():
    """``after_section`` (the script writes its table and JSON there) gets every section's measurements as it ends,
    so that a run stopped from outside keeps what it measured."""
    handed = []
    gpu_bars.run_sections(
        gpu_bars.SMOKE,
        600,
        ["decoding", "LRA ListOps"],
        after_section=lambda measurements, notes: handed.append(({k.split("/")[0] for k in measurements}, list(notes))),
    )
    assert handed == [({"decoding"}, ["decoding"]), ({"decoding", "LRA ListOps"}, ["decoding", "LRA ListOps"])]


def test_masked_lm_steps_end_with_the_optimizers_update(tmp_path):
    """A masked-LM bar times a step of real training: forward, backward and AdamW's update of every parameter, for
    each peer of each setting (a model and optimizer of its own)."""
    steps = Counter()

    def count(optimizer, args, kwargs):
        assert type(optimizer) is torch.optim.AdamW
        steps[optimizer] += 1  # the optimizer kept: a freed one's id may come again

    hook = register_optimizer_step_post_hook(count)
    try:
        rows = gpu_bars.main(["--smoke", "--sections", "masked LM", "--jobs", "0", "--out", str(tmp_path / "b.json")])
    finally:
        hook.remove()
    assert all(row["verdict"] in ("PASS", "MISS", "ref") for row in rows)
    peers = sum(len(peers) for *_, peers in gpu_bars.MLM_RUNS)
    assert len(steps) == peers and min(steps.values()) >= gpu_bars.SMOKE.repeats


def test_no_time_left_marks_every_bar_not_run(tmp_path):
    rows = gpu_bars.main(["--smoke", "--budget-s", "0", "--out", str(tmp_path / "bars.json")])
    assert len(rows) == len(BARS) and {row["verdict"] for row in rows} == {"not run"}
    assert all("its time ran out" in row["reason"] for row in rows)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--smoke", "--budget-s", "-1"], "--budget-s must be >= 0"),
        (["--smoke", "--out", "bars.txt"], "--out must name a .json file"),
        (["--smoke", "--jobs", "-1"], "--jobs must be >= 0"),
        (["--cpu-as-cuda"], "--cpu-as-cuda goes with --smoke"),
        (["--smoke", "--compile-only", "attention/sdpa/4k x1"], "--compile-only takes section/peer/setting"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        gpu_bars.main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_without_cuda_the_gpu_plan_is_refused(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the GPU plan runs here")
    with pytest.raises(SystemExit):
        gpu_bars.main([])
    assert "no CUDA device" in capsys.readouterr().err
