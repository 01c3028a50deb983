"""Elastic data-parallel training: kill a worker or start a new one, training goes on.

    asynccoll run -n 3 --min-nodes 2 --max-nodes 4 examples/elastic.py
    asynccoll run -n 3 --min-nodes 2 --max-nodes 4 --max-restarts 1 examples/elastic.py

While it runs, `kill -9` one of the workers (each prints its PID): the others fall back to their
last commit (at most --commit-every steps ago), re-form at world size 2 and go on. `kill` it
instead (SIGTERM, as a scheduler does before it preempts a machine) and it leaves gracefully:
the job commits the step it finished, the others go on from there without redoing any. With
--max-restarts the launcher starts a replacement, which joins, receives the state, and the
world grows back. A process started by hand with the launcher's rendezvous address and token
(ASYNCCOLL_RENDEZVOUS, ASYNCCOLL_TOKEN, ASYNCCOLL_MIN_NODES/MAX_NODES) joins the same way.

Each step's batch is a function of the step number, split over the current world, so the
result equals one process doing the same steps on the whole batches (`--replay` computes
that), up to floating-point rounding.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from asynccoll import Communicator
from asynccoll.elastic import ElasticGroup
from asynccoll.parallel import MLP, Adam, DistributedModel, as_distributed, train_locally
from asynccoll.parallel.elastic import ElasticTrainer

SIZES = [16, 32, 32, 4]
BATCH = 48          # divisible by 1, 2, 3 and 4 ranks


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, SIZES[0]))
    return x, np.tanh(x[:, :SIZES[-1]]) + 0.1 * rng.standard_normal((BATCH, SIZES[-1]))


def digest(params: np.ndarray) -> str:
    return hashlib.sha256(params.tobytes()).hexdigest()[:16]


async def replay(steps: int) -> np.ndarray:
    """The same steps in one process, on the whole batches."""
    _, params = await train_locally(MLP(SIZES, seed=0), Adam(lr=3e-3),
                                    (batch(step) for step in range(steps)))
    return params


async def train(args: argparse.Namespace) -> None:
    def build(comm: Communicator) -> DistributedModel:
        return as_distributed(MLP(SIZES, seed=0), comm, Adam(lr=3e-3), strategy=args.strategy)

    async def step(dist: DistributedModel, n: int) -> float:
        x, y = batch(n)
        w, r = dist.comm.world_size, dist.comm.rank
        loss = await dist.step((np.array_split(x, w)[r], np.array_split(y, w)[r]))
        if args.step_delay:
            await asyncio.sleep(args.step_delay)     # stands for a bigger model's compute
        return loss

    print(f"PID {os.getpid()}", flush=True)
    async with await ElasticGroup.connect(settle=args.settle, timeout=args.timeout) as group:
        trainer = ElasticTrainer(group, build, commit_every=args.commit_every)
        # SIGTERM: leave after the step in progress, without costing the others any step
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, trainer.request_leave)
        await trainer.start()
        seen = 0
        while trainer.step < args.steps:
            loss = await trainer.run_step(step)
            if trainer.left:
                print(f"LEFT at step {trainer.step}", flush=True)
                return
            for gen, size, resumed in trainer.history[seen:]:
                print(f"WORLD gen={gen} size={size} rank={trainer.comm.rank} "
                      f"resumed_at={resumed}", flush=True)
            seen = len(trainer.history)
            if trainer.comm.rank == 0 and trainer.step % 50 == 0:
                print(f"STEP {trainer.step} loss {loss:.5f} world {trainer.comm.world_size}",
                      flush=True)
        assert trainer.dist is not None
        params, _, _ = await trainer.dist.full_state()
        print(f"FINAL steps={trainer.step} size={trainer.comm.world_size} "
              f"rank={trainer.comm.rank} digest={digest(params)}", flush=True)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240
            np.save(Path(args.out) / f"final-{os.getpid()}.npy", params)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "zero1", "zero2", "zero3"])
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument("--step-delay", type=float, default=0.01,
                        help="seconds each step sleeps (time to kill a worker by hand)")
    parser.add_argument("--settle", type=float, default=0.5,
                        help="seconds a forming generation waits for more processes")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--out", help="directory to save the final parameters to")
    parser.add_argument("--replay", action="store_true",
                        help="train in this process alone and print the digest to compare with")
    args = parser.parse_args()
    if args.replay:
        t = time.perf_counter()
        params = await replay(args.steps)
        print(f"REPLAY steps={args.steps} digest={digest(params)} "
              f"({time.perf_counter() - t:.1f} s)", flush=True)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240
            np.save(Path(args.out) / "replay.npy", params)
        return
    if "ASYNCCOLL_ELASTIC" not in os.environ and "ASYNCCOLL_RENDEZVOUS" not in os.environ:
        sys.exit("start with: asynccoll run -n 3 --min-nodes 2 --max-nodes 4 examples/elastic.py")
    await train(args)


if __name__ == "__main__":
    asyncio.run(main())
