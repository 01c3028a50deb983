"""Run ``all_gather_check`` (direct all_gathers, point-to-point frames, late ranks) and then
``allreduce_check`` on the event loop named by argv[1]: ``asyncio``, ``uvloop``, or ``mixed``
(even ranks on asyncio's loop, odd ranks on uvloop's). Prints ``LOOP <name> rank N`` first,
then what the two checks print. Started by tests/test_uvloop.py through ``asynccoll run``."""

from __future__ import annotations

import asyncio
import os
import sys

import uvloop
from all_gather_check import main as all_gather_main
from allreduce_check import main as allreduce_main


async def main() -> None:
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    print(f"LOOP {loop} rank {os.environ['ASYNCCOLL_RANK']}", flush=True)
    await all_gather_main()
    await allreduce_main()


if __name__ == "__main__":
    which = sys.argv[1]
    if which == "mixed":
        which = "uvloop" if int(os.environ["ASYNCCOLL_RANK"]) % 2 else "asyncio"
    (uvloop.run if which == "uvloop" else asyncio.run)(main())
