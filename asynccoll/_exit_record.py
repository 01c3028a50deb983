"""Whether a rank's world broke because of another rank: a record it leaves at exit for the
launcher (``asynccoll run``), which blames the rank whose failure was its own.

When one rank fails, the others' collectives raise too (an ABORT relayed from it, or a
``PeerLostError`` naming it), and these victims may exit before the culprit does. The launcher
gives each rank a path in ``ASYNCCOLL_ERROR_FILE``; a rank whose last TCP world was broken by
another rank writes there, at exit, a JSON object ``{"rank": R, "peer": P, "error": TEXT}``:
its world rank ``R``, the world rank ``P`` its failure came from (the rank that aborted, or
the one lost) and the error. A rank that failed for its own reason (an exception of its own,
a timeout, a mismatch it found), or was killed, writes nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
from typing import Any

from .errors import CommunicatorClosedError, PeerLostError

#: the variable that names the file (set by the launcher for each rank)
ENV = "ASYNCCOLL_ERROR_FILE"
#: most characters of the error kept in a record
ERROR_CHARS = 2000

#: how an error relayed from another rank (an ABORT frame) begins (``error_from_abort``)
_RELAYED = re.compile(r"world rank (\d+) aborted: ")


def note_world(transport: Any) -> None:
    """Remember ``transport`` as this process's world, whose state the record at exit
    describes (under the launcher only: with ``ASYNCCOLL_ERROR_FILE`` set).

    The interpreter's exit hooks hold it, not this module: the previous world's hook is
    replaced, so a process that forms world after world keeps only the last one."""
    if not os.environ.get(ENV):
        return
    atexit.unregister(_write)
    atexit.register(_write, transport)


def peer_cause(exc: BaseException | None, rank: int) -> int | None:
    """The world rank whose failure broke a world with error ``exc`` on ``rank`` (None: not
    broken, or broken by this rank itself)."""
    if exc is None or isinstance(exc, CommunicatorClosedError):
        return None
    if isinstance(exc, PeerLostError) and exc.rank is not None:
        return exc.rank if exc.rank != rank else None
    relayed = _RELAYED.match(str(exc))
    if relayed is not None and int(relayed[1]) != rank:
        return int(relayed[1])
    return None


def _write(transport: Any) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    exc = transport.broken
    peer = peer_cause(exc, transport.rank)
    if peer is None:
        return
    record = {"rank": transport.rank, "peer": peer, "error": str(exc)[:ERROR_CHARS]}
    with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
        json.dump(record, f)


def read(path: str) -> dict[str, Any] | None:
    """The record a rank left at ``path`` (None: none, or not one)."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or type(record.get("peer")) is not int:
        return None
    return record
