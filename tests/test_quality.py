"""The linters CI runs: ``ruff check`` on the code and ``mypy`` on the package (its settings
are in pyproject.toml), and the wheel ships ``py.typed`` for the users' type checkers.

Each is skipped with its reason when the tool is not installed (``pip install ".[test]"``
installs both).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def tool(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed: pip install '.[test]'")


def check(*command: str, timeout: float) -> None:
    res = subprocess.run([sys.executable, "-m", *command], cwd=REPO, capture_output=True,
                         text=True, timeout=timeout, check=False)
    assert res.returncode == 0, f"{' '.join(command)}:\n{res.stdout}{res.stderr}"


def test_ruff() -> None:
    tool("ruff")
    check("ruff", "check", "--no-cache", "asynccoll", "tests", "examples", "benchmarks",
          timeout=120)


@pytest.mark.timeout(300)
def test_mypy(tmp_path: Path) -> None:
    tool("mypy")
    # a cache of its own: runs that share one may race
    check("mypy", "--cache-dir", str(tmp_path / "mypy-cache"), "asynccoll", timeout=280)


def test_package_is_marked_typed() -> None:
    """py.typed lies in the package, and the wheel takes the whole package directory
    (hatchling's ``packages = ["asynccoll"]``), so the wheel ships it."""
    assert (REPO / "asynccoll" / "py.typed").is_file()
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert 'packages = ["asynccoll"]' in pyproject
    assert '"Typing :: Typed"' in pyproject
