"""The memory backend's all_reduce against NumPy's own bandwidth, in one run.

    python benchmarks/memory_all_reduce.py                 # 64 MiB float32 x 4 ranks
    python benchmarks/memory_all_reduce.py --threads 0 --rounds 7

Prints, as medians over ``--rounds`` alternating rounds:

* NumPy's in-place add, ``np.add(a, b, out=a)`` on two arrays of the message size (the
  reference: bytes of one array / time);
* ``run_local(..., n, "memory")``'s all_reduce, as time and busbw (2(n-1)/n x bytes / time)
  and busbw over the add's bandwidth;
* the same reduction done by NumPy alone, without asynccoll: every rank's block summed over
  all ranks and copied back a cache-sized chunk at a time, in one thread and in a pool of
  ``--threads`` threads. That is the memory traffic floor of an in-place all_reduce (every
  array read once and written once); the distance to it is asynccoll's own overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from workers import median_time  # benchmarks/ is on sys.path when run as a script

from asynccoll.collectives import Communicator
from asynccoll.transport.memory import MemoryWorld
from asynccoll.tuning import Tuning


def numpy_add(n: int) -> float:
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    return median_time(lambda: np.add(a, b, out=a), 10, 2)


def numpy_floor(n: int, ranks: int, threads: int, chunk: int) -> float:
    """All-reduce of ``ranks`` arrays by NumPy alone (see the module docstring)."""
    xs = [np.ones(n, np.float32) for _ in range(ranks)]
    block = -(-n // ranks)

    def job(r: int) -> None:
        lo, hi = r * block, min(n, (r + 1) * block)
        for a in range(lo, hi, chunk):
            b = min(hi, a + chunk)
            own = xs[r][a:b]
            for j in range(ranks):
                if j != r:
                    np.add(own, xs[j][a:b], out=own)
            for j in range(ranks):
                if j != r:
                    np.copyto(xs[j][a:b], own)

    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            return median_time(lambda: list(pool.map(job, range(ranks))), 7, 2)
    def serial() -> None:
        for r in range(ranks):
            job(r)

    return median_time(serial, 7, 2)


def asynccoll_all_reduce(n: int, ranks: int, threads: int | None) -> float:
    async def main() -> float:
        world = MemoryWorld(ranks, threads=threads)
        comms = [Communicator(t) for t in world.transports]

        async def one(comm: Communicator) -> float:
            x = np.ones(n, np.float32)
            for _ in range(2):
                await comm.all_reduce(x)
            times = []
            for _ in range(7):
                t = time.perf_counter()
                await comm.all_reduce(x)
                times.append(time.perf_counter() - t)
            return statistics.median(times)

        try:
            return max(await asyncio.gather(*(one(c) for c in comms)))
        finally:
            for c in comms:
                await c.close()

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--ranks", type=int, default=4)
    p.add_argument("--mib", type=int, default=64, help="message size in MiB (float32)")
    p.add_argument("--threads", type=int, default=None,
                   help="the world's worker threads (default: one per core, at most one per "
                        "rank; 0: none)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chunk-kib", type=int, default=Tuning().reduce_chunk_bytes >> 10,
                   help="chunk of the NumPy-only reference, in KiB (default: asynccoll's, "
                        "Tuning.reduce_chunk_bytes)")
    a = p.parse_args(argv)
    n = a.mib * (1 << 20) // 4
    nbytes = n * 4
    pool = MemoryWorld(a.ranks, threads=a.threads).threads
    rows: dict[str, list[float]] = {"add": [], "asynccoll": [], "floor-1": [], "floor-pool": []}
    for _ in range(a.rounds):
        rows["add"].append(numpy_add(n))
        rows["asynccoll"].append(asynccoll_all_reduce(n, a.ranks, a.threads))
        rows["floor-1"].append(numpy_floor(n, a.ranks, 1, a.chunk_kib * 256))
        if pool > 1:
            rows["floor-pool"].append(numpy_floor(n, a.ranks, pool, a.chunk_kib * 256))
    t_add = statistics.median(rows["add"])
    add_bw = nbytes / t_add / 1e9
    factor = 2 * (a.ranks - 1) / a.ranks
    print(f"# {a.ranks} ranks, {a.mib} MiB float32, medians of {a.rounds} rounds")
    print(f"np.add(a, b, out=a): {t_add * 1e3:7.2f} ms  {add_bw:6.2f} GB/s of array")
    for name, what in (("asynccoll", "asynccoll all_reduce"),
                       ("floor-1", "NumPy alone, 1 thread"),
                       ("floor-pool", f"NumPy alone, {pool} threads")):
        if not rows[name]:
            continue
        t = statistics.median(rows[name])
        busbw = factor * nbytes / t / 1e9
        print(f"{what:<26} {t * 1e3:7.2f} ms  busbw {busbw:6.2f} GB/s  "
              f"{busbw / add_bw:5.3f} x np.add  ({t / t_add:4.2f} x its time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
