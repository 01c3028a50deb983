"""The configuration surface as a user sets it: arguments of ``init``, ``run_local``,
``ElasticGroup`` and ``RendezvousServer``, and the ``ASYNCCOLL_`` environment variables. A
wrong type is a ``TypeError``, a wrong value a ``ValueError``, both naming the knob (or the
variable) and raised before anything connects; the same rule for every timeout."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest

import asynccoll
from asynccoll import Communicator
from asynccoll.elastic import ElasticGroup
from asynccoll.errors import RendezvousError
from asynccoll.rendezvous import RendezvousServer

#: nothing listens there: a connection attempt would raise RendezvousError, not the error
#: a test expects from a check made before connecting
NOWHERE = "127.0.0.1:1"

BAD_TIMEOUTS = ["5", None, True, [1.0], -1.0, math.nan, -math.inf]


def comm_timeout_error(bad: Any) -> type[BaseException]:
    """What ``comm.timeout = bad`` raises: the reference rule."""
    async def fn(comm: Communicator) -> type[BaseException]:
        try:
            comm.timeout = bad
        except (TypeError, ValueError) as exc:
            return type(exc)
        raise AssertionError(f"comm.timeout = {bad!r} was taken")

    return asyncio.run(asynccoll.run_local(fn, 1))[0]  # type: ignore[arg-type]


# ------------------------------------------------------------------------- elastic group

@pytest.mark.parametrize("bad", BAD_TIMEOUTS)
def test_elastic_timeout_is_checked_as_the_communicators(bad: Any) -> None:
    """ElasticGroup refused ``timeout="5"`` with a ValueError where ``comm.timeout = "5"`` is
    a TypeError, and refused 0, which the communicator takes: now one rule, the
    communicator's, for ``connect``, the constructor and the settable attribute."""
    expected = comm_timeout_error(bad)

    async def main() -> None:
        with pytest.raises(expected, match="timeout must be"):
            await ElasticGroup.connect(timeout=bad, rendezvous=NOWHERE)
        with pytest.raises(expected, match="timeout must be"):
            ElasticGroup(None, min_nodes=1, max_nodes=1, settle=0.0, timeout=bad, token=None,
                         tuning=None, job="j")
        group = ElasticGroup(None, min_nodes=1, max_nodes=1, settle=0.0, timeout=np.float32(2),
                             token=None, tuning=None, job="j")
        assert group.timeout == 2.0 and type(group.timeout) is float
        with pytest.raises(expected, match="timeout must be"):
            group.timeout = bad
        assert group.timeout == 2.0

    asyncio.run(main())


async def test_elastic_timeout_zero_is_a_timeout() -> None:
    """0 is a timeout, as for a communicator and ``init``: nothing is waited for, so the
    connection to the rendezvous gives up at once (RendezvousError, not ValueError)."""
    async with RendezvousServer("127.0.0.1", 0) as server:
        with pytest.raises(RendezvousError, match=r"within 0(\.0)? s"):
            await ElasticGroup.connect(timeout=0, rendezvous=f"127.0.0.1:{server.port}")


@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"min_nodes": "2"}, TypeError, "min_nodes must be an int"),
    ({"min_nodes": 1.5}, TypeError, "min_nodes must be an int"),
    ({"max_nodes": "4"}, TypeError, "max_nodes must be an int"),
    ({"min_nodes": 0}, ValueError, "min_nodes"),
    ({"settle": "1"}, TypeError, "settle must be a number"),
    ({"settle": math.nan}, ValueError, "settle must be >= 0"),
    ({"rendezvous": ("127.0.0.1", 1)}, TypeError, "rendezvous must be"),
    ({"rendezvous": "127.0.0.1:70000"}, ValueError, "port 0-65535"),
    ({"job": 3}, TypeError, "job must be a str"),
])
async def test_elastic_arguments_are_checked_before_connecting(kw: dict[str, Any],
                                                              error: type, match: str) -> None:
    """A string or float node count, a string or NaN ``settle``, a port out of range: each
    raised a bare ``'<' not supported`` TypeError, was taken, or failed in the connection."""
    kw.setdefault("rendezvous", NOWHERE)
    with pytest.raises(error, match=match):
        await ElasticGroup.connect(**kw)


