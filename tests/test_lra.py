"""recipes.lra: ListOps by LRA's rules, the paper's LRA model against the official one, training and resuming."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from recipes.lra import data as lra_data
from recipes.lra.data import LISTOPS_VOCAB, OPERATORS, ListOpsRules, generate_listops, listops
from recipes.lra.model import LRAClassifier, LRAConfig, from_official
from recipes.lra.train import machine as train_machine
from recipes.lra.train import main, resolve

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SMALL = ListOpsRules(max_depth=4, max_args=5, min_length=10, max_length=60, train=64, dev=16, test=16)


# ------------------------------------------------------------------------------------------- ListOps rules
def _evaluate(tokens: list[str]) -> tuple[int, int]:
    """Reference: value of the bracketed prefix expression starting at tokens[0], and the tokens it used."""
    if tokens[0].isdigit():
        return int(tokens[0]), 1
    op, args, used = tokens[0], [], 1
    while tokens[used] != "]":
        value, size = _evaluate(tokens[used:])
        args.append(value)
        used += size
    ops = {"MIN": min, "MAX": max, "MED": lambda a: int(np.median(a)), "SM": lambda a: sum(a) % 10}
    return ops[op](args), used + 1


def _depth(tokens: list[str]) -> int:
    depth = best = 0
    for t in tokens:
        depth += t in OPERATORS
        depth -= t == "]"
        best = max(best, depth)
    return best


def test_listops_rules_and_labels():
    """Bracketed generation: every example is a well-formed expression whose label is its value, with LRA's limits on
    depth, arguments and length, and no example repeats."""
    rules = ListOpsRules(**{**SMALL.__dict__, "brackets": True})
    splits = generate_listops(seed=3, rules=rules)
    seen = set()
    for split, size in (("train", 64), ("dev", 16), ("test", 16)):
        ex = splits[split]
        assert len(ex) == size
        for i in range(size):
            tokens = [LISTOPS_VOCAB[t] for t in ex.tokens[ex.offsets[0, i] : ex.offsets[0, i + 1]]]
            value, used = _evaluate(tokens)
            assert used == len(tokens) and value == ex.labels[i]
            assert rules.min_length < len(tokens) < rules.max_length
            assert _depth(tokens) <= rules.max_depth - 1  # operators only below the maximum depth
            seen.add(tuple(tokens))
    assert len(seen) == 96


def test_listops_lra_tokenisation_drops_brackets():
    """LRA's released pipeline keeps only alphanumeric tokens: the same expressions without ']' (same labels)."""
    plain, bracketed = (
        generate_listops(5, SMALL),
        generate_listops(5, ListOpsRules(**{**SMALL.__dict__, "brackets": True})),
    )
    close = LISTOPS_VOCAB.index("]")
    assert close not in plain["train"].tokens
    np.testing.assert_array_equal(plain["train"].tokens, bracketed["train"].tokens[bracketed["train"].tokens != close])
    np.testing.assert_array_equal(plain["dev"].labels, bracketed["dev"].labels)


def test_listops_deterministic_and_cached(tmp_path, monkeypatch):
    a, b, c = (generate_listops(seed, SMALL) for seed in (1, 1, 2))
    np.testing.assert_array_equal(a["train"].tokens, b["train"].tokens)
    assert not np.array_equal(a["train"].labels, c["train"].labels)
    first = listops(tmp_path, 1, SMALL)
    monkeypatch.setattr(lra_data, "generate_listops", lambda *a: pytest.fail("regenerated instead of read"))
    again = listops(tmp_path, 1, SMALL)
    np.testing.assert_array_equal(first["test"].tokens, again["test"].tokens)
    np.testing.assert_array_equal(first["test"].offsets, a["test"].offsets)
    assert len(list(tmp_path.glob("*.npz"))) == 1


def test_fresh_listops_leaves_out_the_training_split():
    """New expressions by the same rules, none of them in the excluded split: a stream that the excluded split came
    from gives nothing new, another seed gives what was asked for."""
    train = generate_listops(1, SMALL)["train"]
    assert len(lra_data.fresh_listops(1, 20, SMALL, exclude=train)) == 0  # the same stream: all in train already
    fresh = lra_data.fresh_listops(2, 20, SMALL, exclude=train)
    assert len(fresh) == 20 and fresh.lengths().max() < SMALL.max_length
    np.testing.assert_array_equal(
        fresh.labels,
        generate_listops(2, ListOpsRules(**{**SMALL.__dict__, "train": 1, "dev": 1, "test": 20}))["test"].labels,
    )


