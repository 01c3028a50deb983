"""Error conformance: the same mistake raises the same exception type on every backend.

Each case runs on every backend of ``conftest.BACKENDS`` (memory and tcp; mpi joins when this
file runs under ``mpirun -n 2``, which ``test_mpi_backend_conforms`` starts). Every rank's
outcome (exception type, message, seconds, ``PeerLostError.rank``) is collected and compared
with what API.md and docs/concepts.md promise: argument errors are ``TypeError`` /
``ValueError`` raised before sending, disagreements are ``CollectiveError`` on *every* rank
within ``PROMPT`` seconds, never a hang. Where a backend departs from the contract the case
is an ``xfail(strict=True)`` naming the cause.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BACKENDS, MPI_WORLD_SIZE, run_world

from asynccoll import (
    CollectiveError,
    Communicator,
    CommunicatorClosedError,
    PeerLostError,
    ReduceOp,
)

pytestmark = pytest.mark.timeout(60)

W = 2
LONG = 30.0  # communicator timeout: far above PROMPT, so only the mechanism under test fires
PROMPT = 1.0  # every rank must have raised within this many seconds
GUARD = 5.0  # a world still running after this long is a hang

Outcome = tuple[str, str, float, Any]  # (exception type name or "ok", message, seconds, rank)

#: (backend, case id) -> why that backend departs from the contract (strict xfail)
KNOWN: dict[tuple[str, str], str] = {}


def _params(cases: list[Any], backends: list[str] = BACKENDS) -> list[Any]:
    out = []
    for b in backends:
        for case in cases:
            cid = case[0]
            marks = ([pytest.mark.xfail(strict=True, reason=KNOWN[(b, cid)])]
                     if (b, cid) in KNOWN else [])
            out.append(pytest.param(b, case, id=f"{b}-{cid}", marks=marks))
    return out


async def outcome(aw: Awaitable[Any]) -> Outcome:
    t0 = time.monotonic()
    try:
        await aw
    except (Exception, asyncio.CancelledError) as exc:
        return (type(exc).__name__, str(exc), time.monotonic() - t0, getattr(exc, "rank", None))
    return ("ok", "", time.monotonic() - t0, None)


async def world(fn: Callable[[Communicator], Awaitable[Any]], backend: str, n: int = W,
                **kw: Any) -> list[Any]:
    kw.setdefault("timeout", LONG)
    try:
        async with asyncio.timeout(GUARD):
            return await run_world(fn, n, backend, **kw)
    except TimeoutError:
        pytest.fail(f"{backend}: ranks still blocked after {GUARD} s")


async def usable(comm: Communicator) -> None:
    """The communicator still lines up after an argument error."""
    got = await comm.all_reduce(np.ones(3))
    assert (got == comm.world_size).all()


def _be(shape: tuple[int, ...] = (4,)) -> np.ndarray:
    return np.zeros(shape, dtype=">f8" if sys.byteorder == "little" else "<f8")


OBJ = np.array([1, "a"], dtype=object)

# ---------------------------------------------------------------- argument errors (every rank)

BAD: list[tuple[str, Callable[[Communicator], Awaitable[Any]], type[Exception]]] = [
    ("strided-all_reduce", lambda c: c.all_reduce(np.arange(8.0)[::2]), TypeError),
    ("fortran-broadcast", lambda c: c.broadcast(np.asfortranarray(np.ones((2, 3)))), TypeError),
    ("strided-send", lambda c: c.send(np.arange(8.0)[::2], 1 - c.rank), TypeError),
    ("strided-all_to_all", lambda c: c.all_to_all([np.arange(8.0)[::2]] * W), TypeError),
    ("bigendian-all_reduce", lambda c: c.all_reduce(_be()), TypeError),
    ("bigendian-all_gather", lambda c: c.all_gather(_be()), TypeError),
    ("bigendian-reduce_scatter", lambda c: c.reduce_scatter(_be()), TypeError),
    ("bigendian-send", lambda c: c.send(_be(), 1 - c.rank), TypeError),
    ("bigendian-gather", lambda c: c.gather(_be()), TypeError),
    ("object-all_reduce", lambda c: c.all_reduce(OBJ.copy()), TypeError),
    ("object-broadcast", lambda c: c.broadcast(OBJ.copy()), TypeError),
    ("object-gather", lambda c: c.gather(OBJ), TypeError),
    ("object-all_to_all", lambda c: c.all_to_all([OBJ] * W), TypeError),
    ("0d-all_gather", lambda c: c.all_gather(np.array(1.0)), ValueError),
    ("0d-reduce_scatter", lambda c: c.reduce_scatter(np.array(1.0)), ValueError),
    ("avg-int-all_reduce", lambda c: c.all_reduce(np.ones(3, np.int64), ReduceOp.AVG),
     TypeError),
    ("avg-int-reduce", lambda c: c.reduce(np.ones(3, np.int32), op=ReduceOp.AVG), TypeError),
    ("avg-bool-reduce_scatter", lambda c: c.reduce_scatter(np.ones(4, bool), ReduceOp.AVG),
     TypeError),
    ("band-float-all_reduce", lambda c: c.all_reduce(np.ones(3), ReduceOp.BAND), TypeError),
    ("bor-float32-reduce", lambda c: c.reduce(np.ones(3, np.float32), op=ReduceOp.BOR),
     TypeError),
    ("bxor-complex-reduce_scatter",
     lambda c: c.reduce_scatter(np.ones(4, np.complex64), ReduceOp.BXOR), TypeError),
    ("root-high-broadcast", lambda c: c.broadcast(np.ones(3), root=W), ValueError),
    ("root-negative-reduce", lambda c: c.reduce(np.ones(3), root=-1), ValueError),
    ("root-high-gather", lambda c: c.gather(np.ones(3), root=W + 7), ValueError),
    ("root-high-scatter", lambda c: c.scatter(None, root=W), ValueError),
    ("root-high-broadcast_object", lambda c: c.broadcast_object(1, root=W), ValueError),
    ("root-float-broadcast", lambda c: c.broadcast(np.ones(3), root=0.0), TypeError),
    ("root-str-reduce", lambda c: c.reduce(np.ones(3), root="0"), TypeError),
    ("root-bool-gather", lambda c: c.gather(np.ones(3), root=True), TypeError),
    ("root-none-scatter", lambda c: c.scatter(None, root=None), TypeError),
    ("dst-high", lambda c: c.send(np.ones(3), W), ValueError),
    ("dst-negative", lambda c: c.send(np.ones(3), -1), ValueError),
    ("dst-float", lambda c: c.send(np.ones(3), 1.0), TypeError),
    ("src-high", lambda c: c.recv(W), ValueError),
    ("src-str", lambda c: c.recv("1"), TypeError),
    ("tag-negative-send", lambda c: c.send(np.ones(3), 1 - c.rank, tag=-1), ValueError),
    ("tag-2**63-send", lambda c: c.send(np.ones(3), 1 - c.rank, tag=2**63), ValueError),
    ("tag-uint64-2**63-recv", lambda c: c.recv(1 - c.rank, tag=np.uint64(2**63)), ValueError),
    ("tag-negative-recv", lambda c: c.recv(1 - c.rank, tag=-1), ValueError),
    ("new_group-duplicates", lambda c: c.new_group([1, 1]), ValueError),
    ("new_group-out-of-range", lambda c: c.new_group([0, W]), ValueError),
]


@pytest.mark.parametrize(("backend", "case"), _params(BAD))
async def test_bad_argument_same_type_everywhere(backend, case):
    _, call, exc = case

    async def fn(comm: Communicator) -> Outcome:
        sent = comm.transport.bytes_sent
        got = await outcome(call(comm))
        assert comm.transport.bytes_sent == sent, "bytes were sent before the error"
        await usable(comm)
        return got

    for r, (name, msg, _, _) in enumerate(await world(fn, backend)):
        assert name == exc.__name__, f"rank {r}: {name}: {msg} (expected {exc.__name__})"


# --------------------------------------------- edge values that are allowed (must not raise)

GOOD: list[tuple[str, Callable[[Communicator], Awaitable[Any]]]] = [
    ("0d-all_reduce", lambda c: c.all_reduce(np.array(2.0))),
    ("0d-broadcast", lambda c: c.broadcast(np.array(c.rank))),
    ("0d-reduce", lambda c: c.reduce(np.array(1.0))),
    ("0d-gather", lambda c: c.gather(np.array(1.0))),
    ("0d-scatter", lambda c: c.scatter([np.array(float(j)) for j in range(W)])),
    ("0d-all_to_all", lambda c: c.all_to_all([np.array(float(j)) for j in range(W)])),
    ("root-np-int", lambda c: c.broadcast(np.ones(3), root=np.int64(1))),
    ("tag-max", lambda c: asyncio.gather(c.send(np.ones(2), 1 - c.rank, tag=2**63 - 1),
                                         c.recv(1 - c.rank, tag=2**63 - 1))),
]


@pytest.mark.parametrize(("backend", "case"), _params(GOOD))
async def test_allowed_edge_values_work_everywhere(backend, case):
    _, call = case

    async def fn(comm: Communicator) -> Outcome:
        return await outcome(call(comm))

    for r, (name, msg, _, _) in enumerate(await world(fn, backend)):
        assert name == "ok", f"rank {r}: {name}: {msg}"


# ------------------------------------------------- ranks that disagree: CollectiveError on all

def _other(c: Communicator) -> bool:
    return c.rank == W - 1


MISMATCH: list[tuple[str, Callable[[Communicator], Awaitable[Any]]]] = [
    ("shape-all_reduce", lambda c: c.all_reduce(np.ones(5 if _other(c) else 6))),
    ("dtype-all_reduce", lambda c: c.all_reduce(np.ones(4, np.float32 if _other(c) else float))),
    ("dtype-all_gather", lambda c: c.all_gather(np.ones(4, np.int64 if _other(c) else float))),
    ("op-all_reduce",
     lambda c: c.all_reduce(np.ones(4), ReduceOp.MAX if _other(c) else ReduceOp.SUM)),
    ("op-reduce_scatter",
     lambda c: c.reduce_scatter(np.ones(4), ReduceOp.MIN if _other(c) else ReduceOp.PROD)),
    ("root-broadcast", lambda c: c.broadcast(np.ones(4), root=int(_other(c)))),
    ("root-reduce", lambda c: c.reduce(np.ones(4), root=int(_other(c)))),
    ("root-gather", lambda c: c.gather(np.ones(4), root=int(_other(c)))),
    ("root-scatter", lambda c: c.scatter([np.ones(2)] * W, root=int(_other(c)))),
    ("root-broadcast_object", lambda c: c.broadcast_object("x", root=int(_other(c)))),
    ("all_reduce-vs-broadcast",
     lambda c: c.all_reduce(np.ones(4)) if _other(c) else c.broadcast(np.ones(4))),
    ("barrier-vs-all_gather",
     lambda c: c.barrier() if _other(c) else c.all_gather(np.ones(1))),
    ("reduce-vs-gather",
     lambda c: c.reduce(np.ones(4)) if _other(c) else c.gather(np.ones(4))),
    ("all_to_all-vs-all_gather_object",
     lambda c: c.all_to_all([np.ones(2)] * W) if _other(c) else c.all_gather_object(1)),
]


@pytest.mark.parametrize(("backend", "case"), _params(MISMATCH))
async def test_disagreeing_ranks_all_raise_collective_error(backend, case):
    _, call = case

    async def fn(comm: Communicator) -> tuple[Outcome, Outcome]:
        first = await outcome(call(comm))
        later = await outcome(comm.all_reduce(np.ones(2)))  # broken for everyone
        return first, later

    for r, ((name, msg, dt, _), (later, _, dt2, _)) in enumerate(await world(fn, backend)):
        assert name == "CollectiveError", f"rank {r}: {name}: {msg}"
        assert dt < PROMPT, f"rank {r} took {dt:.2f} s"
        assert later == "CollectiveError" and dt2 < PROMPT, f"rank {r}: later call gave {later}"


NEW_GROUP = [("new_group-different-lists", None)]


@pytest.mark.parametrize(("backend", "case"), _params(NEW_GROUP))
async def test_new_group_with_different_lists_raises_everywhere_and_leaves_world(backend, case):
    async def fn(comm: Communicator) -> tuple[Outcome, Outcome]:
        members = [0] if comm.rank == 0 else [0, 1]
        got = await outcome(comm.new_group(members))
        after = await outcome(usable(comm))  # docs/concepts.md: still usable
        return got, after

    for r, ((name, msg, dt, _), after) in enumerate(await world(fn, backend)):
        assert name == "CollectiveError" and dt < PROMPT, f"rank {r}: {name}: {msg}"
        assert after[0] == "ok", f"rank {r}: world unusable after it: {after[0]}: {after[1]}"


# ------------------------------------------------------------------------ use after close

CLOSED: list[tuple[str, Callable[[Communicator], Awaitable[Any]]]] = [
    ("all_reduce", lambda c: c.all_reduce(np.ones(2))),
    ("broadcast", lambda c: c.broadcast(np.ones(2))),
    ("reduce", lambda c: c.reduce(np.ones(2))),
    ("reduce_scatter", lambda c: c.reduce_scatter(np.ones(2))),
    ("all_gather", lambda c: c.all_gather(np.ones(2))),
    ("gather", lambda c: c.gather(np.ones(2))),
    ("scatter", lambda c: c.scatter([np.ones(2)] * W)),
    ("all_to_all", lambda c: c.all_to_all([np.ones(2)] * W)),
    ("barrier", lambda c: c.barrier()),
    ("send", lambda c: c.send(np.ones(2), 1 - c.rank)),
    ("recv", lambda c: c.recv(1 - c.rank)),
    ("broadcast_object", lambda c: c.broadcast_object(1)),
    ("all_gather_object", lambda c: c.all_gather_object(1)),
    ("new_group", lambda c: c.new_group([0, 1])),
]


@pytest.mark.parametrize(("backend", "case"), _params(CLOSED))
async def test_use_after_close_raises_closed_error(backend, case):
    _, call = case

    async def fn(comm: Communicator) -> Outcome:
        await comm.barrier()
        await comm.close()
        await comm.close()  # idempotent
        return await outcome(call(comm))

    for r, (name, msg, dt, _) in enumerate(await world(fn, backend)):
        assert name == "CommunicatorClosedError", f"rank {r}: {name}: {msg}"
        assert dt < 0.1


# ----------------------------------------------------------------------------- lost ranks

async def crash(comm: Communicator) -> None:
    """Drop every connection of this rank without a goodbye, as a killed process would."""
    from asynccoll._aio import close_server
    t = comm.transport
    if getattr(t, "_server", None) is not None:
        await close_server(t._server)  # type: ignore[attr-defined]
    for conn in list(t._open):  # type: ignore[attr-defined]
        conn._abort()


LOST = [("crash", "tcp"), ("close", "tcp"), ("close", "memory")]
if "mpi" in BACKENDS:  # (under mpirun: a rank that closed its world tells the others)
    LOST.append(("close", "mpi"))


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize(("how", "backend"), LOST, ids=[f"{b}-{h}" for h, b in LOST])
async def test_lost_rank_is_named_on_every_survivor(backend, how, n):
    gone = n - 1

    async def fn(comm: Communicator) -> Outcome | None:
        await comm.barrier()
        if comm.rank == gone:
            await asyncio.sleep(0.05)
            await (crash(comm) if how == "crash" else comm.close())
            return None
        return await outcome(comm.all_reduce(np.ones(4)))

    results = await world(fn, backend, n)
    for r, res in enumerate(results[:gone]):
        name, msg, dt, rank = res
        assert name == "PeerLostError", f"rank {r}: {name}: {msg}"
        assert rank == gone and str(gone) in msg, f"rank {r}: {msg!r} (rank={rank})"
        assert dt < PROMPT, f"rank {r} took {dt:.2f} s"
    assert issubclass(PeerLostError, CollectiveError)
    assert issubclass(CommunicatorClosedError, CollectiveError)


# ----------------------------------------------------------------------------- cancellation

CANCEL = [("all_reduce", None), ("broadcast", None), ("recv", None)]


@pytest.mark.parametrize("how", ["asyncio.timeout", "task.cancel"])
@pytest.mark.parametrize(("backend", "case"), _params(CANCEL))
async def test_cancelled_rank_gets_cancelled_others_collective_error(backend, case, how):
    kind = case[0]

    def call(comm: Communicator) -> Awaitable[Any]:
        if kind == "all_reduce":
            return comm.all_reduce(np.ones(4))
        if kind == "broadcast":
            return comm.broadcast(np.ones(4), root=1)
        return comm.recv(1) if comm.rank == 0 else comm.recv(0)

    async def fn(comm: Communicator) -> Outcome:
        if comm.rank == 0:  # gives up on a call the peer has not reached (or will never)
            t0 = time.monotonic()
            if how == "asyncio.timeout":
                try:
                    async with asyncio.timeout(0.2):
                        await call(comm)
                except TimeoutError as exc:
                    assert isinstance(exc.__context__, asyncio.CancelledError)
                    return ("CancelledError", "", time.monotonic() - t0, None)
                return ("ok", "", time.monotonic() - t0, None)
            task = asyncio.ensure_future(call(comm))
            await asyncio.sleep(0.2)
            task.cancel()
            return await outcome(task)
        if kind != "recv":
            await asyncio.sleep(0.4)  # enters after rank 0 was cancelled
        return await outcome(call(comm))

    results = await world(fn, backend)
    name, msg, dt, _ = results[0]
    assert name == "CancelledError", f"rank 0: {name}: {msg}"
    assert dt < 0.2 + PROMPT
    for r, (name, msg, dt, _) in enumerate(results[1:], 1):
        assert name == "CollectiveError", f"rank {r}: {name}: {msg}"
        assert "cancel" in msg, f"rank {r}: {msg!r} does not say it was cancelled"
        assert dt < PROMPT, f"rank {r} took {dt:.2f} s"


# --------------------------------------------------------------- the mpi backend, mpirun -n 2

def _why_no_mpi() -> str | None:
    if MPI_WORLD_SIZE is not None:
        return "already inside an MPI job"
    if not (shutil.which("mpirun") or shutil.which("mpiexec")):
        return "no mpirun/mpiexec"
    if importlib.util.find_spec("mpi4py") is None:
        return "no mpi4py"
    return None


@pytest.mark.timeout(240)
@pytest.mark.skipif(_why_no_mpi() is not None, reason=f"MPI unavailable: {_why_no_mpi()}")
def test_mpi_backend_conforms(tmp_path):
    """This file's ``mpi`` cases under ``mpirun -n 2``: every rank's pytest passes (an
    ``xfail(strict=True)`` in KNOWN that starts passing fails it too)."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1",
               OMPI_MCA_btl_vader_single_copy_mechanism="none")
    launcher = shutil.which("mpirun") or shutil.which("mpiexec")
    assert launcher is not None
    proc = subprocess.run(
        [launcher, "-n", str(W), sys.executable, "-m", "pytest", __file__, "-q", "-x",
         "-k", "mpi-", "-p", "no:cacheprovider", "-o", "addopts=", "-W", "ignore"],
        cwd=root, env=env, capture_output=True, text=True, timeout=220, check=False)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
