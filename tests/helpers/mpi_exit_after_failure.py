"""Collectives given up while their data is still moving, then the processes exit.

Run with ``mpirun -n 2 --mca btl tcp,self python tests/helpers/mpi_exit_after_failure.py
[SECONDS]`` (tests/test_mpi.py does). Rank 1 gives up four 32 MiB broadcasts from rank 0
SECONDS after calling them, while their data is still on its way; the world is broken, and
the processes end. MPI_Finalize, which mpi4py calls after Python tore its objects down,
progresses the pending requests: the buffers they read and write must still be there. Prints
``gave up rank R`` (or ``completed``) then ``OK rank R``; freed buffers showed as a segfault,
or a hang in MPI_Finalize ("writev error ... Bad address").
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

import asynccoll


async def main(give_up: float) -> None:
    comm = await asynccoll.init(backend="mpi", timeout=30.0, check_signatures=False)
    await comm.barrier()
    # 4 x 32 MiB (mmap'd: unmapped once freed), both ranks issue them as they call them
    arrays = [np.full(4 << 20, comm.rank, np.float64) for _ in range(4)]
    calls = asyncio.gather(*(comm.broadcast(a, root=0) for a in arrays))
    try:
        if comm.rank == 1:
            async with asyncio.timeout(give_up):
                await calls
        else:
            await calls
        print(f"completed rank {comm.rank}", flush=True)
    except (TimeoutError, asynccoll.CollectiveError):
        print(f"gave up rank {comm.rank}", flush=True)
    del arrays, calls
    await comm.close()
    print(f"OK rank {comm.rank}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1]) if len(sys.argv) > 1 else 0.005))