def test_listops_bad_rules():
    with pytest.raises(ValueError, match="--listops_max_depth"):
        ListOpsRules(max_depth=0).check()
    with pytest.raises(ValueError, match="--listops_max_length"):
        ListOpsRules(min_length=10, max_length=11).check()


# --------------------------------------------------------------------------------- the official LRA model
@pytest.mark.parametrize("case", ["long_short", "window", "projection"])
def test_official_lra_model(case):
    """``lra/model.py`` (Model, post-CLS in the last layer) and ``SCHead`` with random weights, padding, float64:
    our model loads their weights and reproduces the pooled CLS and the logits to 1e-5."""
    from safetensors.torch import load_file

    meta = json.loads((FIXTURES / "lra_model.json").read_text())["cases"][case]
    tensors = load_file(FIXTURES / "lra_model.safetensors")
    part = {
        p: {k[len(f"{case}.{p}.") :]: v for k, v in tensors.items() if k.startswith(f"{case}.{p}.")}
        for p in ("model", "head")
    }
    config = LRAConfig(
        vocab_size=16,
        max_length=meta["seq_len"],
        num_classes=10,
        attention=case,
        window_size=meta["window_size"] or 8,
        projection_rank=meta["num_landmarks"] or 32,
    )
    model = LRAClassifier(config).double().eval()
    model.load_state_dict(from_official(part["model"], part["head"]), strict=True)
    ids, mask = tensors[f"{case}.input_ids"], tensors[f"{case}.mask"] > 0
    with torch.no_grad():
        pooled = model.encoder(ids, mask)
        logits = model([ids], [mask])
    torch.testing.assert_close(pooled, tensors[f"{case}.pooled"], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, tensors[f"{case}.logits"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", ["long_short", "full", "window", "projection"])
def test_model_padding_invariance(attention):
    """Padding a batch further changes no logit (masked keys, projection and CLS)."""
    torch.manual_seed(0)
    model = (
        LRAClassifier(
            LRAConfig(
                vocab_size=16, max_length=64, num_classes=10, attention=attention, window_size=4, projection_rank=3
            )
        )
        .double()
        .eval()
    )
    ids = torch.randint(1, 15, (2, 40))
    mask = torch.arange(40)[None] < torch.tensor([[40], [23]])
    ids[~mask] = 0
    wide_ids = torch.cat([ids, torch.zeros(2, 24, dtype=ids.dtype)], 1)
    wide_mask = torch.cat([mask, torch.zeros(2, 24, dtype=torch.bool)], 1)
    with torch.no_grad():
        torch.testing.assert_close(model([ids], [mask]), model([wide_ids], [wide_mask]), atol=1e-10, rtol=0)
        alone = model([ids[1:, :23]], [mask[1:, :23]])
        torch.testing.assert_close(model([ids], [mask])[1:], alone, atol=1e-10, rtol=0)


def test_bad_config_names_the_argument():
    with pytest.raises(ValueError, match="--attention"):
        LRAConfig(vocab_size=16, max_length=8, num_classes=2, attention="sparse")
    with pytest.raises(ValueError, match="--window_size"):
        LRAConfig(vocab_size=16, max_length=8, num_classes=2, attention="projection", projection_rank=0)


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize(
    "name, message", [("meta", "must be cpu or cuda"), ("gpu0", "must name a torch device"), ("cuda:7", "CUDA device")]
)
def test_bad_device_is_refused_before_any_work(tmp_path, capsys, name, message):
    if name == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a CUDA device 7")
    with pytest.raises(SystemExit):
        main(_argv(tmp_path / "run", 6, "--device", name))
    err = capsys.readouterr().err
    assert "--device" in err and message in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()


def _argv(out, steps, *extra):
    return [
        "--task",
        "listops",
        "--output_dir",
        str(out),
        "--data_dir",
        str(out.parent / "data"),
        "--steps",
        str(steps),
        "--warmup",
        "2",
        "--eval_every",
        "2",
        "--batch_size",
        "4",
        "--eval_batch_size",
        "8",
        "--window_size",
        "4",
        "--projection_rank",
        "2",
        "--listops_train",
        "24",
        "--listops_dev",
        "8",
        "--listops_test",
        "8",
        "--no_progress",
        "--threads",
        "1",
        *extra,
    ]


def test_train_resume_matches_uninterrupted(tmp_path, monkeypatch, device, capsys):
    """A run stopped after its first evaluation and rerun ends where an uninterrupted one ends; the test split is
    scored once, with the best dev checkpoint (ties in dev accuracy go to the lower dev loss). The data generation
    and every evaluation print a line, also with --no_progress."""
    small = {"min_length": 10, "max_length": 60, "max_depth": 4, "max_args": 5}  # short expressions, quick steps
    monkeypatch.setattr("recipes.lra.train.ListOpsRules", lambda **kw: ListOpsRules(**{**small, **kw}))
    on = ("--device", str(device))
    whole = main(_argv(tmp_path / "whole", 6, *on))
    out = capsys.readouterr().out
    assert "Generating 24 / 8 / 8 ListOps expressions" in out
    assert all(f"step {step}/6: train loss" in out for step in (2, 4, 6))
    assert whole["machine"] == train_machine(device)
    assert [h["step"] for h in whole["history"]] == [2, 4, 6]
    best = max(whole["history"], key=lambda h: (h["dev_accuracy"], -h["dev_loss"]))
    assert whole["tested_checkpoint_step"] == best["step"] and whole["best"]["dev_loss"] == best["dev_loss"]
    assert 0 <= whole["test_accuracy"] <= 1
    for name in ("best.pt", "last.pt"):  # plain data: readable without unpickling arbitrary objects
        torch.load(tmp_path / "whole" / name, weights_only=True)

    from recipes.lra import train

    real_save = train.save

    def stop_after_first_eval(obj, path):
        real_save(obj, path)
        if path.name == "last.pt":
            raise KeyboardInterrupt

    monkeypatch.setattr(train, "save", stop_after_first_eval)
    with pytest.raises(KeyboardInterrupt):
        main(_argv(tmp_path / "split", 6, *on))
    monkeypatch.setattr(train, "save", real_save)
    resumed = main(_argv(tmp_path / "split", 6, *on))
    assert [h["step"] for h in resumed["history"]] == [2, 4, 6]
    loss_tol = 1e-6 if device.type == "cpu" else 1e-4  # CUDA's backward sums with atomics, in no fixed order
    for a, b in zip(whole["history"], resumed["history"]):
        assert a["dev_accuracy"] == b["dev_accuracy"] and a["train_loss"] == pytest.approx(
            b["train_loss"], abs=loss_tol
        )
    assert resumed["test_accuracy"] == whole["test_accuracy"]
    # a finished run is not retrained; other settings in the same folder are refused, finished or not
    assert main(_argv(tmp_path / "split", 6, *on))["test_accuracy"] == whole["test_accuracy"]
    with pytest.raises(SystemExit, match="other settings.*'attention': \\('long_short', 'full'\\)"):
        main(_argv(tmp_path / "split", 6, *on, "--attention", "full"))
    (tmp_path / "split" / "results.json").unlink()
    with pytest.raises(SystemExit, match="other settings"):
        main(_argv(tmp_path / "split", 6, *on, "--seed", "1"))

    from recipes.lra.plot import plot

    plot([str(tmp_path / "whole"), str(tmp_path / "whole" / "results.json")], str(tmp_path / "d.png"))
    assert (tmp_path / "d.png").stat().st_size > 0

    from recipes.lra.score import main as score

    best, last = score([str(tmp_path / "whole"), *on, "--threads", "1", "--json", str(tmp_path / "scores.json")])
    assert (best["checkpoint"], best["step"], last["checkpoint"], last["step"]) == (
        "best.pt",
        whole["tested_checkpoint_step"],
        "last.pt",
        6,
    )
    assert best["test"]["accuracy"] == whole["test_accuracy"]
    assert best["dev"]["accuracy"] == {h["step"]: h["dev_accuracy"] for h in whole["history"]}[best["step"]]
    assert sum(best["test"]["label_counts"]) == 8 and json.loads((tmp_path / "scores.json").read_text())[0] == best
    with pytest.raises(SystemExit, match="results.json not found"):
        score([str(tmp_path / "missing")])
    fresh = score(
        [str(tmp_path / "whole"), *on, "--threads", "1", "--checkpoint", "best", "--fresh", "12", "--fresh_seed", "5"]
    )
    assert len(fresh) == 1 and fresh[0]["test"] == best["test"] and sum(fresh[0]["fresh"]["label_counts"]) == 12
    with pytest.raises(SystemExit, match="--fresh_seed 0 is"):
        score([str(tmp_path / "whole"), *on, "--fresh", "12", "--fresh_seed", "0"])


def test_best_checkpoint_ties_go_to_the_lower_dev_loss():
    from recipes.lra.train import better

    best = {"step": 2, "dev_accuracy": 1.0, "dev_loss": 0.654}
    assert better({"dev_accuracy": 1.0, "dev_loss": 0.049}, best)
    assert not better({"dev_accuracy": 1.0, "dev_loss": 0.7}, best)
    assert not better({"dev_accuracy": 0.9, "dev_loss": 0.001}, best)
    assert better({"dev_accuracy": 0.0, "dev_loss": 9.0}, {"step": None, "dev_accuracy": -1.0})


def test_checkpoints_that_would_run_code_are_refused(tmp_path, monkeypatch):
    """``torch.load(weights_only=True)``: a checkpoint whose unpickling would call a function (here: create a file)
    is refused with a clear message, and the function never runs, in training (resume) and in scoring."""
    marker = tmp_path / "code_ran"

    class RunsCode:
        def __reduce__(self):
            return Path.touch, (marker,)

    small = {"min_length": 10, "max_length": 60, "max_depth": 4, "max_args": 5}
    monkeypatch.setattr("recipes.lra.train.ListOpsRules", lambda **kw: ListOpsRules(**{**small, **kw}))
    run = tmp_path / "run"
    main(_argv(run, 4))
    from recipes.lra.score import main as score

    for name in ("best.pt", "last.pt"):
        saved = torch.load(run / name, weights_only=True)
        torch.save({**saved, "model": RunsCode()}, run / name)
    with pytest.raises(SystemExit, match="objects other than tensors and plain data"):
        score([str(run), "--threads", "1"])
    (run / "results.json").unlink()  # unfinished: the rerun reads last.pt to resume
    with pytest.raises(SystemExit, match="objects other than tensors and plain data"):
        main(_argv(run, 4))
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["cut short", "overwritten", "empty", "results.json"])
def test_a_damaged_checkpoint_is_named_with_how_to_start_afresh(tmp_path, capsys, damage):
    """A last.pt cut short (``OSError: [Errno 22]`` from torch), overwritten with other bytes or empty, or a damaged
    results.json: the rerun stops before any work, naming the file and how to go on, not with a traceback."""
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"model": {"w": torch.ones(1000)}, "state": {"step": 2}}, run / "last.pt")
    whole = (run / "last.pt").read_bytes()
    name = "results.json" if damage == "results.json" else "last.pt"
    changed = {"cut short": whole[:-10], "overwritten": bytes(range(256)) * 20, "empty": b"", "results.json": b'{"ru'}
    (run / name).write_bytes(changed[damage])
    with pytest.raises(SystemExit, match=rf"{run / name} cannot be read \(.*\): the file is damaged") as stop:
        main(_argv(run, 6))
    assert "start the run afresh, delete" in str(stop.value) and "or use another --output_dir" in str(stop.value)
    assert not (tmp_path / "data").exists()  # stopped before generating the data


