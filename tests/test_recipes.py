"""The recipes end to end on a tiny converted model and the shipped IMDb-format sample: training lowers the loss,
the artefacts appear, an interrupted run resumes, and bad arguments exit with a clear message."""

import csv
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from datasets import load_dataset
from safetensors.torch import load_file
from transformers import EvalPrediction

from ls_hf import LongShortForMaskedLM, LongShortForSequenceClassification, LongShortXLConfig, LongShortXLForCausalLM
from recipes import char_lm, common, demo, finetune_classification, finetune_imdb, pretrain_mlm, push_to_hub, tiny
from recipes.tiny import IMDB_TEST, IMDB_TRAIN, one_thread, sample_texts, tiny_long_short, tiny_roberta

FAST = ["--learning_rate", "1e-3", "--per_device_train_batch_size", "16", "--seed", "0", "--disable_tqdm", "True"]
TINY_CHAR_LM = [
    "--num_hidden_layers",
    "2",
    "--hidden_size",
    "64",
    "--num_attention_heads",
    "4",
    "--window_size",
    "32",
    "--causal_segment_length",
    "16",
    "--max_positions",
    "256",
    "--dropout",
    "0",
    "--max_seq_length",
    "128",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_long_short(tmp_path_factory.mktemp("models") / "ls-tiny")


@pytest.fixture(scope="module")
def roberta_dir(tmp_path_factory):
    return tiny_roberta(tmp_path_factory.mktemp("models") / "roberta-tiny")


@pytest.fixture(scope="module")
def xl_dir(tmp_path_factory):
    """A tiny byte-level LongShortXLForCausalLM folder (the official character-level model)."""
    folder = tmp_path_factory.mktemp("models") / "xl-tiny"
    LongShortXLForCausalLM(
        LongShortXLConfig(
            num_hidden_layers=1,
            hidden_size=16,
            num_attention_heads=2,
            intermediate_size=32,
            window_size=16,
            memory_length=16,
        )
    ).save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def logged_losses(output_dir):
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def files_of(folder):
    """Every file under ``folder`` with its modification time and a hash of its bytes: equal if nothing was written."""
    return {
        path.relative_to(folder): (path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
        for path in folder.rglob("*")
        if path.is_file()
    }


def test_pretrain_mlm_trains_evaluates_and_resumes(model_dir, tmp_path):
    out = tmp_path / "mlm"
    args = [
        "--model_name_or_path",
        str(model_dir),
        "--train_file",
        str(IMDB_TRAIN),
        "--output_dir",
        str(out),
        "--do_train",
        "--do_eval",
        "--max_seq_length",
        "64",
        "--warmup_steps",
        "0",
        "--save_steps",
        "12",
        *FAST,
    ]
    metrics = pretrain_mlm.main([*args, "--max_steps", "12", "--logging_steps", "1"])
    losses = logged_losses(out)
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert metrics["bits_per_token"] == pytest.approx(metrics["eval_loss"] / math.log(2))
    assert metrics["eval_dataset"] == f"{IMDB_TRAIN.name} (5 % held out)"  # of the training documents
    for name in ("model.safetensors", "config.json", "tokenizer.json", "all_results.json", "checkpoint-12"):
        assert (out / name).exists(), name
    LongShortForMaskedLM.from_pretrained(out)

    # Resume: another seed would change every loss of a fresh run; the resumed run keeps checkpoint-12's history.
    pretrain_mlm.main([*args, "--max_steps", "14", "--logging_steps", "1", "--seed", "1"])
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 14
    assert logged_losses(out)[:12] == losses and len(logged_losses(out)) == 14


def test_finetune_imdb_selects_on_held_out_data_reports_test_and_resumes(model_dir, tmp_path, capsys, caplog):
    out = tmp_path / "imdb"
    args = [
        "--model_name_or_path",
        str(model_dir),
        "--train_file",
        str(IMDB_TRAIN),
        "--test_file",
        str(IMDB_TEST),
        "--output_dir",
        str(out),
        "--do_train",
        "--do_eval",
        "--do_predict",
        "--logging_steps",
        "1",
        "--max_train_samples",
        "160",
        *FAST,
    ]
    metrics = finetune_imdb.main([*args, "--num_train_epochs", "4"])  # 10 steps per epoch
    assert not [record for record in caplog.records if "evaluate" in record.getMessage()]  # accuracy computed here
    losses = logged_losses(out)
    assert len(losses) == 40 and sum(losses[-10:]) < sum(losses[:10])
    # The best epoch is chosen on reviews held out of the training file; the test file only scores the kept model.
    assert metrics["eval_dataset"] == f"{IMDB_TRAIN.name} (5 % held out)" and metrics["test_dataset"] == IMDB_TEST.name
    state = json.loads((out / "trainer_state.json").read_text())
    validation = [entry["eval_accuracy"] for entry in state["log_history"] if "eval_accuracy" in entry]
    assert len(validation) == 4 and max(validation) == metrics["eval_accuracy"]
    best_epoch = next(
        entry["epoch"]
        for entry in state["log_history"]
        if entry.get("eval_accuracy_loss_tiebreak") == state["best_metric"]
    )
    assert f"Kept the best model: {state['best_model_checkpoint']} (epoch {best_epoch}" in capsys.readouterr().err
    kept, best = (load_file(Path(folder) / "model.safetensors") for folder in (out, state["best_model_checkpoint"]))
    assert kept.keys() == best.keys() and all(torch.equal(kept[name], best[name]) for name in kept)
    assert 0.0 <= metrics["test_accuracy"] <= 1.0
    assert json.loads((out / "test_results.json").read_text())["test_accuracy"] == metrics["test_accuracy"]
    model = LongShortForSequenceClassification.from_pretrained(out)
    assert model.config.id2label == {0: "neg", 1: "pos"} and model.config.label2id == {"neg": 0, "pos": 1}
    assert all((out / name).is_file() for name in ("model.safetensors", "all_results.json", "eval_results.json"))

    # The same command again: the finished run is reported, not trained on, and nothing in its folder changes.
    written = files_of(out)
    capsys.readouterr()
    assert finetune_imdb.main([*args, "--num_train_epochs", "4"]) == json.loads((out / "all_results.json").read_text())
    assert f"{out} holds a finished run (step 40, epoch 4 of --num_train_epochs 4)" in capsys.readouterr().out
    assert files_of(out) == written

    finetune_imdb.main([*args, "--num_train_epochs", "5", "--seed", "1"])  # resumes from the epoch-4 checkpoint
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 50
    assert logged_losses(out)[:40] == losses and len(logged_losses(out)) == 50


def test_finetune_classification_any_columns_pairs_string_labels_and_truncation_count(
    model_dir, tmp_path, capsys, caplog
):
    """JSON Lines with renamed columns, a text pair and string labels: trains, selects the best epoch on the validation
    file, scores the test file once, and reports how many documents --max_seq_length cut."""
    rows = {
        split: list(load_dataset("csv", data_files=str(path))["train"])
        for split, path in (("train", IMDB_TRAIN), ("test", IMDB_TEST))
    }
    files = {}
    for split, examples in (("train", rows["train"][:96]), ("dev", rows["train"][96:128]), ("test", rows["test"])):
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text(
            "".join(
                json.dumps(
                    {
                        "review": row["text"],
                        "headline": " ".join(row["text"].split()[:4]),
                        "sentiment": ["negative", "positive"][row["label"]],
                    }
                )
                + "\n"
                for row in examples
            )
        )
    out = tmp_path / "classifier"
    metrics = finetune_classification.main(
        [
            "--model_name_or_path",
            str(model_dir),
            "--train_file",
            str(files["train"]),
            "--validation_file",
            str(files["dev"]),
            "--test_file",
            str(files["test"]),
            "--text_column_name",
            "review",
            "--text_pair_column_name",
            "headline",
            "--label_column_name",
            "sentiment",
            "--max_seq_length",
            "48",
            "--output_dir",
            str(out),
            "--do_train",
            "--do_eval",
            "--do_predict",
            "--num_train_epochs",
            "2",
            *FAST,
        ]
    )
    lengths = [len(text.split()) for text in (json.loads(line)["review"] for line in files["train"].open())]
    assert metrics["max_seq_length"] == 48 and 0 < metrics["truncated_train"] <= 96
    assert metrics["truncated_train"] >= sum(n > 48 for n in lengths)  # a word is one token or more
    warned = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert (
        f"train: {metrics['truncated_train']} of 96 documents are longer than 48 tokens and were truncated"
        " (--max_seq_length)." in warned
    )
    assert {"truncated_validation", "truncated_test", "test_accuracy", "eval_accuracy"} <= metrics.keys()
    assert metrics["eval_dataset"] == "dev.jsonl" and metrics["test_dataset"] == "test.jsonl"
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["best_metric"] == metrics["eval_accuracy_loss_tiebreak"]
    model = LongShortForSequenceClassification.from_pretrained(out)
    assert model.config.id2label == {0: "negative", 1: "positive"}

    with pytest.raises(SystemExit) as exit_info:
        finetune_classification.main(
            [
                "--model_name_or_path",
                str(model_dir),
                "--train_file",
                str(files["train"]),
                "--text_column_name",
                "review",
                "--text_pair_column_name",
                "title",
                "--label_column_name",
                "sentiment",
                "--output_dir",
                str(tmp_path / "o"),
                "--do_train",
            ]
        )
    assert exit_info.value.code == 2 and not (tmp_path / "o").exists()
    assert "no column 'title'" in capsys.readouterr().err


def test_imdb_dataset_name_holds_out_validation_reviews_and_keeps_test_apart(tmp_path):
    """stanfordnlp/imdb has train, test and unsupervised splits and no validation split. A local folder laid out
    the same way (``data/<split>-00000-of-00001.csv``, the sample as stand-ins) goes through --dataset_name and a
    real ``load_dataset``: the recipe holds out --validation_split_percentage of train, the same reviews in every
    run, and reads test only to score."""
    folder = tmp_path / "imdb"
    (folder / "data").mkdir(parents=True)
    for split, source in (("train", IMDB_TRAIN), ("test", IMDB_TEST), ("unsupervised", IMDB_TEST)):
        shutil.copy(source, folder / "data" / f"{split}-00000-of-00001.csv")
    assert set(load_dataset(str(folder))) == {"train", "test", "unsupervised"}
    imdb = load_dataset("csv", data_files={"train": str(IMDB_TRAIN), "test": str(IMDB_TEST)})
    (data_args,) = common.parse_args((finetune_imdb.ImdbDataArguments,), ["--dataset_name", str(folder)])
    columns = ["text", "label"]
    data = common.load_data(data_args, columns, need_eval=True, need_test=True)
    assert (len(data["train"]), len(data["validation"]), len(data["test"])) == (304, 16, 80)
    assert not set(data["validation"]["text"]) & set(data["train"]["text"])
    assert set(data["validation"]["text"]) <= set(imdb["train"]["text"])
    assert data["test"]["text"] == imdb["test"]["text"]
    again = common.load_data(data_args, columns, need_eval=True)
    assert again["validation"]["text"] == data["validation"]["text"] and "test" not in again
    assert set(common.load_data(data_args, columns, need_eval=False)) == {"train"}
    assert data_args.data_name("validation") == f"{folder} (5 % held out)"


@pytest.mark.parametrize(("extra", "selects"), [([], True), (["--eval_strategy", "no"], False)])
def test_finetune_imdb_train_only(model_dir, tmp_path, extra, selects):
    """Without --do_eval the run still keeps its best epoch on held-out reviews, or with --eval_strategy no its last."""
    out = tmp_path / "imdb"
    metrics = finetune_imdb.main(
        [
            "--model_name_or_path",
            str(model_dir),
            "--train_file",
            str(IMDB_TRAIN),
            "--output_dir",
            str(out),
            "--do_train",
            "--max_steps",
            "2",
            *extra,
            *FAST,
        ]
    )
    assert metrics["train_loss"] > 0 and (out / "model.safetensors").is_file()
    state = json.loads((out / "trainer_state.json").read_text())
    assert (state["best_model_checkpoint"] is not None) == selects
    assert metrics.get("eval_dataset") == (f"{IMDB_TRAIN.name} (5 % held out)" if selects else None)


def test_max_tokens_is_the_models_max_input_length():
    config, tokenizer = SimpleNamespace(max_input_length=100), SimpleNamespace(model_max_length=512)
    assert [common.max_tokens(config, tokenizer, n) for n in (None, 64, 4096)] == [100, 64, 100]
    assert common.max_tokens(config, SimpleNamespace(model_max_length=50), None) == 50


def test_model_card_reports_the_test_metrics(tmp_path):
    results = {
        "eval_accuracy": 0.9,
        "eval_loss": 0.3,
        "eval_dataset": "imdb_train.csv",
        "test_accuracy": 0.8,
        "test_loss": 0.4,
        "test_dataset": "imdb_test.csv",
    }
    (tmp_path / "all_results.json").write_text(json.dumps(results))
    assert push_to_hub.measured_metrics(tmp_path) == ({"eval_accuracy": 0.8, "eval_loss": 0.4}, "imdb_test.csv", None)
    (tmp_path / "all_results.json").write_text(json.dumps({k: v for k, v in results.items() if "test" not in k}))
    assert push_to_hub.measured_metrics(tmp_path) == ({"eval_accuracy": 0.9, "eval_loss": 0.3}, "imdb_train.csv", None)
    # char_lm --model_type long_short_xl: streaming and block-by-block bits per character, and the streaming context
    streaming = {
        "test_bpc": 1.5,
        "test_block_bpc": 1.7,
        "test_loss": 1.04,
        "test_dataset": "corpus.txt",
        "test_memory_length": 4096,
        "eval_bpc": 1.6,
        "eval_dataset": "corpus.txt",
    }
    (tmp_path / "all_results.json").write_text(json.dumps(streaming))
    assert push_to_hub.measured_metrics(tmp_path) == (
        {"eval_bpc": 1.5, "eval_block_bpc": 1.7, "eval_loss": 1.04},
        "corpus.txt",
        4096,
    )


def test_classification_metrics_rank_equal_accuracies_by_the_loss():
    """accuracy_loss_tiebreak keeps the accuracy's order and puts the lower loss first among equal accuracies."""
    from recipes.finetune_classification import classification_metrics

    labels = np.array([1, 1, 1, 0])
    sure, unsure = ([[0.0, s], [0.0, s], [0.0, s], [s, 0.0]] for s in (4.0, 0.5))  # both 4/4 right
    wrong = [[0.0, 9.0], [0.0, 9.0], [9.0, 0.0], [9.0, 0.0]]  # 3/4 right, confidently
    scores = [
        classification_metrics(EvalPrediction(predictions=np.array(logits, dtype=np.float32), label_ids=labels))
        for logits in (sure, unsure, wrong)
    ]
    assert [score["accuracy"] for score in scores] == [1.0, 1.0, 0.75]
    ranks = [score["accuracy_loss_tiebreak"] for score in scores]
    assert ranks[0] > ranks[1] > ranks[2] and all(0 < a - r < 1 / 4 for a, r in zip((1.0, 1.0, 0.75), ranks))


def test_best_epoch_among_equal_accuracies_has_the_lowest_loss(model_dir, tmp_path, capsys):
    """Mostly positive training reviews: the model predicts positive for every validation review from the first epoch
    on (the same accuracy, 15/16), more confidently each epoch; the kept epoch is the one with the lowest loss."""
    rows = list(csv.DictReader(IMDB_TRAIN.open()))
    positive, negative = ([row for row in rows if row["label"] == label] for label in ("1", "0"))
    for name, examples in (("train", positive[:54] + negative[:10]), ("dev", positive[100:115] + negative[100:101])):
        with (tmp_path / f"{name}.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, ["text", "label"])
            writer.writeheader()
            writer.writerows(examples)
    out = tmp_path / "imdb"
    finetune_imdb.main(
        [
            "--model_name_or_path",
            str(model_dir),
            "--train_file",
            str(tmp_path / "train.csv"),
            "--validation_file",
            str(tmp_path / "dev.csv"),
            "--output_dir",
            str(out),
            "--do_train",
            "--num_train_epochs",
            "3",
            "--max_seq_length",
            "32",
            *FAST,
        ]
    )
    state = json.loads((out / "trainer_state.json").read_text())
    evaluations = [entry for entry in state["log_history"] if "eval_loss" in entry]
    assert len({entry["eval_accuracy"] for entry in evaluations}) == 1  # a tie: the case this test is about
    lowest = min(evaluations, key=lambda entry: entry["eval_loss"])
    assert state["best_model_checkpoint"] == str(out / f"checkpoint-{lowest['step']}")
    assert f"eval_loss = {lowest['eval_loss']:.4g}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "script, argv, message",
    [
        (finetune_imdb, ["--output_dir", "o", "--do_train"], "--model_name_or_path"),
        (
            pretrain_mlm,
            ["--model_name_or_path", "MODEL", "--output_dir", "o", "--train_file", str(IMDB_TRAIN)],
            "nothing to do",
        ),
        (
            finetune_imdb,
            ["--model_name_or_path", "MODEL", "--output_dir", "o", "--do_train", "--train_file", "missing.csv"],
            "--train_file 'missing.csv': no such file",
        ),
        (
            finetune_imdb,
            [
                "--model_name_or_path",
                "MODEL",
                "--output_dir",
                "o",
                "--do_train",
                "--train_file",
                str(IMDB_TRAIN),
                "--validation_file",
                str(IMDB_TEST),
                "--text_column_name",
                "review",
            ],
            "no column 'review'",
        ),
        (finetune_imdb, ["--model_name_or_path", "./nowhere", "--output_dir", "o", "--do_eval"], "no model folder"),
        (
            finetune_imdb,
            ["--model_name_or_path", "MODEL", "--output_dir", "o", "--do_predict", "--train_file", str(IMDB_TRAIN)],
            "--do_predict needs test data: pass --test_file",
        ),
        (
            finetune_imdb,
            [
                "--model_name_or_path",
                "MODEL",
                "--output_dir",
                "o",
                "--do_train",
                "--train_file",
                str(IMDB_TRAIN),
                "--validation_split_percentage",
                "0",
            ],
            "--validation_split_percentage",
        ),
        (pretrain_mlm, ["--model_name_or_path", "MODEL", "--output_dir", "o", "--do_train"], "no data"),
        (
            pretrain_mlm,
            [
                "--model_name_or_path",
                "MODEL",
                "--output_dir",
                "o",
                "--do_train",
                "--train_file",
                str(IMDB_TRAIN),
                "--mlm_probability",
                "1.5",
            ],
            "--mlm_probability",
        ),
        (
            pretrain_mlm,
            [
                "--model_name_or_path",
                "MODEL",
                "--output_dir",
                "o",
                "--do_train",
                "--train_file",
                str(IMDB_TRAIN),
                "--max_train_samples",
                "1",
                "--max_seq_length",
                "500",
            ],
            "fewer than 500",
        ),
        (
            pretrain_mlm,
            [
                "--model_name_or_path",
                "MODEL",
                "--output_dir",
                "o",
                "--do_train",
                "--do_predict",
                "--train_file",
                str(IMDB_TRAIN),
            ],
            "--do_predict is not an action of this recipe",
        ),
        (
            finetune_imdb,
            ["--model_name_or_path", "ROBERTA", "--output_dir", "o", "--do_train", "--train_file", str(IMDB_TRAIN)],
            "holds a 'roberta' model, not LongShort",
        ),
        (
            pretrain_mlm,
            ["--model_name_or_path", "ROBERTA", "--output_dir", "o", "--do_train", "--train_file", str(IMDB_TRAIN)],
            "convert a RoBERTa checkpoint with ls-convert-roberta",
        ),
        (
            finetune_imdb,
            ["--model_name_or_path", "XL", "--output_dir", "o", "--do_train", "--train_file", str(IMDB_TRAIN)],
            "only `recipes.char_lm --model_type long_short_xl` continues training",
        ),
        (
            char_lm,
            ["--train_file", str(IMDB_TRAIN), "--output_dir", "o", "--do_train", "--model_name_or_path", "XL"],
            "only `recipes.char_lm --model_type long_short_xl` continues training",
        ),
        (
            finetune_imdb,
            [
                "--model_name_or_path",
                "MODEL",
                "--output_dir",
                "o",
                "--do_train",
                "--train_file",
                "one_label.csv",
                "--eval_strategy",
                "no",
            ],
            "a classifier needs at least two",
        ),
        (char_lm, ["--output_dir", "o", "--do_train"], "exactly one of --train_file"),
        (
            char_lm,
            ["--train_file", str(IMDB_TRAIN), "--output_dir", "o", "--do_train", "--model_name_or_path", "MODEL"],
            "is not a byte-level LongShort decoder",
        ),
        (
            char_lm,
            ["--train_file", str(IMDB_TRAIN), "--output_dir", "o", "--do_train", "--model_name_or_path", "./nowhere"],
            "no model there",
        ),
        (
            char_lm,
            ["--train_file", "one_label.csv", "--output_dir", "o", "--do_train", *TINY_CHAR_LM],
            "fewer than one block",
        ),
        (
            char_lm,
            [
                "--train_file",
                str(IMDB_TRAIN),
                "--output_dir",
                "o",
                "--do_train",
                *TINY_CHAR_LM,
                "--max_seq_length",
                "1024",
            ],
            "exceeds the 256 positions",
        ),
        (
            finetune_imdb,
            ["--model_name_or_path", "MODEL", "--output_dir", "o", "--do_train", "--train_file", "empty.csv"],
            "--train_file 'empty.csv' is empty",
        ),
        (
            finetune_imdb,
            ["--model_name_or_path", "MODEL", "--output_dir", "o", "--do_train", "--train_file", "header.csv"],
            "a CSV needs a header row and at least one example row",
        ),
        (
            pretrain_mlm,
            ["--model_name_or_path", "MODEL", "--output_dir", "o", "--do_train", "--train_file", "empty.txt"],
            "--train_file 'empty.txt' is empty",
        ),
        (
            pretrain_mlm,
            [
                "--model_name_or_path",
                "MODEL",
                "--output_dir",
                "o",
                "--do_train",
                "--do_eval",
                "--train_file",
                "one_line.txt",
            ],
            "holding some out for evaluation needs at least 2",
        ),
        (
            char_lm,
            ["--train_file", "two.zip", "--output_dir", "o", "--do_train", *TINY_CHAR_LM],
            "is a zip archive of 2 files",
        ),
        (
            char_lm,
            [
                "--train_file",
                str(IMDB_TRAIN),
                "--output_dir",
                "o",
                "--do_train",
                *TINY_CHAR_LM,
                "--per_device_train_batch_size",
                "10000000",
            ],
            "a training step needs about",
        ),
        (
            finetune_imdb,
            [
                "--model_name_or_path",
                "ls-tiny-modle",
                "--output_dir",
                "o",
                "--do_train",
                "--train_file",
                str(IMDB_TRAIN),
            ],
            "'ls-tiny-modle': no such local folder; did you mean 'ls-tiny-model'?",
        ),
        (
            finetune_imdb,
            ["--model_name_or_path", "MODEL", "--output_dir", "o", "--do_train", "--dataset_name", "./imdb_folder"],
            "--dataset_name './imdb_folder': no such local folder",
        ),
        (
            finetune_imdb,
            [
                "--model_name_or_path",
                "MODEL",
                "--output_dir",
                "o",
                "--do_train",
                "--do_predict",
                "--train_file",
                "sentiment.csv",
                "--test_file",
                str(IMDB_TEST),
            ],
            "--train_file 'sentiment.csv' has no column 'label' (its columns: text, sentiment)",
        ),
        (
            finetune_imdb,
            [
                "--model_name_or_path",
                "MODEL",
                "--output_dir",
                "o",
                "--do_train",
                "--do_predict",
                "--train_file",
                str(IMDB_TRAIN),
                "--test_file",
                "with_id.csv",
            ],
            "the data files have different columns (--train_file: text, label; --test_file: text, label, id)",
        ),
        (
            pretrain_mlm,
            ["--model_name_or_path", "MODEL", "--output_dir", "o", "--do_train", "--train_file", "latin1.txt"],
            (
                "--train_file 'latin1.txt' is not UTF-8 text (byte 3, b'\\xe9': invalid continuation byte); the "
                "recipes read UTF-8: re-encode it, e.g. from Latin-1: iconv -f latin1 -t utf-8 latin1.txt > "
                "latin1.utf8.txt"
            ),
        ),
        (
            finetune_classification,
            [
                "--model_name_or_path",
                "MODEL",
                "--output_dir",
                "o",
                "--do_train",
                "--train_file",
                str(IMDB_TRAIN),
                "--class_names",
                "negative",
            ],
            "--class_names names the labels 0 to 0 (negative), but the training data has label 1",
        ),
        (push_to_hub, ["MODEL", "not a repo id!", "--dry-run", "o"], "REPO_ID"),
        (push_to_hub, ["./nowhere", "user/model", "--dry-run", "o"], "MODEL_DIR"),
    ],
)
def test_bad_arguments_exit_with_a_clear_message(
    script, argv, message, model_dir, roberta_dir, xl_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "one_label.csv").write_text("text,label\n" + "".join(f"review {i},1\n" for i in range(8)))
    (tmp_path / "header.csv").write_text("text,label\n")
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "one_line.txt").write_text("a single short document\n")
    (tmp_path / "sentiment.csv").write_text("text,sentiment\n" + "".join(f"review {i},{i % 2}\n" for i in range(8)))
    (tmp_path / "with_id.csv").write_text("text,label,id\n" + "".join(f"review {i},{i % 2},{i}\n" for i in range(8)))
    (tmp_path / "latin1.txt").write_bytes("café au lait\n".encode("latin-1") * 20)
    (tmp_path / "ls-tiny-model").mkdir()
    shutil.copy(model_dir / "config.json", tmp_path / "ls-tiny-model")
    with zipfile.ZipFile(tmp_path / "two.zip", "w") as archive:
        archive.writestr("a.txt", "a" * 1000)
        archive.writestr("b.txt", "b" * 1000)
    argv = [{"MODEL": str(model_dir), "ROBERTA": str(roberta_dir), "XL": str(xl_dir)}.get(arg, arg) for arg in argv]
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_hub_dataset_offline_is_a_clear_error(model_dir, tmp_path):
    """finetune_imdb without local files and without the Hub (offline): an error naming the local-file options, not a
    traceback, and nothing written."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes.finetune_imdb",
            "--model_name_or_path",
            str(model_dir),
            "--output_dir",
            str(tmp_path / "o"),
            "--do_train",
        ],
        cwd=Path(__file__).parents[1],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--dataset_name 'stanfordnlp/imdb' could not be loaded" in done.stderr and "--train_file" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("script", [finetune_classification, finetune_imdb, pretrain_mlm, char_lm, push_to_hub, tiny])
def test_help(script, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--help"])
    assert exit_info.value.code == 0 and "usage:" in capsys.readouterr().out


def test_demo_end_to_end(tmp_path, capsys):
    summary = demo.main(["--output-dir", str(tmp_path / "demo")])
    assert "Summary" in capsys.readouterr().out
    assert json.loads((tmp_path / "demo" / "summary.json").read_text()) == summary
    for key in (
        "converted LongShort masked LM",
        "masked-LM pretraining output",
        "IMDb-format classifier (best validation epoch)",
        "causal LM output",
        "Hub repo folder (dry run)",
    ):
        assert (Path(summary[key]) / "config.json").is_file(), key
    assert summary["causal LM greedy continuation"].startswith(demo.PROMPT)
    assert 0 <= float(summary["IMDb-format test accuracy of that classifier"]) <= 1
    assert (tmp_path / "demo" / "hub" / "README.md").is_file()


@pytest.mark.parametrize("scheduler", ["polynomial", "cosine", "linear"])
def test_pretrain_mlm_schedulers_and_warmup_ratio(scheduler, tmp_path):
    """Longformer's cubic decay is the default; another --lr_scheduler_type gets no stray power argument, and
    --warmup_steps below 1 is a fraction of the steps (Transformers 5 has no warmup_ratio)."""
    from transformers import get_scheduler

    _, _, args = common.parse_args(
        (common.ModelArguments, pretrain_mlm.MlmDataArguments, pretrain_mlm.MlmTrainingArguments),
        [
            "--model_name_or_path",
            "some/model",
            "--output_dir",
            str(tmp_path),
            "--do_train",
            "--train_file",
            str(IMDB_TRAIN),
            "--lr_scheduler_type",
            scheduler,
            "--warmup_steps",
            "0.1",
        ],
    )
    assert (args.lr_scheduler_kwargs or {}) == ({"power": 3.0} if scheduler == "polynomial" else {})
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = get_scheduler(
        scheduler,
        optimizer,
        num_warmup_steps=args.get_warmup_steps(100),
        num_training_steps=100,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs,
    )
    rates = []
    for _ in range(100):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert args.get_warmup_steps(100) == 10 and max(rates) == pytest.approx(1.0) and rates.index(max(rates)) == 10


def test_training_again_drops_the_earlier_runs_metrics(model_dir, tmp_path):
    """A new training run in the same --output_dir removes the old eval/test results, which described the old
    weights (Trainer.save_metrics merges into all_results.json, and model cards read it)."""
    out = tmp_path / "ft"
    args = [
        "--model_name_or_path",
        str(model_dir),
        "--train_file",
        str(IMDB_TRAIN),
        "--test_file",
        str(IMDB_TEST),
        "--output_dir",
        str(out),
        "--max_seq_length",
        "32",
        "--eval_strategy",
        "no",
        "--save_strategy",
        "no",
        *FAST,
    ]
    finetune_imdb.main([*args, "--do_train", "--do_predict", "--max_steps", "1"])
    assert "test_accuracy" in json.loads((out / "all_results.json").read_text())
    finetune_imdb.main([*args, "--do_train", "--max_steps", "2"])
    results = json.loads((out / "all_results.json").read_text())
    assert "train_loss" in results and not any(key.startswith("test_") for key in results)
    assert not (out / "test_results.json").exists()


def test_char_lm_splits_like_enwik8(tmp_path):
    """Without validation/test files the text is cut in order: 90 % train, 5 % validation, the last 5 % test."""
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(range(256)) * 4)
    args = char_lm.CharLmArguments(train_file=str(path))
    splits = char_lm.read_splits(args)
    assert [len(splits[s]) for s in ("train", "validation", "test")] == [922, 51, 51]
    assert splits["train"] + splits["validation"] + splits["test"] == path.read_bytes()
    (tmp_path / "valid.txt").write_bytes(b"held out")
    splits = char_lm.read_splits(
        char_lm.CharLmArguments(train_file=str(path), validation_file=str(tmp_path / "valid.txt"))
    )
    assert splits["validation"] == b"held out" and splits["train"] + splits["test"] == path.read_bytes()
    path.write_bytes(bytes(range(256)) * 4 + b"abcdef")  # 1030 bytes: every byte lands in one split
    splits = char_lm.read_splits(char_lm.CharLmArguments(train_file=str(path)))
    assert splits["train"] + splits["validation"] + splits["test"] == path.read_bytes()
    # Only the splits a run uses must hold a block: 5 % of 1030 bytes is below 128, and training alone still runs.
    metrics = char_lm.main(
        [
            "--train_file",
            str(path),
            "--output_dir",
            str(tmp_path / "o"),
            "--do_train",
            *TINY_CHAR_LM,
            "--max_steps",
            "1",
            "--save_strategy",
            "no",
            "--disable_tqdm",
            "True",
        ]
    )
    assert "train_loss" in metrics


def test_char_lm_trains_reports_bpc_generates_and_continues(tmp_path):
    """A tiny byte-level model learns the sample text; eval/test BPC are its losses over ln 2; the folder generates
    through the Auto classes; a second phase continues from it with longer blocks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, ByT5Tokenizer, pipeline

    text = tmp_path / "reviews.txt"
    text.write_text("\n\n".join(sample_texts()))
    out = tmp_path / "chars"
    args = [
        "--train_file",
        str(text),
        "--output_dir",
        str(out),
        "--do_train",
        "--do_eval",
        "--do_predict",
        *TINY_CHAR_LM,
        "--max_steps",
        "60",
        "--warmup_steps",
        "5",
        "--learning_rate",
        "3e-3",
        "--per_device_train_batch_size",
        "8",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--disable_tqdm",
        "True",
        "--seed",
        "0",
    ]
    metrics = char_lm.main(args)
    losses = logged_losses(out)
    assert len(losses) == 60 and sum(losses[-10:]) < 0.7 * sum(losses[:10])
    for split in ("eval", "test"):
        assert metrics[f"{split}_bpc"] == pytest.approx(metrics[f"{split}_loss"] / math.log(2))
        assert metrics[f"{split}_bpc"] < 8 and metrics[f"{split}_dataset"] == "reviews.txt"

    # The saved tokenizer has ByT5's ids and adds nothing to a prompt, so the text-generation pipeline continues it.
    tokenizer, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    text, byt5 = "This movie, héllo 日本 </s>", ByT5Tokenizer()
    ids = tokenizer(text).input_ids
    assert ids == byt5(text, add_special_tokens=False).input_ids and tokenizer.decode(ids) == byt5.decode(ids)
    assert len(tokenizer) == len(byt5)
    prompt = tokenizer("This movie ", return_tensors="pt").input_ids
    generated = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert generated.shape == (1, prompt.shape[1] + 12)
    generate = pipeline("text-generation", model=str(out))
    assert generate.preprocess("This movie ")["input_ids"].tolist() == prompt.tolist()
    assert generate("This movie ", max_new_tokens=12, do_sample=False)[0]["generated_text"] == tokenizer.decode(
        generated[0]
    )

    phase2 = char_lm.main(
        [
            *args[: args.index("--max_steps")],
            "--model_name_or_path",
            str(out),
            "--max_seq_length",
            "256",
            "--output_dir",
            str(tmp_path / "phase2"),
            "--max_steps",
            "2",
            "--save_strategy",
            "no",
            "--disable_tqdm",
            "True",
        ]
    )
    assert phase2["eval_bpc"] < 8


def test_char_lm_reads_a_zipped_text_like_the_raw_file(tmp_path):
    """enwik8.zip / text8.zip as downloaded: a zip archive of one file reads as that file's bytes."""
    raw = tmp_path / "enwik8"
    raw.write_bytes(bytes(range(256)) * 4)
    with zipfile.ZipFile(tmp_path / "enwik8.zip", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.write(raw, "enwik8")
    assert char_lm.read_splits(char_lm.CharLmArguments(train_file=str(tmp_path / "enwik8.zip"))) == char_lm.read_splits(
        char_lm.CharLmArguments(train_file=str(raw))
    )


def test_resume_is_said_and_a_checkpoint_of_another_shape_is_refused(tmp_path, capsys, caplog):
    """Rerunning into an output folder resumes visibly (without the tied-weights missing-keys warning); a model of
    other settings there is a clear error before any work: another shape (not a wall of size mismatches), or the same
    shapes with another window (which would mix two models silently)."""
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(sample_texts()))
    out = tmp_path / "chars"
    args = [
        "--train_file",
        str(text),
        "--output_dir",
        str(out),
        "--do_train",
        *TINY_CHAR_LM,
        "--save_steps",
        "2",
        "--disable_tqdm",
        "True",
    ]
    char_lm.main([*args, "--max_steps", "2"])
    capsys.readouterr()
    char_lm.main([*args, "--max_steps", "3"])
    err = capsys.readouterr().err
    assert f"Resuming training from {out / 'checkpoint-2'}" in err
    assert "missing keys" not in caplog.text  # lm_head.decoder is tied to the word embeddings, not saved
    for changed, message in (
        (["--hidden_size", "32"], "'hidden_size': (64, 32)"),
        (["--window_size", "16"], "'window_size': (32, 16)"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            char_lm.main([*args, "--max_steps", "4", *changed])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "holds a model with other settings" in err and message in err
        assert "use a new --output_dir" in err and not (out / "checkpoint-4").exists()


@pytest.mark.parametrize("script", [pretrain_mlm, char_lm])
def test_a_finished_run_rerun_is_reported_and_left_as_it_is(script, model_dir, tmp_path, capsys):
    """A run that reached --max_steps, run again unchanged: its results are printed and returned, and nothing in its
    folder is written (no step past the limit, no new checkpoint, model and results untouched); a larger --max_steps
    trains on. (finetune_imdb's epochs: test_finetune_imdb_selects_on_held_out_data_reports_test_and_resumes.)"""
    out = tmp_path / "run"
    if script is pretrain_mlm:
        data = ["--model_name_or_path", str(model_dir), "--train_file", str(IMDB_TRAIN), "--max_seq_length", "64"]
    else:
        (tmp_path / "text.txt").write_text("\n\n".join(sample_texts()))
        data = ["--train_file", str(tmp_path / "text.txt"), *TINY_CHAR_LM]
    args = [*data, "--output_dir", str(out), "--do_train", "--do_eval", "--warmup_steps", "0", *FAST]
    first = script.main([*args, "--max_steps", "2"])
    written = files_of(out)
    capsys.readouterr()
    again = script.main([*args, "--max_steps", "2"])
    printed = capsys.readouterr().out
    assert again == first == json.loads((out / "all_results.json").read_text())
    assert f"{out} holds a finished run (step 2 of --max_steps 2): " in printed and "Nothing was trained" in printed
    assert files_of(out) == written and not (out / "checkpoint-3").exists()

    script.main([*args, "--max_steps", "3"])
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3


def test_a_damaged_checkpoint_is_named_with_the_way_back(model_dir, tmp_path, capsys):
    """A checkpoint file cut short or overwritten stops the rerun before any work, naming the file, the error and the
    way back: delete that checkpoint to resume from the one before it (done here), or a new --output_dir."""
    out = tmp_path / "mlm"
    args = [
        "--model_name_or_path",
        str(model_dir),
        "--train_file",
        str(IMDB_TRAIN),
        "--output_dir",
        str(out),
        "--do_train",
        "--max_seq_length",
        "64",
        "--save_steps",
        "1",
        *FAST,
    ]
    pretrain_mlm.main([*args, "--max_steps", "2"])
    last, before = out / "checkpoint-2", out / "checkpoint-1"
    optimizer = (last / "optimizer.pt").read_bytes()
    for name, damage, error in (
        ("optimizer.pt", optimizer[: len(optimizer) // 2], "File is not a zip file"),
        ("model.safetensors", b"\xff" * 64, "header too large"),
    ):
        (last / name).write_bytes(damage)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            pretrain_mlm.main([*args, "--max_steps", "3"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and f"the checkpoint {last} cannot be read: {name}: " in err and error in err
        assert f"To resume from the checkpoint before it, {before}, delete {last}; to start afresh, use a new" in err
        assert not (out / "checkpoint-3").exists()
        (last / "optimizer.pt").write_bytes(optimizer)

    shutil.rmtree(last)
    pretrain_mlm.main([*args, "--max_steps", "3"])
    assert f"Resuming training from {before}" in capsys.readouterr().err
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3


def test_a_warmup_as_long_as_the_run_is_warned(model_dir, tmp_path, caplog):
    """pretrain_mlm's default 500 warmup steps in a 2-step run: one warning naming both numbers and the flag; a
    fraction of the run (--warmup_steps below 1) gets none."""
    args = [
        "--model_name_or_path",
        str(model_dir),
        "--train_file",
        str(IMDB_TRAIN),
        "--do_train",
        "--max_seq_length",
        "64",
        "--max_steps",
        "2",
        "--save_strategy",
        "no",
        *FAST,
    ]
    pretrain_mlm.main([*args, "--output_dir", str(tmp_path / "a")])
    warnings = [record.getMessage() for record in caplog.records if "--warmup_steps" in record.getMessage()]
    expected = (
        "--warmup_steps 500 is at least as long as this run, 2 training steps (--max_steps 2): the learning rate "
        "rises all run and never reaches --learning_rate 0.001. Lower --warmup_steps (e.g. --warmup_steps 0.1, a "
        "tenth of the run) or train longer."
    )
    assert warnings == [expected]
    caplog.clear()
    pretrain_mlm.main([*args, "--output_dir", str(tmp_path / "b"), "--warmup_steps", "0.5"])
    assert not [record for record in caplog.records if "--warmup_steps" in record.getMessage()]


def test_tiny_builds_a_model_the_recipes_run_offline(tmp_path, capsys):
    """``python -m recipes.tiny --output_dir tiny-roberta-ls``: a small RoBERTa and tokenizer built here and converted,
    which pretrain_mlm and finetune_imdb take as they are; an existing non-empty folder is kept unless --overwrite."""
    folder = tmp_path / "tiny-roberta-ls"
    assert tiny.main(["--output_dir", str(folder)]) == folder
    assert f"wrote {folder}" in capsys.readouterr().out
    assert (folder / "model.safetensors").is_file() and (
        tmp_path / "tiny-roberta-ls-roberta" / "tokenizer.json"
    ).is_file()
    steps = ["--max_steps", "2", "--max_seq_length", "64", *FAST]
    mlm = pretrain_mlm.main(
        ["--model_name_or_path", str(folder), "--train_file", str(IMDB_TRAIN), "--output_dir", str(tmp_path / "mlm")]
        + ["--do_train", "--do_eval", *steps]
    )
    imdb = finetune_imdb.main(
        ["--model_name_or_path", str(folder), "--train_file", str(IMDB_TRAIN), "--test_file", str(IMDB_TEST)]
        + ["--output_dir", str(tmp_path / "imdb"), "--do_train", "--do_eval", "--do_predict", *steps]
    )
    assert mlm["eval_loss"] > 0 and 0 <= imdb["test_accuracy"] <= 1

    model = (folder / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        tiny.main(["--output_dir", str(folder)])
    assert exit_info.value.code == 2 and "already exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert (folder / "model.safetensors").read_bytes() == model
    tiny.main(["--output_dir", str(folder), "--overwrite", "--window_size", "8"])
    assert json.loads((folder / "config.json").read_text())["window_size"] == 8
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "imdb",
        "mlm",
        "tiny-roberta-ls",
        "tiny-roberta-ls-roberta",
    ]


def test_checkpoints_are_bounded_by_default():
    for script, arguments in (
        (pretrain_mlm, pretrain_mlm.MlmTrainingArguments),
        (char_lm, char_lm.CharLmTrainingArguments),
    ):
        assert arguments(output_dir="o").save_total_limit == 3, script.__name__
