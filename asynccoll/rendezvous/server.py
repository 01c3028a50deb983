"""The rendezvous server: the handshake, then REQUEST/RESPONSE frames over asyncio streams."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

from .._aio import close_server, is_loopback, uncancelled, wait_server_closed
from ..errors import ProtocolError
from ..handshake import handshake_timeout as resolve_handshake_timeout
from ..handshake import normalize_token, read_frame, server_handshake, write_frame
from ..wire import Frame, FrameHeader, FrameKind
from ._common import (
    _I64_MAX,
    _I64_MIN,
    _U32,
    DEFAULT_MAX_HANDSHAKES,
    DEFAULT_MAX_KEYS,
    DEFAULT_MAX_STORE_BYTES,
    DEFAULT_MAX_VALUE_BYTES,
    DEFAULT_MAX_WAITING,
    DEFAULT_WAIT_TIMEOUT,
    E_BAD_REQUEST,
    E_LIMIT,
    E_TIMEOUT,
    E_UNKNOWN_OP,
    MAX_ERROR_CHARS,
    MAX_WAIT_TIMEOUT,
    _close_writer,
    _Hangup,
    _OpError,
    _peername,
    logger,
)
from .store import Store, Usage

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
        port: port to bind; 0 picks a free one (read it back from ``port``).
        token: shared secret every client must prove it knows (``None``: the empty token).
        job: when not empty, clients announcing another job id are rejected. When empty (a
            standalone server shared by jobs), each job id that clients announce gets a store,
            roster and generation of its own (see ``store``).
        handshake_timeout: seconds; a connection that has not finished the handshake by then
            is dropped (default: ``ASYNCCOLL_HANDSHAKE_TIMEOUT``, else 5 s; see
            ``asynccoll.handshake.handshake_timeout``).
        max_value_bytes: largest value (frame payload) accepted; a larger frame drops the
            connection that sent it. Announced to clients in WELCOME, so that a well-behaved
            client refuses a larger value itself (``ValueError``) before sending it.
        send_timeout: a client that does not read its responses for this long is dropped.
        max_keys: most keys and roster entries the server holds, every job's together
            (default 2**20).
        max_store_bytes: most bytes of keys, values and roster entries (a rank's host and
            meta) the server holds, every job's together (default 1 GiB).
        max_waiting: most requests waiting at once (a ``get`` or ``wait`` for a missing key,
            a ``roster`` for ranks yet to join), every connection's together (default 65536;
            0: none may wait).
        max_handshakes: most connections in their handshake at once (default 1024; at
            least 1). A connection past it drops the oldest one still in its handshake (a
            WARNING says so): strangers that connect and stay silent hold at most this many
            sockets, and a client whose handshake takes milliseconds is not the oldest
            (a ``RendezvousClient`` dropped during its handshake tries again).

    The three limits bound what authenticated clients make the server hold: a request that
    would pass one is answered with the error code ``limit`` (``RendezvousError`` on the
    client) and changes nothing; the connection stays open, and room made (keys deleted, a
    job's connections closed, waits answered) is room for the next request.

    A connection that fails the handshake or breaks the protocol is closed and logged at
    WARNING; the other clients are not disturbed.

    Jobs: a client's requests act on the namespace of the job id it announced in its
    handshake (``RendezvousClient.connect(job=...)``, ``ASYNCCOLL_JOB_ID`` for ranks). The
    namespace of the empty job id is ``store`` and lives as long as the server; another job's
    is made at its first connection and dropped, keys, roster and generation, when its last
    connection closes (that job is over), so that a server serving job after job holds only
    the state of the jobs connected now, and a later job of the same id starts empty.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 token: str | bytes | None = None, job: str = "",
                 handshake_timeout: float | None = None,
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                 send_timeout: float = 30.0, max_keys: int = DEFAULT_MAX_KEYS,
                 max_store_bytes: int = DEFAULT_MAX_STORE_BYTES,
                 max_waiting: int = DEFAULT_MAX_WAITING,
                 max_handshakes: int = DEFAULT_MAX_HANDSHAKES) -> None:
        # a wrong type is a TypeError, a wrong value a ValueError, each naming the argument
        handshake_timeout = resolve_handshake_timeout(handshake_timeout)
        for name, value in (("max_value_bytes", max_value_bytes), ("max_keys", max_keys),
                            ("max_store_bytes", max_store_bytes),
                            ("max_waiting", max_waiting), ("max_handshakes", max_handshakes)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < (name == "max_handshakes"):
                raise ValueError(f"{name} must be >= {int(name == 'max_handshakes')}, "
                                 f"got {value}")
        if isinstance(send_timeout, bool) or not isinstance(send_timeout, int | float):
            raise TypeError(f"send_timeout must be a number of seconds, got {send_timeout!r}")
        if not 0 < send_timeout < math.inf:
            raise ValueError(f"send_timeout must be a finite number of seconds > 0, "
                             f"got {send_timeout!r}")
        if token is not None and not isinstance(token, str | bytes):
            raise TypeError("token must be str, bytes or None")
        normalize_token(token)  # (a str that cannot be a key: now, not at every connection)
        if not isinstance(job, str):
            raise TypeError(f"job must be a str, not {type(job).__name__}")
        self._bind = (host, port)
        self._token = token
        self._server_job = job
        self._handshake_timeout = handshake_timeout
        self._max_value_bytes = max_value_bytes
        self._send_timeout = float(send_timeout)
        #: what every job's store holds together, against max_keys and max_store_bytes
        self._usage = Usage(max_keys, max_store_bytes)
        self._max_waiting = max_waiting
        #: requests waiting now (every connection's)
        self._waiting = 0
        self._max_handshakes = max_handshakes
        #: the connections in their handshake, oldest first: their tasks and streams
        self._handshaking: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        #: the namespace of the empty job id (clients that announce none)
        self.store = Store(usage=self._usage)
        #: every job's namespace, and how many connections of each are open
        self._stores: dict[str, Store] = {"": self.store}
        self._job_sessions: dict[str, int] = {}
        #: the job of the request a handler serves (set with ``_caller``)
        self._job = ""
        #: the sessions, numbered from 1: those open, the last one's number, and the one whose
        #: request a handler serves (roster entries remember who joined them, see Store.join)
        self._live: set[int] = set()
        self._sessions = 0
        self._caller = 0
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
        return f"RendezvousServer({where}, job={self._server_job!r})"

    @property
    def host(self) -> str:
        """The bound host (after ``start``)."""
        if self._address is None:
            raise RuntimeError("the server is not started")
        return self._address[0]

    @property
    def port(self) -> int:
        """The bound port (after ``start``)."""
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
        host, port = self._bind
        try:
            await ready
            # not serving yet: cancelled in start_server's own turn after binding, the
            # listening socket would be lost to close()
            self._server = await asyncio.start_server(self._on_connect, host, port,
                                                      start_serving=False)
            await self._server.start_serving()
        except BaseException:  # cannot bind, or cancelled: nothing is left running
            await uncancelled(self.close())  # (all of it, even if cancelled again meanwhile)
            raise
        sockname = self._server.sockets[0].getsockname()
        self._address = (sockname[0], sockname[1])
        if not self._token and not is_loopback(host):
            logger.warning("rendezvous server on %s:%d has no token: anyone who can reach it "
                           "can read and write the store", *self._address)

    async def _supervise(self, ready: asyncio.Future[None]) -> None:
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            if not ready.done():  # (cancelled with the start that awaited it)
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
            await wait_server_closed(self._server)
        for _ in range(3):  # let connections aborted in _on_connect close their sockets
            await asyncio.sleep(0)

    # ------------------------------------------------------------------------- connections

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing or self._tg is None:
            writer.transport.abort()
            return
        if len(self._handshaking) >= self._max_handshakes:
            oldest = next(iter(self._handshaking))
            dropped = self._handshaking.pop(oldest)
            logger.warning("rendezvous: dropped connection from %s: still in its handshake "
                           "when %d were (max_handshakes), the oldest", _peername(dropped),
                           self._max_handshakes)
            # (the socket first: a task cancelled before it started runs none of its code,
            # its finally that closes the connection included)
            dropped.transport.abort()
            oldest.cancel()
        task = self._tg.create_task(self._serve_connection(reader, writer))
        self._handshaking[task] = writer

    async def _serve_connection(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        peer = _peername(writer)
        abort = True
        try:
            try:
                hs = await server_handshake(
                    reader, writer, self._token, job=self._server_job,
                    timeout=self._handshake_timeout,
                    welcome_meta={"max_value_bytes": self._max_value_bytes})
            except (ProtocolError, TimeoutError) as exc:  # AuthenticationError included
                logger.warning("rendezvous: dropped connection from %s: %s", peer, exc)
                abort = isinstance(exc, TimeoutError)
                return
            finally:
                self._handshaking.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
            logger.debug("rendezvous: %s connected (role=%s, rank=%s)",
                         peer, hs.peer_role, hs.peer_rank)
            abort = await self._session(reader, writer, peer, hs.peer_job or "")
        except Exception:  # a bug: log it, never take the other connections down with it
            logger.exception("rendezvous: internal error serving %s", peer)
        finally:
            await _close_writer(writer, abort=abort)

    @property
    def jobs(self) -> list[str]:
        """The job ids whose namespaces the server holds now (``""`` always): those with a
        connection open."""
        return sorted(self._stores)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       peer: str, job: str) -> bool:
        """Serve requests of job ``job`` until the client leaves; return True when the
        connection should be aborted rather than closed gracefully."""
        abort = True
        self._sessions += 1
        session = self._sessions
        self._live.add(session)
        self._job_sessions[job] = self._job_sessions.get(job, 0) + 1
        if job not in self._stores:
            self._stores[job] = Store(usage=self._usage)
        # one response at a time goes to the socket (see _respond)
        sending = asyncio.Lock()
        try:
            async with asyncio.TaskGroup() as tg:
                while (frame := await read_frame(reader, self._max_value_bytes)) is not None:
                    rid, op, args = _parse_request(frame)
                    await self._dispatch(tg, writer, sending, rid, op, args,
                                         bytes(frame.payload), session, job)
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
            logger.warning("rendezvous: connection from %s lost: %s", peer,
                           group.exceptions[0])
        finally:
            self._live.discard(session)
            self._job_sessions[job] -= 1
            if not self._job_sessions[job]:
                del self._job_sessions[job]
                if job:  # that job is over: nothing of it is kept (its waiters were its own)
                    self._stores.pop(job).release()
                    logger.debug("rendezvous: the last connection of job %r closed; its keys "
                                 "and roster are dropped", job)
        return abort

    async def _dispatch(self, tg: asyncio.TaskGroup, writer: asyncio.StreamWriter,
                        sending: asyncio.Lock, rid: int, op: str, args: dict[str, Any],
                        payload: bytes, session: int, job: str) -> None:
        handler = self._handlers.get(op)
        try:
            if handler is None:
                raise _OpError(E_UNKNOWN_OP, f"unknown op {op!r}")
            self._caller = session        # read by handlers (synchronous: no await before)
            self._job = job
            result = handler(args, payload)
        except _OpError as exc:
            await self._respond(writer, sending, _error_response(rid, exc))
            return
        if not callable(result):
            await self._respond(writer, sending, _ok_response(rid, *result))
        elif self._waiting >= self._max_waiting:
            await self._respond(writer, sending, _error_response(rid, _OpError(
                E_LIMIT, f"{op} refused: it would wait, and {self._waiting} requests wait "
                         f"at the rendezvous server already, its limit "
                         f"(max_waiting={self._max_waiting})")))
        else:
            # counted until its task ends (a callback: a task cancelled before it started
            # runs none of its code)
            self._waiting += 1
            tg.create_task(self._finish_later(writer, sending, rid, result)
                           ).add_done_callback(self._waited)

    def _waited(self, _: object) -> None:
        self._waiting -= 1

    async def _finish_later(self, writer: asyncio.StreamWriter, sending: asyncio.Lock,
                            rid: int, later: _Later) -> None:
        try:
            response = _ok_response(rid, *await later())
        except _OpError as exc:
            response = _error_response(rid, exc)
        await self._respond(writer, sending, response)

    async def _respond(self, writer: asyncio.StreamWriter, sending: asyncio.Lock,
                       frame: Frame) -> None:
        """Write ``frame`` once the connection's previous response has drained (``sending``
        is the connection's): the event loop holds at most one response of a connection
        at a time, so the requests waiting for one key, answered together when it is set,
        cost one value's memory rather than one per request (CPython 3.11's loop copies
        each response it buffers: 100 ``get``s waiting for a 16 MiB value took 1.6 GB while
        the client did not read)."""
        async with sending:  # (bounded: the one before drains within send_timeout, or fails)
            write_frame(writer, frame)
            async with asyncio.timeout(self._send_timeout):
                await writer.drain()

    # ------------------------------------------------------------------------- waiting

    def _wake(self, topic: Any) -> None:
        for fut in self._waiters.pop(topic, ()):
            if not fut.done():
                fut.set_result(None)

    async def _next_wake(self, topic: Any) -> None:
        """Return when ``topic`` is next woken. Unbounded: callers wrap it in ``_bounded``."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(topic, set()).add(fut)
        try:
            await fut
        finally:
            waiting = self._waiters.get(topic)
            if waiting is not None:
                waiting.discard(fut)
                if not waiting:
                    del self._waiters[topic]

    async def _wait_until(self, topic: Any, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds, re-checking it whenever ``topic`` is woken.
        Unbounded: callers wrap it in ``_bounded``."""
        while not predicate():
            await self._next_wake(topic)

    @staticmethod
    async def _bounded(wait: Awaitable[None], limit: float, what: Callable[[], str]) -> None:
        try:
            async with asyncio.timeout(limit):
                await wait
        except TimeoutError:
            raise _OpError(E_TIMEOUT, f"timed out after {limit} s waiting for {what()}"
                           ) from None

    @property
    def _store(self) -> Store:
        """The namespace of the job whose request a handler serves."""
        return self._stores[self._job]

    def _changed_key(self, key: str) -> None:
        self._wake(("key", self._job, key))

    def _changed_roster(self) -> None:
        self._wake(("roster", self._job))

    # ------------------------------------------------------------------------- ops

    def _op_set(self, args: dict[str, Any], payload: bytes) -> _Result:
        key = _arg_str(args, "key")
        self._store.set(key, payload)
        self._changed_key(key)
        return {}, b""

    def _op_get(self, args: dict[str, Any], payload: bytes) -> _Result | _Later:
        _no_payload("get", payload)
        key = _arg_str(args, "key")
        wait = args.get("wait", True)
        if not isinstance(wait, bool):
            raise _OpError(E_BAD_REQUEST, "argument 'wait' must be a bool")
        timeout = _arg_timeout(args)
        # (captured: a later answer runs when another job's request may be the one served)
        data, topic = self._store.data, ("key", self._job, key)
        if key in data or not wait:
            return self._get_now(data, key)

        async def later() -> _Result:
            await self._bounded(self._wait_until(topic, lambda: key in data),
                                timeout, lambda: f"key {key!r}")
            return self._get_now(data, key)
        return later

    @staticmethod
    def _get_now(data: dict[str, bytes], key: str) -> _Result:
        value = data.get(key)
        if value is None:
            return {"found": False}, b""
        return {"found": True}, value

    def _op_wait(self, args: dict[str, Any], payload: bytes) -> _Result | _Later:
        _no_payload("wait", payload)
        keys = _arg(args, "keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise _OpError(E_BAD_REQUEST, "argument 'keys' must be an array of strings")
        timeout = _arg_timeout(args)
        data = self._store.data
        job = self._job
        if all(k in data for k in keys):
            return {}, b""

        async def wait_all() -> None:
            # wait() promises that each key existed at some moment, which is what barriers
            # built on it need: earlier keys may be deleted while later ones are awaited, and a
            # wake means the key was just written, even if it is deleted before this task runs.
            for key in keys:
                if key not in data:
                    await self._next_wake(("key", job, key))

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
        value = self._store.add(key, delta)
        self._changed_key(key)
        return {"value": value}, b""

    def _op_compare_set(self, args: dict[str, Any], payload: bytes) -> _Result:
        key = _arg_str(args, "key")
        expected = _arg(args, "expected")
        if expected is not None and not isinstance(expected, bytes):
            raise _OpError(E_BAD_REQUEST, "argument 'expected' must be binary or nil")
        swapped, current = self._store.compare_set(key, expected, payload)
        if swapped:
            self._changed_key(key)
        return {"swapped": swapped, "exists": current is not None}, current or b""

    def _op_delete(self, args: dict[str, Any], payload: bytes) -> _Result:
        _no_payload("delete", payload)
        return {"deleted": self._store.delete(_arg_str(args, "key"))}, b""

    def _op_num_keys(self, args: dict[str, Any], payload: bytes) -> _Result:
        _no_payload("num_keys", payload)
        return {"count": len(self._store.data)}, b""

    def _op_join(self, args: dict[str, Any], payload: bytes) -> _Result:
        _no_payload("join", payload)
        rank = _arg_int(args, "rank", 0, _U32)
        host = _arg_str(args, "host")
        port = _arg_int(args, "port", 0, 65535)
        assert rank is not None and port is not None
        generation = self._store.join(rank, host, port, _arg_meta(args), self._caller,
                                     self._live)
        self._changed_roster()
        return {"generation": generation}, b""

    def _op_leave(self, args: dict[str, Any], payload: bytes) -> _Result:
        _no_payload("leave", payload)
        rank = _arg_int(args, "rank", 0, _U32)
        assert rank is not None
        removed = self._store.leave(rank)
        if removed:
            self._changed_roster()
        return {"removed": removed}, b""

    def _op_roster(self, args: dict[str, Any], payload: bytes) -> _Result | _Later:
        _no_payload("roster", payload)
        world_size = _arg_int(args, "world_size", 1, _U32 + 1, optional=True)
        generation = _arg_int(args, "generation", 0, _I64_MAX, optional=True)
        timeout = _arg_timeout(args)
        store = self._store
        topic = ("roster", self._job)
        caller = self._caller  # (a later answer runs when another request is the caller)

        def ready() -> bool:
            if generation is not None and store.generation != generation:
                return True
            return world_size is None or len(store.members) >= world_size

        if ready():
            return store.roster(caller, world_size)

        async def later() -> _Result:
            await self._bounded(
                self._wait_until(topic, ready), timeout,
                lambda: f"{world_size} ranks to join the roster (have {len(store.members)})")
            return store.roster(caller, world_size)
        return later

    def _op_generation(self, args: dict[str, Any], payload: bytes) -> _Result:
        _no_payload("generation", payload)
        return {"generation": self._store.generation}, b""

    def _op_bump_generation(self, args: dict[str, Any], payload: bytes) -> _Result:
        _no_payload("bump_generation", payload)
        expected = _arg_int(args, "expected", 0, _I64_MAX, optional=True)
        bumped, generation = self._store.bump(expected)
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


async def serve(host: str = "127.0.0.1", port: int = 0, token: str | bytes | None = None, *,
                job: str = "") -> None:
    """Run a rendezvous server until cancelled (the ``asynccoll rendezvous`` command).

    Logs the bound address at INFO on the ``asynccoll.rendezvous`` logger.
    """
    async with RendezvousServer(host, port, token=token, job=job) as server:
        logger.info("rendezvous server listening on %s:%d", server.host, server.port)
        # Runs until the caller cancels it (Ctrl-C under asyncio.run).
        await asyncio.get_running_loop().create_future()