def test_a_short_run_scales_the_default_warmup_and_an_explicit_one_must_fit(tmp_path, capsys):
    """--steps 5 without --warmup: Table 8's 1000 warm-up steps (of 5000) cannot fit, so the warm-up is the same 20 %
    (at least OneCycleLR's 2 steps), said on stdout; a run the task's warm-up fits keeps it; an explicit --warmup that
    does not fit, and fewer than 4 steps, are refused with the range."""
    out = ["--task", "listops", "--output_dir", str(tmp_path / "run")]
    assert resolve([*out, "--steps", "5"]).warmup == 2 and resolve([*out, "--steps", "50"]).warmup == 10
    assert "--warmup 2: Table 8's 1000 warm-up steps (of 5000) do not fit --steps 5" in capsys.readouterr().out
    assert resolve([*out, "--steps", "2000"]).warmup == 1000 and resolve([*out]).warmup == 1000
    for argv, message in (
        (["--steps", "5", "--warmup", "1000"], "--warmup must be in [2, --steps - 2] = [2, 3]"),
        (["--steps", "3"], "--steps must be >= 4"),
    ):
        with pytest.raises(SystemExit):
            resolve([*out, *argv])
        assert message in capsys.readouterr().err


def test_label_scores_and_reweighting():
    """Per-label accuracy, and a split's accuracy under another label mix over the labels it holds."""
    from recipes.lra.score import label_scores, reweighted

    scores = label_scores(np.array([0, 0, 1, 1, 1, 2]), np.array([0, 1, 1, 1, 0, 2]), num_classes=4)
    assert scores["label_counts"] == [2, 3, 1, 0]
    assert scores["label_accuracy"] == [0.5, pytest.approx(2 / 3), 1.0, None]
    assert scores["accuracy"] == pytest.approx(4 / 6)
    assert reweighted(scores["label_accuracy"], [1, 1, 0, 5]) == pytest.approx((0.5 + 2 / 3) / 2)
    assert reweighted(scores["label_accuracy"], scores["label_counts"]) == pytest.approx(scores["accuracy"])


