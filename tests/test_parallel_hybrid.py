"""Hybrid data x pipeline x tensor parallelism equals the unsplit model in one process."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_world

from asynccoll import Communicator
from asynccoll.parallel import MLP, SGD, Adam, Optimizer, train_locally
from asynccoll.parallel.hybrid import Hybrid, TensorParallelStage

SIZES = [6, 9, 7, 5, 8, 3]      # 5 layers: uneven stages and uneven tensor splits
BATCH = 12
STEPS = 3


def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(5)
    return [(rng.standard_normal((BATCH, SIZES[0])), rng.standard_normal((BATCH, SIZES[-1])))
            for _ in range(STEPS)]


def make_opt(name: str) -> Optimizer:
    return SGD(lr=0.1, momentum=0.9) if name == "sgd" else Adam(lr=0.01)


async def reference(opt_name: str) -> tuple[list[float], np.ndarray]:
    return await train_locally(MLP(SIZES, seed=2), make_opt(opt_name), batches())


CONFIGS = [  # (data, pipe, tensor, strategy, optimizer, micro-batches, schedule)
    (2, 2, 1, "ddp", "sgd", 3, "1f1b"),
    (1, 2, 2, "ddp", "adam", 2, "gpipe"),
    (2, 1, 2, "zero2", "adam", 1, "1f1b"),
    (2, 2, 2, "ddp", "sgd", 2, "1f1b"),
    (2, 2, 2, "zero3", "adam", 3, "gpipe"),
    (2, 2, 2, "zero1", "sgd", 2, "1f1b"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "x".join(map(str, c[:3])) + "-"
                         + "-".join(map(str, c[3:])))
async def test_hybrid_equals_one_process(config: tuple) -> None:
    data, pipe, tensor, strategy, opt_name, micro, schedule = config
    want_losses, want = await reference(opt_name)

    async def rank(comm: Communicator) -> tuple[list[float], np.ndarray]:
        hybrid = await Hybrid.create(comm, MLP(SIZES, seed=2), data=data, pipe=pipe,
                                     tensor=tensor, optimizer=make_opt(opt_name),
                                     strategy=strategy, micro_batches=micro, schedule=schedule)
        if tensor > 1:
            assert isinstance(hybrid.stage, TensorParallelStage)
        losses = [await hybrid.step(b) for b in batches()]
        full = await hybrid.full_parameters()
        return losses, np.concatenate([full[f"layers.{i}.{k}"].reshape(-1)
                                       for i in range(len(SIZES) - 1)
                                       for k in ("weight", "bias")])

    for losses, params in await run_world(rank, data * pipe * tensor, "memory"):
        np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
        np.testing.assert_allclose(params, want, rtol=1e-6, atol=1e-12)


async def test_hybrid_over_tcp() -> None:
    want_losses, want = await reference("adam")

    async def rank(comm: Communicator) -> tuple[list[float], np.ndarray]:
        hybrid = await Hybrid.create(comm, MLP(SIZES, seed=2), data=2, pipe=2, tensor=2,
                                     optimizer=make_opt("adam"), strategy="zero2",
                                     micro_batches=2)
        losses = [await hybrid.step(b) for b in batches()]
        full = await hybrid.full_parameters()
        return losses, np.concatenate([full[f"layers.{i}.{k}"].reshape(-1)
                                       for i in range(len(SIZES) - 1)
                                       for k in ("weight", "bias")])

    for losses, params in await run_world(rank, 8, "tcp"):
        np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
        np.testing.assert_allclose(params, want, rtol=1e-6, atol=1e-12)


async def test_hybrid_shape_must_match_the_world() -> None:
    async def rank(comm: Communicator) -> None:
        with pytest.raises(ValueError, match="ranks"):
            await Hybrid.create(comm, MLP(SIZES), data=2, pipe=2, tensor=2, optimizer=SGD(0.1))

    await run_world(rank, 4, "memory")


@pytest.mark.timeout(90)
def test_hybrid_example_with_8_processes() -> None:
    import re
    import subprocess
    import sys

    from test_launcher import REPO, clean_env

    res = subprocess.run([sys.executable, "-m", "asynccoll", "run", "-n", "8",
                          "examples/train_hybrid.py", "--steps", "20"], cwd=REPO,
                         env=clean_env(), capture_output=True, text=True, timeout=80,
                         check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert len(re.findall(r"rank \d: data \d pipe \d tensor \d", out)) == 8, out
    err = re.search(r"largest relative difference to one process ([0-9.e+-]+)", out)
    assert err and float(err.group(1)) < 1e-6, out
