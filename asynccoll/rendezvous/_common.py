"""Constants, errors and stream helpers shared by the rendezvous server and client."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Final

logger = logging.getLogger("asynccoll.rendezvous")

#: Default limit on one value (and so on one frame's payload), both directions.
DEFAULT_MAX_VALUE_BYTES: Final = 64 << 20
#: Server-side wait when a blocking request carries no ``timeout``.
DEFAULT_WAIT_TIMEOUT: Final = 300.0
#: Longest wait a request may ask for.
MAX_WAIT_TIMEOUT: Final = 86400.0
#: Longest error message a RESPONSE carries (longer ones are cut).
MAX_ERROR_CHARS: Final = 1000
#: Extra time a client waits for the answer to a blocking request beyond its ``timeout``.
RESPONSE_GRACE: Final = 5.0
#: Default limit on the keys and roster entries a server holds, every job's together.
DEFAULT_MAX_KEYS: Final = 1 << 20
#: Default limit on the bytes of the keys, values and roster entries a server holds, every
#: job's together.
DEFAULT_MAX_STORE_BYTES: Final = 1 << 30
#: Default limit on the connections in their handshake at once (past it the oldest goes).
DEFAULT_MAX_HANDSHAKES: Final = 1024
#: Default limit on the requests waiting at once (``get``, ``wait``, ``roster`` that wait),
#: every connection's together.
DEFAULT_MAX_WAITING: Final = 1 << 16

_I64_MIN: Final = -(1 << 63)
_I64_MAX: Final = (1 << 63) - 1
_U32: Final = (1 << 32) - 1
_DECIMAL: Final = re.compile(rb"-?[0-9]{1,19}")

#: Error codes a RESPONSE may carry in ``code``.
E_BAD_REQUEST: Final = "bad_request"
E_TIMEOUT: Final = "timeout"
E_NOT_INTEGER: Final = "not_integer"
E_OVERFLOW: Final = "overflow"
E_UNKNOWN_OP: Final = "unknown_op"
E_LIMIT: Final = "limit"


class _OpError(Exception):
    """A request that fails without breaking the connection; answered with ``ok: false``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Hangup(Exception):
    """The client closed its side; ends a session and cancels its pending requests."""




def _peername(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)


async def _close_writer(writer: asyncio.StreamWriter, *, abort: bool = False) -> None:
    """Close a stream without ever hanging on a peer that does not read."""
    if abort:
        writer.transport.abort()
    else:
        writer.close()
    try:
        async with asyncio.timeout(1.0):
            await writer.wait_closed()
    except TimeoutError:
        writer.transport.abort()
    except (ConnectionError, OSError):
        pass
    except BaseException:  # cancelled while it waited: do not leave the socket half closed
        writer.transport.abort()
        raise