def test_flops_count_the_attention():
    """FlopCounterMode sees the fused CPU attention: full attention's score and value products, 4 n^2 d per layer
    (the CLS adds a row and a column in the last)."""
    from recipes.lra.flops import count

    n = 64
    full = count(LRAConfig(vocab_size=16, max_length=n, num_classes=10, attention="full"), n)
    assert full["by_op"]["aten._scaled_dot_product_flash_attention_for_cpu"] == 4 * 64 * (n**2 + (n + 1) ** 2)
    short = count(LRAConfig(vocab_size=16, max_length=n, num_classes=10, window_size=8, projection_rank=4), n)
    assert short["flops"] < full["flops"]


# ---------------------------------------------------------------------------------- synthetic long range
@pytest.mark.parametrize("size", [16, 7])
def test_synthetic_batch(size):
    """BOS first, exactly one marker, from --marker_from on, naming the label; balanced labels: half of each (one
    more 0 when the size is odd), in an order that changes from batch to batch; random ids below --vocab_size."""
    from recipes.lra.synthetic import BOS, FIRST_RANDOM, MARKERS, Task

    generator = torch.Generator().manual_seed(0)
    for task in (Task(64), Task(64, vocab_size=9, marker_from=0.75)):
        ids, labels = task.batch(generator, size)
        is_marker = (ids == MARKERS[0]) | (ids == MARKERS[1])
        assert (ids[:, 0] == BOS).all() and (ids[:, 1:][~is_marker[:, 1:]] >= FIRST_RANDOM).all()
        assert ids.max() < task.vocab_size and (ids == task.vocab_size - 1).any()
        assert (is_marker.sum(1) == 1).all() and not is_marker[:, : int(64 * task.marker_from)].any()
        assert (ids[is_marker] == torch.tensor(MARKERS)[labels]).all()
        assert int((labels == 0).sum()) == (size + 1) // 2
        assert any(not torch.equal(task.batch(generator, size)[1], labels) for _ in range(5))
    independent = torch.stack([Task(64, labels="independent").batch(generator, size)[1] for _ in range(50)])
    assert (independent.sum(1) != size // 2).any() and 0.4 < independent.float().mean() < 0.6


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"length": 1}, "--length"),
        ({"vocab_size": 4}, "--vocab_size"),
        ({"labels": "equal"}, "--labels"),
        ({"marker_from": 1.0}, "--marker_from"),
        ({"marker_from": 0.01, "length": 64}, "--marker_from"),
    ],
)
def test_synthetic_task_settings_are_checked(setting, message):
    from recipes.lra.synthetic import Task

    with pytest.raises(ValueError, match=message):
        Task(**setting)


