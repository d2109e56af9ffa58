"""The test device/dtype settings (tests/devices.py) and the GPU run's selection of tests."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.devices import (
    GPU_EXAMPLES,
    assert_close,
    device_sample,
    device_selection,
    needed_fixtures,
    property_examples,
    test_device,
    test_dtype,
)

ROOT = Path(__file__).resolve().parent.parent


def test_device_test_list_names_existing_test_files():
    listed = (ROOT / "tests" / "device_tests.txt").read_text().split()
    assert listed and len(set(listed)) == len(listed)
    for name in listed:
        assert (ROOT / name).is_file() and Path(name).name.startswith("test_"), name
    assert "tests/test_attention.py" in listed


@pytest.mark.parametrize(
    "where,precision,needed",
    [
        ("cpu", torch.float64, set()),
        ("cpu", torch.bfloat16, {"dtype"}),
        ("cuda", torch.float32, {"device"}),
        ("cuda", torch.bfloat16, {"device", "dtype"}),
    ],
)
def test_each_run_keeps_the_tests_that_depend_on_its_setting(where, precision, needed):
    """On a GPU the tests that do not take the device fixture are deselected (they would run on the CPU); in bfloat16,
    below the device's full precision, those that do not take the dtype fixture (they would run as in the full
    precision's run); on the CPU in float64 every test runs."""
    takes = [(), ("device",), ("dtype",), ("device", "dtype"), ("device", "dtype", "monkeypatch")]
    items = [SimpleNamespace(fixturenames=names) for names in takes]
    kept, dropped = device_selection(items, torch.device(where), precision)
    assert needed_fixtures(torch.device(where), precision) == needed
    assert kept == [item for item in items if needed <= set(item.fixturenames)]
    assert dropped == [item for item in items if not needed <= set(item.fixturenames)]


def test_property_examples_follow_the_device(monkeypatch):
    monkeypatch.setenv("LS_TEST_DEVICE", "cpu")
    assert property_examples(40) == 40 and property_examples(3) == 3
    if torch.cuda.is_available():
        monkeypatch.setenv("LS_TEST_DEVICE", "cuda")
        assert property_examples(40) == GPU_EXAMPLES and property_examples(3) == min(3, GPU_EXAMPLES)


def test_device_sample_follows_the_device(monkeypatch):
    monkeypatch.setenv("LS_TEST_DEVICE", "cpu")
    assert device_sample(["a", "b", "c"], ["a"]) == ["a", "b", "c"]
    if torch.cuda.is_available():
        monkeypatch.setenv("LS_TEST_DEVICE", "cuda")
        assert device_sample(["a", "b", "c"], ["a"]) == ["a"]


def test_settings_come_from_the_environment(monkeypatch, device, dtype):
    assert (device, dtype) == (test_device(), test_dtype())
    monkeypatch.setenv("LS_TEST_DEVICE", "cpu")
    monkeypatch.setenv("LS_TEST_DTYPE", "bfloat16")
    assert (test_device(), test_dtype()) == (torch.device("cpu"), torch.bfloat16)
    monkeypatch.setenv("LS_TEST_DTYPE", "half")
    with pytest.raises(ValueError, match="LS_TEST_DTYPE must be one of"):
        test_dtype()
    monkeypatch.setenv("LS_TEST_DEVICE", "mps")
    with pytest.raises(ValueError, match="LS_TEST_DEVICE must be cpu or cuda"):
        test_device()
    if not torch.cuda.is_available():
        monkeypatch.setenv("LS_TEST_DEVICE", "cuda")
        with pytest.raises(RuntimeError, match="no CUDA device"):
            test_device()


def test_tolerance_follows_the_dtype():
    """float64 as given; bfloat16 relative to the reference's largest magnitude (8-bit mantissa)."""
    expected = torch.tensor([100.0, 0.0], dtype=torch.float64)
    assert_close(expected + 1e-12, expected, atol=1e-10)
    assert_close((expected + torch.tensor([0.5, 1.0])).bfloat16(), expected, atol=0.0)
    with pytest.raises(AssertionError):
        assert_close((expected + 7.0).bfloat16(), expected, atol=0.0)
