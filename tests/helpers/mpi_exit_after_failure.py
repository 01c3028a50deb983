"""Collectives given up while their data is still moving, then the processes exit.

Run with ``mpirun -n 2 --mca btl tcp,self python tests/helpers/mpi_exit_after_failure.py
[SECONDS]`` (tests/test_mpi.py does). Rank 1 gives up four 32 MiB broadcasts from rank 0
SECONDS after both ranks called them, while their data is still on its way; the world is broken, and
the processes end. MPI_Finalize, which mpi4py calls after Python tore its objects down,
progresses the pending requests: the buffers they read and write must still be there. Prints
``gave up rank R`` (or ``completed``) then ``OK rank R``; freed buffers showed as a segfault,
or a hang in MPI_Finalize ("writev error ... Bad address").

Last of all (after every other exit handler, just before MPI_Finalize) it prints ``pending
at finalize rank R: N``, the number of the failed operations' requests MPI had not
completed: data still moving then raced the peer's exit, and Open MPI 4.1 deadlocked in
MPI_Finalize when its writev hit the closed connection ("writev failed: Broken pipe").
"""

from __future__ import annotations

import atexit
import sys


def _report_pending() -> None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    from asynccoll.transport import mpi_world

    pending = sum(not mpi.Request.Testall(reqs) for reqs, _ in mpi_world._ABANDONED)
    print(f"pending at finalize rank {mpi.COMM_WORLD.Get_rank()}: {pending}", flush=True)


# registered before anything else: runs after every other exit handler
atexit.register(_report_pending)

import asyncio  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import asynccoll  # noqa: E402


async def main(give_up: float) -> None:
    comm = await asynccoll.init(backend="mpi", timeout=30.0, check_signatures=False)
    await comm.barrier()
    # 4 x 32 MiB (mmap'd: unmapped once freed), both ranks issue them as they call them
    arrays = [np.full(4 << 20, comm.rank, np.float64) for _ in range(4)]
    # rank 1 calls them once rank 0 has issued all four (told through a file: an MPI message
    # would queue behind their data): every broadcast is under way on both ranks when rank 1
    # gives up, so each can complete and all the data moves, unless MPI is stopped
    flag = Path(tempfile.gettempdir(), f"asynccoll-exit-after-failure-{os.getppid()}")
    if comm.rank == 0:
        calls = asyncio.gather(*(comm.broadcast(a, root=0) for a in arrays))
        await asyncio.sleep(0.001)
        flag.touch()  # noqa: ASYNC240 (a tiny local file)
    else:
        async with asyncio.timeout(20):
            while not flag.exists():  # noqa: ASYNC110, ASYNC240 (another process's file)
                await asyncio.sleep(0.0002)
        flag.unlink()  # noqa: ASYNC240
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
