"""Where and in which precision the tests run (``LS_TEST_DEVICE``, ``LS_TEST_DTYPE``; fixtures in conftest.py), and
comparisons with tolerances suited to that precision."""

import copy
import os

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# assert_close's atol below float64, relative to the largest reference magnitude: float32 leaves room for TF32
# convolutions (cuDNN's default on CUDA, 10-bit mantissa), bfloat16 for its 8-bit mantissa through a few layers.
RELATIVE_ATOL = {torch.float32: 2e-3, torch.bfloat16: 6e-2}
# The precision of a device's full test run (the CPU's default; on a GPU, gpu-check's first): a run in another one
# leaves out the tests that do not take the dtype (``device_selection``).
FULL_PRECISION = {"cpu": torch.float64, "cuda": torch.float32}
# Examples per property test on a GPU: each example draws new shapes, and on CUDA a new shape can cost a kernel
# compilation (FlexAttention's) where the CPU pays microseconds, so the GPU run draws a sample of them.
GPU_EXAMPLES = 8


def test_device() -> torch.device:
    """``LS_TEST_DEVICE`` (default ``cpu``); a clear error when it names a device this machine lacks."""
    device = torch.device(os.environ.get("LS_TEST_DEVICE", "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("LS_TEST_DEVICE=cuda but torch finds no CUDA device here; unset it to test on the CPU.")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"LS_TEST_DEVICE must be cpu or cuda, got {device.type!r}.")
    return device


def test_dtype() -> torch.dtype:
    """``LS_TEST_DTYPE`` (default ``float64``: exact comparisons)."""
    name = os.environ.get("LS_TEST_DTYPE", "float64")
    if name not in DTYPES:
        raise ValueError(f"LS_TEST_DTYPE must be one of {sorted(DTYPES)}, got {name!r}.")
    return DTYPES[name]


test_device.__test__ = test_dtype.__test__ = False  # helpers, not tests


def property_examples(cpu: int) -> int:
    """Hypothesis examples for a property test that draws ``cpu`` of them on the CPU: at most ``GPU_EXAMPLES`` when
    ``LS_TEST_DEVICE`` names a GPU."""
    return cpu if test_device().type == "cpu" else min(cpu, GPU_EXAMPLES)


def device_sample(every: list, on_gpu: list) -> list:
    """The parameters of a test that runs the same kernels at each of ``every``: all of them on the CPU, ``on_gpu``
    when ``LS_TEST_DEVICE`` names a GPU, where each new shape costs compilations."""
    return every if test_device().type == "cpu" else on_gpu


def needed_fixtures(device: torch.device, dtype: torch.dtype) -> set[str]:
    """The fixtures a test must take to run on ``device`` in ``dtype``, so that each run keeps the tests whose result
    can depend on its setting: on a GPU ``device`` (the others would run on the CPU just as they do without it); in a
    precision below the device's full one (``FULL_PRECISION``, the precision of the run beside it) ``dtype`` too."""
    needed = {"device"} if device.type != "cpu" else set()
    if dtype != FULL_PRECISION[device.type]:
        needed.add("dtype")
    return needed


def device_selection(items: list, device: torch.device, dtype: torch.dtype) -> tuple[list, list]:
    """The collected tests to run on ``device`` in ``dtype`` (they take the ``needed_fixtures``) and those to
    deselect."""
    needed = needed_fixtures(device, dtype)
    kept, deselected = [], []
    for item in items:
        (kept if needed <= set(getattr(item, "fixturenames", ())) else deselected).append(item)
    return kept, deselected


def cpu64(*objects):
    """float64 CPU copies of modules and tensors (None passes through): the reference side of a comparison, from the
    very weights and inputs (already rounded to the tested dtype) the tested side used."""

    def convert(obj):
        if obj is None:
            return None
        if isinstance(obj, torch.nn.Module):
            return copy.deepcopy(obj).to("cpu", torch.float64)
        return obj.to("cpu", torch.float64) if obj.is_floating_point() else obj.cpu()

    return tuple(convert(obj) for obj in objects)


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float = 0.0, dtype: torch.dtype | None = None
) -> None:
    """``torch.testing.assert_close`` on CPU float64 copies: ``atol``/``rtol`` as given when the values were computed in
    float64 (``dtype``, default ``actual``'s), else an absolute tolerance of ``RELATIVE_ATOL[dtype]`` times the
    largest magnitude of ``expected``."""
    dtype = dtype or actual.dtype
    if dtype != torch.float64:
        scale = expected.abs().max().item() if expected.numel() else 0.0
        atol, rtol = RELATIVE_ATOL[dtype] * scale, 0.0
    torch.testing.assert_close(actual.to("cpu", torch.float64), expected.to("cpu", torch.float64), atol=atol, rtol=rtol)
