"""A real ``accelerate launch`` of finetune_imdb with 2 CPU processes trains on both and writes what 1 process does."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ls_hf import LongShortForSequenceClassification
from recipes import finetune_imdb
from recipes.tiny import IMDB_TEST, IMDB_TRAIN, one_thread, tiny_long_short

ROOT = Path(__file__).parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def artefacts(output_dir: Path) -> set[str]:
    """Relative file names, with checkpoint steps and per-process RNG files folded together."""
    names = {str(path.relative_to(output_dir)) for path in output_dir.rglob("*") if path.is_file()}
    names = {re.sub(r"checkpoint-\d+", "checkpoint-N", name) for name in names}
    return {re.sub(r"rng_state(_\d+)?\.pth", "rng_state.pth", name) for name in names}


def test_two_process_cpu_launch_matches_one_process(tmp_path):
    model = tiny_long_short(tmp_path / "ls-tiny")
    args = [
        "--model_name_or_path",
        str(model),
        "--train_file",
        str(IMDB_TRAIN),
        "--test_file",
        str(IMDB_TEST),
        "--do_train",
        "--do_eval",
        "--do_predict",
        "--max_train_samples",
        "64",
        "--max_eval_samples",
        "32",
        "--per_device_train_batch_size",
        "8",
        "--num_train_epochs",
        "1",
        "--learning_rate",
        "1e-3",
        "--logging_steps",
        "1",
        "--disable_tqdm",
        "True",
        "--use_cpu",
        "True",
    ]
    launch = [
        f"{sys.prefix}/bin/accelerate",
        "launch",
        "--config_file",
        "recipes/accelerate/cpu.yaml",
        "--main_process_port",
        str(free_port()),
        "-m",
        "recipes.finetune_imdb",
    ]
    result = subprocess.run(
        [*launch, *args, "--output_dir", str(tmp_path / "two")],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]

    with one_thread():
        finetune_imdb.main([*args, "--output_dir", str(tmp_path / "one")])

    two, one = (json.loads((tmp_path / name / "trainer_state.json").read_text()) for name in ("two", "one"))
    assert two["global_step"] == 4 and one["global_step"] == 8  # 64 examples in batches of 8 on 2 processes vs 1
    losses = [entry["loss"] for entry in two["log_history"] if "loss" in entry]
    assert len(losses) == 4 and all(0 < loss < 2 for loss in losses)
    assert artefacts(tmp_path / "two") == artefacts(tmp_path / "one")
    assert {"model.safetensors", "all_results.json", "checkpoint-N/optimizer.pt"} <= artefacts(tmp_path / "two")
    assert {"eval_accuracy", "test_accuracy"} <= set(json.loads((tmp_path / "two" / "all_results.json").read_text()))
    trained = LongShortForSequenceClassification.from_pretrained(tmp_path / "two").long_short.embeddings
    start = LongShortForSequenceClassification.from_pretrained(model).long_short.embeddings
    assert not torch.equal(trained.word_embeddings.weight, start.word_embeddings.weight)


def test_a_recipe_that_returns_destroys_the_process_group(tmp_path):
    """In a distributed run a recipe's command (``recipes.common.cli``) that returns destroys the process group, so
    that no process exits with it alive (gloo's threads then may abort the interpreter's shutdown, failing a launch
    whose training went well); after a usage error it is left alone."""
    from recipes.common import UsageError, cli

    def refuses(argv):
        raise UsageError("--flag must be positive, got -1.")

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(SystemExit):
            cli(refuses)([])
        assert torch.distributed.is_initialized()
        assert cli(lambda argv: {"trained on": argv})(["a"]) == {"trained on": ["a"]}
        assert not torch.distributed.is_initialized()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.parametrize("name", ["single_gpu", "multi_gpu", "fsdp", "deepspeed_zero2", "cpu"])
def test_launch_configs_load(name):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "recipes" / "accelerate" / f"{name}.yaml"))
    assert config.compute_environment.value == "LOCAL_MACHINE"
    if name == "fsdp":
        assert config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "LongShortLayer"
    if name == "deepspeed_zero2":
        assert config.deepspeed_config["zero_stage"] == 2
