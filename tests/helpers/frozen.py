"""A rank of a TCP world that the test freezes (SIGSTOP): ``frozen.py MODE FLOATS TIMEOUTS``.

Started by the test itself, one process per rank (``ASYNCCOLL_RANK`` and the rest set), not
under ``asynccoll run``, whose launcher would stop the others at the first failed exit.
TIMEOUTS is the communicator timeout of each rank, comma-separated. Every rank prints
``PID <pid>`` and ``READY`` once the world formed, then, by MODE:

    all_reduce   all_reduces of FLOATS float32 values (each result checked) until one raises
    gather       rank 1 stops itself (SIGSTOP: the test continues it); every rank then
                 gathers FLOATS float32 values on rank 1, which the others cannot finish

and prints

    ERR <monotonic time> <exception type> <message>     the first error
    LATER <exception type>                              what the next all_reduce raised
    CORRUPT <iteration>                                 a result was wrong (exit 5)

then closes its communicator and exits 3. Times are ``time.monotonic()``, which is the same
clock in every process of the machine, so the test can compare them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import numpy as np

import asynccoll


def say(line: str) -> None:
    print(line, flush=True)


async def main(mode: str, floats: int, timeouts: list[float]) -> int:
    say(f"PID {os.getpid()}")
    rank = int(os.environ["ASYNCCOLL_RANK"])
    comm = await asynccoll.init("tcp", timeout=timeouts[rank])
    r, n = comm.rank, comm.world_size
    await comm.barrier()
    say("READY")
    a = np.empty(floats, dtype=np.float32)
    i = 0
    try:
        if mode == "gather":
            if r == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            a.fill(r)
            await comm.gather(a, root=1)
            raise AssertionError("the gather returned")
        while True:
            a.fill(r + 1 + i % 7)
            await comm.all_reduce(a)
            if not np.all(a == n * (n + 1) / 2 + n * (i % 7)):
                say(f"CORRUPT {i}")
                return 5
            i += 1
    except Exception as exc:
        say(f"ERR {time.monotonic():.3f} {type(exc).__name__} {exc}")
    try:
        await comm.all_reduce(a)
        say("LATER returned")
    except Exception as exc:
        say(f"LATER {type(exc).__name__}")
    await comm.close()
    return 3


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], int(sys.argv[2]),
                              [float(t) for t in sys.argv[3].split(",")])))
