"""The transport interface: move frames between ranks, match them to the receives waiting for them.

A backend implements :class:`Transport` in one file. It has to provide three things:

* ``send(dst, kind, header, payload)``: deliver one frame to world rank ``dst``. When it
  returns, the caller may reuse ``payload``.
* ``_notify_abort(frame)``: best-effort delivery of an ABORT frame to every other rank.
* ``close()``.

Receiving is shared code: the backend hands each incoming frame to :class:`Mailbox`, which
matches it to a posted receive by its key ``(src, kind, group, seq, step, tag)``. A backend that
can read payloads straight into memory (TCP) first asks :meth:`Mailbox.claim` for the buffer the
receiver posted, so array data lands where it belongs without a copy.

The mailbox also checks collective signatures: every DATA frame carries the signature of the
collective that sent it (name, dtype, shape, op, algorithm ...). When it differs from the
signature of the collective this rank runs under the same ``(group, seq)`` the world is aborted
with a :class:`~asynccoll.errors.CollectiveError` naming both, before any payload touches a user
buffer.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import (
    CollectiveError,
    CommunicatorClosedError,
    PeerLostError,
)
from ..wire import Frame, FrameHeader, FrameKind

log = logging.getLogger("asynccoll.transport")

#: (src world rank, frame kind, group, seq, step, tag)
Key = tuple[int, int, int, int, int, int]


def frame_key(kind: int, header: FrameHeader) -> Key:
    return (header.src, int(kind), header.group, header.seq, header.step, header.tag)


@dataclass(slots=True)
class _Posted:
    future: asyncio.Future[Frame]
    into: memoryview | None
    sig: tuple[Any, ...] | None


def describe_sig(sig: tuple[Any, ...] | None) -> str:
    """Human-readable form of a collective signature, for error messages."""
    if not sig:
        return "<nothing>"
    name, *rest = sig
    return f"{name}({', '.join(str(x) for x in rest)})"


class Mailbox:
    """Posted receives and early frames of one rank, matched by key. Not thread-safe.

    ``on_mismatch`` is called with a :class:`CollectiveError` when a DATA frame's signature
    differs from the local collective's; the transport then aborts the world.
    """

    def __init__(self, rank: int, on_mismatch: Callable[[CollectiveError], None]) -> None:
        self.rank = rank
        self._posted: dict[Key, _Posted] = {}
        self._early: dict[Key, Frame] = {}
        self._active: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._early_sig: dict[tuple[int, int], tuple[int, tuple[Any, ...] | None]] = {}
        self._lost: dict[int, CollectiveError] = {}
        self._error: CollectiveError | None = None
        self._on_mismatch = on_mismatch

    # -- the collective's side ------------------------------------------------------------

    def begin(self, group: int, seq: int, sig: tuple[Any, ...]) -> None:
        """Register the collective ``(group, seq)`` this rank now runs, and check early frames."""
        self._active[(group, seq)] = sig
        early = self._early_sig.pop((group, seq), None)
        if early is not None and early[1] != sig:
            self._mismatch(early[0], early[1], sig)

    def end(self, group: int, seq: int) -> None:
        self._active.pop((group, seq), None)

    def take(self, key: Key, into: memoryview | None) -> Frame | None:
        """The frame for ``key`` if it arrived already (copied into ``into`` when given)."""
        if self._error is not None:
            raise self._error
        frame = self._early.pop(key, None)
        if frame is None:
            lost = self._lost.get(key[0])
            if lost is not None:
                raise lost
            return None
        return _fill(frame, into)

    def post(self, key: Key, into: memoryview | None, sig: tuple[Any, ...] | None
             ) -> asyncio.Future[Frame]:
        if key in self._posted:
            raise RuntimeError(f"receive for {key} posted twice")  # our own invariant
        fut: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self._posted[key] = _Posted(fut, into, sig)
        return fut

    def unpost(self, key: Key) -> None:
        self._posted.pop(key, None)

    # -- the transport's side -------------------------------------------------------------

    def check(self, kind: int, header: FrameHeader) -> bool:
        """Check an incoming frame's signature; ``False`` (and the world aborted) on mismatch."""
        if kind != FrameKind.DATA:
            return True
        gs = (header.group, header.seq)
        mine = self._active.get(gs)
        if mine is None:
            self._early_sig.setdefault(gs, (header.src, header.sig))
            return True
        if header.sig != mine:
            self._mismatch(header.src, header.sig, mine)
            return False
        return True

    def claim(self, key: Key, nbytes: int) -> memoryview | None:
        """The buffer posted for ``key`` if it exists and holds exactly ``nbytes``."""
        posted = self._posted.get(key)
        if posted is None or posted.into is None or posted.into.nbytes != nbytes:
            return None
        return posted.into

    def deliver(self, key: Key, frame: Frame) -> None:
        """Hand a received frame to its receiver, or keep it until one is posted.

        The frame's payload must be memory the receiver may keep (not the sender's buffer).
        """
        if self._error is not None:
            return
        posted = self._posted.pop(key, None)
        if posted is None:
            if key in self._early:
                log.warning("rank %d: duplicate frame %s dropped", self.rank, key)
                return
            self._early[key] = frame
            return
        if not posted.future.done():
            posted.future.set_result(_fill(frame, posted.into))

    def peer_lost(self, src: int, exc: CollectiveError) -> None:
        """Fail receives from ``src`` now and later (frames that already arrived stay readable)."""
        self._lost.setdefault(src, exc)
        for key in [k for k in self._posted if k[0] == src]:
            posted = self._posted.pop(key)
            if not posted.future.done():
                posted.future.set_exception(exc)

    def fail(self, exc: CollectiveError) -> None:
        """Fail every posted and future receive with ``exc`` (the world is broken)."""
        if self._error is None:
            self._error = exc
        posted, self._posted = self._posted, {}
        self._early.clear()
        for p in posted.values():
            if not p.future.done():
                p.future.set_exception(exc)

    @property
    def error(self) -> CollectiveError | None:
        return self._error

    def _mismatch(self, src: int, theirs: tuple[Any, ...] | None, mine: tuple[Any, ...]) -> None:
        self._on_mismatch(CollectiveError(
            f"collective mismatch: world rank {src} called {describe_sig(theirs)} "
            f"but world rank {self.rank} called {describe_sig(mine)}"))