def test_synthetic_run_settings_are_checked_before_any_work(tmp_path, capsys):
    from recipes.lra.synthetic import Task, main, train

    for setting, message in (({"eval_every": 0}, "--eval_every"), ({"target": 1.5}, "--target")):
        with pytest.raises(ValueError, match=message):
            train("long_short", Task(64), 2, checkpoint=tmp_path / "run.pt", **setting)
    with pytest.raises(SystemExit):
        main(["--length", "64", "--steps", "1", "--json", str(tmp_path / "missing" / "result.json")])
    assert "--json" in capsys.readouterr().err
    assert not (tmp_path / "run.pt").exists() and not (tmp_path / "missing").exists()


def test_synthetic_checkpoint_resumes_the_same_run(tmp_path):
    """A run saved at step 4 and resumed to step 6 is the uninterrupted run; another run's checkpoint is refused."""
    from recipes.lra.synthetic import Task, train

    task, checkpoint = Task(128, vocab_size=16), tmp_path / "run.pt"
    whole = train("long_short", task, 6, eval_every=2, eval_size=16)
    train("long_short", task, 4, eval_every=2, eval_size=16, checkpoint=checkpoint)
    resumed = train("long_short", task, 6, eval_every=2, eval_size=16, checkpoint=checkpoint)
    assert [(h["step"], h["loss"], h["accuracy"]) for h in resumed["history"]] == [
        (h["step"], h["loss"], h["accuracy"]) for h in whole["history"]
    ]
    with pytest.raises(ValueError, match="--checkpoint"):
        train("long_short", Task(128, vocab_size=17), 6, eval_every=2, eval_size=16, checkpoint=checkpoint)


