"""The training examples run as their docstrings say: ``asynccoll run -n 2 examples/...``,
real processes over TCP."""

from __future__ import annotations

import re
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
