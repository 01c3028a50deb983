"""The ``"nccl"`` backend and CuPy host staging on real GPUs.

Every test here skips ("CuPy with a CUDA GPU is required") where CuPy or a GPU is missing, as
on this repository's CI machine; tests/test_gpu_logic.py runs the same code paths against a
CPU stand-in for CuPy everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import asynccoll
from asynccoll.gpu import GPU_REQUIRED

ROOT = Path(__file__).resolve().parents[1]


def _gpus() -> tuple[Any, int] | str:
    """(cupy, number of GPUs), or why there is none."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:
        return f"{GPU_REQUIRED} (CuPy is not importable: {exc})"
    if not getattr(nccl, "available", True):
        return f"{GPU_REQUIRED} (this CuPy was built without NCCL)"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver / no device
        return f"{GPU_REQUIRED} (no usable CUDA device: {exc})"
    return (cupy, count) if count else f"{GPU_REQUIRED} (no CUDA device visible)"


@pytest.fixture
def gpus() -> tuple[Any, int]:
    got = _gpus()
    if isinstance(got, str):
        pytest.skip(got)
    return got


@pytest.mark.timeout(600)
def test_nccl_collectives_one_rank_per_gpu(gpus: tuple[Any, int]) -> None:
    _, count = gpus
    n = min(count, 4)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "asynccoll", "run", "-n", str(n),
                           "tests/helpers/nccl_check.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for r in range(n):
        assert f"OK rank {r}" in proc.stdout, out[-6000:]


async def test_host_staging_with_real_cupy(gpus: tuple[Any, int]) -> None:
    cupy, _ = gpus

    async def fn(comm: asynccoll.Communicator) -> Any:
        a = cupy.full(1000, comm.rank + 1.0)
        assert await comm.all_reduce(a) is a
        got = await comm.all_gather(cupy.full((comm.rank + 1, 2), comm.rank))
        return a.get(), got.get()

    for a, got in await asynccoll.run_local(fn, 3, "memory", gpu_staging=True):
        np.testing.assert_array_equal(a, np.full(1000, 6.0))
        np.testing.assert_array_equal(got, np.repeat(np.array([0, 1, 1, 2, 2, 2]), 2)
                                      .reshape(6, 2))
