"""Elastic training whose end the test decides: ``elastic_gated.py STEPS`` under
``asynccoll run --elastic`` (tests/test_elastic_processes.py, tests/test_launcher_nodes.py).

The model and batches of examples/elastic.py, but the processes train on past ``STEPS`` until
the file named by ``GATE`` exists. Each step all-reduces whether a process sees that file, so
the members of a world agree on the step they stop at. A test kills, replaces and lets
processes leave while the training cannot end yet (however slow the machine), then creates
the file. SIGTERM: leave the job after the step in progress. ``TIMEOUT``: seconds a
generation may take to form (30); ``OUT``: a directory to save the final parameters to
(``final-<pid>.npy``). ``elastic_gated.py --replay STEPS`` trains STEPS steps in this process
alone, on the whole batches, and saves the parameters to ``OUT``/replay.npy: what the job's
processes must end with, up to rounding, if they stopped at step STEPS.

Prints ``PID <pid>``; ``WORLD gen=G size=S rank=R resumed_at=N`` for each world it trains in;
``STEP N`` (world rank 0, every 50 steps); ``LEFT at step N``; and at the end
``FINAL steps=N size=S rank=R digest=D``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sys
from pathlib import Path

import numpy as np

from asynccoll import Communicator
from asynccoll.elastic import ElasticGroup
from asynccoll.parallel import MLP, Adam, DistributedModel, as_distributed, train_locally
from asynccoll.parallel.elastic import ElasticTrainer

SIZES = [16, 32, 32, 4]
BATCH = 48


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, SIZES[0]))
    return x, np.tanh(x[:, :SIZES[-1]])


async def main(steps: int) -> None:
    gate = os.environ["GATE"]

    def build(comm: Communicator) -> DistributedModel:
        return as_distributed(MLP(SIZES, seed=0), comm, Adam(lr=3e-3))

    async def step(dist: DistributedModel, n: int) -> bool:
        x, y = batch(n)
        w, r = dist.comm.world_size, dist.comm.rank
        await dist.step((np.array_split(x, w)[r], np.array_split(y, w)[r]))
        await asyncio.sleep(0.01)
        seen = np.array([1.0 if os.path.exists(gate) else 0.0])  # noqa: ASYNC240
        await dist.comm.all_reduce(seen)
        return bool(seen[0] > 0)   # the same on every member of this world

    print(f"PID {os.getpid()}", flush=True)
    timeout = float(os.environ.get("TIMEOUT", "30"))
    async with await ElasticGroup.connect(settle=0.3, timeout=timeout) as group:
        trainer = ElasticTrainer(group, build, commit_every=10)
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, trainer.request_leave)
        await trainer.start()
        seen = 0
        while True:
            opened = await trainer.run_step(step)
            if trainer.left:
                print(f"LEFT at step {trainer.step}", flush=True)
                return
            for gen, size, resumed in trainer.history[seen:]:
                print(f"WORLD gen={gen} size={size} rank={trainer.comm.rank} "
                      f"resumed_at={resumed}", flush=True)
            seen = len(trainer.history)
            if trainer.comm.rank == 0 and trainer.step % 50 == 0:
                print(f"STEP {trainer.step}", flush=True)
            if opened and trainer.step >= steps:
                break
        assert trainer.dist is not None
        params, _, _ = await trainer.dist.full_state()
        print(f"FINAL steps={trainer.step} size={trainer.comm.world_size} "
              f"rank={trainer.comm.rank} "
              f"digest={hashlib.sha256(params.tobytes()).hexdigest()[:16]}", flush=True)
        if os.environ.get("OUT"):
            np.save(Path(os.environ["OUT"]) / f"final-{os.getpid()}.npy", params)


async def replay(steps: int) -> None:
    _, params = await train_locally(MLP(SIZES, seed=0), Adam(lr=3e-3),
                                    (batch(step) for step in range(steps)))
    np.save(Path(os.environ["OUT"]) / "replay.npy", params)


if __name__ == "__main__":
    if sys.argv[1] == "--replay":
        asyncio.run(replay(int(sys.argv[2])))
    else:
        asyncio.run(main(int(sys.argv[1])))
