"""Which of ``pyproject.toml``'s declared dependencies this Python environment lacks, or holds at a version outside the
declared range, and whether ``bash run.sh gpu-check`` can run without them.

``gpu-check`` needs ``GPU_CHECK_NEEDS`` (what the device tests and the GPU bars import) and refuses to run without
one of them; a version outside the declared range is reported, and the check runs with it. The other declared
dependencies serve the recipes (data loading, scoring, distributed launch) and are only reported. The package itself
need not be installed: ``gpu-check`` runs it from this tree.

    python -m bench.dependencies        # the report; exit status 1 when a package gpu-check needs is not installed
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from collections.abc import Callable
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
EXTRAS = ("test", "bench")  # the optional dependencies gpu-check uses
GPU_CHECK_NEEDS = (
    "torch",
    "torchvision",
    "transformers",
    "timm",
    "safetensors",
    "tokenizers",
    "huggingface-hub",
    "pillow",
    "psutil",
    "pytest",
    "pytest-xdist",
    "hypothesis",
    "matplotlib",
)


def normalized(name: str) -> str:
    """A distribution name as PEP 503 compares them: ``huggingface_hub`` and ``Huggingface-Hub`` are one."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(pyproject: Path = PYPROJECT, extras: tuple[str, ...] = EXTRAS) -> list[Requirement]:
    """The project's dependencies and those of ``extras``, as ``packaging`` requirements."""
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = project["dependencies"] + [line for extra in extras for line in project["optional-dependencies"][extra]]
    return [Requirement(line) for line in lines if not line.startswith(project["name"])]


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def problems(
    requirements: list[Requirement], version_of: Callable[[str], str | None] = installed_version
) -> list[tuple[Requirement, str | None]]:
    """(requirement, installed version or None) for each requirement missing here or installed outside its range."""
    found = [(req, version_of(req.name)) for req in requirements]
    return [
        (req, version)
        for req, version in found
        if version is None or not req.specifier.contains(version, prereleases=True)
    ]


def report(found: list[tuple[Requirement, str | None]]) -> tuple[list[str], bool]:
    """Lines saying what is missing or at another version, and whether gpu-check can run: nothing in
    ``GPU_CHECK_NEEDS`` is missing (a version outside the declared range is reported, and the check runs with it)."""
    needs = {normalized(name) for name in GPU_CHECK_NEEDS}
    missing = [req for req, version in found if version is None]
    blocking = [req for req in missing if normalized(req.name) in needs]
    unused = [req for req in missing if normalized(req.name) not in needs]
    elsewhere = [f"{req} ({version} installed)" for req, version in found if version is not None]
    lines = []
    if unused:
        lines.append(
            f"not installed, and not used by gpu-check (the recipes' data, scoring and launch tools use "
            f"them): {', '.join(map(str, unused))}"
        )
    if elsewhere:
        lines.append(f"installed outside the declared range (gpu-check runs with them): {', '.join(elsewhere)}")
    if blocking:
        lines.append(
            f"gpu-check needs these and this environment lacks them: {', '.join(map(str, blocking))}; "
            f"install them (pip install '{blocking[0]}' ...) or carry their wheels, then run it again."
        )
    if not found:
        lines.append("every declared dependency is installed, each in its declared range")
    return lines, not blocking


def main(argv: list[str] | None = None) -> int:
    if argv:
        raise SystemExit(f"usage: python -m bench.dependencies (takes no arguments, got {' '.join(argv)!r})")
    if tomllib is None:
        print("bench.dependencies: reading pyproject.toml needs Python 3.11 or later; no dependency report here.")
        return 0
    lines, runnable = report(problems(declared()))
    for line in lines:
        print(f"{Path(sys.executable).parent.parent}: {line}", file=sys.stdout if runnable else sys.stderr)
    return 0 if runnable else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
