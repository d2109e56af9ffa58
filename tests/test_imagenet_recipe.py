"""The ImageNet recipe end to end on a tiny CvT-LS and a generated ImageFolder of PNGs: training with the paper's
augmentation lowers the validation loss, the state and the best weights appear, a rerun resumes where it stopped, the
exported weights evaluate to the recorded top-1, and bad arguments exit with a clear message."""

import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from timm.data import resolve_data_config
from timm.data.auto_augment import AugmentOp

from recipes.imagenet import train
from recipes.tiny import one_thread

COLOURS = {"blue": (30, 30, 200), "green": (30, 200, 30), "red": (200, 30, 30)}
TINY = [
    "--model",
    "cvt_ls_13",
    "--model-kwargs",
    "embed_dims=(16,32,48)",
    "depths=(1,1,1)",
    "num_heads=(1,2,2)",
    "--img-size",
    "32",
    "--batch-size",
    "8",
    "--workers",
    "0",
    "--seed",
    "0",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """3 classes of noisy single-colour 40x40 PNGs: 8 per class to train on, 4 to evaluate."""
    root = tmp_path_factory.mktemp("imagefolder")
    rng = np.random.default_rng(0)
    for split, count in (("train", 8), ("val", 4)):
        for name, colour in COLOURS.items():
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                pixels = np.clip(np.array(colour) + rng.normal(0, 25, (40, 40, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def summary(out):
    with open(out / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_trains_resumes_and_exports(data_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    args = [
        "--data-dir",
        str(data_dir),
        "--output-dir",
        str(out),
        *TINY,
        "--lr",
        "2e-3",
        "--warmup-epochs",
        "1",
        "--model-ema",
        "--model-ema-decay",
        "0.5",
    ]
    untrained = train.main([*args, "--eval-only"])  # the same seed builds the same initial weights
    first = train.main([*args, "--epochs", "2"])
    assert first["loss"] < untrained["loss"] and first["top1"] > 100 / len(COLOURS)
    assert first["top5"] == 100.0  # 3 classes: the top 5 always hold the label
    assert [row["epoch"] for row in summary(out)] == ["0", "1"]
    for name in (
        "last/model.safetensors",
        "last/optimizer.bin",
        "last/progress.json",
        "best/model.safetensors",
        "best/config.json",
    ):
        assert (out / name).is_file(), name

    # A rerun with a longer schedule continues after epoch 1 instead of starting over, reading its state without
    # unpickling objects (every torch.load with weights_only=True; the EMA from safetensors).
    capsys.readouterr()
    loads = []

    def weights_only_load(*load_args, **kwargs):
        loads.append(kwargs.get("weights_only"))
        return real_load(*load_args, **kwargs)

    real_load = torch.load
    monkeypatch.setattr(torch, "load", weights_only_load)
    ema = load_file(out / "last" / "ema.safetensors")
    third = train.main([*args, "--epochs", "3"])
    monkeypatch.undo()
    assert loads and all(loads), loads
    assert not torch.equal(load_file(out / "last" / "ema.safetensors")["head.weight"], ema["head.weight"])
    printed = capsys.readouterr().out
    assert "after epoch 1" in printed and f"the best weights go to {out}" in printed
    assert f"weights in {out / 'best'}" in printed
    rows = summary(out)
    assert [row["epoch"] for row in rows] == ["0", "1", "2"]
    assert train.main([*args, "--epochs", "3"]) == third  # nothing left to train: the last metrics, no new row
    assert len(summary(out)) == 3

    # The exported best (EMA) weights load by path with their classes and input size and reproduce the best recorded
    # top-1; as a --pretrained-file they load whole too, classifier included.
    best = max(float(row["eval_ema_top1"]) for row in rows)
    metrics = train.main(
        [
            "--data-dir",
            str(data_dir),
            "--model",
            f"local-dir:{out / 'best'}",
            "--pretrained",
            "--eval-only",
            "--workers",
            "0",
        ]
    )
    assert metrics["top1"] == pytest.approx(best)
    from_file = train.main(
        [
            "--data-dir",
            str(data_dir),
            *TINY,
            "--pretrained-file",
            str(out / "best" / "model.safetensors"),
            "--eval-only",
        ]
    )
    assert from_file == pytest.approx(metrics)


def test_paper_defaults_without_mixup(data_dir, tmp_path):
    """Label smoothing alone (no Mixup/CutMix) takes the other loss; no EMA, a plain export. The warm-up starts from
    0.002 x --lr and rises linearly over 5 epochs of 3 steps."""
    out = tmp_path / "plain"
    metrics = train.main(
        [
            "--data-dir",
            str(data_dir),
            "--output-dir",
            str(out),
            *TINY,
            "--epochs",
            "1",
            "--mixup",
            "0",
            "--cutmix",
            "0",
            "--aa",
            "none",
            "--lr",
            "2e-3",
        ]
    )
    assert set(metrics) == {"loss", "top1", "top5"} and (out / "best" / "model.safetensors").is_file()
    start = 0.002 * 2e-3
    assert float(summary(out)[0]["lr"]) == pytest.approx(start + (2e-3 - start) * 3 / 15)


def test_pretrained_file_for_other_classes(data_dir, tmp_path, capsys):
    """Weights with a classifier for 5 classes: --eval-only refuses them for the 3 colour classes; training keeps
    their backbone and fine-tunes a new classifier."""
    kwargs = {"embed_dims": (16, 32, 48), "depths": (1, 1, 1), "num_heads": (1, 2, 2)}
    save_file(timm.create_model("cvt_ls_13", num_classes=5, **kwargs).state_dict(), tmp_path / "five.safetensors")
    start = load_file(tmp_path / "five.safetensors")
    args = [
        "--data-dir",
        str(data_dir),
        "--output-dir",
        str(tmp_path / "run"),
        *TINY,
        "--pretrained-file",
        str(tmp_path / "five.safetensors"),
    ]
    with pytest.raises(SystemExit) as exit_info:
        train.main([*args, "--eval-only"])
    assert exit_info.value.code == 2 and "classifies 5 classes, but --data-dir" in capsys.readouterr().err

    frozen = ["--lr", "0", "--warmup-lr", "0"]  # the saved backbone stays the file's
    train.main([*args, "--epochs", "1", *frozen, "--mixup", "0", "--cutmix", "0", "--aa", "none"])
    assert "fine-tuning with a new classifier" in capsys.readouterr().out
    saved = load_file(tmp_path / "run" / "best" / "model.safetensors")
    assert saved["head.weight"].shape == (3, 48)
    changed = {k for k in start if not k.startswith("head.") and not torch.equal(start[k], saved[k])}
    # only the BatchNorm statistics (CvT's dw_bn projections) move, and all of them: training updates them
    statistics = {k for k in start if k.endswith(("running_mean", "running_var", "num_batches_tracked"))}
    assert statistics and changed == statistics, sorted(changed ^ statistics)


def test_checkpoint_classes_of_timm_and_official_files(tmp_path):
    head = torch.zeros(7, 4)
    torch.save({"net": {"module.head.weight": head}, "epoch": 300}, tmp_path / "official.pth")
    save_file({"head.weight": head}, tmp_path / "timm.safetensors")
    save_file({"stages.0.embed.proj.weight": head}, tmp_path / "backbone.safetensors")
    files = ("official.pth", "timm.safetensors", "backbone.safetensors")
    assert [train.checkpoint_classes(str(tmp_path / name), "head") for name in files] == [7, 7, 0]


def test_model_keeps_its_input_size_without_img_size():
    """vil_ls_medium_384 without --img-size: the architecture and the data config of its own 384 input."""
    parser = train.build_parser()
    args = parser.parse_args(["--data-dir", "unused", "--model", "vil_ls_medium_384"])
    with torch.device("meta"):
        model, reference = train.create_model(parser, args, 1000), timm.create_model("vil_ls_medium_384")
    shapes = [{name: tensor.shape for name, tensor in m.state_dict().items()} for m in (model, reference)]
    assert shapes[0] == shapes[1]
    assert resolve_data_config({"img_size": args.img_size}, model=model)["input_size"] == (3, 384, 384)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--data-dir", "/no/such/dir"], "--data-dir '/no/such/dir': no such folder"),
        (["--model", "no_such_model"], "--model 'no_such_model': unknown"),
        (["--batch-size", "7"], "must be even"),
        (["--batch-size", "64"], "--batch-size 64: larger than the 24 training images"),
        (["--model-kwargs", "depths=(1,1)"], "depths"),
        (["--img-size", "8192"], "a training step needs about"),  # before training: the estimate names --batch-size
    ],
)
def test_bad_arguments_exit_with_a_message(data_dir, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--data-dir", str(data_dir), "--output-dir", str(tmp_path), *TINY, "--epochs", "1", *extra])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_start_weights_that_are_missing_or_no_weights_are_clear_errors(data_dir, tmp_path, capsys):
    """A text file or a checkpoint without weights as --pretrained-file, and the same through timm's offline
    fallback for the released ViL-LS weights (pretrained_cfg_overlay file), missing or not a checkpoint: errors that
    name the file and what to pass, before any training."""
    (tmp_path / "notes.pth").write_text("not a checkpoint")
    torch.save({"epoch": 3}, tmp_path / "no_weights.pth")
    with pytest.raises(SystemExit) as exit_info:
        train.main(
            [
                "--data-dir",
                str(data_dir),
                "--output-dir",
                str(tmp_path / "out"),
                *TINY,
                "--epochs",
                "1",
                "--pretrained-file",
                str(tmp_path / "notes.pth"),
            ]
        )
    assert exit_info.value.code == 2 and "holds no weights that can be read" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(FileNotFoundError, match="file '.*missing.pth': no such file; give the path of the downloaded"):
        timm.create_model(
            "vil_ls_small", pretrained=True, pretrained_cfg_overlay={"file": str(tmp_path / "missing.pth")}
        )
    for name in ("notes.pth", "no_weights.pth"):
        with pytest.raises(ValueError, match=f"{name}' holds no vil_ls_small weights that can be read"):
            timm.create_model("vil_ls_small", pretrained=True, pretrained_cfg_overlay={"file": str(tmp_path / name)})


def test_missing_split_from_the_command_line(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    result = subprocess.run(
        [sys.executable, "-m", "recipes.imagenet.train", "--data-dir", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    assert result.returncode == 2
    assert f"{tmp_path / 'val'} is missing or has no class folders" in result.stderr


def test_paper_randaugment_strongest_posterize_runs():
    """rand-m9-mstd0.5-inc1 reaches magnitude 10, where timm's PosterizeIncreasing keeps 0 bits (pillow<13 needed)."""
    op = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)
    assert op(Image.new("RGB", (8, 8), (200, 100, 50))).getpixel((0, 0)) == (0, 0, 0)


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    shown = capsys.readouterr().out.split("\n\n", 2)[-1]  # the options, after the usage and the description
    for option in ("--epochs", "--weight-decay", "--opt-eps", "--min-lr", "--model-ema-decay", "--seed"):
        text = shown.split(option, 1)[1].split("\n  --", 1)[0]
        assert "(default: " in " ".join(text.split()), option
