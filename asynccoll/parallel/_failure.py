"""Breaking a communicator on purpose.

A training wrapper whose rank fails outside any collective (its model raised, or its step was
cancelled while it computed) would leave the other ranks waiting in their next exchange until
the timeout. ``break_comm`` makes them raise at once instead, through the Communicator's
contract: a cancelled operation breaks the communicator for every rank (and for every group
of its world, which share its connections).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..collectives import Communicator

#: The point-to-point tag of the receive ``break_comm`` starts and cancels (just below the
#: pipeline's tags, ``pipeline.TAG_BASE``; no message is ever sent with it).
BREAK_TAG = (1 << 40) - 1


async def break_comm(comm: Communicator) -> None:
    """Break ``comm`` for every rank: start a receive and cancel it. Nothing to do with one
    rank; harmless on a communicator that is broken already."""
    if comm.world_size < 2:
        return
    probe = asyncio.ensure_future(comm.recv((comm.rank + 1) % comm.world_size, tag=BREAK_TAG))
    await asyncio.sleep(0)
    probe.cancel()
    await asyncio.gather(probe, return_exceptions=True)


def first_error(group: BaseExceptionGroup[Any], prefer: type[BaseException] | None = None
                ) -> BaseException:
    """The error to re-raise from a failed task group: its first leaf exception (depth
    first), or, with ``prefer``, its first leaf of that type if it has one."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            stack[:0] = list(exc.exceptions)
        else:
            leaves.append(exc)
    if prefer is not None:
        return next((e for e in leaves if isinstance(e, prefer)), leaves[0])
    return leaves[0]