def test_synthetic_only_the_projection_reaches_the_second_half():
    """Without global tokens the first token's logits do not depend on the second half through a 2-layer window of
    w = 16; with the dynamic projection (r = 8) they do, and so they do when the first token is global."""
    from recipes.lra.synthetic import Task, build, logits

    ids, _ = Task(512).batch(torch.Generator().manual_seed(0), 2)
    changed = ids.clone()
    changed[:, 256:] = torch.randint(4, 32, (2, 256), generator=torch.Generator().manual_seed(1))
    for attention, global_first_token, reaches in (
        ("window", False, False),
        ("long_short", False, True),
        ("window", True, True),
    ):
        model = build(attention, Task(512)).eval()
        with torch.no_grad():
            delta = (logits(model, ids, global_first_token) - logits(model, changed, global_first_token)).abs().max()
        assert (delta.item() > 1e-4) == reaches, (attention, global_first_token, delta)


@pytest.mark.slow
def test_synthetic_long_range_is_learned():
    """Long-Short learns the marker of the second half at n = 512 with no global token (only its projected rows can
    carry it): seed 0 reaches 1.0 by step 100 (about 12 s of one core); 600 steps leave room for other machines."""
    from recipes.lra.synthetic import Task, train

    result = train("long_short", Task(512), 600, eval_every=50, eval_size=256, target=0.9)
    assert result["best_accuracy"] >= 0.9, result["history"]


