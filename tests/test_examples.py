"""The examples run as their docstrings say: ``asynccoll run -n 2 examples/...``, real
processes over TCP, and ``examples/notebook_local.py`` as a script and as notebook cells (in a
running event loop). ``quickstart.py`` is covered by test_launcher.py."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import re
import runpy
import subprocess
import sys

import pytest
from test_launcher import REPO, clean_env


def launch(*args: str, timeout: float = 90, **env: str) -> str:
    res = subprocess.run([sys.executable, "-m", "asynccoll", "run", *args], cwd=REPO,
                         env=clean_env(**env), capture_output=True, text=True,
                         timeout=timeout, check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    return out


def losses(out: str) -> list[float]:
    return [float(m) for m in re.findall(r"test loss after \d+ steps ([0-9.]+)", out)]


@pytest.mark.timeout(120)
def test_train_ddp_example() -> None:
    out = launch("-n", "2", "examples/train_ddp.py", "--steps", "100")
    got = losses(out)
    assert len(got) == 2 and got[0] == got[1], out     # both ranks hold the same model
    assert got[0] < 0.02, out                           # it learned (starts near 0.2)


@pytest.mark.timeout(120)
def test_train_ddp_example_with_torch() -> None:
    pytest.importorskip("torch")
    out = launch("-n", "2", "examples/train_ddp.py", "--steps", "100", "--torch")
    got = losses(out)
    assert len(got) == 2 and got[0] == got[1], out
    assert got[0] < 0.02, out


@pytest.mark.timeout(120)
def test_train_zero3_example() -> None:
    out = launch("-n", "2", "examples/train_zero3.py", "--steps", "40")
    held = re.findall(r"rank (\d): holds ([0-9.]+) MB \(DDP would hold ([0-9.]+) MB\)", out)
    assert len(held) == 2, out
    for _, mine, ddp in held:
        assert float(mine) <= float(ddp) / 2 * 1.05, out
    assert re.search(r"checkpoint in .*: 8 arrays, 142602 parameters", out), out


def test_launcher_shares_the_cores_between_blas_pools() -> None:
    script = REPO / "tests" / "helpers" / "print_env.py"
    out = launch("-n", "2", str(script))
    assert re.findall(r"OMP (\d+)", out) and "OMP None" not in out, out
    out = launch("-n", "2", str(script), OMP_NUM_THREADS="3")
    assert out.count("OMP 3") == 2, out


def stated(example: str, pattern: str) -> float:
    """A figure an example's docstring states (so that the docstring cannot drift)."""
    doc = ast.get_docstring(ast.parse((REPO / "examples" / example).read_text("utf-8"))) or ""
    match = re.search(pattern, doc, flags=re.DOTALL)
    assert match, f"{example}'s docstring does not state {pattern!r}"
    return float(match.group(1))


@pytest.mark.timeout(120)
def test_train_digits_example_reaches_its_stated_accuracy() -> None:
    pytest.importorskip("sklearn")
    out = launch("-n", "2", "examples/train_digits.py")
    got = re.findall(r"rank (\d): test accuracy ([0-9.]+) \((\d+) of (\d+)\)", out)
    assert sorted(r for r, *_ in got) == ["0", "1"], out
    assert len({acc for _, acc, _, _ in got}) == 1, out        # both ranks hold the same model
    accuracy = float(got[0][1])
    claim = stated("train_digits.py", r"test accuracy of ([0-9.]+)\*\*")
    # the same arithmetic on another CPU or BLAS may round differently: a few images
    assert abs(accuracy - claim) <= 0.011, (accuracy, claim, out)
    assert "epoch 20/20" in out, out                            # rank 0's progress bar
    assert "[1] epoch" not in out, out                          # and only rank 0's


def test_train_digits_plain_progress_bar_without_tqdm(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("train_digits",
                                                  REPO / "examples" / "train_digits.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "tqdm", None)              # import tqdm: ImportError
    bar = module.progress_bar(4, "epoch 1/1")
    for _ in range(4):
        bar.update(1)
    bar.set_postfix_str("loss 0.5")
    bar.close()
    assert capsys.readouterr().out == f"epoch 1/1 [{'#' * 30}] 4/4 loss 0.5\n"


NOTEBOOK_LINES = [
    "all_reduce: [[10.0, 10.0, 10.0], [10.0, 10.0, 10.0], [10.0, 10.0, 10.0], [10.0, 10.0, 10.0]]",
    "reduce_scatter     rank 0: [0.0]  rank 1: [3.0]  rank 2: [6.0]",
    "all_to_all         rank 0: [[0], [10], [20]]  rank 1: [[1], [11], [21]]  rank 2: [[2], "
    "[12], [22]]",
    "rank 0: received [3] from its left neighbour; in the even group: (0, [2])",
    "in flight: ([3.0, 3.0, 3.0, 3.0], [0, 1, 2])",
    "weights equal to the single process's: True",
    "tcp all_reduce: [[10.0, 10.0, 10.0]",
]


@pytest.mark.timeout(120)
def test_notebook_local_runs_as_a_script() -> None:
    res = subprocess.run([sys.executable, "examples/notebook_local.py"], cwd=REPO,
                         env=clean_env(), capture_output=True, text=True, timeout=90,
                         check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    for line in NOTEBOOK_LINES:
        assert line in out, (line, out)
    assert re.search(r"^CollectiveError: collective mismatch: .*\(3,\).*\(4,\)", out,
                     flags=re.MULTILINE), out
    assert re.search(r"^CollectiveTimeout: barrier\(\) .* within 0.5 s", out,
                     flags=re.MULTILINE), out
    assert out.count("weights equal to the single process's: True") == 2, out


@pytest.mark.timeout(120)
async def test_notebook_local_runs_in_a_running_event_loop(
        capsys: pytest.CaptureFixture[str]) -> None:
    """In Jupyter the cells run while an event loop runs (as here, in an async test)."""
    asyncio.get_running_loop()
    await asyncio.to_thread(lambda: None)                # a loop that really runs
    runpy.run_path(str(REPO / "examples" / "notebook_local.py"), run_name="__notebook__")
    out = capsys.readouterr().out
    for line in NOTEBOOK_LINES:
        assert line in out, (line, out)


def test_every_example_is_run_by_a_test() -> None:
    """A new example needs a test that runs it (with small settings), here or next to the
    feature it shows."""
    tests = {p.name: p.read_text("utf-8") for p in (REPO / "tests").glob("test_*.py")}
    for example in sorted((REPO / "examples").glob("*.py")):
        runners = [name for name, text in tests.items()
                   if f"examples/{example.name}" in text or f'"{example.name}"' in text]
        assert runners, f"no test runs examples/{example.name}"


def test_quickstart_local_prints_what_getting_started_shows() -> None:
    """``python examples/quickstart.py --local 3`` (the launcher's run is test_launcher's):
    docs/getting_started.md says it prints the same lines as the processes do."""
    res = subprocess.run([sys.executable, "examples/quickstart.py", "--local", "3"], cwd=REPO,
                         env=clean_env(), capture_output=True, text=True, timeout=60,
                         check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    doc = (REPO / "docs" / "getting_started.md").read_text("utf-8")
    shown = re.findall(r"^\[\d\] (rank \d/3 .*)$", doc, flags=re.MULTILINE)
    assert len(shown) > 10, shown
    for line in shown:
        assert line in out.splitlines(), (line, out)
