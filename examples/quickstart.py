"""Every collective of asynccoll, once, on every rank.

Launch (processes over TCP on this machine):

    asynccoll run -n 3 examples/quickstart.py

or, without the launcher, all ranks as coroutines of one process:

    python examples/quickstart.py --local 3
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np

import asynccoll
from asynccoll import ReduceOp


async def tour(comm: asynccoll.Communicator) -> None:
    rank, size = comm.rank, comm.world_size

    def say(what: str, value: object) -> None:
        print(f"rank {rank}/{size} {what:<18} {value}", flush=True)

    a = np.arange(4, dtype=np.float32) + rank
    say("all_reduce(sum)", (await comm.all_reduce(a)).tolist())

    b = np.array([rank + 1.0])
    say("all_reduce(max)", (await comm.all_reduce(b, op=ReduceOp.MAX)).tolist())

    c = np.full(3, 7 if rank == 0 else -1, dtype=np.int64)
    say("broadcast", (await comm.broadcast(c, root=0)).tolist())

    d = np.ones(2) * rank
    reduced = await comm.reduce(d, root=size - 1)
    say("reduce", None if reduced is None else reduced.tolist())

    say("reduce_scatter", (await comm.reduce_scatter(np.arange(size * 2.0))).tolist())
    say("all_gather", (await comm.all_gather(np.full(rank + 1, rank))).tolist())

    gathered = await comm.gather(np.array([rank * 10]), root=0)
    say("gather", None if gathered is None else [g.tolist() for g in gathered])

    parts = [np.array([j * j]) for j in range(size)] if rank == 0 else None
    say("scatter", (await comm.scatter(parts, root=0)).tolist())

    mine = [np.array([100 * rank + j]) for j in range(size)]
    say("all_to_all", [x.tolist() for x in await comm.all_to_all(mine)])

    await comm.barrier()
    say("barrier", "passed")

    if size > 1:
        if rank == 0:
            await comm.send(np.array([3.14, 2.72]), dst=1, tag=7)
        elif rank == 1:
            say("recv", (await comm.recv(src=0, tag=7)).tolist())

    cfg = await comm.broadcast_object({"lr": 0.1, "from": rank} if rank == 0 else None)
    say("broadcast_object", cfg)
    say("all_gather_object", await comm.all_gather_object(f"hello from {rank}"))

    evens = await comm.new_group(list(range(0, size, 2)))
    if evens is not None:
        say("new_group(evens)", (await evens.all_reduce(np.array([rank]))).tolist())


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", type=int, metavar="N",
                        help="run N ranks as coroutines of this process (memory backend)")
    args = parser.parse_args()
    if args.local:
        await asynccoll.run_local(tour, world_size=args.local)
        return
    async with await asynccoll.init(backend="tcp") as comm:
        await tour(comm)


if __name__ == "__main__":
    asyncio.run(main())
