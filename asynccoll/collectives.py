"""The Communicator: argument checks, sequence numbers, signatures, timeouts, failures.

Each public collective validates its arguments (raising ``TypeError``/``ValueError`` before
anything is sent), takes the next sequence number of its group, computes its *signature* (what
all ranks must agree on: name, dtype, shape, op, root, algorithm) and runs one algorithm of
``asynccoll.algorithms``, chosen by ``asynccoll.tuning``.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import operator
import re
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgpack
import numpy as np

from .algorithms import (
    AGREE_STEP,
    Call,
    begin_barrier,
    binomial_broadcast,
    bytes_view,
    chain_broadcast,
    direct_all_gather,
    direct_all_reduce,
    direct_reduce_scatter,
    dissemination_barrier,
    doubling_broadcast,
    doubling_gather,
    end_barrier,
    recursive_doubling,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce,
    ring_reduce_scatter,
    row_bounds,
    settle,
)
from .errors import CollectiveError, CollectiveTimeout, CommunicatorClosedError, PeerLostError
from .ops import ReduceOp, check_op, finish
from .transport.base import Transport, describe_sig, name_call, payload_too_large, refused
from .tuning import Tuning, check_tuning, fit_frames
from .wire import FrameKind, array_view, dtype_code, encode_data_head

T = TypeVar("T")

_MAX_TAG = (1 << 63) - 1
#: distinct plans (all_reduce, broadcast, all_gather: per dtype, shape and op, root or out) a
#: communicator keeps (see Communicator._plans)
_MAX_PLANS = 256


# --------------------------------------------------------------------------------- helpers

def _not_an_array(a: Any, what: str) -> str:
    """The ``TypeError`` message for ``a``, which is not a NumPy array; for a torch tensor
    (or subclass: ``nn.Parameter``), what to pass instead (torch is not imported)."""
    if not any(c.__name__ == "Tensor" and c.__module__.partition(".")[0] == "torch"
               for c in type(a).__mro__):
        return f"{what} must be a numpy.ndarray, got {type(a).__name__}"
    got = f"{what} must be a numpy.ndarray, got a torch.Tensor"
    device = getattr(a, "device", None)
    if getattr(device, "type", "cpu") != "cpu":
        return (f"{got} on {device}: the collectives take NumPy arrays (CuPy arrays on "
                f"nccl); copy it to the CPU (tensor.cpu().numpy()) and the result back")
    if str(getattr(a, "dtype", "")) == "torch.bfloat16":
        return (f"{got} of dtype torch.bfloat16, which NumPy does not have: convert it "
                f"(tensor.float().numpy()) and the result back")
    return (f"{got}: pass tensor.numpy() (tensor.detach().numpy() if it requires grad), "
            f"a view of its memory, so results written in place land in the tensor")


def _check_array(a: Any, what: str = "array", *, writable: bool = False) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(_not_an_array(a, what))
    if a.__class__ is not np.ndarray and isinstance(a, np.matrix):
        # it stays 2-D when flattened: the algorithms' flat views of it are wrong
        raise TypeError(f"{what} is a numpy.matrix; pass numpy.asarray({what}) (a view)")
    if not a.flags.c_contiguous:
        raise TypeError(f"{what} must be C-contiguous (use numpy.ascontiguousarray)")
    dtype_code(a.dtype)  # TypeError for unsupported dtypes
    if not a.dtype.isnative:
        raise TypeError(f"{what} has non-native byte order ({a.dtype.str}); convert it with "
                        f"array.astype(array.dtype.newbyteorder('='))")
    if writable and not a.flags.writeable:
        raise ValueError(f"{what} is read-only but this collective writes into it")
    return a


def _fits(a: np.ndarray, writable: bool) -> bool:
    """Whether an array of a planned dtype and shape still fits its plan: C-contiguous, and
    writable when ``writable`` (the checks of ``_check_array`` that can change between calls)."""
    flags = a.flags
    return flags.c_contiguous and (not writable or flags.writeable)


def _sig_array(a: np.ndarray) -> tuple[str, tuple[int, ...]]:
    return dtype_code(a.dtype), a.shape  # numpy shapes are tuples of Python ints


def _into(out: np.ndarray, blocks: list[np.ndarray]) -> np.ndarray:
    """Concatenate ``blocks`` into ``out`` (the uneven all_gather's path). Blocks may be views
    of ``out`` at even offsets (where they were received): those are concatenated apart first,
    since moving one block to its place can overwrite another not moved yet."""
    rows = sum(b.shape[0] for b in blocks)
    if rows != out.shape[0]:
        raise CollectiveError(f"all_gather gathered {rows} rows but out has {out.shape[0]}")
    if any(np.may_share_memory(b, out) for b in blocks):
        out[...] = np.concatenate(blocks)
    else:
        np.concatenate(blocks, out=out)
    return out


#: first byte of what a rank sends in an object collective for an object it cannot send (no
#: msgpack message starts with it: 0xc1 is "never used"); then b"T" (the object does not
#: pack: TypeError) or b"V" (too large: ValueError), then the error's message
_UNSENDABLE = 0xC1


def _pack_object(obj: Any, rank: int, limit: int | None = None) -> np.ndarray:
    """``obj`` packed by group rank ``rank``. An object that does not pack, or packs to more
    than ``limit`` bytes (what one frame may carry), becomes a marker carrying the error,
    which the call moves like any object, so that every rank raises it (``_unpack_object``):
    raising here, before the call, left the other ranks waiting for this one until their
    timeout broke the world, and sending it broke the world at once. A marker longer than
    ``limit`` is cut to it."""
    try:
        data = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        data = bytes([_UNSENDABLE]) + b"T" + (f"the object of group rank {rank} is not "
                                              f"msgpack-serialisable: {exc}").encode()
    else:
        if limit is not None and len(data) > limit:
            data = bytes([_UNSENDABLE]) + b"V" + (
                f"the object of group rank {rank} packs to {len(data)} bytes, more than one "
                f"frame may carry (max_payload: {limit} bytes): split it, or raise "
                f"max_payload on every rank").encode()
    if limit is not None and len(data) > limit and data[0] == _UNSENDABLE:
        # the error must travel too: cut (a long message of msgpack's, a small max_payload)
        data = data[:max(limit - 3, 2)] + b"..."[:max(limit - 2, 0)]
    return np.frombuffer(data, dtype=np.uint8)


def _unpack_object(a: np.ndarray, rank: int) -> Any:
    """The object group rank ``rank`` packed in ``a``. Called after the collective that moved
    it, so that an object that does not pack, is too large, or packs but does not unpack (a
    dict with tuple keys: a list is no key) raises on every rank and leaves the communicator
    usable.

    Raises:
        TypeError: the object did not pack, or does not unpack.
        ValueError: the object was too large to send.
    """
    data = a.tobytes()
    if data[:1] == bytes([_UNSENDABLE]):
        error = ValueError if data[1:2] == b"V" else TypeError
        raise error(data[2:].decode(errors="replace"))
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the object of group rank {rank} does not round-trip through "
                        f"msgpack: {exc}") from exc


# ----------------------------------------------------------------------------- communicator

def check_timeout(timeout: object, name: str = "timeout") -> float:
    """``timeout`` as seconds: a number >= 0 (``inf``: none); errors name ``name``."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float | np.integer
                                                    | np.floating):
        raise TypeError(f"{name} must be a number of seconds, got {timeout!r}")
    if not float(timeout) >= 0:  # NaN too
        raise ValueError(f"{name} must be >= 0 seconds, got {timeout!r}")
    return float(timeout)


