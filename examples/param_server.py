"""Asynchronous SGD with a parameter server: rank 0 holds the parameters, the other ranks
train at their own pace, each on its own batches, without waiting for one another.

    asynccoll run --elastic -n 4 examples/param_server.py  # 1 server + 3 workers over TCP
    python examples/param_server.py --local 4              # the same in one process
    asynccoll run --elastic -n 5 examples/param_server.py --servers 2 --max-staleness 2 \
        --stale reject

Each worker pulls the current parameters, computes a gradient on its batch and pushes it;
the server applies every push as it arrives. A push computed on parameters more than
``--max-staleness`` versions old is scaled down (``--stale scale``) or dropped
(``--stale reject``). The world runs with ``peer_loss="isolate"``, so a worker that dies is
dropped by the server while the others go on (try ``--die-after 20``: the last worker kills
itself). ``--elastic`` keeps the launcher from stopping every rank when one fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

import numpy as np

import asynccoll
from asynccoll.parallel import MLP, SGD
from asynccoll.parallel.param_server import AsyncSGD

SIZES = [16, 64, 64, 1]


def batch(rng: np.random.Generator, w: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((n, SIZES[0]))
    return x, np.sin(x @ w)


async def train(comm: asynccoll.Communicator, args: argparse.Namespace) -> None:
    model = MLP(SIZES, seed=0)
    opt = AsyncSGD(model, comm, servers=range(args.servers),
                   optimizer=SGD(lr=args.lr, momentum=0.5),
                   max_staleness=None if args.max_staleness < 0 else args.max_staleness,
                   stale=args.stale)
    w = np.random.default_rng(0).standard_normal((SIZES[0], 1)) / 4
    if opt.is_server:
        stats = await opt.serve()
        print(f"server {comm.rank}: version {stats.version}, accepted {stats.accepted}, "
              f"scaled {stats.scaled}, rejected {stats.rejected}, lost {list(stats.lost)}",
              flush=True)
        for r, ws in stats.workers.items():
            print(f"server {comm.rank}:   worker {r}: {ws.state}, {ws.pulls} pulls, "
                  f"{ws.accepted} accepted, {ws.scaled} scaled, {ws.rejected} rejected, "
                  f"staleness up to {ws.max_staleness}", flush=True)
        return
    rng = np.random.default_rng(comm.rank)          # every worker its own data
    test = batch(np.random.default_rng(999), w, 512)
    last = comm.world_size - 1
    for step in range(args.steps):
        loss = await opt.step(batch(rng, w, 32))
        if step % 25 == 0:
            print(f"worker {comm.rank}: step {step:4d}  loss {loss:.5f}  "
                  f"staleness {opt.last_push[0].staleness}", flush=True)
        if args.die_after and comm.rank == last and step + 1 == args.die_after:
            print(f"worker {comm.rank}: dying without a word", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)      # a crash: no goodbye, a failed exit
    await opt.parameters()                          # the latest model, into `model`
    final = await model.loss(test)
    print(f"worker {comm.rank}: test loss after {args.steps} steps {final:.5f}", flush=True)
    await opt.finish()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", type=int, metavar="N", help="N ranks in this process")
    parser.add_argument("--steps", type=int, default=200, help="steps per worker")
    parser.add_argument("--servers", type=int, default=1, help="ranks 0..S-1 are servers")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--max-staleness", type=int, default=4,
                        help="staleness bound; -1 applies every push (Hogwild)")
    parser.add_argument("--stale", choices=["scale", "reject"], default="scale")
    parser.add_argument("--die-after", type=int, default=0, metavar="K",
                        help="the last worker kills itself after K steps (processes only)")
    args = parser.parse_args()
    if args.local:
        await asynccoll.run_local(lambda c: train(c, args), args.local)
        return
    # timeout: must exceed a worker's longest step, which is milliseconds here
    async with await asynccoll.init(backend="tcp", peer_loss="isolate", timeout=60) as comm:
        await train(comm, args)


if __name__ == "__main__":
    asyncio.run(main())
