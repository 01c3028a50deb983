"""Whom the launcher blames: ``blame.py MODE CULPRIT``.

Every rank prints ``PID <pid>`` first and ``READY`` once the world formed (after a barrier).

MODE
    slow    rank CULPRIT raises in its own code inside ``async with comm`` (closing its
            communicator: the others' all_reduce raises PeerLostError naming it at once),
            then takes 1.5 s to clean up (a checkpoint, a log flushed) and exits with code 7.
            The others let their PeerLostError end them (exit code 1): they exit first.
    killed  rank CULPRIT SIGKILLs itself while the others wait in an all_reduce; they
            exit with code 1 on their PeerLostError.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import numpy as np

import asynccoll


async def main(mode: str, culprit: int) -> None:
    print(f"PID {os.getpid()}", flush=True)
    async with await asynccoll.init(backend="tcp", timeout=30.0) as comm:
        await comm.barrier()
        print("READY", flush=True)
        if comm.rank == culprit:
            await asyncio.sleep(0.3)  # the others are waiting in the all_reduce by now
            if mode == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"rank {culprit} failed in its own code")
        await comm.all_reduce(np.ones(1024))  # raises PeerLostError
        print("UNEXPECTED: all_reduce succeeded", flush=True)


if __name__ == "__main__":
    mode, culprit = sys.argv[1], int(sys.argv[2])
    try:
        asyncio.run(main(mode, culprit))
    except RuntimeError:
        if os.environ["ASYNCCOLL_RANK"] != str(culprit):
            raise
        time.sleep(1.5)  # slow clean-up of the culprit: its victims exit before it
        print("CULPRIT exits", flush=True)
        sys.exit(7)