def _fill(frame: Frame, into: memoryview | None) -> Frame:
    if into is None or frame.payload is into:
        return frame
    src = memoryview(frame.payload)
    if src.nbytes != into.nbytes:
        return frame  # size mismatch: the receiver validates the header and raises
    into[:] = src.cast("B") if src.format != "B" else src
    return Frame(frame.kind, frame.header, into)


def error_from_abort(frame: Frame) -> CollectiveError:
    """Rebuild the exception an ABORT frame describes."""
    meta = frame.header.meta or {}
    reason = str(meta.get("reason", "no reason given"))
    message = f"world rank {frame.header.src} aborted: {reason}"
    if meta.get("error") == "PeerLostError":
        lost = meta.get("lost")
        return PeerLostError(message, rank=lost if isinstance(lost, int) else None)
    return CollectiveError(message)


def abort_meta(exc: BaseException) -> dict[str, Any]:
    meta: dict[str, Any] = {"reason": str(exc), "error": type(exc).__name__}
    if isinstance(exc, PeerLostError) and exc.rank is not None:
        meta["lost"] = exc.rank
    return meta


class Transport(abc.ABC):
    """Moves frames between the ranks of one world. One instance per rank."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.mailbox = Mailbox(rank, self._on_mismatch)
        self._closed = False
        #: bytes of payload handed to ``send`` (for accounting, e.g. compression tests)
        self.bytes_sent = 0

    # -- to implement ---------------------------------------------------------------------

    @abc.abstractmethod
    async def send(self, dst: int, kind: FrameKind, header: FrameHeader, payload: Any) -> None:
        """Send one frame to world rank ``dst``; ``payload`` may be reused once this returns.

        Raises:
            PeerLostError: ``dst`` is gone.
            CollectiveError: the world is broken.
        """

    @abc.abstractmethod
    def _notify_abort(self, frame: Frame) -> None:
        """Best effort: make every other rank receive ``frame`` (an ABORT), without waiting."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """Release connections; called once."""

    # -- shared ---------------------------------------------------------------------------

    async def recv(self, key: Key, into: memoryview | None = None,
                   sig: tuple[Any, ...] | None = None) -> Frame:
        """Wait for the frame matching ``key``; fill ``into`` with its payload when sizes agree.

        When the returned frame's payload is not ``into``, sizes differed and the caller must
        validate the header before using the data.
        """
        frame = self.mailbox.take(key, into)
        if frame is not None:
            return frame
        fut = self.mailbox.post(key, into, sig)
        try:
            return await fut
        finally:
            self.mailbox.unpost(key)

    def check_usable(self) -> None:
        if self._closed:
            raise CommunicatorClosedError("the communicator was closed")
        if self.mailbox.error is not None:
            raise CollectiveError(f"the communicator is broken by an earlier error: "
                                  f"{self.mailbox.error}") from self.mailbox.error

    @property
    def broken(self) -> CollectiveError | None:
        return self.mailbox.error

    def abort(self, exc: CollectiveError, *, notify: bool = True) -> None:
        """Break the world: fail every receive with ``exc`` and tell the other ranks."""
        if self.mailbox.error is not None:
            return
        log.debug("rank %d aborts: %s", self.rank, exc)
        self.mailbox.fail(exc)
        if notify and not self._closed:
            header = FrameHeader(src=self.rank, meta=abort_meta(exc))
            self._notify_abort(Frame(FrameKind.ABORT, header, b""))

    def _on_abort_frame(self, frame: Frame) -> None:
        self.abort(error_from_abort(frame), notify=False)

    def _on_mismatch(self, exc: CollectiveError) -> None:
        self.abort(exc)

    async def close(self) -> None:
        """Close connections; idempotent. Pending receives fail with CommunicatorClosedError."""
        if self._closed:
            return
        self._closed = True
        if self.mailbox.error is None:
            self.mailbox.fail(CommunicatorClosedError("the communicator was closed"))
        await self._close()
