"""The ``"nccl"`` backend and CuPy host staging on real GPUs.

One rank per GPU, then two ranks as two NCCL "hosts" (which also runs where there is one GPU),
then a timeout that must abort a waiting NCCL kernel and reach the other rank.

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


def _launch(script: str, n: int, **env: str) -> str:
    """``asynccoll run -n n tests/helpers/<script>``; its output, after checking that it
    exited 0 and that every rank printed ``OK rank R``."""
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "asynccoll", "run", "-n", str(n),
                           f"tests/helpers/{script}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for r in range(n):
        assert f"OK rank {r}" in proc.stdout, out[-6000:]
    return out


#: Two ranks on one GPU (see ``split_hosts`` in tests/helpers/nccl_check.py): NCCL takes them
#: for two hosts and connects them through its socket transport, on loopback only.
SPLIT_HOSTS = {"ASYNCCOLL_CHECK_SPLIT_HOSTS": "1", "NCCL_SOCKET_IFNAME": "lo",
               "NCCL_IB_DISABLE": "1"}


@pytest.mark.timeout(600)
def test_nccl_collectives_one_rank_per_gpu(gpus: tuple[Any, int]) -> None:
    _, count = gpus
    _launch("nccl_check.py", min(count, 4))


@pytest.mark.timeout(600)
def test_nccl_collectives_two_ranks_as_two_hosts(gpus: tuple[Any, int]) -> None:
    """Every device path between two ranks, also where the machine has one GPU."""
    _launch("nccl_check.py", 2, **SPLIT_HOSTS)


@pytest.mark.timeout(300)
def test_nccl_timeout_aborts_a_waiting_kernel_and_tells_the_peer(gpus: tuple[Any, int]
                                                                 ) -> None:
    _launch("nccl_abort.py", 2, **SPLIT_HOSTS)


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
