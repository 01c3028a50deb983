"""The network services against hostile or broken clients, as an operator exposing them on a
cluster network sees them: the rendezvous server (``asynccoll rendezvous``, a real process
where the point is its memory) and a rank's peer listener, over loopback sockets.

What docs/backends/tcp.md ("Security", "Limits") promises: a stranger costs a few KiB and a
log line; an authenticated client that abuses the store meets a documented limit with a clear
error, not memory growth.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from asynccoll.handshake import client_handshake, read_frame, write_frame
from asynccoll.wire import Frame, FrameHeader, FrameKind

TOKEN = "hostile-test-token"


SERVE_ON_ASYNCIO = """
import asyncio, os
from asynccoll.rendezvous import RendezvousServer
async def main():
    async with RendezvousServer(token=os.environ["ASYNCCOLL_TOKEN"]) as server:
        print(f"listening on 127.0.0.1:{server.port}", flush=True)
        await asyncio.get_running_loop().create_future()
asyncio.run(main())
"""


class Standalone:
    """``python -m asynccoll rendezvous`` in a process of its own."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc, self.port = proc, port

    @classmethod
    async def start(cls, loop: str = "uvloop") -> Standalone:
        """``loop``: ``"uvloop"``, the command (on uvloop when installed), or ``"asyncio"``,
        a process that serves on the standard event loop, as a rank 0 hosting it does."""
        command = (["-m", "asynccoll", "rendezvous", "--host", "127.0.0.1", "--port", "0"]
                   if loop == "uvloop" else ["-c", SERVE_ON_ASYNCIO])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *command, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "ASYNCCOLL_TOKEN": TOKEN})
        assert proc.stdout is not None
        async with asyncio.timeout(10):
            line = (await proc.stdout.readline()).decode()
        assert "listening on" in line, line
        return cls(proc, int(line.rsplit(":", 1)[1]))

    def memory_mib(self, field: str) -> float:
        """``VmRSS`` (now) or ``VmHWM`` (peak) of the server process, in MiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise AssertionError(f"no {field} in /proc/{self.proc.pid}/status")

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()


@pytest.fixture(params=["uvloop", "asyncio"])
async def standalone(request: pytest.FixtureRequest) -> AsyncIterator[Standalone]:
    server = await Standalone.start(request.param)
    try:
        yield server
    finally:
        await server.kill()


def request(rid: int, op: str, payload: bytes = b"", **args: Any) -> Frame:
    return Frame(FrameKind.REQUEST, FrameHeader(meta={"id": rid, "op": op, **args}), payload)


async def raw_client(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An authenticated connection that sends and reads frames as the test says."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await client_handshake(reader, writer, TOKEN, role="client", timeout=5.0)
    return reader, writer


async def roundtrip(port: int, frame: Frame) -> Frame:
    reader, writer = await raw_client(port)
    try:
        write_frame(writer, frame)
        response = await read_frame(reader, 1 << 30)
        assert response is not None
        return response
    finally:
        writer.transport.abort()


# ------------------------------------------------------------------------ the rendezvous

@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
async def test_requests_waiting_for_one_large_value_cost_one_copy_of_it(
        standalone: Standalone) -> None:
    """A client that does not read sends 48 ``get``s waiting for one key, then sets it to
    8 MiB: the server answers them one at a time as the client reads, holding one copy of
    the value, not 48 (384 MiB; 100 such requests for 16 MiB took 1.6 GB). Read, every
    answer arrives whole."""
    waiting, size = 48, 8 << 20
    async with asyncio.timeout(20):
        reader, writer = await raw_client(standalone.port)
        for rid in range(waiting):
            write_frame(writer, request(rid, "get", key="big", timeout=30))
        await writer.drain()
        before = standalone.memory_mib("VmRSS")
        writer.transport.pause_reading()  # (this side reads nothing until told)
        write_frame(writer, request(waiting, "set", b"x" * size, key="big"))
        await writer.drain()
        # until another connection sees the key, then a little longer: the server has run
        # the requests the set woke
        for _ in range(250):
            if (await roundtrip(standalone.port, request(1, "num_keys"))
                    ).header.meta["count"] == 1:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        grown = standalone.memory_mib("VmHWM") - before
        assert grown < 5 * size / (1 << 20), f"the server grew by {grown:.0f} MiB"
        writer.transport.resume_reading()
        answers = [await read_frame(reader, 1 << 30) for _ in range(waiting + 1)]
        got = {f.header.meta["id"]: f for f in answers if f is not None}
        assert sorted(got) == list(range(waiting + 1))
        assert all(got[rid].header.meta["found"] and len(got[rid].payload) == size
                   for rid in range(waiting))
        writer.transport.abort()
