"""The recipes end to end on a tiny converted model and the shipped IMDb-format sample: training lowers the loss,
the artefacts appear, an interrupted run resumes, and bad arguments exit with a clear message."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import EvalPrediction

from ls_hf import LongShortForMaskedLM, LongShortForSequenceClassification
from recipes import demo, finetune_imdb, pretrain_mlm, push_to_hub
from recipes.tiny import IMDB_TEST, IMDB_TRAIN, one_thread, tiny_long_short

FAST = ["--learning_rate", "1e-3", "--per_device_train_batch_size", "16", "--seed", "0", "--disable_tqdm", "True"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_long_short(tmp_path_factory.mktemp("models") / "ls-tiny")


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def logged_losses(output_dir):
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def test_pretrain_mlm_trains_evaluates_and_resumes(model_dir, tmp_path):
    out = tmp_path / "mlm"
    args = ["--model_name_or_path", str(model_dir), "--train_file", str(IMDB_TRAIN), "--output_dir", str(out),
            "--do_train", "--do_eval", "--max_seq_length", "64", "--warmup_steps", "0", "--save_steps", "12", *FAST]
    metrics = pretrain_mlm.main([*args, "--max_steps", "12", "--logging_steps", "1"])
    losses = logged_losses(out)
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert metrics["bits_per_token"] == pytest.approx(metrics["eval_loss"] / math.log(2))
    assert metrics["eval_dataset"] == IMDB_TRAIN.name  # held-out 5% of the training documents
    for name in ("model.safetensors", "config.json", "tokenizer.json", "all_results.json", "checkpoint-12"):
        assert (out / name).exists(), name
    LongShortForMaskedLM.from_pretrained(out)

    # Resume: another seed would change every loss of a fresh run; the resumed run keeps checkpoint-12's history.
    pretrain_mlm.main([*args, "--max_steps", "14", "--logging_steps", "1", "--seed", "1"])
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 14
    assert logged_losses(out)[:12] == losses and len(logged_losses(out)) == 14


def test_finetune_imdb_keeps_best_model_and_resumes(model_dir, tmp_path):
    out = tmp_path / "imdb"
    args = ["--model_name_or_path", str(model_dir), "--train_file", str(IMDB_TRAIN), "--validation_file",
            str(IMDB_TEST), "--output_dir", str(out), "--do_train", "--do_eval", "--logging_steps", "1",
            "--max_train_samples", "160", *FAST]
    metrics = finetune_imdb.main([*args, "--num_train_epochs", "2"])  # 10 steps per epoch
    losses = logged_losses(out)
    assert len(losses) == 20 and sum(losses[-5:]) < sum(losses[:5])
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and metrics["eval_dataset"] == IMDB_TEST.name
    assert metrics["accuracy_computed_by"] == "local"
    state = json.loads((out / "trainer_state.json").read_text())
    best = state["best_model_checkpoint"]
    assert best is not None and state["best_metric"] == max(
        entry["eval_accuracy"] for entry in state["log_history"] if "eval_accuracy" in entry
    )
    model = LongShortForSequenceClassification.from_pretrained(out)
    assert model.config.id2label == {0: "0", 1: "1"}
    assert all((out / name).is_file() for name in ("model.safetensors", "all_results.json", "eval_results.json"))

    finetune_imdb.main([*args, "--num_train_epochs", "3", "--seed", "1"])  # resumes from the epoch-2 checkpoint
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 30
    assert logged_losses(out)[:20] == losses and len(logged_losses(out)) == 30


def test_accuracy_falls_back_to_local_computation():
    compute, source = finetune_imdb.accuracy_metric()  # no network here: evaluate cannot fetch its script
    assert source == "local"
    prediction = EvalPrediction(predictions=torch.tensor([[0.1, 0.9], [2.0, 1.0], [0.0, 1.0]]).numpy(),
                                label_ids=torch.tensor([1, 1, 1]).numpy())
    assert compute(prediction)["accuracy"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    "script, argv, message",
    [
        (finetune_imdb, ["--output_dir", "o", "--do_train"], "--model_name_or_path"),
        (pretrain_mlm, ["--model_name_or_path", "MODEL", "--output_dir", "o", "--train_file", str(IMDB_TRAIN)],
         "nothing to do"),
        (finetune_imdb, ["--model_name_or_path", "MODEL", "--output_dir", "o", "--do_train", "--train_file",
                         "missing.csv"], "--train_file 'missing.csv': no such file"),
        (finetune_imdb, ["--model_name_or_path", "MODEL", "--output_dir", "o", "--do_train", "--train_file",
                         str(IMDB_TRAIN), "--validation_file", str(IMDB_TEST), "--text_column_name", "review"],
         "no column 'review'"),
        (finetune_imdb, ["--model_name_or_path", "./nowhere", "--output_dir", "o", "--do_eval"], "no model folder"),
        (pretrain_mlm, ["--model_name_or_path", "MODEL", "--output_dir", "o", "--do_train"], "no data"),
        (pretrain_mlm, ["--model_name_or_path", "MODEL", "--output_dir", "o", "--do_train", "--train_file",
                        str(IMDB_TRAIN), "--mlm_probability", "1.5"], "--mlm_probability"),
        (pretrain_mlm, ["--model_name_or_path", "MODEL", "--output_dir", "o", "--do_train", "--train_file",
                        str(IMDB_TRAIN), "--max_train_samples", "1", "--max_seq_length", "500"], "fewer than 500"),
        (push_to_hub, ["MODEL", "not a repo id!", "--dry-run", "o"], "REPO_ID"),
        (push_to_hub, ["./nowhere", "user/model", "--dry-run", "o"], "MODEL_DIR"),
    ],
)
def test_bad_arguments_exit_with_a_clear_message(script, argv, message, model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [str(model_dir) if arg == "MODEL" else arg for arg in argv]
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("script", [finetune_imdb, pretrain_mlm, push_to_hub])
def test_help(script, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--help"])
    assert exit_info.value.code == 0 and "usage:" in capsys.readouterr().out


def test_demo_end_to_end(tmp_path, capsys):
    summary = demo.main(["--output-dir", str(tmp_path / "demo")])
    assert "Summary" in capsys.readouterr().out
    assert json.loads((tmp_path / "demo" / "summary.json").read_text()) == summary
    for key in ("converted LongShort masked LM", "masked-LM pretraining output", "IMDb-format classifier (best epoch)",
                "causal LM output", "Hub repo folder (dry run)"):
        assert (Path(summary[key]) / "config.json").is_file(), key
    assert summary["causal LM greedy continuation"].startswith(demo.PROMPT)
    assert (tmp_path / "demo" / "hub" / "README.md").is_file()