# ------------------------------------------------------------------------------------------- user data
def _write_jsonl(folder: Path, rows_by_split: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in rows_by_split.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_text_and_retrieval_files(tmp_path):
    """Bytes + 1 as ids, truncated to --max_length; Retrieval keeps two sequences per example and trains its dual
    tower end to end."""
    text = _write_jsonl(
        tmp_path / "text",
        {s: [{"text": "héllo", "label": 1}, {"text": "a" * 50, "label": 0}] for s in ("train", "dev", "test")},
    )
    splits = lra_data.load_user_data("text", text, max_length=16, num_classes=2)
    ex = splits["dev"]
    assert list(ex.tokens[ex.offsets[0, 0] : ex.offsets[0, 1]]) == [b + 1 for b in "héllo".encode()]
    assert ex.lengths()[0, 1] == 16 and list(ex.labels) == [1, 0]

    reviews = _write_jsonl(
        tmp_path / "reviews",
        {
            s: [{"text": f"review {i}", "label": ["neg", "pos"][i % 2]} for i in range(8)]
            for s in ("train", "dev", "test")
        },
    )
    assert list(lra_data.load_user_data("text", reviews, 16, num_classes=2)["dev"].labels[:4]) == [0, 1, 0, 1]
    result = main(
        [
            "--task",
            "text",
            "--data_dir",
            str(reviews),
            "--output_dir",
            str(tmp_path / "text_run"),
            "--steps",
            "4",
            "--warmup",
            "2",
            "--eval_every",
            "2",
            "--batch_size",
            "4",
            "--max_length",
            "32",
            "--window_size",
            "4",
            "--projection_rank",
            "2",
            "--no_progress",
            "--threads",
            "1",
        ]
    )
    assert 0 <= result["test_accuracy"] <= 1

    pairs = [{"text1": f"doc {i}", "text2": f"other {i % 2}", "label": i % 2} for i in range(8)]
    retrieval = _write_jsonl(tmp_path / "retrieval", {s: pairs for s in ("train", "dev", "test")})
    result = main(
        [
            "--task",
            "retrieval",
            "--data_dir",
            str(retrieval),
            "--output_dir",
            str(tmp_path / "run"),
            "--steps",
            "4",
            "--warmup",
            "2",
            "--eval_every",
            "2",
            "--batch_size",
            "4",
            "--max_length",
            "32",
            "--window_size",
            "4",
            "--projection_rank",
            "2",
            "--no_progress",
            "--threads",
            "1",
        ]
    )
    assert result["model"]["dual"] and result["split_sizes"] == {"train": 8, "dev": 8, "test": 8}


def test_image_dataset_folder(tmp_path):
    """CIFAR-style images saved with save_to_disk: grey levels (ITU-R 601-2) + 1, row by row."""
    import datasets
    from PIL import Image

    rgb = np.random.default_rng(0).integers(0, 256, (2, 4, 4, 3), dtype=np.uint8)
    split = datasets.Dataset.from_dict(
        {"image": [Image.fromarray(a) for a in rgb], "label": [3, 7]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}),
    )
    datasets.DatasetDict({s: split for s in ("train", "dev", "test")}).save_to_disk(tmp_path / "cifar")
    ex = lra_data.load_user_data("image", tmp_path / "cifar", max_length=16, num_classes=10)["test"]
    grey = np.asarray(Image.fromarray(rgb[1]).convert("L"), dtype=np.int64).reshape(-1)
    np.testing.assert_array_equal(ex.tokens[ex.offsets[0, 1] : ex.offsets[0, 2]], grey + 1)
    with pytest.raises(ValueError, match="--max_length"):
        lra_data.load_user_data("image", tmp_path / "cifar", max_length=8, num_classes=10)


def test_user_data_errors(tmp_path):
    with pytest.raises(ValueError, match="--data_dir"):
        lra_data.load_user_data("text", tmp_path / "missing", 16, 2)
    folder = _write_jsonl(tmp_path / "bad", {s: [{"body": "x", "label": 0}] for s in ("train", "dev")})
    with pytest.raises(ValueError, match="test"):
        lra_data.load_user_data("text", folder, 16, 2)
    _write_jsonl(folder, {"test": [{"body": "x", "label": 0}]})
    with pytest.raises(ValueError, match="lacks the column"):
        lra_data.load_user_data("text", folder, 16, 2)
    _write_jsonl(
        folder,
        {
            "train": [{"text": "x", "label": "neg"}, {"text": "y", "label": "pos"}],
            "dev": [{"text": "x", "label": "neutral"}],
            "test": [{"text": "x", "label": "pos"}],
        },
    )
    with pytest.raises(ValueError, match=r"the dev split has the label\(s\) \['neutral'\]"):
        lra_data.load_user_data("text", folder, 16, 2)
    _write_jsonl(folder, {split: [{"text": "x", "label": 2}] for split in ("train", "dev", "test")})
    with pytest.raises(ValueError, match="class ids 0 .. 1"):
        lra_data.load_user_data("text", folder, 16, 2)
