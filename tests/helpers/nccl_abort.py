"""The ``"nccl"`` backend's failure path on real GPUs: a timeout while an NCCL kernel waits.

Two ranks (``asynccoll run -n 2``), signature checks off so that rank 0's all_reduce reaches
NCCL and its kernel waits for a rank 1 that never calls it. Rank 0 must get
``CollectiveTimeout`` after its timeout (``ncclCommAbort`` ends the waiting kernel); rank 1,
waiting in a TCP barrier, must get a ``CollectiveError`` from rank 0's abort; afterwards both
communicators refuse work, and both processes exit. Prints ``OK rank R``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import cupy
from nccl_check import split_hosts

import asynccoll
from asynccoll import CollectiveError, CollectiveTimeout

TIMEOUT = 4.0


async def raises(call: Awaitable[Any], error: type[BaseException], unexpected: str
                 ) -> BaseException:
    """The ``error`` that awaiting ``call`` raises; AssertionError(``unexpected``) if it
    returns."""
    try:
        await call
    except error as exc:
        return exc
    raise AssertionError(unexpected)


async def main() -> None:
    split_hosts()
    comm = await asynccoll.init(backend="nccl", timeout=60.0, check_signatures=False)
    async with comm:
        r = comm.rank
        a = cupy.ones(1 << 20, cupy.float32)
        await comm.all_reduce(a)  # NCCL sets its connections up on the first collective
        assert float(a[0]) == comm.world_size
        await comm.barrier()
        t0 = time.monotonic()
        if r == 0:
            comm.timeout = TIMEOUT
            exc = await raises(comm.all_reduce(a), CollectiveTimeout,
                               "all_reduce returned though rank 1 never called it")
            print(f"rank 0 timed out after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
            assert time.monotonic() - t0 < TIMEOUT + 10
        else:
            comm.timeout = 30.0  # longer than rank 0's: the abort must end this wait
            exc = await raises(comm.barrier(), CollectiveError,
                               "barrier returned though rank 0 never entered it")
            assert not isinstance(exc, CollectiveTimeout), "rank 0's abort did not reach rank 1"
            print(f"rank 1 told after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
            assert time.monotonic() - t0 < TIMEOUT + 20
        await raises(comm.all_reduce(cupy.ones(3)), CollectiveError,
                     "a broken communicator accepted a collective")
    print(f"OK rank {r}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
