"""``bash run.sh``: an unknown command is refused before anything is created or installed, and the installation
shows pip's progress rather than running silently for minutes."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("args", [["tests"], ["demos", "--output-dir", "x"], []])
def test_unknown_command_is_refused_before_the_environment_is_made(args, tmp_path):
    venv = tmp_path / "venv"
    done = subprocess.run(
        ["bash", str(ROOT / "run.sh"), *args],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "VENV": str(venv)},
        timeout=60,
    )
    assert done.returncode == 2 and "usage: bash run.sh demo|test|gpu-check" in done.stderr
    assert (f"got '{args[0]}'" in done.stderr) if args else "got" not in done.stderr
    assert not venv.exists() and not done.stdout


def test_installation_shows_pips_progress(tmp_path):
    """An environment without the packages: run.sh says what it installs and runs pip with its progress shown. The
    environment's python and pip are stand-ins that record how they are called (nothing is installed)."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls"
    (bin_dir / "python").write_text(
        f'#!/bin/sh\necho "python $*" >> {log}\ncase "$*" in *"import ls_hf"*) exit 1;; esac\n'
    )
    (bin_dir / "pip").write_text(f'#!/bin/sh\necho "pip $*" >> {log}\n')
    for name in ("python", "pip"):
        (bin_dir / name).chmod(0o755)
    done = subprocess.run(
        ["bash", str(ROOT / "run.sh"), "demo", "--output-dir", "out"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "VENV": str(tmp_path / "venv")},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "installing torch, Transformers, timm" in done.stderr and "pip's progress follows" in done.stderr
    calls = log.read_text().splitlines()
    install = next(call for call in calls if call.startswith("pip install"))
    assert "--progress-bar on" in install and " -q" not in install and "-e .[test,bench]" in install
    assert calls[-1] == "python -m recipes.demo --output-dir out"
