"""Failure scenarios for the launcher tests: ``faulty.py MODE``.

Every rank prints ``PID <pid>`` first and ``READY`` once the world formed (after a barrier).

MODE
    killed_before   rank 2 SIGKILLs itself while the others enter an all_reduce.
    killed_during   1000 all_reduces of 1 MiB; rank 2 SIGKILLs itself during the 6th.
    raise           rank 1 raises a Python exception in its own code; the others all_reduce.
    forever         all_reduce in a loop with small sleeps, until interrupted.

In the ``killed_*`` modes the survivors report ``LOST rank=<r> after=<seconds>`` (the time from
entering the failing collective to the PeerLostError) and exit with code 3. The launcher sends
them SIGTERM as soon as it sees rank 2 die, which races with their own detection; so that the
line is always printed, the survivors note a SIGTERM and go on (the launcher SIGKILLs them after
its grace period if they do not exit by themselves, which would fail the test).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import numpy as np

import asynccoll

VICTIM = 2
MIB_FLOATS = (1 << 20) // 4  # 1 MiB of float32


def say(line: str) -> None:
    print(line, flush=True)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


async def killed(comm: asynccoll.Communicator, *, during: bool) -> int:
    r, n = comm.rank, comm.world_size
    loop = asyncio.get_running_loop()
    if r != VICTIM:
        loop.add_signal_handler(signal.SIGTERM, lambda: say("SIGTERM received"))
    iterations = 1000 if during else 1
    a = np.empty(MIB_FLOATS if during else 1024, dtype=np.float32)
    for i in range(iterations):
        a.fill(r + 1)
        if r == VICTIM:
            if not during:
                await asyncio.sleep(0.3)  # the others are waiting in the all_reduce by now
                die()
            elif i == 5:
                loop.call_soon(die)  # dies once the all_reduce below has started
        started = time.perf_counter()
        try:
            await comm.all_reduce(a)
        except asynccoll.PeerLostError as exc:
            after = time.perf_counter() - started
            say(f"LOST rank={exc.rank} after={after:.3f} iteration={i} error={exc}")
            return 3
        if not np.all(a == n * (n + 1) / 2):
            say(f"WRONG result at iteration {i}")
            return 4
    say("UNEXPECTED: every all_reduce succeeded")
    return 5


async def main(mode: str) -> int:
    say(f"PID {os.getpid()}")
    async with await asynccoll.init(backend="tcp", timeout=30.0) as comm:
        await comm.barrier()
        say("READY")
        if mode in ("killed_before", "killed_during"):
            return await killed(comm, during=mode == "killed_during")
        if mode == "raise":
            if comm.rank == 1:
                raise RuntimeError("deliberate failure in user code")
            await comm.all_reduce(np.ones(1024))
            say("UNEXPECTED: all_reduce succeeded without rank 1")
            return 5
        if mode == "forever":
            a = np.ones(4096, dtype=np.float32)
            while True:
                await comm.all_reduce(a)
                a.fill(1.0)
                await asyncio.sleep(0.02)
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1])))
