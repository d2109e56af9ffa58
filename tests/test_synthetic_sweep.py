"""recipes.lra.synthetic_sweep: one JSON line per finished run, finished runs skipped, an interrupted run resumed."""

import json

import pytest

from recipes.lra.synthetic import Task, train
from recipes.lra.synthetic_sweep import checkpoint_path, main

SMALL = [
    "--lengths",
    "64",
    "--vocab_sizes",
    "8",
    "--seeds",
    "0",
    "--steps",
    "4",
    "--eval_every",
    "2",
    "--eval_size",
    "8",
    "--target",
    "1.0",
]


def test_sweep_appends_skips_and_resumes(tmp_path, capsys):
    out, checkpoints = tmp_path / "sweep.jsonl", tmp_path / "checkpoints"
    args = [*SMALL, "--out", str(out), "--checkpoint_dir", str(checkpoints)]
    # a run of the grid interrupted after its evaluation at step 2
    interrupted = train(
        "long_short",
        Task(64, 8, global_first_token=False),
        2,
        eval_every=2,
        eval_size=8,
        target=1.0,
        checkpoint=checkpoint_path(checkpoints, ("long_short", 64, 8, False, 0, 4)),
    )
    main(args)
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["global_first_token"], [h["step"] for h in r["history"]]) for r in runs] == [
        (True, [2, 4]),
        (False, [2, 4]),
    ]  # global first token first, both still at chance
    resumed = next(r for r in runs if not r["global_first_token"])
    assert resumed["history"][0] == interrupted["history"][0] and not list(checkpoints.iterdir())
    main(args)  # everything done: nothing runs, nothing is added
    assert out.read_text().count("\n") == len(runs) == 2
    capsys.readouterr()
    main([*args, "--report"])
    assert "| 64 | 8 |" in capsys.readouterr().out


def test_sweep_checks_every_setting_before_any_work(tmp_path):
    out = tmp_path / "sweep.jsonl"
    with pytest.raises(ValueError, match="--vocab_size"):
        main([*SMALL[:2], "--vocab_sizes", "8", "4", *SMALL[4:], "--out", str(out)])
    assert not out.exists()
