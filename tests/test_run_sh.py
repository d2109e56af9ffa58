"""``bash run.sh``: an unknown command is refused before anything is created or installed, the installation shows
pip's progress rather than running silently for minutes, ``test`` runs the quick tier unless ``--all`` is given, and
``gpu-check`` runs the device tests and then the benchmarks on CUDA, or says that there is no GPU."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def run_sh(*args, env=None):
    return subprocess.run(
        ["bash", str(ROOT / "run.sh"), *args],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def stand_ins(folder: Path, log: Path, python: str = "") -> Path:
    """An environment whose python and pip record how they are called (``python``: more shell cases for it, before
    the default exit status 0), and a folder with an ``nvidia-smi`` that answers; returns the environment."""
    bin_dir = folder / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(
        f'#!/bin/sh\necho "python $* [$LS_TEST_DEVICE $LS_TEST_DTYPE]" >> {log}\ncase "$*" in {python} esac\n'
    )
    (bin_dir / "pip").write_text(f'#!/bin/sh\necho "pip $*" >> {log}\n')
    (folder / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: a stand-in'\n")
    for path in (bin_dir / "python", bin_dir / "pip", folder / "nvidia-smi"):
        path.chmod(0o755)
    return folder / "venv"


@pytest.mark.parametrize("args", [["tests"], ["demos", "--output-dir", "x"], []])
def test_unknown_command_is_refused_before_the_environment_is_made(args, tmp_path):
    venv = tmp_path / "venv"
    done = run_sh(*args, env={"VENV": str(venv)})
    assert done.returncode == 2 and "usage: bash run.sh demo|test|gpu-check" in done.stderr
    assert (f"got '{args[0]}'" in done.stderr) if args else "got" not in done.stderr
    assert not venv.exists() and not done.stdout


def test_installation_shows_pips_progress(tmp_path):
    """An environment without the packages: run.sh says what it installs and runs pip with its progress shown
    (nothing is installed: the stand-ins record the calls)."""
    log = tmp_path / "calls"
    venv = stand_ins(tmp_path, log, python='*"import ls_hf"*) exit 1;;')
    done = run_sh("demo", "--output-dir", "out", env={"VENV": str(venv)})
    assert done.returncode == 0, done.stderr
    assert "installing torch, Transformers, timm" in done.stderr and "pip's progress follows" in done.stderr
    calls = log.read_text().splitlines()
    install = next(call for call in calls if call.startswith("pip install"))
    assert "--progress-bar on" in install and " -q" not in install and "-e .[test,bench]" in install
    assert calls[-1].startswith("python -m recipes.demo --output-dir out")


def test_gpu_check_without_a_gpu_says_so_and_succeeds():
    if shutil.which("nvidia-smi") or torch.cuda.is_available():
        pytest.skip("this machine has a GPU: bash run.sh gpu-check runs the CUDA tests and benchmarks here")
    done = run_sh("gpu-check", env={"VENV": "/nonexistent"})  # the check comes before any environment is made
    assert done.returncode == 0, done.stderr
    assert "no GPU found" in done.stdout
    assert not Path("/nonexistent").exists()


def test_gpu_check_takes_no_arguments(tmp_path):
    done = run_sh("gpu-check", "bench", env={"VENV": str(tmp_path / "venv")})
    assert done.returncode == 2 and "gpu-check (no arguments), got 'bench'" in done.stderr
    assert not (tmp_path / "venv").exists()


@pytest.mark.parametrize(
    "args, tier", [(["tests/x.py"], "-m not slow tests/x.py"), (["--all", "tests/x.py"], "tests/x.py")]
)
def test_test_runs_the_quick_tier_unless_all_is_asked(tmp_path, args, tier):
    """``bash run.sh test`` leaves out the slow-marked tests and says so, with how long each tier takes; ``--all``
    runs them too; the other arguments go to pytest after the tier's."""
    log = tmp_path / "calls"
    done = run_sh("test", *args, env={"VENV": str(stand_ins(tmp_path, log))})
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines()[-1].startswith(f"python -m pytest -q -n 2 {tier} [")
    said = "the slow ones too" if args[0] == "--all" else "'bash run.sh test --all' adds the slow tests"
    assert said in done.stderr and "minutes on 2 cores" in done.stderr


@pytest.mark.parametrize("tests_fail", [False, True])
def test_gpu_check_runs_the_device_tests_then_each_benchmark_on_cuda(tmp_path, tests_fail):
    """With a GPU (stand-ins for nvidia-smi and the environment's python): the device tests in float32 and bfloat16,
    then every benchmark with ``--device cuda``, nothing else; a failing test run fails the check, after the
    benchmarks."""
    log = tmp_path / "calls"
    venv = stand_ins(tmp_path, log, python='*"-m pytest"*) exit 1;;' if tests_fail else "")
    done = run_sh("gpu-check", env={"VENV": str(venv), "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert done.returncode == int(tests_fail), done.stderr
    calls = [call for call in log.read_text().splitlines() if " -c " not in call]
    tests = [call for call in calls if "-m pytest" in call]
    assert [call.split("[")[1] for call in tests] == ["cuda float32]", "cuda bfloat16]"]
    assert all("@tests/device_tests.txt" in call for call in tests) and calls[:2] == tests
    benchmarks = [call.split()[2] for call in calls[2:]]
    assert set(benchmarks) == {
        f"bench.{name}" for name in ("bench_attention", "bench_models", "bench_vision", "bench_limits")
    }
    assert all("--device cuda --dtype bf16" in call for call in calls[2:])
    for name in benchmarks:
        assert (ROOT / name.replace(".", "/")).with_suffix(".py").is_file(), name
