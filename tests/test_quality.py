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


def test_mypy_passes_without_the_optional_dependencies() -> None:
    """``mypy asynccoll`` must pass where an optional dependency is not installed (torch has
    no build for every Python version the package supports): every third-party module the
    package imports that is not one of its dependencies is in an override of pyproject's
    ``[tool.mypy]`` with ``ignore_missing_imports`` (type-checked where installed, skipped
    where not)."""
    import ast
    import re
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    required = {re.split(r"[^A-Za-z0-9_.-]", dep, maxsplit=1)[0].lower()
                for dep in config["project"]["dependencies"]}
    ignored = {module for override in config["tool"]["mypy"].get("overrides", [])
               if override.get("ignore_missing_imports")
               for module in override["module"]}
    imported: set[str] = set()
    for path in (REPO / "asynccoll").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    optional = {name for name in imported
                if name not in sys.stdlib_module_names and name not in required
                and name not in {"asynccoll", "__future__"}}
    assert "torch" in optional and "mpi4py" in optional  # (the scan finds them)
    uncovered = sorted(name for name in optional
                       if name not in ignored or f"{name}.*" not in ignored)
    assert not uncovered, f"optional imports mypy fails on where not installed: {uncovered}"
