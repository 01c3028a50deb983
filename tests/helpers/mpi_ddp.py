"""DDP training over the mpi backend, checked against one process on the whole batches.

Run with ``mpirun -n 2 python tests/helpers/mpi_ddp.py [STRATEGY ...]`` (tests/test_mpi.py
does; default ``ddp``); prints ``OK rank R STRATEGY`` when this rank's parameters match the
single-process reference and every rank holds bit-identical parameters; exits non-zero (an
AssertionError traceback) otherwise.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

import asynccoll
from asynccoll.parallel import SGD, FlatLayout, as_distributed, split_batch
from asynccoll.parallel.mlp import MLP
from asynccoll.parallel.model import Model

SIZES = [5, 7, 4, 3]
BATCH = 12
STEPS = 4


def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((BATCH, SIZES[0])), rng.standard_normal((BATCH, SIZES[-1])))
            for _ in range(STEPS)]


def flatten(model: Model) -> np.ndarray:
    return np.concatenate([model.parameters()[s.name].reshape(-1) for s in model.param_specs()])


async def reference() -> np.ndarray:
    """One process, whole batches."""
    model = MLP(SIZES, seed=3)
    lay = FlatLayout(model.param_specs(), 1, 0)
    params, grads = flatten(model), np.zeros(lay.size)
    model.bind(params=lay.views(params), grads=lay.views(grads))
    opt = SGD(lr=0.05, momentum=0.9)
    for batch in batches():
        grads.fill(0)
        await model.forward_backward(batch)
        opt.step(params, grads)
    return params


async def main(strategies: list[str]) -> None:
    want = await reference()
    async with await asynccoll.init(backend="mpi", timeout=30.0) as comm:
        for strategy in strategies:
            await train(comm, strategy, want)


async def train(comm: asynccoll.Communicator, strategy: str, want: np.ndarray) -> None:
    """A few steps of ``strategy``; checks the parameters against ``want``."""
    # rank 0's initial parameters win (DDP broadcasts them)
    model = MLP(SIZES, seed=3 if comm.rank == 0 else 100 + comm.rank)
    dist = as_distributed(model, comm, SGD(lr=0.05, momentum=0.9), strategy=strategy,
                          bucket_bytes=200)  # several buckets in flight at once
    for batch in batches():
        await dist.step(split_batch(batch, comm.rank, comm.world_size))
    full = await dist.full_parameters()
    got = np.concatenate([full[s.name].reshape(-1) for s in model.param_specs()])
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    every = await comm.all_gather(got[None])
    assert all(row.tobytes() == got.tobytes() for row in every), "ranks disagree"
    print(f"OK rank {comm.rank} {strategy}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:] or ["ddp"]))