def check_int(value: object, name: str) -> int:
    """``value`` as an ``int``: Python's and NumPy's integers are ones; a bool, a float or a
    string is a ``TypeError`` naming ``name`` (for the arguments of ``init``, ``run_local``)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int, got {value!r}")


#: how an error relayed from another rank (an ABORT frame) begins
_RELAYED = re.compile(r"world rank (\d+) aborted: ")


class _Watchdog:
    """Cancels collectives (and point-to-point calls) that make no progress for their timeout.

    One timer per communicator, armed for the earliest check, instead of an
    ``asyncio.timeout`` per call (whose set-up costs more than a small all_reduce's own work).
    A task runs at most one collective at a time, so tasks identify collectives.

    Progress is bytes moving on the transport: bytes received (``Transport.bytes_received``;
    for a point-to-point call, from its peer only, ``received_from``), or a backlog of bytes
    to write (``outgoing_bytes``: the event loop's and the kernel's) that changed. A call is
    looked at every ``timeout / CHECKS`` while it runs (the counters are read then, and once
    when it starts), and cancelled once nothing moved for ``timeout``: a transfer that keeps
    moving is never cut short, and one that stalls stops between ``timeout`` and
    ``timeout * (1 + 1 / CHECKS)`` after its last byte. Bytes moved for other calls of the
    same transport count too.
    """

    #: looks per timeout at a running call
    CHECKS = 4
    #: the timers' resolution (uvloop's): a look this early counts as on time
    SLACK = 1e-3

    __slots__ = ("__weakref__", "_armed", "_calls", "_expired", "_handle", "_loop", "_ref",
                 "_transport")

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        #: what the timer holds: this watchdog strongly while it watches calls, weakly after
        self._ref = _TimerRef(self)
        #: per task: [when to look at it next, timeout, the peer of a point-to-point call or
        #: -1, bytes received (from it) at the last look, unsent bytes (to it) at the last
        #: look or -1, when bytes last moved (or the call began)]
        self._calls: dict[asyncio.Task[Any], list[Any]] = {}
        self._expired: set[asyncio.Task[Any]] = set()
        # the timer and the deadline it is armed for (kept here: uvloop hands back a plain
        # ``Handle``, without ``when()``, for a timer due within its 1 ms resolution)
        self._handle: asyncio.Handle | None = None
        self._armed = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    def current_task(self) -> asyncio.Task[Any]:
        """The running task. The loop is looked up once: ``asyncio.get_running_loop`` (which
        ``asyncio.current_task()`` calls) costs a getpid() system call on Python 3.11."""
        loop = self._loop
        task = asyncio.current_task(loop) if loop is not None else None
        if task is None:  # first call, or called from another loop than before
            loop = asyncio.get_running_loop()
            self._transport.check_loop(loop)
            self._loop = loop
            task = asyncio.current_task(loop)
            assert task is not None
        return task

    def watch(self, task: asyncio.Task[Any], timeout: float, peer: int = -1) -> None:
        """Watch ``task``'s call (with world rank ``peer`` only, for point to point)."""
        loop = self._loop or asyncio.get_running_loop()
        now = loop.time()
        deadline = now + timeout / self.CHECKS
        t = self._transport
        if not self._calls:
            self._ref.strong = self
        self._calls[task] = [deadline, timeout, peer,
                             t.bytes_received if peer < 0 else t.received_from[peer], -1, now]
        if self._handle is None or deadline < self._armed:
            if self._handle is not None:
                self._handle.cancel()
                self._handle = None
            self._arm(loop, deadline)

    def _arm(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """Set the timer for ``deadline``. It refers to the watchdog weakly once no call is
        watched: a timer left armed after the last call (it is not cancelled per call: that
        costs) must not keep a communicator nobody uses any more, and with it the world's
        transport, alive until it fires. While calls are watched it holds the watchdog, and
        with it their tasks: a world dropped under pending calls (tasks nobody keeps, in
        process, where no socket holds the world) was collected with them, their timeout
        never raised. A call without a timeout (``inf``) arms none at all (it would stay in
        the event loop for good)."""
        if deadline != math.inf:
            self._handle = loop.call_at(deadline, _fire, self._ref)
            self._armed = deadline

    def unwatch(self, task: asyncio.Task[Any]) -> None:
        calls = self._calls
        calls.pop(task, None)
        if not calls:
            self._ref.strong = None
        self._expired.discard(task)

    def stop(self) -> None:
        """Forget every call and the timer (the communicator closed: its calls ended)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._calls.clear()
        self._ref.strong = None

    @property
    def idle(self) -> bool:
        """Whether no call is being watched."""
        return not self._calls

    def expired(self, task: asyncio.Task[Any]) -> bool:
        """Whether the watchdog cancelled ``task`` (then it withdraws that cancellation)."""
        if task in self._expired:
            self._expired.discard(task)
            task.uncancel()
            return True
        return False

    def _fire(self) -> None:
        self._handle = None
        loop = self._loop or asyncio.get_running_loop()
        now = loop.time()
        t = self._transport
        earliest = None
        for task, call in list(self._calls.items()):
            deadline, timeout, peer, mark, backlog, since = call
            if deadline <= now:
                received = t.bytes_received if peer < 0 else t.received_from[peer]
                if received != mark:  # bytes came in
                    call[3] = received
                    call[5] = since = now
                else:
                    unsent = t.outgoing_bytes(None if peer < 0 else peer)
                    if unsent != backlog and (unsent or backlog > 0):  # bytes went out
                        call[4] = unsent
                        call[5] = since = now
                if now >= since + timeout - self.SLACK:  # nothing moved for its timeout
                    del self._calls[task]
                    self._expired.add(task)
                    task.cancel()
                    continue
                call[0] = deadline = min(now + timeout / self.CHECKS, since + timeout)
            if earliest is None or deadline < earliest:
                earliest = deadline
        if earliest is not None:
            self._arm(loop, earliest)
        elif not self._calls:
            self._ref.strong = None


class _TimerRef:
    """A watchdog as its timer refers to it: ``strong`` while it watches calls, else only
    ``weak``."""

    __slots__ = ("strong", "weak")

    def __init__(self, watchdog: _Watchdog) -> None:
        self.strong: _Watchdog | None = None
        self.weak = weakref.ref(watchdog)


def _fire(ref: _TimerRef) -> None:
    """A watchdog's timer: its look at the calls, if the watchdog still exists."""
    watchdog = ref.strong or ref.weak()
    if watchdog is not None:
        watchdog._fire()


class Communicator:
    """A group of ranks that run collectives together.

    Obtain one from ``asynccoll.init``, ``asynccoll.run_local`` or ``new_group``.
    All ranks of a group call the same collectives in the same order; several may be in flight
    at once (they are matched by sequence number, never mixed).

    Attributes:
        timeout: seconds a collective may make no progress before it raises
            ``CollectiveTimeout`` (and breaks the communicator).
        tuning: algorithm thresholds (``Tuning``), as set; equal on all ranks.
    """

    def __init__(self, transport: Transport, *, ranks: Sequence[int] | None = None,
                 group: int = 0, timeout: float = 60.0, tuning: Tuning | None = None,
                 backend: str = "memory", owns_transport: bool = True) -> None:
        self._transport = transport
        self._ranks = tuple(ranks) if ranks is not None else tuple(range(transport.world_size))
        self._rank = self._ranks.index(transport.rank)
        self._group = group
        self._seq = 0
        # point to point: the k-th message to a group rank travels as P2P frame seq k, with
        # its tag beside the header's fields (``sig``), so that the state kept is per peer,
        # not per (peer, tag): a tag used once (say, a step number) leaves nothing behind.
        # A recv takes the messages of its source in the order they were sent, keeping those
        # of other tags until their recv comes (``_pull``)
        self._p2p_sent: dict[int, int] = {}  # group rank -> seq of the next send to it
        self._p2p_next: dict[int, int] = {}  # group rank -> seq of the next frame to take
        self._p2p_kept: dict[tuple[int, int], deque[np.ndarray]] = {}  # (src, tag) -> arrays
        self._p2p_pulling: dict[int, asyncio.Future[None]] = {}  # src -> a recv taking a frame
        self._children = 0
        self._closed = False
        self._owns_transport = owns_transport
        self._timeout_s = check_timeout(timeout)
        self._watchdog = _Watchdog(transport)
        self.tuning = tuning if tuning is not None else Tuning()  # also starts self._plans
        self.backend = backend

    # -- properties -----------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank in the group (0 .. world_size-1)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return len(self._ranks)

    @property
    def timeout(self) -> float:
        """Seconds a collective may make no progress before it raises ``CollectiveTimeout``;
        settable (a number >= 0, ``math.inf`` for none: anything else is a ``TypeError`` or
        ``ValueError`` at once, not in the next call)."""
        return self._timeout_s

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout_s = check_timeout(value)

    @property
    def tuning(self) -> Tuning:
        """Algorithm thresholds (``Tuning``); equal on all ranks. Settable: anything but a
        ``Tuning`` is a ``TypeError`` at once, not in the next call. It returns the tuning
        as set; the collectives run it with the frame sizes above the transport's
        ``max_payload`` lowered to it (``asynccoll.tuning.fit_frames``, done here once:
        ``effective_tuning``)."""
        return self._tuning_set

    @tuning.setter
    def tuning(self, value: Tuning) -> None:
        check_tuning(value, default=False)
        self._tuning_set = value
        # (MPI's world is no Transport and has no frame limit)
        self._tuning = fit_frames(value, getattr(self._transport, "max_payload", 1 << 62))
        # what a collective works out from its arguments before it runs (signature,
        # algorithm), kept per kind of call (``_plan``): small collectives repeat the same
        # call, and working it out is a good part of their cost. It depends on the tuning
        self._plans: dict[tuple[Any, ...], tuple[tuple[Any, ...], str]] = {}

    @property
    def effective_tuning(self) -> Tuning:
        """The tuning the collectives run (read-only): ``tuning`` with its frame sizes above
        the transport's ``max_payload`` lowered to it (``asynccoll.tuning.fit_frames``), which
        decides their algorithms (a larger array takes the ring, not recursive doubling);
        ``tuning`` itself where every frame size fits, as with the default ``max_payload``.
        What code that predicts a collective's algorithm, or its bytes, must read."""
        return self._tuning

    @property
    def transport(self) -> Transport:
        """The transport this communicator sends through (shared with its subgroups)."""
        return self._transport

    def __repr__(self) -> str:
        return (f"<Communicator {self.backend} rank {self._rank}/{self.world_size}"
                f" group {self._group:#x}>")

    # -- machinery ------------------------------------------------------------------------

    def _check_rank(self, value: Any, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"{what} must be an int, got {value!r}")
        if not 0 <= value < self.world_size:
            raise ValueError(f"{what}={value} is out of range for world_size {self.world_size}")
        return int(value)

    def _plan(self, key: tuple[Any, ...] | None, plan: tuple[tuple[Any, ...], str]
              ) -> tuple[tuple[Any, ...], str]:
        """Keep ``plan`` for ``key`` (none: the call's arguments cannot key a plan); returns
        ``plan``."""
        if key is not None:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _reuse(self, key: tuple[Any, ...] | None, array: np.ndarray, writable: bool
               ) -> tuple[tuple[Any, ...], str] | None:
        """The plan kept for ``key`` (made from arrays of the dtypes and shapes in it), if
        ``array`` still fits it: C-contiguous, and writable when ``writable`` (what can change
        between calls with the same key)."""
        if key is None:
            return None
        plan = self._plans.get(key)
        return plan if plan is not None and _fits(array, writable) else None

    def _where(self, seq: int) -> str:
        """Which call of which group collective ``seq`` is, for error messages."""
        if self._group == 0:
            return f"sequence number {seq} of the world"
        ranks = list(self._ranks)
        shown = (str(ranks) if len(ranks) <= 8
                 else f"[{', '.join(map(str, ranks[:6]))}, ..., {ranks[-1]}] ({len(ranks)} ranks)")
        return f"sequence number {seq} of the group of world ranks {shown}"

    def _names(self, world: list[int]) -> str:
        """World ranks of this group, as its errors name them."""
        s = "s" if len(world) > 1 else ""
        listed = ", ".join(map(str, world))
        if self._group == 0:
            return f"world rank{s} {listed}"
        return (f"group rank{s} {', '.join(str(self._ranks.index(r)) for r in world)} "
                f"(world rank{s} {listed})")

    def _stalled(self, seq: int) -> str:
        """What a stalled collective ``seq`` still waited for (its posted receives, else its
        unwritten sends), with ``_where``: what a timeout's message says beside the call."""
        t = self._transport
        waited = t.mailbox.awaited(self._group, seq)
        if waited:
            return f"{self._where(seq)}; waiting for {self._names(waited)}"
        unsent = [r for r in self._ranks if r != t.rank and t.unsent_bytes(r)]
        if unsent:
            return f"{self._where(seq)}; its frames to {self._names(unsent)} unsent"
        return self._where(seq)

    def _in_call(self, exc: CollectiveError, sig: tuple[Any, ...], seq: int
                 ) -> CollectiveError:
        """``exc``, which ended collective ``seq`` here, as an error that names that call,
        this rank and ``seq`` (``name_call``); ``exc`` itself where this rank made it about
        this call (a mismatch its mailbox found in it)."""
        extra = ""
        relayed = _RELAYED.match(str(exc)) if type(exc) is CollectiveError else None
        waited = self._transport.mailbox.awaited(self._group, seq) if relayed else None
        if waited and relayed and waited != [int(relayed[1])]:  # (not only the one that said)
            # another rank gave up (its timer fired first, say): what this rank itself
            # waited for leads on towards a rank that never called
            extra = (f"; {self._names([self._transport.rank])} was waiting for "
                     f"{self._names(waited)}")
        own = self._transport.mailbox.mismatch == ((self._group, seq), exc)
        return name_call(exc, sig, self._rank, self._where(seq), extra, own=own)

    def _check_open(self, what: str = "") -> None:
        """Raise unless a call (named ``what`` in the error of a broken world) may start."""
        if self._closed:
            raise CommunicatorClosedError("the communicator was closed")
        try:
            self._transport.check_usable()
        except CollectiveError as exc:
            raise refused(exc, what) from exc.__cause__
        self._watchdog.current_task()  # another event loop's transport: raised here

    async def _run(self, sig: tuple[Any, ...], body: Callable[[Call], Awaitable[T]], *,
                   agree: bool = False) -> T:
        """Run one collective: sequence number, signature check, timeout, failure spreading.

        Symmetric algorithms (every rank's result depends on every rank's frames) check the
        signature on the way. Rooted ones pass ``agree=True``: a dissemination round of empty
        frames first makes every rank check every signature, so that on a mismatch *every*
        rank raises (a root that only sends would otherwise return) and ranks that disagree
        about the root cannot all sit waiting.
        """
        if self._closed:
            raise CommunicatorClosedError("the communicator was closed")
        watchdog = self._watchdog
        task = watchdog.current_task()  # (before the call takes its number: another loop's)
        t = self._transport
        seq = self._seq
        if t._closed or t.mailbox._error is not None:
            # a failure in a later collective lets this one finish if every rank got past it
            try:
                t.check_usable(self._group, seq)
            except CollectiveError as exc:
                raise refused(exc, sig[0]) from exc.__cause__
        if t.mailbox._left:
            left = t.mailbox.left_group(self._group, seq)
            if left is not None:  # a member closed this group
                raise self._in_call(left, sig, seq)
        self._seq += 1
        call = Call(t, self._ranks, self._group, self._rank, seq, sig, self._tuning)
        size = call.size
        if size == 1:
            return await body(call)
        t.mailbox.begin(self._group, seq, sig)
        scope = (self._group, seq)
        watchdog.watch(task, self._timeout_s)
        try:
            if not agree:
                return await body(call)
            # nobody returns before the agreement completed
            if size == 2:
                # a single round: its frames go out before the data (the peer never waits for
                # them behind a large payload), and nothing needs to drive it alongside the data
                first = begin_barrier(call, AGREE_STEP)
                result = await body(call)
                await end_barrier(call, AGREE_STEP, first)
                return result
            # more rounds run alongside the data, from where the body first waits (posting the
            # first round up front here too measured slower: 90 against 74 ms for a 64 MiB
            # broadcast over 4 ranks on 2 cores, not explained yet)
            agreement = asyncio.ensure_future(dissemination_barrier(call, AGREE_STEP))
            try:
                result = await body(call)
                await agreement
                return result
            finally:
                agreement.cancel()
                await asyncio.gather(agreement, return_exceptions=True)
        except asyncio.CancelledError:
            if watchdog.expired(task):
                err = CollectiveTimeout(f"{describe_sig(sig)} on group rank {self._rank} made "
                                        f"no progress within {self._timeout_s:g} s "
                                        f"({self._stalled(seq)})")
                t.abort(err, scope=scope)
                raise err from None
            t.abort(CollectiveError(f"{describe_sig(sig)} was cancelled on group rank "
                                    f"{self._rank}"), scope=scope)
            raise
        except CollectiveError as exc:
            left = t.mailbox.left_group(self._group, seq)
            if left is not None:
                # a member closed this group: its collectives fail, nothing else does
                raise self._in_call(left, sig, seq) from None
            t.abort(exc, scope=scope)
            raise self._in_call(exc, sig, seq) from None
        except Exception as exc:
            t.abort(CollectiveError(f"{describe_sig(sig)} failed on group rank {self._rank}: "
                                    f"{exc!r}"), scope=scope)
            raise
        finally:
            watchdog.unwatch(task)
            t.mailbox.end(self._group, seq)

    # -- collectives ----------------------------------------------------------------------

    async def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Overwrite ``array`` on every rank with root's ``array``; returns ``array``.

        Root's ``array`` is only read (it may be read-only); the others' must be writable.

        Raises:
            CollectiveError: ranks passed different shapes/dtypes/roots (and subclasses for
                lost peers and timeouts). ``array`` then holds undefined values on non-roots.
        """
        a = array
        # a call like an earlier one skips the checks that depend only on dtype, shape, root
        key = (("broadcast", a.dtype, a.shape, root)
               if a.__class__ is np.ndarray and root.__class__ is int else None)
        # root's array is only read (it may be read-only); the others' are written
        plan = self._reuse(key, a, root.__class__ is not int or root != self._rank)
        if plan is None:
            root = self._check_rank(root, "root")
            _check_array(a, writable=root != self._rank)
            algo = self._tuning.broadcast(a.nbytes, self.world_size,
                                          crowded=self._transport.crowded,
                                          max_payload=self._transport.max_payload)
            plan = self._plan(key, (("broadcast", *_sig_array(a), root, algo), algo))
        sig, algo = plan

        async def body(call: Call) -> np.ndarray:
            flat = a if a.ndim == 1 else a.reshape(-1)
            if algo == "chain":
                await chain_broadcast(call, root, flat)
            else:
                await doubling_broadcast(call, root, flat)
            return a

        # the doubling broadcast is symmetric (every rank hears from every rank on the way):
        # it needs no agreement round
        return await self._run(sig, body, agree=algo != "doubling")

    async def reduce(self, array: np.ndarray, root: int = 0, op: ReduceOp = ReduceOp.SUM
                     ) -> np.ndarray | None:
        """Reduce ``array`` over all ranks onto ``root``, in place there.

        Returns ``array`` on root, ``None`` elsewhere (where ``array`` is left unchanged).
        """
        a = _check_array(array, writable=self._rank == root)
        root = self._check_rank(root, "root")
        op = check_op(op, a.dtype)
        algo = self._tuning.reduce(a.nbytes, self.world_size)

        async def body(call: Call) -> np.ndarray | None:
            flat = a.reshape(-1)
            if algo == "ring" and call.size > 1:
                await ring_reduce(call, root, flat, op)
            elif call.size > 1:
                # small: every rank reduces (recursive doubling; non-roots on a copy), which
                # takes as many rounds as a binomial tree and, being symmetric, needs no
                # agreement round beside it
                await recursive_doubling(call, flat if call.rank == root else flat.copy(), op)
            if call.rank != root:
                return None
            finish(a, op, call.size)
            return a

        return await self._run(("reduce", *_sig_array(a), op._value_, root, algo), body,
                               agree=algo != "doubling")

    async def all_reduce(self, array: np.ndarray, op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
        """Reduce ``array`` over all ranks, in place on every rank; returns ``array``.

        Every rank ends with bit-identical values.

        Raises:
            TypeError: unsupported/non-contiguous array, or an op that does not fit the dtype.
            CollectiveError: ranks passed different shapes/dtypes/ops; a peer was lost
                (PeerLostError) or no progress was made (CollectiveTimeout). ``array`` then
                holds undefined values.
        """
        a = array
        # a call like an earlier one skips the checks that depend only on dtype, shape and op
        key = (("all_reduce", a.dtype, a.shape, op)
               if a.__class__ is np.ndarray and op.__class__ is ReduceOp else None)
        plan = self._reuse(key, a, True)
        if plan is None:
            _check_array(a, writable=True)
            op = check_op(op, a.dtype)
            algo = self._tuning.all_reduce(a.nbytes, self.world_size,
                                           lends=self._transport.lends)
            plan = self._plan(key, (("all_reduce", *_sig_array(a), op._value_, algo), algo))
        sig, algo = plan

        async def body(call: Call) -> np.ndarray:
            flat = a if a.ndim == 1 else a.reshape(-1)
            if call.size > 1:
                if algo == "direct":
                    await direct_all_reduce(call, flat, op)
                elif algo == "ring":
                    await ring_all_reduce(call, flat, op)
                else:
                    await recursive_doubling(call, flat, op)
            finish(a, op, call.size)
            return a

        return await self._run(sig, body)

    async def reduce_scatter(self, array: np.ndarray, op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
        """Reduce ``array`` over all ranks and return this rank's block of the result.

        Blocks are split along axis 0 as ``numpy.array_split(array, world_size)`` splits them.
        ``array`` is not modified.
        """
        a = _check_array(array)
        if a.ndim == 0:
            raise ValueError("reduce_scatter needs an array with at least one dimension")
        op = check_op(op, a.dtype)
        algo = self._tuning.reduce_scatter(a.nbytes, self.world_size)
        row = math.prod(a.shape[1:])

        async def body(call: Call) -> np.ndarray:
            flat = a.reshape(-1)
            bounds = row_bounds(a.shape[0], row, call.size)
            if call.size == 1:
                out = flat.copy()
            elif algo == "doubling":
                # small: the whole array all-reduced along recursive doubling's pairs (the
                # lean path of small all_reduces), this rank's block kept
                whole = flat.copy()
                await recursive_doubling(call, whole, op)
                start, stop = bounds[call.rank]
                out = whole[start:stop]
            elif algo == "ring":
                out = await ring_reduce_scatter(call, flat, bounds, op)
            else:
                out = await direct_reduce_scatter(call, flat, bounds, op)
            finish(out, op, call.size)
            first, last = row_bounds(a.shape[0], 1, call.size)[call.rank]
            return out.reshape(last - first, *a.shape[1:])

        return await self._run(("reduce_scatter", *_sig_array(a), op._value_, algo), body)

    async def _gather_blocks(self, call: Call, a: np.ndarray, algo: str,
                             out: np.ndarray | None = None) -> np.ndarray | list[np.ndarray]:
        """All-gather core: returns the concatenated array (``out`` when given) when all
        blocks had ``a``'s shape, else the list of blocks."""
        w, r = call.size, call.rank
        n = a.shape[0]
        if out is None or out.shape[0] != w * n:
            out = np.empty((w * n, *a.shape[1:]), a.dtype)
        blocks = [out[j * n:(j + 1) * n] for j in range(w)]
        if w == 1:
            blocks[r][...] = a
            return out
        if algo == "ring":
            even = await ring_all_gather(call, blocks, a, 0)
        else:
            even = await direct_all_gather(call, blocks, a)
        return out if even else blocks

    async def all_gather(self, array: np.ndarray, *, out: np.ndarray | None = None
                         ) -> np.ndarray:
        """Every rank's ``array`` concatenated along axis 0, in rank order.

        Axis-0 lengths may differ between ranks; dtypes and the other axes must agree.

        Args:
            out: optional destination (an extension of the API contract, for loops that
                gather the same shapes again and again: it saves allocating, and first
                touching, a new array each call). Same dtype as ``array``, C-contiguous,
                shape ``(total rows, *array.shape[1:])``; returned when given.

        Raises:
            CollectiveError: also when ``out`` does not hold exactly the gathered rows.
        """
        a = array
        # a call like an earlier one skips the checks that depend only on dtypes and shapes
        key = (("all_gather", a.dtype, a.shape, None if out is None else (out.dtype, out.shape))
               if a.__class__ is np.ndarray and (out is None or out.__class__ is np.ndarray)
               else None)
        plan = self._reuse(key, a, False)
        if plan is not None and out is not None and not _fits(out, True):
            plan = None
        if plan is None:
            _check_array(a)
            if a.ndim == 0:
                raise ValueError("all_gather needs an array with at least one dimension")
            if out is not None:
                _check_array(out, "out", writable=True)
                if out.dtype != a.dtype or out.shape[1:] != a.shape[1:]:
                    raise ValueError(f"out must have dtype {a.dtype} and shape (rows, "
                                     f"*{a.shape[1:]}), got {out.dtype} {out.shape}")
            algo = self._tuning.all_gather(self.world_size)
            dtype, shape = _sig_array(a)
            plan = self._plan(key, (("all_gather", dtype, shape[1:], algo), algo))
        sig, algo = plan

        async def body(call: Call) -> np.ndarray:
            got = await self._gather_blocks(call, a, algo, out)
            if isinstance(got, np.ndarray):
                if out is not None and got is not out:
                    return _into(out, [got])
                return got
            return np.concatenate(got) if out is None else _into(out, got)

        return await self._run(sig, body)

    async def gather(self, array: np.ndarray, root: int = 0) -> list[np.ndarray] | None:
        """On root, the list of every rank's ``array`` in rank order; ``None`` elsewhere."""
        a = _check_array(array)
        root = self._check_rank(root, "root")
        algo = self._tuning.gather(a.nbytes, self.world_size)

        async def body(call: Call) -> list[np.ndarray] | None:
            if algo == "doubling":
                rows = await doubling_gather(call, root, a.reshape(-1))
                return None if rows is None else [row.reshape(a.shape) for row in rows]
            if call.rank != root:
                await call.send(root, 0, a)
                return None
            out = [a.copy() if j == root else np.empty_like(a) for j in range(call.size)]
            for rcv in [call.post_recv(j, 0, out[j]) for j in range(call.size) if j != root]:
                await rcv.get()
            return out

        # the doubling gather is symmetric (every rank hears from every rank on the way): it
        # needs no agreement round
        return await self._run(("gather", *_sig_array(a), root, algo), body,
                               agree=algo != "doubling")

    async def scatter(self, arrays: Sequence[np.ndarray] | None, root: int = 0) -> np.ndarray:
        """The array that root put at this rank's position of ``arrays`` (a new array).

        ``arrays`` (``world_size`` arrays, each any shape) is read on root only.
        """
        root = self._check_rank(root, "root")
        items: list[np.ndarray] = []
        if self._rank == root:
            if arrays is None or len(arrays) != self.world_size:
                raise ValueError(f"scatter on root needs a sequence of {self.world_size} arrays")
            items = [_check_array(x, f"arrays[{j}]") for j, x in enumerate(arrays)]

        async def body(call: Call) -> np.ndarray:
            if call.rank == root:
                await settle([call.post(j, 0, items[j])
                              for j in range(call.size) if j != root])
                return items[root].copy()
            return await call.recv(root, 0)

        return await self._run(("scatter", root), body, agree=True)

    async def all_to_all(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Element ``j`` of the result is what rank ``j`` put at position ``rank`` of its
        ``arrays``."""
        if arrays is None or len(arrays) != self.world_size:
            raise ValueError(f"all_to_all needs a sequence of {self.world_size} arrays")
        items = [_check_array(x, f"arrays[{j}]") for j, x in enumerate(arrays)]

        async def body(call: Call) -> list[np.ndarray]:
            w, r = call.size, call.rank
            out: list[np.ndarray] = [np.empty(0)] * w
            out[r] = items[r].copy()
            for k in range(1, w):
                dst, src = (r + k) % w, (r - k) % w
                out[src] = await call.exchange(dst, items[dst], src, None, k)
            return out

        return await self._run(("all_to_all",), body)

    async def barrier(self) -> None:
        """Return once every rank of the group has entered the barrier."""
        async def body(call: Call) -> None:
            await dissemination_barrier(call)

        await self._run(("barrier",), body)

    # -- point to point -------------------------------------------------------------------

    def _check_tag(self, tag: Any) -> int:
        if isinstance(tag, bool) or not isinstance(tag, int | np.integer):
            raise TypeError(f"tag must be an int, got {tag!r}")
        if not 0 <= tag <= _MAX_TAG:
            raise ValueError(f"tag must be in [0, 2**63), got {tag!r}")
        return int(tag)

    async def send(self, array: np.ndarray, dst: int, tag: int = 0) -> None:
        """Send ``array`` to group rank ``dst``; returns when ``array`` may be reused.

        Messages with the same (dst, tag) arrive in the order they were sent.
        """
        a = _check_array(array)
        dst = self._check_rank(dst, "dst")
        tag = self._check_tag(tag)
        if dst == self._rank:
            raise ValueError("send to self is not supported")
        t = self._transport
        if a.nbytes > t.max_payload:  # (before the message takes its number)
            raise ValueError(payload_too_large(a.nbytes, t.max_payload))
        self._check_open("send")
        left = t.mailbox.left_group(self._group, dst=self._ranks[dst])
        if left is not None:  # the receiver closed this group: nobody would take it
            raise left.with_traceback(None)  # (kept: see Mailbox.take)
        n = self._p2p_sent.get(dst, 0)
        self._p2p_sent[dst] = n + 1
        head = encode_data_head(FrameKind.P2P, self._group, n, 0, 0, t.rank,
                                dtype_code(a.dtype), a.shape, (tag,), a.nbytes)
        await self._watched_p2p(t.send(self._ranks[dst], head, bytes_view(a)), dst, "send",
                        f"send to group rank {dst} made no progress within")

    async def recv(self, src: int, tag: int = 0) -> np.ndarray:
        """Receive the next array group rank ``src`` sent with ``tag`` (a new array)."""
        src = self._check_rank(src, "src")
        tag = self._check_tag(tag)
        if src == self._rank:
            raise ValueError("recv from self is not supported")
        self._check_open("recv")
        return await self._watched_p2p(self._pull(src, tag), src, "recv",
                                       f"recv from group rank {src} (tag {tag}) got nothing "
                                       f"within")

    async def _pull(self, src: int, tag: int) -> np.ndarray:
        """The next message from group rank ``src`` with ``tag``: one kept already, or the
        frames ``src`` sent taken in order (one recv at a time per source) until one has
        ``tag``; the others are kept for their recvs."""
        t = self._transport
        kept = self._p2p_kept
        while True:
            queue = kept.get((src, tag))
            if queue:
                arr = queue.popleft()
                if not queue:
                    del kept[(src, tag)]
                return arr
            pulling = self._p2p_pulling.get(src)
            if pulling is not None:  # another recv takes the next frame: then look again
                await asyncio.wait((pulling,))
                continue
            n = self._p2p_next.get(src, 0)
            self._p2p_next[src] = n + 1
            pulling = self._p2p_pulling[src] = asyncio.get_running_loop().create_future()
            try:
                frame = await t.recv((self._ranks[src], int(FrameKind.P2P), self._group, n, 0, 0))
            finally:
                del self._p2p_pulling[src]
                pulling.set_result(None)
            h = frame.header
            if h.dtype is None or h.shape is None or not h.sig or type(h.sig[0]) is not int:
                err = CollectiveError(f"world rank {self._ranks[src]} sent a point-to-point "
                                      f"message without its tag")
                t.abort(err)
                raise err
            arr = array_view(frame.payload, h.dtype, h.shape)
            if h.sig[0] == tag:
                return arr
            kept.setdefault((src, h.sig[0]), deque()).append(arr)

    async def _watched_p2p(self, op: Awaitable[T], peer: int, what: str, timed_out: str) -> T:
        """Await a send or recv with group rank ``peer`` under the watchdog (counting that
        peer's bytes only): ``CollectiveTimeout`` ("``timed_out`` <timeout> s") when it made
        no progress; a cancellation breaks the world."""
        watchdog = self._watchdog
        task = watchdog.current_task()
        watchdog.watch(task, self._timeout_s, self._ranks[peer])
        try:
            return await op
        except asyncio.CancelledError:
            if watchdog.expired(task):
                err = CollectiveTimeout(f"{timed_out} {self._timeout_s:g} s")
                self._p2p_failed(self._ranks[peer], err)
                raise err from None
            self._transport.abort(CollectiveError(f"{what} on group rank {self._rank} was "
                                                  f"cancelled"))
            raise
        finally:
            watchdog.unwatch(task)

    def _p2p_failed(self, peer: int, err: CollectiveError) -> None:
        """A point-to-point wait on world rank ``peer`` timed out: break the world, or, where
        the transport isolates lost peers (``peer_loss="isolate"``), give up on that peer."""
        t = self._transport
        if t.peer_loss == "isolate":
            t.mailbox.peer_lost(peer, PeerLostError(f"world rank {peer} stopped responding: "
                                                    f"{err}", rank=peer))
        else:
            t.abort(err)

    # -- objects --------------------------------------------------------------------------

    async def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        """Root's ``obj`` on every rank (msgpack-serialisable; tuples come back as lists).

        Raises:
            TypeError: root's ``obj`` does not pack (a set, a NumPy array or integer), or packs
                but does not unpack (a dict with tuple keys): on every rank, once the call
                has moved it, and the communicator stays usable.
            ValueError: root's ``obj`` packs to more than one frame may carry (the TCP
                option ``max_payload``): on every rank too.
        """
        root = self._check_rank(root, "root")
        data = (_pack_object(obj, root, self._transport.max_payload) if self._rank == root
                else None)

        async def body(call: Call) -> np.ndarray:
            if call.size == 1:
                return data  # type: ignore[return-value]
            return await binomial_broadcast(call, root, data)

        return _unpack_object(await self._run(("broadcast_object", root), body, agree=True),
                              root)

    async def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order (msgpack-serialisable).

        Raises:
            TypeError, ValueError: a rank's ``obj`` does not pack, does not unpack or is too
                large: as in ``broadcast_object``, on every rank (naming the first such
                rank), and the communicator stays usable.
        """
        data = _pack_object(obj, self._rank, self._transport.max_payload)
        algo = self._tuning.all_gather(self.world_size)

        async def body(call: Call) -> list[np.ndarray]:
            got = await self._gather_blocks(call, data, algo)
            return list(got.reshape(call.size, -1)) if isinstance(got, np.ndarray) else got

        got = await self._run(("all_gather_object", algo), body)
        return [_unpack_object(b, j) for j, b in enumerate(got)]

    # -- groups and lifetime --------------------------------------------------------------

    async def new_group(self, ranks: Sequence[int]) -> Communicator | None:
        """A communicator over ``ranks`` (renumbered 0..k-1 in the given order).

        Called by every rank of this group with the same ``ranks``; returns ``None`` on ranks
        that are not members. The new group has its own sequence numbers, so its collectives
        never mix with this group's.
        """
        members = [self._check_rank(r, "group member") for r in ranks]
        if not members:
            raise ValueError("new_group needs at least one rank")
        if len(set(members)) != len(members):
            raise ValueError(f"new_group ranks must be distinct, got {members}")
        digest = np.frombuffer(hashlib.sha256(msgpack.packb(members)).digest(), np.uint8)
        child = self._children
        self._children += 1
        algo = self._tuning.all_gather(self.world_size)

        async def body(call: Call) -> np.ndarray | list[np.ndarray]:
            return await self._gather_blocks(call, digest, algo)

        got = await self._run(("new_group", child, algo), body)
        digests = list(got.reshape(self.world_size, -1)) if isinstance(got, np.ndarray) else got
        if any(not np.array_equal(d, digest) for d in digests):
            raise CollectiveError("new_group: ranks passed different member lists")
        gid = int.from_bytes(hashlib.blake2b(f"{self._group}/{child}".encode(),
                                             digest_size=8).digest(), "big") >> 1
        if self._rank not in members:
            return None
        return Communicator(self._transport, ranks=[self._ranks[m] for m in members], group=gid,
                            timeout=self._timeout_s, tuning=self._tuning_set, backend=self.backend,
                            owns_transport=False)

    async def close(self) -> None:
        """Close the communicator (and, for a world communicator, its connections). Idempotent.

        Closing a world fails this rank's calls in flight on it and its groups
        (``CommunicatorClosedError``). Closing a group closes no connection: its collectives
        in flight go on, its receives in flight fail, and the other members are told, so
        that their collectives of the group from the next sequence number on (and their
        receives of this rank's messages beyond those it sent, their sends to it) raise
        ``CollectiveError`` naming this rank at once (memory and tcp; see docs/concepts.md).
        """
        if self._closed:
            return
        if self._owns_transport:
            # another event loop's connections cannot be closed from this one ('Event loop is
            # closed' from inside the transport, after an ``async with`` body said this)
            self._transport.check_loop(asyncio.get_running_loop())
        self._closed = True
        if self._owns_transport:
            self._watchdog.stop()  # (its calls in flight fail as the transport closes)
            await self._transport.close()
            return
        # a group: its collectives in flight go on (nothing closes underneath) and keep
        # their timeout (the watchdog's timer stops once they ended); its receives in flight
        # fail, and the other members learn that this rank takes part in none of the
        # group's collectives from the next sequence number on, nor sends more messages
        if self._watchdog.idle:
            self._watchdog.stop()
        if len(self._ranks) > 1:
            self._transport.close_group(
                self._group, self._ranks, self._seq,
                {self._ranks[r]: n for r, n in self._p2p_sent.items()})

    async def __aenter__(self) -> Communicator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = ["Communicator"]
