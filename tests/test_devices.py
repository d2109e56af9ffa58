"""The test device/dtype settings (tests/devices.py), the GPU run's selection of tests, the dependency report
(bench/dependencies.py), and ``bash run.sh gpu-check`` on a machine without a GPU."""

import ast
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from packaging.requirements import Requirement

from bench import dependencies
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
FIRST_PARTY = ("ls_hf", "ls_timm", "tests", "bench", "recipes")


def test_gpu_check_without_a_gpu_says_so_and_succeeds():
    if shutil.which("nvidia-smi") or torch.cuda.is_available():
        pytest.skip("this machine has a GPU: bash run.sh gpu-check runs the CUDA tests and benchmarks here")
    env = {**os.environ, "VENV": "/nonexistent"}  # the check comes before any environment is made
    done = subprocess.run(
        ["bash", str(ROOT / "run.sh"), "gpu-check"], capture_output=True, text=True, env=env, check=False, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "no GPU found" in done.stdout
    assert not Path("/nonexistent").exists()


@pytest.mark.parametrize("args", [["benchmarks"], ["tests", "float16"], ["bench", "bfloat16"], ["profile", "float32"]])
def test_gpu_check_refuses_unknown_arguments_before_anything_runs(args):
    """An unknown part, an unknown precision, or a precision after anything but 'tests': usage error, exit 2."""
    env = {**os.environ, "VENV": "/nonexistent"}
    done = subprocess.run(
        ["bash", str(ROOT / "run.sh"), "gpu-check", *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=60,
    )
    assert done.returncode == 2
    assert "gpu-check [tests [float32|bfloat16]|bench|profile]" in done.stderr and f"'{' '.join(args)}'" in done.stderr
    assert not Path("/nonexistent").exists()


def test_device_test_list_names_existing_test_files():
    listed = (ROOT / "tests" / "device_tests.txt").read_text().split()
    assert listed and len(set(listed)) == len(listed)
    for name in listed:
        assert (ROOT / name).is_file() and Path(name).name.startswith("test_"), name
    assert "tests/test_attention.py" in listed


def _module_file(name: str) -> Path | None:
    path = ROOT / name.replace(".", "/")
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, in functions too, relative imports resolved (``from x import y``: ``x`` and
    ``x.y``, which may be a module)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


def _third_party_imports(paths: list[Path]) -> set[str]:
    """Top-level names of the third-party modules that ``paths`` import, following this repository's modules."""
    seen, found, queue = set(), set(), list(paths)
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imported_modules(path):
            if name.split(".")[0] in FIRST_PARTY:
                queue += [file for file in [_module_file(name)] if file]
            elif name.split(".")[0] not in sys.stdlib_module_names:
                found.add(name.split(".")[0])
    return found


def test_device_tests_need_only_what_gpu_check_needs():
    """The device list's files, and every module of this repository they import, import no declared dependency
    outside ``GPU_CHECK_NEEDS`` (the recipes' data loading needs ``datasets``, which a GPU image may lack)."""
    listed = [ROOT / name for name in (ROOT / "tests" / "device_tests.txt").read_text().split()]
    distributions = importlib.metadata.packages_distributions()
    declared = {dependencies.normalized(req.name) for req in dependencies.declared()}
    needs = {dependencies.normalized(name) for name in dependencies.GPU_CHECK_NEEDS}
    used = {
        dependencies.normalized(dist) for name in _third_party_imports(listed) for dist in distributions.get(name, [])
    }
    assert used & declared <= needs, sorted((used & declared) - needs)
    assert {"torch", "transformers", "timm", "hypothesis"} <= used


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


# ----------------------------------------------------------------------------------------- dependencies
def test_declared_dependencies_come_from_pyproject():
    names = {dependencies.normalized(req.name) for req in dependencies.declared()}
    assert {"torch", "transformers", "timm", "datasets", "pytest", "hypothesis", "matplotlib"} <= names
    assert "transformer-ls" not in names and "ruff" not in names  # itself and the dev extra are not read
    assert {dependencies.normalized(name) for name in dependencies.GPU_CHECK_NEEDS} <= names


def test_report_names_what_is_missing_and_refuses_only_for_what_gpu_check_needs():
    requirements = dependencies.declared()
    # an environment with every declared dependency at its lower bound (whatever this one holds), then an offline GPU
    # image: no datasets or accelerate, torch 2.11.0, an older scikit-learn
    lowest = {
        req.name: next((s.version for s in req.specifier if s.operator in (">=", "==")), "1.0") for req in requirements
    }
    image = {"datasets": None, "accelerate": None, "torch": "2.11.0", "scikit-learn": "1.3.0"}

    def version_of(name, changed=image):
        return changed[name] if name in changed else lowest[name]

    found = dependencies.problems(requirements, version_of)
    assert [(str(req), version) for req, version in found] == [("accelerate>=1.0", None), ("datasets>=3.0", None)]
    lines, runnable = dependencies.report(found)
    assert runnable and len(lines) == 1 and "accelerate>=1.0, datasets>=3.0" in lines[0] and "not used by" in lines[0]
    other_torch = dependencies.problems(requirements, lambda name: version_of(name, {**image, "torch": "2.10.1"}))
    lines, runnable = dependencies.report(other_torch)
    assert (
        runnable and "outside the declared range (gpu-check runs with them): torch>=2.11 (2.10.1 installed)" in lines[1]
    )
    no_torch = dependencies.problems(requirements, lambda name: version_of(name, {**image, "torch": None}))
    lines, runnable = dependencies.report(no_torch)
    assert not runnable and lines[-1].startswith("gpu-check needs these and this environment lacks them: torch>=2.11;")
    assert dependencies.report([]) == (["every declared dependency is installed, each in its declared range"], True)
    assert dependencies.problems([Requirement("pytest>=8.2")], lambda name: "9.0.0rc1") == []


def test_dependency_report_runs_in_this_environment():
    done = subprocess.run(
        [sys.executable, "-m", "bench.dependencies"], cwd=ROOT, capture_output=True, text=True, check=False, timeout=120
    )
    expected_rc = 0 if dependencies.report(dependencies.problems(dependencies.declared()))[1] else 1
    assert done.returncode == expected_rc and sys.prefix in done.stdout + done.stderr
    refused = subprocess.run(
        [sys.executable, "-m", "bench.dependencies", "now"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert refused.returncode == 1 and "takes no arguments" in refused.stderr


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
