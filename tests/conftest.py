"""The device and dtype the attention, model and timm tests run in: ``LS_TEST_DEVICE`` (``cpu``, the default, or
``cuda``) and ``LS_TEST_DTYPE`` (``float64``, the default, ``float32`` or ``bfloat16``), e.g.

    LS_TEST_DEVICE=cuda LS_TEST_DTYPE=bfloat16 python -m pytest tests/test_attention.py

Tests that compare against a reference take ``device`` and ``dtype`` and check with ``tests.devices.assert_close``
(tolerances suited to the dtype); ``bash run.sh gpu-check`` runs them on CUDA in float32 and bfloat16.

On a GPU (``LS_TEST_DEVICE=cuda``) only the tests that take the ``device`` fixture run: the others would run on the
CPU exactly as they do without it, so they are deselected; so are, in a precision below the device's full one
(bfloat16; ``tests.devices.FULL_PRECISION``), the tests that do not take the ``dtype`` fixture. Property tests draw
fewer examples on a GPU (``tests.devices.property_examples``), and only the tests marked ``compiled_layer`` compile the
rest of the attention layer around its kernel (``compile_attention``, seconds for every new configuration); the
others run the kernel alone compiled, which the marked tests check the compiled layer against.

On the CPU, Triton's kernels (``ls_timm.window_kernel_2d``) run in Triton's interpreter: ``TRITON_INTERPRET=1`` is
set here, before anything imports Triton.
"""

import os

if os.environ.get("LS_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.devices import device_selection, needed_fixtures, test_device, test_dtype


def pytest_configure(config):
    try:
        test_device(), test_dtype()
    except (ValueError, RuntimeError) as err:
        raise pytest.UsageError(str(err)) from None


def pytest_collection_modifyitems(config, items):
    items[:], deselected = device_selection(items, test_device(), test_dtype())
    if deselected:
        config.hook.pytest_deselected(items=deselected)


def pytest_report_header(config):
    needed = sorted(needed_fixtures(test_device(), test_dtype()))
    if needed:
        return f"{test_device()}, {test_dtype()}: only the tests that take the {' and '.join(needed)} fixtures run"


@pytest.fixture(autouse=True)
def _compiled_layer_where_marked(request, monkeypatch):
    if test_device().type != "cpu" and request.node.get_closest_marker("compiled_layer") is None:
        from ls_hf import long_short_plan

        monkeypatch.setattr(long_short_plan.AttentionPlan, "compiled", property(lambda plan: False))


@pytest.fixture(scope="session")  # session scope: hypothesis's @given tests may take it
def device():
    """The torch.device of ``LS_TEST_DEVICE``."""
    return test_device()


@pytest.fixture(scope="session")
def dtype():
    """The floating dtype of ``LS_TEST_DTYPE``: the precision modules and inputs are built in."""
    return test_dtype()
