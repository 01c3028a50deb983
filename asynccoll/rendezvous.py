"""The rendezvous: an authenticated key-value store with a roster of ranks, over asyncio.

What torch's ``TCPStore`` does, plus a roster with generations for elastic training. One
:class:`RendezvousServer` (usually hosted by rank 0, or standalone with
``asynccoll rendezvous``) and one :class:`RendezvousClient` per process.

Every connection first passes the token handshake (:mod:`asynccoll.handshake`); then the client
sends REQUEST frames and the server answers with RESPONSE frames tagged by request id, so
several requests may be in flight on one connection and a blocking one (``get`` of a missing
key, ``wait``, ``roster`` for a world size) never holds up the others. Values travel as raw
frame payloads, never inside msgpack. ``protocol/SPEC.md`` (section "Rendezvous messages")
specifies the ops.

The store has three parts, all owned by one server object (never by the module, so two servers
in one process are independent): ``data`` (str keys to bytes values), ``members`` (rank to
host, port, meta) and ``generation`` (an int that ``bump_generation`` increments, clearing
``members``).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import operator
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

from ._aio import close_server
from .errors import AuthenticationError, ProtocolError, RendezvousError
from .handshake import client_handshake, read_frame, server_handshake, write_frame
from .wire import Frame, FrameHeader, FrameKind

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


class _OpError(Exception):
    """A request that fails without breaking the connection; answered with ``ok: false``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Hangup(Exception):
    """The client closed its side; ends a session and cancels its pending requests."""


# ----------------------------------------------------------------------------------- store

@dataclass(slots=True)
class Member:
    """One rank of the roster."""

    host: str
    port: int
    meta: dict[str, Any]


