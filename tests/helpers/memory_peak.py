"""One 64 MiB float32 all_reduce; report the peak extra resident memory it cost this rank.

Prints ``PEAK rank=<r> extra_mib=<x> ok=<True|False>``: ``x`` is the growth of
``ru_maxrss`` (the process's peak RSS) across the all_reduce, measured after the array was
allocated and a warm-up 8-byte all_reduce set up the connections.
"""

from __future__ import annotations

import asyncio
import resource

import numpy as np

import asynccoll

NBYTES = 64 << 20


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


async def main() -> None:
    async with await asynccoll.init(backend="tcp", timeout=60.0) as comm:
        r, n = comm.rank, comm.world_size
        a = np.full(NBYTES // 4, float(r), dtype=np.float32)  # one allocation, pages touched
        await comm.all_reduce(np.ones(2, dtype=np.float32))  # warm-up: 8 bytes
        await comm.barrier()
        before = maxrss_mib()
        await comm.all_reduce(a)
        after = maxrss_mib()
        expected = float(n * (n - 1) // 2)
        ok = bool(a.min() == expected and a.max() == expected)
        print(f"PEAK rank={r} extra_mib={after - before:.1f} before_mib={before:.1f} "
              f"after_mib={after:.1f} ok={ok}", flush=True)
        await comm.barrier()


if __name__ == "__main__":
    asyncio.run(main())
