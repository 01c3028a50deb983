"""A message nobody receives, then the processes end.

Run with ``mpirun -n 2 --mca btl tcp,self python tests/helpers/mpi_unreceived.py MODE``
(tests/test_mpi.py does). Rank 0 sends rank 1 a 64 MiB message rank 1 never asks for, then a
small one it receives: receiving the small one, rank 1 learns of the large one and starts
taking its payload. Then, by MODE: ``close`` closes the world; ``noclose`` ends without
closing it; ``group`` does this on a subgroup that is dropped unclosed while the world goes
on. MPI still moves that payload (and the sender's copy) afterwards, so neither may be freed
before MPI is done: prints ``OK rank R``; a freed buffer was a segfault, or a hang in
MPI_Finalize ("writev error ... Bad address").
"""

from __future__ import annotations

import asyncio
import gc
import sys

import numpy as np

import asynccoll


async def main(mode: str) -> None:
    comm = await asynccoll.init(backend="mpi", timeout=5.0)
    c = comm
    if mode == "group":
        sub = await comm.new_group([1, 0])
        assert sub is not None
        c = sub
    sender = c.rank == (1 if mode == "group" else 0)
    if sender:
        await c.send(np.ones(8 << 20), 1 - c.rank, tag=2)  # never received
        await c.send(np.ones(3), 1 - c.rank, tag=1)
    else:
        await asyncio.sleep(0.2)
        got = await c.recv(1 - c.rank, tag=1)
        assert got.tolist() == [1.0, 1.0, 1.0]
    if mode == "group":
        del c, sub
        gc.collect()  # the subgroup is gone; the world goes on
        await comm.all_reduce(np.ones(1 << 20))
        await comm.barrier()
    if mode != "noclose":
        await comm.close()
    print(f"OK rank {comm.rank}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
