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


@pytest.mark.compiled
def test_cpu_code_is_scheduled_as_cudas():
    """Inductor's code for CPU tensors makes CUDA's choices while ``bench.cuda_lowered`` lowers them so: a softmax's
    max and sum in one online reduction, and a LayerNorm's input and gain gradients (reductions over rows and over
    columns of the same 8,192 x 768 tensors) in one mix-order kernel (not under torch 2.11, whose check reads the
    device); afterwards inductor is as it was."""
    from torch._inductor import metrics, scheduler, utils

    from bench.cuda_lowered import launched_as_for_cuda

    def step(x, weight):
        probabilities = torch.softmax(x, dim=-1)
        normed = torch.nn.functional.layer_norm(x, (x.shape[-1],), weight)
        (normed * probabilities).sum().backward()

    x = torch.randn(8192, 768, requires_grad=True)
    weight = torch.ones(768, requires_grad=True)
    torch._dynamo.reset()
    metrics.reset()
    is_cpu = scheduler.BaseSchedulerNode.is_cpu
    with launched_as_for_cuda() as launched:
        torch.compile(step)(x, weight)
    assert any("prepare_softmax_online" in kernel.fn.__name__ for kernel in launched)
    # from torch 2.14 on, a device check of the mix-order fusion that the lowering no longer reaches fails here
    mixes_orders = torch.torch_version.TorchVersion(torch.__version__) >= "2.14" or hasattr(
        scheduler, "_is_gpu_triton_backend"
    )
    assert (metrics.codegen_mix_order_reduction > 0) == mixes_orders
    assert scheduler.is_gpu is utils.is_gpu and scheduler.BaseSchedulerNode.is_cpu is is_cpu
    assert torch._inductor.config.post_grad_custom_post_pass is None
