"""``bench.gpu_work``: the GPU's work of the attention module's training step, counted in inductor's CUDA code on
the CPU. Checked to count what the peers compute, never timed."""

import pytest
import torch

from bench import gpu_work


@pytest.mark.compiled
@pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < gpu_work.TORCH_NEEDED,
    reason=f"bench.gpu_work needs torch {gpu_work.TORCH_NEEDED} or later",
)
def test_gpu_work_counts_each_peers_gemms_and_memory(tmp_path):
    """At 256 tokens x 2 (the bars' width: hidden 768, r = 64): every GEMM's FLOPs, as the peers' products make them
    (FlexAttention's window: four Linears, three GEMMs each a step; Long-Short: five, and Eq. 3's two products with
    their four gradients), the bytes of Long-Short's Triton kernels and of the window's eager sums of its Linears'
    gradients, and both FlexAttention kernels' bytes, written to the JSON file asked for."""
    out = tmp_path / "work.json"
    tokens, batch, hidden, rank = 256, 2, 768, 64
    rows = gpu_work.main(["--settings", f"{tokens}x{batch}", "--out", str(out)])["rows"]
    assert list(rows) == [f"{tokens}x{batch} long-short", f"{tokens}x{batch} flex-window"] and out.exists()
    long_short, window = rows.values()
    linear = 2 * batch * tokens * hidden * hidden / 1e12
    projection = 2 * batch * tokens * rank * hidden / 1e12
    assert window["gemm_tflop"] == pytest.approx(12 * linear, rel=1e-9)
    assert long_short["gemm_tflop"] == pytest.approx(15 * linear + 6 * projection, rel=1e-9)
    assert long_short["triton_kernels"] > window["triton_kernels"] > 0
    assert long_short["triton_gb"] > 0 and window["eager_gb"] > 0
    assert long_short["flex_attention_gb"] > 0 and window["flex_attention_gb"] > 0


def test_gpu_work_refuses_a_setting_it_cannot_read(capsys, tmp_path):
    """A setting without its batch size stops before any work, the message naming the parameter and its form."""
    out = tmp_path / "work.json"
    with pytest.raises(SystemExit) as exit_:
        gpu_work.main(["--settings", "4096", "--out", str(out)])
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and "--settings" in error and "4096x8" in error and not out.exists()


def test_gpu_work_refuses_a_torch_too_old(capsys, monkeypatch, tmp_path):
    """Under a torch whose inductor writes CPU kernels' benchmark harness so that it does not import, the script stops
    before any work, naming the version it needs."""
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.11.0"))
    out = tmp_path / "work.json"
    with pytest.raises(SystemExit) as exit_:
        gpu_work.main(["--settings", "256x2", "--out", str(out)])
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and f"torch {gpu_work.TORCH_NEEDED}" in error and "2.11.0" in error
    assert not out.exists()