@pytest.mark.parametrize(("env", "match"), [
    ({"ASYNCCOLL_MIN_NODES": "two"}, "ASYNCCOLL_MIN_NODES='two' is not an integer"),
    ({"ASYNCCOLL_MAX_NODES": "4.0"}, "ASYNCCOLL_MAX_NODES='4.0' is not an integer"),
    ({"ASYNCCOLL_MIN_NODES": "0"}, "ASYNCCOLL_MIN_NODES=0"),
    ({"ASYNCCOLL_MIN_NODES": "3", "ASYNCCOLL_MAX_NODES": "2"}, "ASYNCCOLL_MAX_NODES=2"),
    ({"ASYNCCOLL_RENDEZVOUS": "127.0.0.1"}, "ASYNCCOLL_RENDEZVOUS must give host:port"),
    ({"ASYNCCOLL_PORT": "http"}, "ASYNCCOLL_PORT/MASTER_PORT must give host:port"),
])
async def test_elastic_environment_errors_name_the_variable(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], match: str) -> None:
    """``ASYNCCOLL_MIN_NODES=two`` raised "invalid literal for int() with base 10", naming no
    variable; ``ASYNCCOLL_MIN_NODES=0`` was taken as 1; a bad ``ASYNCCOLL_RENDEZVOUS`` was
    reported as the argument ``rendezvous``."""
    for name in ("ASYNCCOLL_MIN_NODES", "ASYNCCOLL_MAX_NODES", "ASYNCCOLL_RENDEZVOUS",
                 "ASYNCCOLL_ADDR", "MASTER_ADDR", "ASYNCCOLL_PORT", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if "ASYNCCOLL_PORT" not in env and "ASYNCCOLL_RENDEZVOUS" not in env:
        monkeypatch.setenv("ASYNCCOLL_RENDEZVOUS", NOWHERE)
    with pytest.raises(ValueError, match=match):
        await ElasticGroup.connect()


# --------------------------------------------------------------------- handshake timeout

async def _silent_connection_lasts(host: str, port: int, limit: float) -> float:
    """Seconds until the server at ``host:port`` drops a connection that never says a word
    (at most ``limit``: then it was still open)."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection(host, port)
    start = loop.time()
    try:
        async with asyncio.timeout(limit):
            while await reader.read(4096):
                pass
    except TimeoutError:
        pass
    finally:
        writer.close()
    return loop.time() - start


@pytest.mark.parametrize("how", ["env", "argument"])
async def test_handshake_timeout_is_settable(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """The 5 s handshake limit was fixed (``HANDSHAKE_TIMEOUT``): neither a loaded machine
    nor hundreds of ranks could raise it. ``ASYNCCOLL_HANDSHAKE_TIMEOUT`` (every server and
    rank of the process) or ``init(..., handshake_timeout=)`` (this rank and the rendezvous
    it hosts) set it: a silent connection is dropped after that long, not after 5 s, and a
    longer limit keeps it open longer."""
    monkeypatch.delenv("ASYNCCOLL_HANDSHAKE_TIMEOUT", raising=False)
    kw: dict[str, Any] = {}
    if how == "env":
        monkeypatch.setenv("ASYNCCOLL_HANDSHAKE_TIMEOUT", "0.3")
    else:
        kw["handshake_timeout"] = 0.3
    comm = await asynccoll.init("tcp", rank=0, world_size=1, port=0, timeout=5, **kw)
    async with comm:
        assert comm.transport.handshake_timeout == 0.3  # type: ignore[attr-defined]
        host, port = comm.transport.addresses[0]  # type: ignore[attr-defined]
        assert await _silent_connection_lasts(host, port, 3.0) < 2.0
    if how == "env":
        async with RendezvousServer("127.0.0.1", 0) as srv:
            assert await _silent_connection_lasts("127.0.0.1", srv.port, 3.0) < 2.0
        monkeypatch.setenv("ASYNCCOLL_HANDSHAKE_TIMEOUT", "2.5")
    else:
        kw["handshake_timeout"] = 2.5
    async with RendezvousServer("127.0.0.1", 0, **kw) as srv:
        # a longer limit: still open after 1 s (the old fixed 5 s would pass this too; the
        # check above is the one 5 s fails)
        assert await _silent_connection_lasts("127.0.0.1", srv.port, 1.0) >= 1.0


async def test_handshake_timeout_of_the_hosted_rendezvous(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The rendezvous rank 0 hosts takes ``init``'s ``handshake_timeout`` too."""
    monkeypatch.delenv("ASYNCCOLL_HANDSHAKE_TIMEOUT", raising=False)
    async with RendezvousServer("127.0.0.1", 0) as probe:
        port = probe.port  # a free port (the server is gone once it closes)
    task = asyncio.ensure_future(asynccoll.init("tcp", rank=0, world_size=2, port=port,
                                                timeout=5, handshake_timeout=0.3))
    try:
        lasted = None
        for _ in range(100):  # until rank 0's rendezvous listens
            try:
                lasted = await _silent_connection_lasts("127.0.0.1", port, 3.0)
                break
            except OSError:
                await asyncio.sleep(0.02)
        assert lasted is not None and lasted < 2.0
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.parametrize(("bad", "error"), [("5", TypeError), (True, TypeError),
                                            (0, ValueError), (-1.0, ValueError),
                                            (math.nan, ValueError), (math.inf, ValueError)])
async def test_bad_handshake_timeout_is_refused_before_connecting(bad: Any,
                                                                  error: type) -> None:
    with pytest.raises(error, match="handshake_timeout must be"):
        # (rendezvous: nothing listens there, so connecting would raise RendezvousError)
        await asynccoll.init("tcp", rank=1, world_size=2, rendezvous=NOWHERE, timeout=1,
                             handshake_timeout=bad)
    with pytest.raises(error, match="handshake_timeout must be"):
        await asynccoll.run_local(lambda c: asyncio.sleep(0), 2, "tcp", handshake_timeout=bad)
    with pytest.raises(error, match="handshake_timeout must be"):
        RendezvousServer("127.0.0.1", 0, handshake_timeout=bad)


@pytest.mark.parametrize("raw", ["abc", "0", "-2", "nan", "inf"])
async def test_bad_handshake_timeout_variable_is_named(monkeypatch: pytest.MonkeyPatch,
                                                       raw: str) -> None:
    monkeypatch.setenv("ASYNCCOLL_HANDSHAKE_TIMEOUT", raw)
    match = f"ASYNCCOLL_HANDSHAKE_TIMEOUT='{raw}' is not a number of seconds"
    with pytest.raises(ValueError, match=match):
        await asynccoll.init("tcp", rank=1, world_size=2, rendezvous=NOWHERE, timeout=1)
    with pytest.raises(ValueError, match=match):
        RendezvousServer("127.0.0.1", 0)


# --------------------------------------------------------------------------- max_payload

@pytest.mark.parametrize(("bad", "error", "match"), [
    (100, ValueError, "max_payload must be from 512 bytes"),
    (0, ValueError, "max_payload must be from 512 bytes"),
    (-1, ValueError, "max_payload must be from 512 bytes"),
    ((1 << 40) + 1, ValueError, "max_payload must be from 512 bytes"),
    ("4096", TypeError, "max_payload must be an int"),
    (4096.0, TypeError, "max_payload must be an int"),
    (True, TypeError, "max_payload must be an int"),
])
async def test_bad_max_payload_is_refused_before_connecting(bad: Any, error: type,
                                                            match: str) -> None:
    """A ``max_payload`` below what an object collective's error needs (~150 bytes) broke
    the world at the first object that did not fit: the error itself did not fit in a frame
    (the sender raised "an array of 149 bytes is larger than one frame may carry", every
    other rank a CollectiveError). A string was taken and failed in the transport's frame
    reader, -1 was taken and every frame broke the protocol. Now refused up front."""
    with pytest.raises(error, match=match):
        await asynccoll.run_local(lambda c: asyncio.sleep(0), 2, "tcp", max_payload=bad)
    with pytest.raises(error, match=match):
        await asynccoll.init("tcp", rank=1, world_size=2, rendezvous=NOWHERE, timeout=1,
                             max_payload=bad)


async def test_object_errors_fit_the_smallest_max_payload() -> None:
    """At the smallest ``max_payload`` an object too large, or one that does not pack with a
    long message (a long class name), raises on every rank and the world goes on."""
    long_named = type("Unsendable" + "X" * 2000, (), {})()

    async def fn(comm: Communicator) -> list[Any]:
        with pytest.raises(ValueError, match="packs to 1003 bytes, more than one frame"):
            await comm.broadcast_object("x" * 1000 if comm.rank == 1 else None, root=1)
        with pytest.raises(TypeError, match="group rank 1 is not msgpack-serialisable"):
            await comm.all_gather_object(long_named if comm.rank == 1 else 0)
        return await comm.all_gather_object(comm.rank)

    assert await asynccoll.run_local(fn, 2, "tcp", timeout=5, max_payload=512) == [[0, 1]] * 2


@pytest.mark.parametrize("limit", [40, 200])
def test_an_object_error_longer_than_a_frame_is_cut_to_fit(limit: int) -> None:
    """The marker carrying an object's error is cut to the frame's limit (it was sent whole,
    and one longer than ``max_payload`` broke the world); it still raises the right error."""
    from asynccoll.collectives import _pack_object, _unpack_object

    long_named = type("Unsendable" + "X" * 2000, (), {})()
    packed = _pack_object(long_named, 3, limit)
    assert packed.nbytes == limit
    with pytest.raises(TypeError, match=r"^the object of group rank 3 .*\.\.\.$"):
        _unpack_object(packed, 3)
    packed = _pack_object("y" * 5000, 3, limit)
    assert packed.nbytes <= limit
    with pytest.raises(ValueError, match=r"^the object of group rank 3"):
        _unpack_object(packed, 3)


# ------------------------------------------------------------- init and run_local options

@pytest.mark.parametrize(("kw", "match"), [
    ({"tuning": "fast"}, "tuning must be an asynccoll.Tuning"),
    ({"tuning": {"small_bytes": 1}}, "tuning must be an asynccoll.Tuning"),
    ({"addr": 5}, "addr must be a str"),
    ({"bind": 5}, "bind must be a str"),
    ({"rendezvous": ("127.0.0.1", 1)}, "rendezvous must be a str"),
    ({"host_rendezvous": "no"}, "host_rendezvous must be a bool"),
    ({"token": 5}, "token must be str, bytes or None"),
    ({"gpu_staging": "no"}, "gpu_staging must be a bool"),
])
async def test_init_options_of_a_wrong_type_are_refused_before_connecting(
        kw: dict[str, Any], match: str) -> None:
    """``tuning="fast"`` was taken and failed at the first collective; ``addr=5`` raised
    "argument of type 'int' is not iterable", ``rendezvous=(host, port)`` an AttributeError;
    ``host_rendezvous="no"`` and ``gpu_staging="no"`` were taken as true."""
    with pytest.raises(TypeError, match=match):
        # rank 0 would host a rendezvous; rank 1 connects to nowhere: either would fail
        # otherwise than with this TypeError
        await asynccoll.init("tcp", rank=1, world_size=2, port=1, timeout=1, **kw)


@pytest.mark.parametrize("backend", ["memory", "tcp"])
@pytest.mark.parametrize(("kw", "match"), [
    ({"tuning": "fast"}, "tuning must be an asynccoll.Tuning"),
    ({"gpu_staging": "yes"}, "gpu_staging must be a bool"),
])
async def test_run_local_options_of_a_wrong_type_are_refused(backend: str, kw: dict[str, Any],
                                                             match: str) -> None:
    with pytest.raises(TypeError, match=match):
        await asynccoll.run_local(lambda c: asyncio.sleep(0), 2, backend, **kw)


async def test_a_bad_peer_loss_is_refused_before_rank_0_hosts_the_rendezvous() -> None:
    """``peer_loss="bad"`` was refused only once rank 0 had bound the rendezvous and
    connected to it (an occupied port then said "address in use" instead)."""
    async with RendezvousServer("127.0.0.1", 0) as busy:  # rank 0 could not bind this port
        with pytest.raises(ValueError, match="peer_loss must be one of"):
            await asynccoll.init("tcp", rank=0, world_size=1, port=busy.port, timeout=1,
                                 peer_loss="bad")
