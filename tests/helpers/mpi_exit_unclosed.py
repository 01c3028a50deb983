"""A rank that ends without closing its world while another waits for it.

Run with ``mpirun -n 2 python tests/helpers/mpi_exit_unclosed.py MODE`` (tests/test_mpi.py
does). After a barrier, rank 1 ends without closing its communicator, by MODE: ``raise``
(an uncaught exception out of ``asyncio.run``), ``exit`` (``sys.exit(3)``) or ``drop`` (it
drops the communicator unclosed, then waits 1 s and ends normally). Rank 0 meanwhile waits
in an all_reduce rank 1 never calls (timeout 30 s) and prints what it raised and after how
long: ``RESULT <class> <rank> <seconds> <message>``.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time

import numpy as np

import asynccoll


async def main(mode: str) -> None:
    comm = await asynccoll.init(backend="mpi", timeout=30.0)
    await comm.barrier()
    if comm.rank == 1:
        await asyncio.sleep(0.3)
        if mode == "raise":
            raise RuntimeError("rank 1 gives up")
        if mode == "exit":
            sys.exit(3)
        del comm
        gc.collect()
        await asyncio.sleep(1.0)
        return
    t0 = time.monotonic()
    try:
        await comm.all_reduce(np.ones(3))
        print("RESULT ok", flush=True)
    except asynccoll.CollectiveError as exc:
        print(f"RESULT {type(exc).__name__} {getattr(exc, 'rank', None)} "
              f"{time.monotonic() - t0:.2f} {exc}", flush=True)
    await comm.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
