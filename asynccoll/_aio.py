"""Small asyncio and network helpers shared by the rendezvous server, the transports and
``run_local``."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def uncancelled(aw: Awaitable[T]) -> T:
    """Await ``aw`` to its end even if the caller is cancelled meanwhile, then raise that
    cancellation: for clean-ups that must not stop halfway (a close cut short leaves sockets
    and tasks behind, and a second close returns at once). ``aw`` must be bounded."""
    inner = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(inner)
            break
        except asyncio.CancelledError:
            if inner.cancelled():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


async def close_server(server: asyncio.Server) -> None:
    """Stop accepting and close ``server`` without leaking a connection accepted meanwhile.

    CPython 3.11's selector event loop loses (and leaks the socket of) a connection whose
    accept is in progress when ``Server.close()`` runs. Stop accepting first, let accepts in
    progress attach (their protocols see a closing owner and drop them), then close.
    """
    loop = asyncio.get_running_loop()
    if hasattr(loop, "_selector"):  # the stdlib selector loop; uvloop is not affected
        for sock in server.sockets:
            with contextlib.suppress(Exception):
                loop.remove_reader(sock.fileno())
        for _ in range(3):
            await asyncio.sleep(0)
    server.close()


def writelines(transport: asyncio.WriteTransport, parts: list[bytes | memoryview]) -> None:
    """``transport.writelines(parts)`` with the flow control that CPython 3.12 and 3.13.0 drop.

    Their selector transports' gather write keeps what the kernel did not take in the loop's
    buffer without checking the high-water mark: the protocol is never paused, so
    ``drain()`` returns at once (unbounded buffering) and nothing tells the writer when the
    loop is done with the parts' memory. Setting the limits again runs that check (a no-op
    where the transport already paused, or nothing is buffered)."""
    transport.writelines(parts)
    low, high = transport.get_write_buffer_limits()
    if transport.get_write_buffer_size() > high:
        transport.set_write_buffer_limits(high=high, low=low)


#: seconds ``wait_server_closed`` waits for a closed server's connections to go
SERVER_CLOSE_TIMEOUT = 1.0


async def wait_server_closed(server: asyncio.Server) -> None:
    """``server.wait_closed()``, bounded by ``SERVER_CLOSE_TIMEOUT``: uvloop's (like CPython
    3.12's) returns only once every connection the server accepted is closed, which a slow
    or stuck peer would otherwise hold up for ever."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(server.wait_closed(), SERVER_CLOSE_TIMEOUT)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine's loopback: 127.0.0.0/8,
    ::1, and 127.x written as an IPv4-mapped IPv6 address."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