@dataclass(slots=True)
class Store:
    """The state of a rendezvous server: plain data and synchronous operations, no I/O.

    Each mutating method returns what it changed so the server can wake the matching waiters.
    """

    data: dict[str, bytes] = field(default_factory=dict)
    members: dict[int, Member] = field(default_factory=dict)
    generation: int = 0

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def add(self, key: str, delta: int) -> int:
        old = self.data.get(key, b"0")
        if not _DECIMAL.fullmatch(old):
            raise _OpError(E_NOT_INTEGER, f"value of key {key!r} is not a decimal integer")
        new = int(old) + delta
        if not _I64_MIN <= new <= _I64_MAX:
            raise _OpError(E_OVERFLOW, f"add would overflow a signed 64-bit integer at {key!r}")
        self.data[key] = str(new).encode("ascii")
        return new

    def compare_set(self, key: str, expected: bytes | None, desired: bytes
                    ) -> tuple[bool, bytes | None]:
        current = self.data.get(key)
        if current != expected:
            return False, current
        self.data[key] = desired
        return True, desired

    def delete(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    def join(self, rank: int, host: str, port: int, meta: dict[str, Any]) -> int:
        self.members[rank] = Member(host, port, meta)
        return self.generation

    def leave(self, rank: int) -> bool:
        return self.members.pop(rank, None) is not None

    def bump(self, expected: int | None) -> tuple[bool, int]:
        if expected is not None and expected != self.generation:
            return False, self.generation
        self.generation += 1
        self.members.clear()
        return True, self.generation

    def roster(self) -> tuple[dict[str, Any], bytes]:
        """The ``roster`` result: meta, and the members as a msgpack array in the payload
        (a large world would not fit the 64 KiB header)."""
        members = [[rank, m.host, m.port, m.meta] for rank, m in sorted(self.members.items())]
        return ({"generation": self.generation, "count": len(members)},
                msgpack.packb(members, use_bin_type=True))


# ----------------------------------------------------------------------------------- arguments

def _arg(args: dict[str, Any], key: str) -> Any:
    if key not in args:
        raise _OpError(E_BAD_REQUEST, f"missing argument {key!r}")
    return args[key]


def _arg_str(args: dict[str, Any], key: str) -> str:
    value = _arg(args, key)
    if not isinstance(value, str):
        raise _OpError(E_BAD_REQUEST, f"argument {key!r} must be a string")
    return value


def _arg_int(args: dict[str, Any], key: str, lo: int, hi: int, *, optional: bool = False
             ) -> int | None:
    value = args.get(key) if optional else _arg(args, key)
    if value is None and optional:
        return None
    if type(value) is not int or not lo <= value <= hi:
        raise _OpError(E_BAD_REQUEST, f"argument {key!r} must be an int in [{lo}, {hi}]")
    return value


def _arg_timeout(args: dict[str, Any]) -> float:
    value = args.get("timeout")
    if value is None:
        return DEFAULT_WAIT_TIMEOUT
    if type(value) not in (int, float) or not 0 <= value <= MAX_WAIT_TIMEOUT:
        raise _OpError(E_BAD_REQUEST, f"timeout must be a number in [0, {MAX_WAIT_TIMEOUT}]")
    return float(value)


def _arg_meta(args: dict[str, Any]) -> dict[str, Any]:
    value = args.get("meta")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _OpError(E_BAD_REQUEST, "argument 'meta' must be a map or nil")
    return value


def _no_payload(op: str, payload: bytes) -> None:
    if payload:
        raise _OpError(E_BAD_REQUEST, f"{op} takes no payload")


# ----------------------------------------------------------------------------------- server

_Result = tuple[dict[str, Any], bytes]
_Later = Callable[[], Awaitable[_Result]]


class RendezvousServer:
    """An asyncio rendezvous server. Use ``async with RendezvousServer(...) as server:`` or
    ``await server.start()`` ... ``await server.close()``.

    Args:
        host: address to bind (loopback by default; bind a routable address only with a token).
        port: port to bind; 0 picks a free one (read it back from :attr:`port`).
        token: shared secret every client must prove it knows (``None``: the empty token).
        job: when not empty, clients announcing another job id are rejected.
        handshake_timeout: a connection that has not finished the handshake by then is dropped.
        max_value_bytes: largest value (frame payload) accepted; a larger frame drops the
            connection that sent it. Announced to clients in WELCOME, so that a well-behaved
            client refuses a larger value itself (``ValueError``) before sending it.
        send_timeout: a client that does not read its responses for this long is dropped.

    A connection that fails the handshake or breaks the protocol is closed and logged at
    WARNING; the other clients are not disturbed.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 token: str | bytes | None = None, job: str = "",
                 handshake_timeout: float = 5.0, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                 send_timeout: float = 30.0) -> None:
        if not (isinstance(handshake_timeout, int | float) and handshake_timeout > 0):
            raise ValueError("handshake_timeout must be a positive number")
        if type(max_value_bytes) is not int or max_value_bytes < 0:
            raise ValueError("max_value_bytes must be a non-negative int")
        if not (isinstance(send_timeout, int | float) and send_timeout > 0):
            raise ValueError("send_timeout must be a positive number")
        if token is not None and not isinstance(token, str | bytes):
            raise TypeError("token must be str, bytes or None")
        self._bind = (host, port)
        self._token = token
        self._job = job
        self._handshake_timeout = float(handshake_timeout)
        self._max_value_bytes = max_value_bytes
        self._send_timeout = float(send_timeout)
        self.store = Store()
        self._waiters: dict[Any, set[asyncio.Future[None]]] = {}
        self._handlers: dict[str, Callable[[dict[str, Any], bytes], _Result | _Later]] = {
            "set": self._op_set, "get": self._op_get, "wait": self._op_wait,
            "add": self._op_add, "compare_set": self._op_compare_set,
            "delete": self._op_delete, "num_keys": self._op_num_keys,
            "join": self._op_join, "leave": self._op_leave, "roster": self._op_roster,
            "generation": self._op_generation, "bump_generation": self._op_bump_generation,
        }
        self._server: asyncio.Server | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._closing = False
        self._address: tuple[str, int] | None = None

    def __repr__(self) -> str:
        where = f"{self.host}:{self.port}" if self._address else "not started"
        return f"RendezvousServer({where}, job={self._job!r})"

    @property
    def host(self) -> str:
        """The bound host (after :meth:`start`)."""
        if self._address is None:
            raise RuntimeError("the server is not started")
        return self._address[0]

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        if self._address is None:
            raise RuntimeError("the server is not started")
        return self._address[1]

    async def __aenter__(self) -> RendezvousServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Bind and start accepting connections.

        Raises:
            OSError: the address cannot be bound.
            RuntimeError: already started.
        """
        if self._supervisor is not None:
            raise RuntimeError("the server was already started")
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        self._supervisor = asyncio.create_task(self._supervise(ready),
                                               name="asynccoll-rendezvous-server")
        await ready
        host, port = self._bind
        try:
            self._server = await asyncio.start_server(self._on_connect, host, port)
        except BaseException:
            await self.close()
            raise
        sockname = self._server.sockets[0].getsockname()
        self._address = (sockname[0], sockname[1])
        if not self._token and host not in ("127.0.0.1", "localhost", "::1"):
            logger.warning("rendezvous server on %s:%d has no token: anyone who can reach it "
                           "can read and write the store", *self._address)

    async def _supervise(self, ready: asyncio.Future[None]) -> None:
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            ready.set_result(None)
            # Lives until close() cancels it; the task group then cancels every connection.
            await asyncio.get_running_loop().create_future()

    async def close(self) -> None:
        """Stop listening, close every connection and cancel every pending request.

        Idempotent. Clients with requests in flight see their connection close.
        """
        self._closing = True
        if self._server is not None:
            await close_server(self._server)
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.wait({self._supervisor})
        if self._server is not None:
            await self._server.wait_closed()
        for _ in range(3):  # let connections aborted in _on_connect close their sockets
            await asyncio.sleep(0)

    # ------------------------------------------------------------------------- connections

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing or self._tg is None:
            writer.transport.abort()
            return
        self._tg.create_task(self._serve_connection(reader, writer))

    async def _serve_connection(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        peer = _peername(writer)
        abort = True
        try:
            try:
                hs = await server_handshake(
                    reader, writer, self._token, job=self._job, timeout=self._handshake_timeout,
                    welcome_meta={"max_value_bytes": self._max_value_bytes})
            except (ProtocolError, TimeoutError) as exc:  # AuthenticationError included
                logger.warning("rendezvous: dropped connection from %s: %s", peer, exc)
                abort = isinstance(exc, TimeoutError)
                return
            logger.debug("rendezvous: %s connected (role=%s, rank=%s)",
                         peer, hs.peer_role, hs.peer_rank)
            abort = await self._session(reader, writer, peer)
        except Exception:  # a bug: log it, never take the other connections down with it
            logger.exception("rendezvous: internal error serving %s", peer)
        finally:
            await _close_writer(writer, abort=abort)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       peer: str) -> bool:
        """Serve requests until the client leaves; return True when the connection should be
        aborted rather than closed gracefully."""
        abort = True
        try:
            async with asyncio.TaskGroup() as tg:
                while (frame := await read_frame(reader, self._max_value_bytes)) is not None:
                    rid, op, args = _parse_request(frame)
                    await self._dispatch(tg, writer, rid, op, args, bytes(frame.payload))
                raise _Hangup
        except* _Hangup:
            logger.debug("rendezvous: %s disconnected", peer)
            abort = False
        except* ProtocolError as group:
            logger.warning("rendezvous: dropped connection from %s: %s", peer,
                           group.exceptions[0])
        except* TimeoutError:
            logger.warning("rendezvous: dropped connection from %s: it did not read its "
                           "responses for %s s", peer, self._send_timeout)
        except* (ConnectionError, OSError) as group:
            logger.info("rendezvous: connection from %s lost: %s", peer, group.exceptions[0])
        return abort

    async def _dispatch(self, tg: asyncio.TaskGroup, writer: asyncio.StreamWriter, rid: int,
                        op: str, args: dict[str, Any], payload: bytes) -> None:
        handler = self._handlers.get(op)
        try:
            if handler is None:
                raise _OpError(E_UNKNOWN_OP, f"unknown op {op!r}")
            result = handler(args, payload)
        except _OpError as exc:
            await self._respond(writer, _error_response(rid, exc))
            return
        if callable(result):
            tg.create_task(self._finish_later(writer, rid, result))
        else:
            await self._respond(writer, _ok_response(rid, *result))

    async def _finish_later(self, writer: asyncio.StreamWriter, rid: int, later: _Later) -> None:
        try:
            response = _ok_response(rid, *await later())
        except _OpError as exc:
            response = _error_response(rid, exc)
        await self._respond(writer, response)

    async def _respond(self, writer: asyncio.StreamWriter, frame: Frame) -> None:
        write_frame(writer, frame)
        async with asyncio.timeout(self._send_timeout):
            await writer.drain()

    # ------------------------------------------------------------------------- waiting

    def _wake(self, topic: Any) -> None:
        for fut in self._waiters.pop(topic, ()):
            if not fut.done():
                fut.set_result(None)

    async def _wait_until(self, topic: Any, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds, re-checking it whenever ``topic`` is woken.
        Unbounded: callers wrap it in :meth:`_bounded`."""
        loop = asyncio.get_running_loop()
        while not predicate():
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.setdefault(topic, set()).add(fut)
            try:
                await fut
            finally:
                waiting = self._waiters.get(topic)
                if waiting is not None:
                    waiting.discard(fut)
                    if not waiting:
                        del self._waiters[topic]

    @staticmethod
    async def _bounded(wait: Awaitable[None], limit: float, what: Callable[[], str]) -> None:
        try:
            async with asyncio.timeout(limit):
                await wait
        except TimeoutError:
            raise _OpError(E_TIMEOUT, f"timed out after {limit} s waiting for {what()}"
                           ) from None

    def _changed_key(self, key: str) -> None:
        self._wake(("key", key))

    def _changed_roster(self) -> None:
        self._wake(("roster",))

    # ------------------------------------------------------------------------- ops

    def _op_set(self, args: dict[str, Any], payload: bytes) -> _Result:
        key = _arg_str(args, "key")
        self.store.set(key, payload)
        self._changed_key(key)
        return {}, b""

    def _op_get(self, args: dict[str, Any], payload: bytes) -> _Result | _Later:
        _no_payload("get", payload)
        key = _arg_str(args, "key")
        wait = args.get("wait", True)
        if not isinstance(wait, bool):
            raise _OpError(E_BAD_REQUEST, "argument 'wait' must be a bool")
        timeout = _arg_timeout(args)
        if key in self.store.data or not wait:
            return self._get_now(key)

        async def later() -> _Result:
            await self._bounded(self._wait_until(("key", key), lambda: key in self.store.data),
                                timeout, lambda: f"key {key!r}")
            return self._get_now(key)
        return later

    def _get_now(self, key: str) -> _Result:
        value = self.store.data.get(key)
        if value is None:
            return {"found": False}, b""
        return {"found": True}, value

    def _op_wait(self, args: dict[str, Any], payload: bytes) -> _Result | _Later:
        _no_payload("wait", payload)
        keys = _arg(args, "keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise _OpError(E_BAD_REQUEST, "argument 'keys' must be an array of strings")
        timeout = _arg_timeout(args)
        data = self.store.data
        if all(k in data for k in keys):
            return {}, b""

        async def wait_all() -> None:
            # Earlier keys may be deleted while later ones are awaited; wait() promises that
            # each key existed at some moment, which is what barriers built on it need.
            for key in keys:
                present = functools.partial(operator.contains, data, key)
                await self._wait_until(("key", key), present)

        async def later() -> _Result:
            await self._bounded(wait_all(), timeout,
                                lambda: f"keys {[k for k in keys if k not in data]!r}")
            return {}, b""
        return later

    def _op_add(self, args: dict[str, Any], payload: bytes) -> _Result:
        _no_payload("add", payload)
        key = _arg_str(args, "key")
        delta = _arg_int(args, "delta", _I64_MIN, _I64_MAX)
        assert delta is not None
        value = self.store.add(key, delta)
        self._changed_key(key)
        return {"value": value}, b""

    def _op_compare_set(self, args: dict[str, Any], payload: bytes) -> _Result:
        key = _arg_str(args, "key")
        expected = _arg(args, "expected")
        if expected is not None and not isinstance(expected, bytes):
            raise _OpError(E_BAD_REQUEST, "argument 'expected' must be binary or nil")
        swapped, current = self.store.compare_set(key, expected, payload)
        if swapped:
            self._changed_key(key)
        return {"swapped": swapped, "exists": current is not None}, current or b""

    def _op_delete(self, args: dict[str, Any], payload: bytes) -> _Result:
        _no_payload("delete", payload)
        return {"deleted": self.store.delete(_arg_str(args, "key"))}, b""

    def _op_num_keys(self, args: dict[str, Any], payload: bytes) -> _Result:
        _no_payload("num_keys", payload)
        return {"count": len(self.store.data)}, b""

    def _op_join(self, args: dict[str, Any], payload: bytes) -> _Result:
        _no_payload("join", payload)
        rank = _arg_int(args, "rank", 0, _U32)
        host = _arg_str(args, "host")
        port = _arg_int(args, "port", 0, 65535)
        assert rank is not None and port is not None
        generation = self.store.join(rank, host, port, _arg_meta(args))
        self._changed_roster()
        return {"generation": generation}, b""

    def _op_leave(self, args: dict[str, Any], payload: bytes) -> _Result:
        _no_payload("leave", payload)
        rank = _arg_int(args, "rank", 0, _U32)
        assert rank is not None
        removed = self.store.leave(rank)
        if removed:
            self._changed_roster()
        return {"removed": removed}, b""

    def _op_roster(self, args: dict[str, Any], payload: bytes) -> _Result | _Later:
        _no_payload("roster", payload)
        world_size = _arg_int(args, "world_size", 1, _U32 + 1, optional=True)
        generation = _arg_int(args, "generation", 0, _I64_MAX, optional=True)
        timeout = _arg_timeout(args)
        store = self.store

        def ready() -> bool:
            if generation is not None and store.generation != generation:
                return True
            return world_size is None or len(store.members) >= world_size

        if ready():
            return store.roster()

        async def later() -> _Result:
            await self._bounded(
                self._wait_until(("roster",), ready), timeout,
                lambda: f"{world_size} ranks to join the roster (have {len(store.members)})")
            return store.roster()
        return later

    def _op_generation(self, args: dict[str, Any], payload: bytes) -> _Result:
        _no_payload("generation", payload)
        return {"generation": self.store.generation}, b""

    def _op_bump_generation(self, args: dict[str, Any], payload: bytes) -> _Result:
        _no_payload("bump_generation", payload)
        expected = _arg_int(args, "expected", 0, _I64_MAX, optional=True)
        bumped, generation = self.store.bump(expected)
        if bumped:
            self._changed_roster()
        return {"generation": generation, "bumped": bumped}, b""


def _parse_request(frame: Frame) -> tuple[int, str, dict[str, Any]]:
    if frame.kind != FrameKind.REQUEST:
        raise ProtocolError(f"expected a REQUEST frame, got {frame.kind.name}")
    meta = frame.header.meta
    if meta is None:
        raise ProtocolError("REQUEST without meta")
    rid = meta.get("id")
    if type(rid) is not int or not 0 <= rid <= _I64_MAX:
        raise ProtocolError("REQUEST 'id' must be a non-negative int")
    op = meta.get("op")
    if not isinstance(op, str):
        raise ProtocolError("REQUEST 'op' must be a string")
    return rid, op, meta


def _ok_response(rid: int, result: dict[str, Any], payload: bytes) -> Frame:
    return Frame(FrameKind.RESPONSE, FrameHeader(meta={"id": rid, "ok": True, **result}),
                 payload)


def _error_response(rid: int, exc: _OpError) -> Frame:
    message = str(exc)
    if len(message) > MAX_ERROR_CHARS:  # keys are echoed: keep the header small
        message = message[:MAX_ERROR_CHARS] + "..."
    return Frame(FrameKind.RESPONSE, FrameHeader(
        meta={"id": rid, "ok": False, "error": message, "code": exc.code}), b"")


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


async def serve(host: str = "127.0.0.1", port: int = 0, token: str | bytes | None = None, *,
                job: str = "") -> None:
    """Run a rendezvous server until cancelled (the ``asynccoll rendezvous`` command).

    Logs the bound address at INFO on the ``asynccoll.rendezvous`` logger.
    """
    async with RendezvousServer(host, port, token=token, job=job) as server:
        logger.info("rendezvous server listening on %s:%d", server.host, server.port)
        # Runs until the caller cancels it (Ctrl-C under asyncio.run).
        await asyncio.get_running_loop().create_future()


# ----------------------------------------------------------------------------------- client

def _as_bytes(value: bytes | bytearray | memoryview | str, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"{what} must be bytes or str, not {type(value).__name__}")


def _check_key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, not {type(key).__name__}")
    return key


def _check_timeout(timeout: float | None, default: float) -> float:
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            0 <= timeout <= MAX_WAIT_TIMEOUT) or math.isnan(timeout):
        raise ValueError(f"timeout must be a number in [0, {MAX_WAIT_TIMEOUT}], got {timeout!r}")
    return float(timeout)


def _check_int(value: object, what: str, lo: int, hi: int) -> int:
    if type(value) is not int:
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{what} must be in [{lo}, {hi}], got {value}")
    return value


class RendezvousClient:
    """A connection to a :class:`RendezvousServer`. Create it with :meth:`connect`.

    Coroutine methods mirror the server's ops; any number may run concurrently (one reader
    task matches responses to requests by id). Every call is bounded: blocking calls by their
    ``timeout`` (default: the client's ``timeout``) plus a grace period for the answer, the
    others by the client's ``timeout``.

    Every method raises:
        RendezvousError: the server refused the request (its message is included), did not
            answer in time, or the connection is lost or closed. After a lost connection every
            pending and later call raises at once.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 timeout: float, max_value_bytes: int, send_limit: int, address: str) -> None:
        self._reader = reader
        self._writer = writer
        self._timeout = timeout
        self._max_value_bytes = max_value_bytes
        self._send_limit = send_limit
        self._address = address
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[dict[str, Any] | None, Any]]] = {}
        self._error: str | None = None
        self._closed = False
        self._reader_task = asyncio.create_task(self._read_loop(),
                                                name=f"asynccoll-rendezvous-client-{address}")

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._error else "open")
        return f"RendezvousClient({self._address}, {state})"

    @classmethod
    async def connect(cls, host: str, port: int, *, token: str | bytes | None = None,
                      job: str = "", timeout: float = 30.0,
                      connect_retry: bool = True,
                      rank: int | None = None,
                      max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> RendezvousClient:
        """Connect and authenticate to the rendezvous server at ``host:port``.

        With ``connect_retry`` a refused connection is retried (with backoff) until ``timeout``
        has passed, since rank 0 may not have started its server yet. ``timeout`` is also the
        default bound of every later call. ``max_value_bytes`` bounds the values this client
        accepts from the server; the values it sends are bounded by the server's limit, which
        the server announces in WELCOME.

        Raises:
            AuthenticationError: the token (or job id) does not match the server's.
            RendezvousError: the server could not be reached, or the handshake failed, within
                ``timeout``.
        """
        timeout = _check_timeout(timeout, 30.0)
        if rank is not None:
            _check_int(rank, "rank", 0, _U32)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        address = f"{host}:{port}"
        delay = 0.02
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    reader, writer = await asyncio.open_connection(host, port)
                break
            except TimeoutError:
                raise RendezvousError(
                    f"could not connect to the rendezvous server at {address} within "
                    f"{timeout} s") from None
            except ConnectionError as exc:
                if not connect_retry or loop.time() + delay >= deadline:
                    raise RendezvousError(f"could not connect to the rendezvous server at "
                                          f"{address}: {exc}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
            except OSError as exc:
                raise RendezvousError(f"could not connect to the rendezvous server at "
                                      f"{address}: {exc}") from exc
        # A server that came up just before the deadline still gets a fair handshake.
        budget = max(deadline - loop.time(), min(timeout, 5.0))
        try:
            welcome = await client_handshake(reader, writer, token, role="client", rank=rank,
                                             job=job, timeout=budget)
        except AuthenticationError:
            await _close_writer(writer, abort=True)
            raise
        except (ProtocolError, TimeoutError) as exc:
            await _close_writer(writer, abort=True)
            raise RendezvousError(f"handshake with the rendezvous server at {address} failed: "
                                  f"{exc}") from exc
        except BaseException:
            await _close_writer(writer, abort=True)
            raise
        send_limit = welcome.get("max_value_bytes")
        if type(send_limit) is not int or send_limit < 0:
            send_limit = max_value_bytes
        return cls(reader, writer, timeout=timeout, max_value_bytes=max_value_bytes,
                   send_limit=send_limit, address=address)

    async def __aenter__(self) -> RendezvousClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def local_address(self) -> tuple[str, int]:
        """(host, port) of this end of the connection: an address of this machine that routes
        to the rendezvous (what a rank advertises to its peers unless told otherwise)."""
        sockname = self._writer.get_extra_info("sockname")
        return str(sockname[0]), int(sockname[1])

    @property
    def closed(self) -> bool:
        """True after :meth:`close` or once the connection is lost."""
        return self._closed or self._error is not None

    async def close(self) -> None:
        """Close the connection; pending calls raise :class:`RendezvousError`. Idempotent."""
        if not self._closed:
            self._closed = True
            self._fail("the rendezvous client was closed")
            self._reader_task.cancel()
        await asyncio.wait({self._reader_task})
        await _close_writer(self._writer)

    # ------------------------------------------------------------------------- plumbing

    def _fail(self, reason: str) -> None:
        if self._error is None:
            self._error = reason
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_result((None, self._error))
        self._writer.close()

    async def _read_loop(self) -> None:
        try:
            while True:
                frame = await read_frame(self._reader, self._max_value_bytes)
                if frame is None:
                    self._fail(f"the rendezvous server at {self._address} closed the connection")
                    return
                meta = frame.header.meta
                if frame.kind != FrameKind.RESPONSE or meta is None or type(
                        meta.get("id")) is not int or not isinstance(meta.get("ok"), bool):
                    raise ProtocolError("expected a RESPONSE frame with an int 'id' and a "
                                        "bool 'ok'")
                fut = self._pending.pop(meta["id"], None)
                if fut is None:
                    logger.debug("rendezvous: response to abandoned request %d", meta["id"])
                elif not fut.done():
                    fut.set_result((meta, frame.payload))
        except ProtocolError as exc:
            self._fail(f"the rendezvous server at {self._address} broke the protocol: {exc}")
        except (ConnectionError, OSError) as exc:
            self._fail(f"connection to the rendezvous server at {self._address} lost: {exc}")
        except Exception as exc:  # a bug: fail the calls loudly rather than hang them
            logger.exception("rendezvous client: internal error")
            self._fail(f"internal error in the rendezvous client: {exc!r}")

    async def _call(self, op: str, args: dict[str, Any], payload: bytes = b"", *,
                    wait_s: float | None = None) -> tuple[dict[str, Any], Any]:
        if self._error is not None:
            raise RendezvousError(self._error)
        if len(payload) > self._send_limit:
            raise ValueError(f"value of {len(payload)} bytes exceeds the server's "
                             f"max_value_bytes={self._send_limit}")
        rid = next(self._ids)
        fut: asyncio.Future[tuple[dict[str, Any] | None, Any]] = (
            asyncio.get_running_loop().create_future())
        self._pending[rid] = fut
        budget = self._timeout if wait_s is None else wait_s + RESPONSE_GRACE
        try:
            write_frame(self._writer, Frame(
                FrameKind.REQUEST, FrameHeader(meta={"id": rid, "op": op, **args}), payload))
            async with asyncio.timeout(budget):
                await self._writer.drain()
                meta, result = await fut
        except TimeoutError:
            raise RendezvousError(f"no answer from the rendezvous server at {self._address} "
                                  f"to {op!r} within {budget} s") from None
        except (ConnectionError, OSError) as exc:
            self._fail(f"connection to the rendezvous server at {self._address} lost: {exc}")
            raise RendezvousError(self._error or str(exc)) from exc
        finally:
            self._pending.pop(rid, None)
        if meta is None:
            raise RendezvousError(result)
        if not meta["ok"]:
            error = meta.get("error")
            raise RendezvousError(f"rendezvous {op} failed: "
                                  f"{error if isinstance(error, str) else 'unknown error'}")
        return meta, result

    @staticmethod
    def _field(meta: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
        value = meta.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise RendezvousError(f"malformed response from the rendezvous server: {key!r}")
        return value

    # ------------------------------------------------------------------------- ops

    async def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` (bytes; ``str`` is UTF-8 encoded) under ``key``, waking waiters."""
        await self._call("set", {"key": _check_key(key)}, _as_bytes(value, "value"))

    async def get(self, key: str, *, wait: bool = True,
                  timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` s for it to exist.

        Raises:
            KeyError: ``wait=False`` and the key does not exist.
            RendezvousError: the key did not appear within ``timeout`` (or see the class).
        """
        t = _check_timeout(timeout, self._timeout)
        meta, payload = await self._call(
            "get", {"key": _check_key(key), "wait": bool(wait), "timeout": t},
            wait_s=t if wait else None)
        if not self._field(meta, "found", bool):
            raise KeyError(key)
        return bytes(payload)

    async def wait(self, keys: str | Sequence[str],
                   timeout: float | None = None) -> None:
        """Return once every key in ``keys`` exists (each existed at some moment).

        Raises:
            RendezvousError: not all keys appeared within ``timeout`` s.
        """
        keys = [keys] if isinstance(keys, str) else [_check_key(k) for k in keys]
        t = _check_timeout(timeout, self._timeout)
        await self._call("wait", {"keys": keys, "timeout": t}, wait_s=t)

    async def add(self, key: str, delta: int = 1) -> int:
        """Atomically add ``delta`` to the integer at ``key`` (missing counts as 0); return the
        new value. Values are stored as decimal ASCII, so ``get`` returns e.g. ``b"42"``.

        Raises:
            RendezvousError: the existing value is not a decimal integer, or the result
                overflows a signed 64-bit integer.
        """
        _check_int(delta, "delta", _I64_MIN, _I64_MAX)
        meta, _ = await self._call("add", {"key": _check_key(key), "delta": delta})
        return self._field(meta, "value", int)

    async def compare_set(self, key: str, expected: bytes | str | None,
                          desired: bytes | str) -> tuple[bool, bytes | None]:
        """Set ``key`` to ``desired`` iff its value equals ``expected`` (``None``: iff the key
        does not exist). Return ``(swapped, current)``: ``current`` is the value after the
        call (``desired`` when swapped), ``None`` when the key does not exist."""
        exp = None if expected is None else _as_bytes(expected, "expected")
        meta, payload = await self._call("compare_set", {"key": _check_key(key), "expected": exp},
                                         _as_bytes(desired, "desired"))
        swapped = self._field(meta, "swapped", bool)
        exists = self._field(meta, "exists", bool)
        return swapped, bytes(payload) if exists else None

    async def delete(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        meta, _ = await self._call("delete", {"key": _check_key(key)})
        return self._field(meta, "deleted", bool)

    async def num_keys(self) -> int:
        """How many keys the store holds."""
        meta, _ = await self._call("num_keys", {})
        return self._field(meta, "count", int)

    async def join(self, rank: int, host: str, port: int,
                   meta: dict[str, Any] | None = None) -> int:
        """Add (or replace) ``rank`` in the roster with its address and ``meta`` (a msgpack-able
        dict with str keys); return the current generation."""
        _check_int(rank, "rank", 0, _U32)
        _check_int(port, "port", 0, 65535)
        if not isinstance(host, str):
            raise TypeError("host must be a str")
        if meta is not None and (not isinstance(meta, dict)
                                 or not all(isinstance(k, str) for k in meta)):
            raise TypeError("meta must be a dict with str keys or None")
        result, _ = await self._call("join", {"rank": rank, "host": host, "port": port,
                                              "meta": meta})
        return self._field(result, "generation", int)

    async def leave(self, rank: int) -> bool:
        """Remove ``rank`` from the roster; return whether it was there."""
        _check_int(rank, "rank", 0, _U32)
        meta, _ = await self._call("leave", {"rank": rank})
        return self._field(meta, "removed", bool)

    async def roster(self, world_size: int | None = None,
                     timeout: float | None = None, *,
                     generation: int | None = None) -> dict[str, Any]:
        """The roster of the current generation:
        ``{"generation": int, "members": {rank: [host, port, meta]}}``.

        With ``world_size``, first wait until at least that many ranks have joined the current
        generation. With ``generation``, also return as soon as the current generation is a
        different one (the caller then sees the new generation number and should join again).

        Raises:
            RendezvousError: the ranks did not join within ``timeout`` s.
        """
        args: dict[str, Any] = {}
        if world_size is not None:
            args["world_size"] = _check_int(world_size, "world_size", 1, _U32 + 1)
        if generation is not None:
            args["generation"] = _check_int(generation, "generation", 0, _I64_MAX)
        t = _check_timeout(timeout, self._timeout)
        args["timeout"] = t
        meta, payload = await self._call("roster", args,
                                         wait_s=t if world_size is not None else None)
        generation = self._field(meta, "generation", int)
        try:
            raw = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # msgpack raises many types for corrupt input
            raise RendezvousError(f"malformed roster from the rendezvous server: {exc}") from None
        if not isinstance(raw, list):
            raise RendezvousError("malformed roster from the rendezvous server: not an array")
        members: dict[int, list[Any]] = {}
        for entry in raw:
            if (not isinstance(entry, list) or len(entry) != 4 or type(entry[0]) is not int
                    or not isinstance(entry[1], str) or type(entry[2]) is not int
                    or not isinstance(entry[3], dict)):
                raise RendezvousError("malformed roster entry from the rendezvous server")
            members[entry[0]] = [entry[1], entry[2], entry[3]]
        return {"generation": generation, "members": members}

    async def generation(self) -> int:
        """The current roster generation (starts at 0)."""
        meta, _ = await self._call("generation", {})
        return self._field(meta, "generation", int)

    async def bump_generation(self, expected: int | None = None) -> int:
        """Start a new generation (clearing the roster) and return its number.

        With ``expected``, bump only if the current generation is ``expected`` (so that ranks
        that notice the same failure bump once); either way return the current generation.
        """
        args: dict[str, Any] = {}
        if expected is not None:
            args["expected"] = _check_int(expected, "expected", 0, _I64_MAX)
        meta, _ = await self._call("bump_generation", args)
        return self._field(meta, "generation", int)


__all__ = ["DEFAULT_MAX_VALUE_BYTES", "RendezvousClient", "RendezvousServer", "Store", "serve"]
