"""The rendezvous client: one connection, concurrent requests demultiplexed by id."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Sequence
from typing import Any

import msgpack

from ..errors import AuthenticationError, ProtocolError, RendezvousError, RendezvousTimeout
from ..handshake import (
    HandshakeClosed,
    client_handshake,
    normalize_token,
    read_frame,
    write_frame,
)
from ..wire import Frame, FrameHeader, FrameKind
from ._common import (
    _I64_MAX,
    _I64_MIN,
    _U32,
    DEFAULT_MAX_VALUE_BYTES,
    MAX_WAIT_TIMEOUT,
    RESPONSE_GRACE,
    _close_writer,
    logger,
)


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
    """A connection to a ``RendezvousServer``. Create it with ``connect``.

    Coroutine methods mirror the server's ops; any number may run concurrently (one reader
    task matches responses to requests by id). Every call is bounded: blocking calls by their
    ``timeout`` (default: the client's ``timeout``) plus a grace period for the answer, the
    others by the client's ``timeout``.

    Every method raises:
        RendezvousError: the server refused the request (its message is included), did not
            answer in time, or the connection is lost or closed. After a lost connection every
            pending and later call raises at once.
        ValueError: the request cannot be sent (its key and arguments over the 64 KiB
            header, or text that is not UTF-8), or its value is over the server's
            ``max_value_bytes``; nothing was sent and the connection stays usable.
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

        With ``connect_retry`` a refused connection, or one closed during the handshake
        without a refusal (a server going away as we came), is retried (with backoff) until
        ``timeout`` has passed, since rank 0 may not have started its server yet.
        ``timeout`` is also the default bound of every later call. ``max_value_bytes`` bounds
        the values this client accepts from the server; the values it sends are bounded by
        the server's limit, which the server announces in WELCOME.

        Raises:
            AuthenticationError: the token (or job id) does not match the server's.
            RendezvousTimeout: (a ``RendezvousError``) with ``connect_retry``, the server
                could not be reached within ``timeout``: its port refused every try, or hung
                up during the handshake.
            RendezvousError: the server could not be reached, or the handshake failed.
            TypeError, ValueError: ``rank`` or ``max_value_bytes`` is not a non-negative int,
                or ``token`` cannot be a key (``asynccoll.handshake.normalize_token``).
        """
        timeout = _check_timeout(timeout, 30.0)
        if rank is not None:
            _check_int(rank, "rank", 0, _U32)
        _check_int(max_value_bytes, "max_value_bytes", 0, 1 << 62)
        normalize_token(token)  # (one that cannot be a key: before the server sees a client)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        address = f"{host}:{port}"
        delay = 0.02
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    reader, writer = await asyncio.open_connection(host, port)
            except TimeoutError:
                raise RendezvousTimeout(
                    f"could not connect to the rendezvous server at {address} within "
                    f"{timeout} s") from None
            except OSError as exc:
                # Refused: the server may not be up yet. A host with several addresses (as
                # "localhost" often has: ::1 and 127.0.0.1) that all failed raises asyncio's
                # combined OSError("Multiple exceptions: ..."), which has no errno.
                retry = isinstance(exc, ConnectionError) or (
                    type(exc) is OSError and exc.errno is None)
                if not (retry and connect_retry):
                    raise RendezvousError(f"could not connect to the rendezvous server at "
                                          f"{address}: {exc}") from exc
                if loop.time() + delay >= deadline:  # (tried until the end of its timeout)
                    raise RendezvousTimeout(f"could not connect to the rendezvous server at "
                                            f"{address} within {timeout} s: {exc}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            # A server that came up just before the deadline still gets a fair handshake.
            budget = max(deadline - loop.time(), min(timeout, 5.0))
            try:
                welcome = await client_handshake(reader, writer, token, role="client",
                                                 rank=rank, job=job, timeout=budget)
                break
            except AuthenticationError as exc:
                await _close_writer(writer, abort=True)
                # (which server: a rank's own refusals name the peer, see TcpTransport._dial)
                raise AuthenticationError(f"rendezvous server at {address}: {exc}") from None
            except HandshakeClosed as exc:
                # Hung up on without REJECT: a server going away as we came (the last world's
                # rendezvous closing on the port the next one is about to bind) or not up
                # yet behind a proxy. Another try, as for a refused connection.
                await _close_writer(writer, abort=True)
                if not connect_retry:
                    raise RendezvousError(f"handshake with the rendezvous server at {address} "
                                          f"failed: {exc}") from exc
                if loop.time() + delay >= deadline:
                    raise RendezvousTimeout(f"handshake with the rendezvous server at "
                                            f"{address} failed: {exc} (tried for {timeout} s)"
                                            ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
            except (ProtocolError, TimeoutError) as exc:
                await _close_writer(writer, abort=True)
                raise RendezvousError(f"handshake with the rendezvous server at {address} "
                                      f"failed: {exc}") from exc
            except BaseException:
                await _close_writer(writer, abort=True)
                raise
        send_limit = welcome.get("max_value_bytes")
        if type(send_limit) is not int or send_limit < 0:
            send_limit = max_value_bytes
        logger.debug("rendezvous: connected to the server at %s (rank %s)", address, rank)
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
        """True after ``close`` or once the connection is lost."""
        return self._closed or self._error is not None

    async def close(self) -> None:
        """Close the connection; pending calls raise ``RendezvousError``. Idempotent."""
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
                    if not self._closed:
                        logger.debug("rendezvous: the server at %s closed the connection",
                                     self._address)
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
            # (a response larger than this client accepts reads the same way: say so)
            why = f"{exc} (this client's max_value_bytes is {self._max_value_bytes})"
            logger.warning("rendezvous: the server at %s broke the protocol: %s", self._address,
                           why)
            self._fail(f"the rendezvous server at {self._address} broke the protocol: {why}")
        except (ConnectionError, OSError) as exc:
            if not self._closed:
                logger.debug("rendezvous: connection to the server at %s lost: %s",
                             self._address, exc)
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
            try:
                write_frame(self._writer, Frame(
                    FrameKind.REQUEST, FrameHeader(meta={"id": rid, "op": op, **args}), payload))
            except ProtocolError as exc:  # (a key over the 64 KiB header, not UTF-8): unsent
                raise ValueError(f"rendezvous {op}: the request cannot be sent: {exc}") from None
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


__all__ = ["RendezvousClient"]
