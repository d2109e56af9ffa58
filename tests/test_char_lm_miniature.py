"""recipes.char_lm_miniature report on run folders written as the recipe writes them (config.json, trainer_state.json,
all_results.json, checkpoints, legs.jsonl): the table has every variant and seed, streaming and block BPC, DualLN, the
means of two seeds and the training time; the plot has a curve per run."""

import json
import math

import pytest

from recipes import char_lm_miniature

STREAMING = {"test_bpc": 2.2, "test_block_bpc": 2.3, "eval_bpc": 2.4, "eval_block_bpc": 2.5}


def fake_run(root, name, *, use_dual_ln=True, results=None, step=1000, legs=(0,)):
    """A run folder: finished (``results``: BPC metrics, train_runtime in seconds) or stopped at ``step`` (its last
    checkpoint only)."""
    folder = root / name
    where = folder if results is not None else folder / f"checkpoint-{step}"
    where.mkdir(parents=True)
    (where / "config.json").write_text(json.dumps({"use_dual_ln": use_dual_ln, "hidden_size": 256}))
    log = [{"step": s, "loss": 3.0 - s / 1000, "learning_rate": 1e-3} for s in range(25, step + 1, 25)]
    if results is not None:
        log.append({"step": step, "train_loss": 2.0, "train_runtime": results["train_runtime"]})
        (folder / "all_results.json").write_text(json.dumps({**results, "test_dataset": "corpus.txt"}))
    (where / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": 1000, "log_history": log}))
    (folder / "legs.jsonl").write_text("".join(json.dumps({"start_step": s}) + "\n" for s in legs))


@pytest.fixture
def root(tmp_path):
    (tmp_path / "corpus.txt").write_text("x")
    (tmp_path / "empty-s0").mkdir()  # started, no log yet: left out
    fake_run(tmp_path, "full-s0", use_dual_ln=True, results={**STREAMING, "test_bpc": 2.0, "train_runtime": 1800})
    fake_run(tmp_path, "causal-s0", results={"test_bpc": 2.6, "eval_bpc": 2.7, "train_runtime": 1200})
    fake_run(tmp_path, "official-s1", results={**STREAMING, "test_bpc": 2.1, "train_runtime": 600}, legs=(0, 500))
    fake_run(tmp_path, "official-s0", results={**STREAMING, "train_runtime": 1380})
    fake_run(tmp_path, "official_no_dual_ln-s0", use_dual_ln=False, results={**STREAMING, "train_runtime": 1320})
    fake_run(tmp_path, "paper_rules-s0", step=250)
    return tmp_path


def rows(table: str) -> list[dict]:
    lines = table.splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True)) for line in lines[2:]]


def test_report_table_has_every_variant_seed_and_the_means(root, capsys):
    char_lm_miniature.main(["--root", str(root), "report"])
    table = (root / "table.md").read_text()
    assert capsys.readouterr().out.strip() == table.strip()
    got = rows(table)
    assert [(r["variant"], r["seed"]) for r in got] == [
        ("official", "0"),
        ("official", "1"),
        ("official", "mean of 0, 1"),
        ("official_no_dual_ln", "0"),
        ("paper_rules", "0"),
        ("causal", "0"),
        ("full", "0"),
    ]
    official, resumed, mean, no_dual_ln, running, causal, full = got
    assert official["test BPC (stream)"] == "2.200" and official["test BPC (blocks)"] == "2.300"
    assert official["val BPC (stream)"] == "2.400" and official["val BPC (blocks)"] == "2.500"
    assert official["train time (min)"] == "23.0" and official["DualLN"] == "on"
    assert resumed["train time (min)"] == "10.0 (steps 500-1000)"  # only the session that finished it was timed
    assert mean["test BPC (stream)"] == f"{(2.2 + 2.1) / 2:.3f}" and mean["test BPC (blocks)"] == "2.300"
    assert mean["train time (min)"] == "23.0" and mean["steps"] == "1000"  # the mean time leaves the resumed run out
    assert no_dual_ln["DualLN"] == "off" and "official rules" in no_dual_ln["model and attention"]
    assert running["steps"] == "250 of 1000 (running or stopped)" and running["test BPC (stream)"] == "-"
    assert running["train time (min)"] == "-" and "paper rules" in running["model and attention"]
    assert causal["test BPC (stream)"] == "-" and causal["test BPC (blocks)"] == "2.600"  # no memory: blocks only
    assert causal["val BPC (blocks)"] == "2.700" and "LongShortForCausalLM" in causal["model and attention"]
    assert full["test BPC (stream)"] == "2.000" and "full attention" in full["model and attention"]
    assert (root / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_has_a_curve_per_run(root, tmp_path):
    runs = char_lm_miniature.load_runs(root)
    labels = char_lm_miniature.plot(runs, tmp_path / "curves.png")
    assert labels == [
        "official, seed 0",
        "official, seed 1",
        "official_no_dual_ln, seed 0",
        "paper_rules, seed 0 (to step 250)",
        "causal, seed 0",
        "full, seed 0",
    ]
    running = next(r for r in runs if r.variant == "paper_rules")
    assert running.curve[0] == list(range(25, 251, 25))
    assert running.curve[1][0] == pytest.approx((3.0 - 0.025) / math.log(2))  # nats -> bits


def test_report_without_runs_says_how_to_start_one(tmp_path):
    with pytest.raises(SystemExit, match="recipes.char_lm_miniature run official"):
        char_lm_miniature.main(["--root", str(tmp_path), "report"])
    assert not list(tmp_path.iterdir())


def test_each_session_notes_the_step_it_starts_from(tmp_path):
    out = tmp_path / "official-s0"
    assert char_lm_miniature.start_session(out) == 0
    for step in (250, 500):
        (out / f"checkpoint-{step}").mkdir()
    assert char_lm_miniature.start_session(out) == 500
    assert [json.loads(line) for line in (out / "legs.jsonl").read_text().splitlines()] == [
        {"start_step": 0},
        {"start_step": 500},
    ]
