"""bench.profile_attention on the CPU with a tiny shape: each peer's operator table, printed and written, and what its
forward pass keeps for the backward pass."""

import re

import pytest

from bench import profile_attention
from ls_hf import long_short_attention, long_short_blocks


@pytest.fixture
def device_choices_restored(monkeypatch):
    """``--cpu-as-cuda`` changes the package's device choices for the process: restored after the test."""
    for module, name in (
        (long_short_attention, "FUSED_DEVICES"),
        (long_short_attention, "COMPILED_LAYER_DEVICES"),
        (long_short_blocks, "COMPILED_DEVICES"),
    ):
        monkeypatch.setattr(module, name, getattr(module, name))


def test_profile_lists_each_peers_operators(tmp_path, capsys):
    out = tmp_path / "profile.txt"
    profile_attention.main(
        [
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--n",
            "64",
            "--steps",
            "1",
            "--warmups",
            "0",
            "--rows",
            "4",
            "--batch",
            "2",
            "--peers",
            "long-short",
            "sdpa",
            "--out",
            str(out),
        ]
    )
    report = out.read_text()
    assert "== long-short, n = 64, batch 2" in report and "== sdpa, n = 64, batch 2" in report
    assert "aten::" in report  # the operators' rows
    assert "== sdpa" in capsys.readouterr().out


def test_cpu_as_cuda_counts_what_compiling_the_layer_removes(tmp_path, device_choices_restored):
    """``--cpu-as-cuda``: the CPU takes CUDA's choices (forward only); the layer compiled around the kernel issues
    fewer operator calls than the kernel alone compiled, and runs as one graph before the kernel's call and one after
    it (dynamo's nested graph breaks; 7 graphs without), beside the kernel's own."""
    out = tmp_path / "profile.txt"
    arguments = ["--device", "cpu", "--dtype", "fp32", "--n", "256", "--steps", "1", "--warmups", "1", "--rows", "2"]
    profile_attention.main(
        [*arguments, "--cpu-as-cuda", "--peers", "long-short", "long-short-kernel", "--out", str(out)]
    )
    report = out.read_text()
    assert "forward steps" in report and "forward + backward" not in report
    counts = [line.split("per step: ")[1].split(", ") for line in report.splitlines() if "per step: " in line]
    calls, graphs = ([float(peer[i].split()[0]) for peer in counts] for i in (0, 2))
    assert len(calls) == 2 and calls[0] < calls[1]
    assert graphs == [3, 1]


def test_saved_counts_what_the_forward_pass_keeps(tmp_path, device_choices_restored):
    """``--saved --cpu-as-cuda``: dense SDPA keeps the query, keys, values and output (4 tensors of (n, hidden) and
    the log-sum-exp); the fused Long-Short layer keeps its window keys and values once, inside the kernel's keys and
    values, not LN_L's input, and its kernel's output as the output projection's input: 5.3 such tensors at n = 1024
    (at most 5.5 here), where a heads-first output copied for the projection made 6.3, keeping LN_L's input 8.3 and
    keeping the window again for the projection's product 10.3."""
    out = tmp_path / "saved.txt"
    arguments = ["--device", "cpu", "--dtype", "fp32", "--n", "1024", "--cpu-as-cuda", "--saved"]
    profile_attention.main([*arguments, "--peers", "sdpa", "long-short-kernel", "--out", str(out)])
    totals = [float(line.split("= ")[1].split(" x")[0]) for line in out.read_text().splitlines() if "kept for" in line]
    assert len(totals) == 2
    assert 4.0 <= totals[0] < 4.1
    assert totals[1] <= 5.5


def test_vision_profiles_whole_models(tmp_path, monkeypatch):
    """``--vision``: inference of whole ``bench.bench_vision`` models; a ``-kernel`` peer is the model with its
    Long-Short layers' ``compile_attention=False``, a ``-triton`` peer with their inference on the Triton window kernel
    (on the devices that take the fused path). ``--saved`` does not take it."""
    from bench import bench_vision
    from ls_timm.long_short_attention_2d import LongShortAttention2d

    built = []
    real = bench_vision.build
    monkeypatch.setattr(bench_vision, "build", lambda *args, **kwargs: built.append(real(*args, **kwargs)) or built[-1])
    out = tmp_path / "profile.txt"
    arguments = ["--device", "cpu", "--dtype", "fp32", "--steps", "1", "--warmups", "0", "--rows", "2"]
    vision = ["--vision", "cvt_ls_13", "cvt_ls_13-kernel", "cvt_ls_13-triton", "--resolution", "64", "--batch", "1"]
    profile_attention.main([*arguments, *vision, "--out", str(out)])
    report = out.read_text()
    assert "== cvt_ls_13, 64 x 64, batch 1" in report and "== cvt_ls_13-kernel, 64 x 64, batch 1" in report
    assert report.count("per step: ") == 3 and "== long-short" not in report
    # each stage's attention layers apart: cvt_ls_13's maps of 16 x 16, 8 x 8 and 4 x 4 (and its cls) at 64 pixels
    for tokens, calls in ((256, 1), (64, 2), (17, 10)):
        line = f"  LongShortAttention2d (1, {tokens}, "
        assert report.count(line) == 3  # every peer
        assert re.search(rf"{re.escape(line)}\d+\): {calls} calls, \d+\.\d+ ms", report)
    settings = [
        {(m.compile_attention, m.window_kernel_devices) for m in model.modules() if isinstance(m, LongShortAttention2d)}
        for model in built
    ]
    assert settings == [{(True, ())}, {(False, ())}, {(True, ("cpu", "cuda"))}]
    with pytest.raises(SystemExit):
        profile_attention.main([*arguments, *vision, "--saved"])


def test_vision_train_profiles_training_steps(tmp_path, monkeypatch):
    """``--vision ... --train``: training steps of the models (their parameters get gradients); the attention peers
    do not take it."""
    from bench import bench_vision

    built = []
    real = bench_vision.build
    monkeypatch.setattr(bench_vision, "build", lambda *args, **kwargs: built.append(real(*args, **kwargs)) or built[-1])
    out = tmp_path / "profile.txt"
    arguments = ["--device", "cpu", "--dtype", "fp32", "--steps", "1", "--warmups", "0", "--rows", "2"]
    profile_attention.main(
        [*arguments, "--vision", "cvt_ls_13", "--train", "--resolution", "64", "--batch", "2", "--out", str(out)]
    )
    report = out.read_text()
    assert "== cvt_ls_13, 64 x 64, batch 2, 1 training (forward + backward) steps" in report
    assert all(model.training for model in built)
    assert all(p.grad is not None for p in built[-1].parameters() if p.requires_grad)
    with pytest.raises(SystemExit):
        profile_attention.main([*arguments, "--train"])
