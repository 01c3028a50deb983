"""The ``"nccl"`` backend and CuPy host staging, against a CPU stand-in for CuPy and NCCL.

These are not GPU tests (tests/test_nccl.py has those, and skips without a GPU): they run the
backend's own logic (which reduction plan each dtype/op takes, pointer offsets of uneven
blocks, grouped send/recv for gather/scatter/all-to-all, the TCP signature and header exchange,
device flags of send/recv, subgroups) with tests/helpers/fake_cupy.py standing in for CuPy,
ranks as threads of this process (each with its own event loop and a real TCP world).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from helpers import fake_cupy
from test_collectives import ALL_DTYPES, make_input, ops_for, reference

import asynccoll
from asynccoll import CollectiveError, ReduceOp
from asynccoll.gpu import HostStaged, is_device_array

W = 3


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fake ``cupy`` module (installed in ``sys.modules`` for the test)."""
    return fake_cupy.install(monkeypatch)["cupy"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_nccl(fn: Callable[[Any], Awaitable[Any]], world_size: int = W, timeout: float = 20.0,
             **kw: Any) -> list[Any]:
    """``fn(comm)`` on every rank of a fake-NCCL world; ranks are threads with their own
    event loops (the fake's collectives block until every rank called them)."""
    from asynccoll.transport.nccl import nccl_init

    port = _free_port()
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def rank(r: int) -> None:
        async def main() -> Any:
            comm = await nccl_init(rank=r, world_size=world_size, addr="127.0.0.1", port=port,
                                   timeout=timeout, **kw)
            try:
                return await fn(comm)
            finally:
                await comm.close()

        try:
            results[r] = asyncio.run(main())
        except BaseException as exc:  # reported below, in the test's thread
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for exc in errors:
        if exc is not None:
            raise exc
    return results


def dev(fake: Any, a: np.ndarray) -> Any:
    return fake.asarray(a)


# ---------------------------------------------------------------------------------- tests

def test_reductions_every_dtype_and_op(fake: Any) -> None:
    """all_reduce, reduce and reduce_scatter (even and uneven blocks) for every dtype and op:
    native NCCL, complex viewed as float pairs, 16-bit integers widened, bool XOR as parity,
    bitwise and complex PROD/MIN/MAX gathered and reduced locally."""
    cases = [(d, op) for d in ALL_DTYPES for op in ops_for(d)]

    async def fn(comm: Any) -> list[Any]:
        out = []
        for k, (dtype, op) in enumerate(cases):
            a = dev(fake, make_input(dtype, (5, 7), k, comm.rank, op))
            assert await comm.all_reduce(a, op) is a and is_device_array(a)
            b = dev(fake, make_input(dtype, (4,), k, comm.rank, op))
            got = await comm.reduce(b, root=1, op=op)
            assert (got is b) == (comm.rank == 1)
            c = dev(fake, make_input(dtype, (7, 2), k, comm.rank, op))
            d = dev(fake, make_input(dtype, (6,), k, comm.rank, op))
            out.append((a.get(), b.get(), (await comm.reduce_scatter(c, op)).get(),
                        (await comm.reduce_scatter(d, op)).get()))
        return out

    got = run_nccl(fn)
    for k, (dtype, op) in enumerate(cases):
        def ref(shape: tuple[int, ...], k: int = k, dtype: str = dtype, op: ReduceOp = op
                ) -> np.ndarray:
            return reference(op, [make_input(dtype, shape, k, r, op) for r in range(W)])

        for r in range(W):
            a, b, c, d = got[r][k]
            what = f"{dtype} {op} rank {r}"
            np.testing.assert_array_equal(a, ref((5, 7)), err_msg=what, strict=True)
            assert a.tobytes() == got[0][k][0].tobytes(), what
            want_b = ref((4,)) if r == 1 else make_input(dtype, (4,), k, r, op)
            np.testing.assert_array_equal(b, want_b, err_msg=what, strict=True)
            np.testing.assert_array_equal(c, np.array_split(ref((7, 2)), W)[r], err_msg=what)
            np.testing.assert_array_equal(d, np.array_split(ref((6,)), W)[r], err_msg=what)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_min_max_propagate_nan_like_every_other_backend(fake: Any, dtype: str) -> None:
    """NCCL's MIN/MAX drop a NaN met by a number (the fake does as NCCL does); the backend
    puts it back, so the result is NumPy's, as on the memory and TCP backends."""

    def data(r: int, n: int) -> np.ndarray:
        x = np.arange(n, dtype=dtype) + r
        x[r::W + 2] = np.nan  # each rank its own NaN positions; some columns have none
        return x

    async def fn(comm: Any) -> list[Any]:
        got = []
        for op in (ReduceOp.MIN, ReduceOp.MAX):
            for n in (W * 4, W * 4 + 1):  # even and uneven reduce_scatter blocks
                a = dev(fake, data(comm.rank, n))
                await comm.all_reduce(a, op)
                b = dev(fake, data(comm.rank, n))
                root = await comm.reduce(b, root=1, op=op)
                rows = await comm.reduce_scatter(dev(fake, data(comm.rank, n)), op)
                got.append((op, n, a.get(), None if root is None else root.get(), rows.get()))
        return got

    for r, results in enumerate(run_nccl(fn)):
        for op, n, a, root, rows in results:
            ufunc = np.minimum if op is ReduceOp.MIN else np.maximum
            want = ufunc.reduce(np.stack([data(j, n) for j in range(W)]), axis=0)
            assert np.isnan(want).any() and not np.isnan(want).all()
            np.testing.assert_array_equal(a, want)
            np.testing.assert_array_equal(rows, np.array_split(want, W)[r])
            if r == 1:
                np.testing.assert_array_equal(root, want)
            else:
                assert root is None


def test_data_movement_and_point_to_point(fake: Any) -> None:
    async def fn(comm: Any) -> dict[str, Any]:
        r = comm.rank
        out: dict[str, Any] = {}
        a = dev(fake, np.full(5, r, np.float16))
        out["bcast"] = (await comm.broadcast(a, root=2)).get()
        out["ag_uneven"] = (await comm.all_gather(dev(fake, np.full((r + 1, 2), r, np.int16)))
                            ).get()
        out["ag_even"] = (await comm.all_gather(dev(fake, np.full((2, 2), r + 0.5j)))).get()
        into = dev(fake, np.zeros((3, 0), np.float32))
        out["ag_empty"] = (await comm.all_gather(dev(fake, np.zeros((1, 0), np.float32)),
                                                 out=into)).shape
        g = await comm.gather(dev(fake, np.array(r + 1j, np.complex128)), root=1)
        out["gather"] = None if g is None else [x.get() for x in g]
        items = ([np.arange(3, dtype=np.int8), dev(fake, np.ones((2, 2), bool)),
                  dev(fake, np.zeros((0,), np.uint64))] if r == 0 else None)
        s = await comm.scatter(items, root=0)
        out["scatter"] = (is_device_array(s), s.get() if is_device_array(s) else s)
        send = [dev(fake, np.full(j + 1, 10 * r + j, np.int32)) if j % 2 else
                np.full((j, 2), 10 * r + j, np.float64) for j in range(W)]
        got = await comm.all_to_all(send)
        out["a2a"] = [(is_device_array(x), x.get() if is_device_array(x) else x) for x in got]
        await comm.barrier()
        out["obj"] = await comm.all_gather_object({"r": r})
        host = np.full(4, r + 1.0)
        out["host"] = await comm.all_reduce(host)
        right, left = (r + 1) % W, (r - 1) % W
        await comm.send(dev(fake, np.arange(r, r + 3.0)), right, tag=5)
        await comm.send(np.array([r]), right, tag=6)
        x6 = await comm.recv(left, tag=6)
        x5 = await comm.recv(left, tag=5)
        out["p2p"] = (is_device_array(x5), x5.get(), is_device_array(x6), x6)
        return out

    got = run_nccl(fn)
    for r in range(W):
        o = got[r]
        np.testing.assert_array_equal(o["bcast"], np.full(5, 2, np.float16))
        np.testing.assert_array_equal(
            o["ag_uneven"], np.concatenate([np.full((j + 1, 2), j, np.int16) for j in range(W)]))
        np.testing.assert_array_equal(
            o["ag_even"], np.concatenate([np.full((2, 2), j + 0.5j) for j in range(W)]))
        assert o["ag_empty"] == (3, 0)
        if r == 1:
            assert [x.item() for x in o["gather"]] == [j + 1j for j in range(W)]
        else:
            assert o["gather"] is None
        on_dev, s = o["scatter"]
        assert on_dev == (r != 0)  # root 0 sent NumPy to itself, device arrays to 1 and 2
        want = [np.arange(3, dtype=np.int8), np.ones((2, 2), bool), np.zeros((0,), np.uint64)]
        np.testing.assert_array_equal(s, want[r], strict=True)
        for j, (on_dev, x) in enumerate(o["a2a"]):
            assert on_dev == (r % 2 == 1), (r, j)  # what rank j put at position r
            want_x = (np.full(r + 1, 10 * j + r, np.int32) if r % 2
                      else np.full((r, 2), 10 * j + r, np.float64))
            np.testing.assert_array_equal(x, want_x, strict=True)
        assert o["obj"] == [{"r": j} for j in range(W)]
        assert isinstance(o["host"], np.ndarray) and not is_device_array(o["host"])
        np.testing.assert_array_equal(o["host"], np.full(4, 6.0))
        left = (r - 1) % W
        assert o["p2p"][0] and not o["p2p"][2]
        np.testing.assert_array_equal(o["p2p"][1], np.arange(left, left + 3.0))
        np.testing.assert_array_equal(o["p2p"][3], np.array([left]))


def test_subgroups_and_collectives_in_flight(fake: Any) -> None:
    async def fn(comm: Any) -> Any:
        r = comm.rank
        sub = await comm.new_group([2, 0])
        mine = None
        if sub is not None:
            mine = (sub.rank, (await sub.all_reduce(dev(fake, np.array([r + 1])))).get())
            await sub.close()
        coros = []
        for k in range(4):
            coros += [comm.all_reduce(dev(fake, np.full(3, r + k, np.float32))),
                      comm.all_gather(dev(fake, np.full((r + k, 1), k, np.int64))),
                      comm.all_reduce(dev(fake, np.full(2, r, np.int16)), ReduceOp.BXOR)]
        got = [x.get() for x in await asyncio.gather(*coros)]
        return mine, got

    got = run_nccl(fn)
    assert got[1][0] is None
    assert got[2][0][0] == 0 and got[0][0][0] == 1
    for r in (0, 2):
        np.testing.assert_array_equal(got[r][0][1], [4])
    for r in range(W):
        for k in range(4):
            a, g, x = got[r][1][3 * k:3 * k + 3]
            np.testing.assert_array_equal(a, np.full(3, sum(j + k for j in range(W)), np.float32))
            assert g.shape == (sum(j + k for j in range(W)), 1) and (g == k).all()
            np.testing.assert_array_equal(x, np.full(2, 0 ^ 1 ^ 2, np.int16))


@pytest.mark.parametrize("check", [True, False])
def test_signature_check_switch(fake: Any, check: bool) -> None:
    async def fn(comm: Any) -> str:
        a = dev(fake, np.ones(4 + (comm.rank == 1 and check)))
        try:
            await comm.all_reduce(a)
            # without the check, what runs must still be right when the calls agree
            return f"ok {a.get().tolist()} {(await comm.all_gather(a[:1])).get().tolist()}"
        except CollectiveError as exc:
            return str(exc)

    got = run_nccl(fn, check_signatures=check)
    if check:
        assert all("(4,)" in m and "(5,)" in m for m in got), got
    else:
        assert got == ["ok [3.0, 3.0, 3.0, 3.0] [3.0, 3.0, 3.0]"] * W


def test_a_mismatch_names_the_sequence_number_of_the_device_call(fake: Any) -> None:
    """As on memory and tcp, ranks that disagree deep into a job learn which call it was:
    the nccl backend named the two signatures only, which a loop repeats call after call."""
    async def fn(comm: Any) -> str:
        for _ in range(2):  # device calls 0 and 1 agree
            await comm.all_reduce(dev(fake, np.ones(4)))
        await comm.all_reduce(np.ones(3))  # a host array: the TCP world's call, not counted
        try:
            await comm.all_reduce(dev(fake, np.ones(4 + (comm.rank == 1))))
        except CollectiveError as exc:
            return str(exc)
        return "no error"

    for msg in run_nccl(fn, world_size=2):
        assert "(4,)" in msg and "(5,)" in msg, msg
        assert "(sequence number 2 of the world, counting calls on GPU arrays)" in msg, msg


def test_a_device_call_refused_by_a_broken_world_names_itself(fake: Any) -> None:
    """As on memory, tcp and mpi, a device call started after the world broke says which
    call was refused ('all_reduce: the communicator is broken: ...'), and says once that
    the communicator is broken: here the TCP world under NCCL broke first (a host-array
    mismatch), the next device calls refuse to start."""
    async def fn(comm: Any) -> list[str]:
        with pytest.raises(CollectiveError):
            await comm.all_reduce(np.ones(3 + comm.rank))  # host arrays: the TCP world's
        texts = []
        for call in (lambda: comm.all_reduce(dev(fake, np.ones(4))),
                     lambda: comm.all_reduce(dev(fake, np.ones(4))),
                     lambda: comm.broadcast(dev(fake, np.ones(4)))):
            with pytest.raises(CollectiveError) as raised:
                await call()
            texts.append(str(raised.value))
        return texts

    for texts in run_nccl(fn, world_size=2):
        assert texts[0].startswith("all_reduce: the communicator is broken"), texts
        assert texts[1].startswith("all_reduce: the communicator is broken"), texts
        assert texts[2].startswith("broadcast: the communicator is broken"), texts
        assert all(t.count("the communicator is broken") == 1 for t in texts), texts
        assert all("collective mismatch" in t for t in texts), texts


def test_long_device_collectives_wake_on_a_host_function(fake: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A device collective still running after the spin is woken by a host function queued
    on a side stream behind its event; short ones never queue one."""
    from asynccoll.transport import nccl

    async def fn(comm: Any) -> list[float]:
        a = dev(fake, np.ones(3))
        await comm.all_reduce(a)
        await comm.broadcast(a)
        return a.get().tolist()

    before = fake.cuda.Stream.host_funcs
    assert run_nccl(fn) == [[3.0] * 3] * W
    assert fake.cuda.Stream.host_funcs == before  # done at once: no host function
    monkeypatch.setattr(fake.cuda.Event, "lag", 10**9)  # "never done" when asked
    monkeypatch.setattr(nccl, "WAIT_SPIN_SECONDS", 0.0)
    assert run_nccl(fn) == [[3.0] * 3] * W
    # the two collectives and close (which waits for the stream the same way), per rank
    assert fake.cuda.Stream.host_funcs - before == 3 * W


def test_bench_times_device_arrays_on_nccl(fake: Any) -> None:
    """``asynccoll bench --backend nccl`` must time CuPy arrays: NumPy ones would take the TCP
    world underneath and the table would show TCP's figures under NCCL's name."""
    from asynccoll import bench

    seen: list[bool] = []

    async def fn(comm: Any) -> list[dict[str, Any]]:
        assert is_device_array(bench._zeros(comm, 4, np.dtype("float32")))
        inner_all_reduce = comm.inner.all_reduce

        async def spy(array: Any, op: Any = ReduceOp.SUM) -> Any:  # only NumPy gets here
            seen.append(is_device_array(array))
            return await inner_all_reduce(array, op)

        comm.inner.all_reduce = spy
        return [await bench.measure(comm, op, 4096, "float32", 3, 1)
                for op in ("all_reduce", "all_gather", "broadcast", "all_to_all")]

    for rows in run_nccl(fn):
        assert [r["op"] for r in rows] == ["all_reduce", "all_gather", "broadcast",
                                           "all_to_all"]
        assert all(r["backend"] == "nccl" and r["time_us"] > 0 for r in rows)
    # the only NumPy all_reduce is measure's own (the slowest rank's time), once per row
    assert seen == [False] * (4 * W)


def test_host_staging_on_the_memory_backend(fake: Any) -> None:
    async def fn(comm: Any) -> Any:
        assert isinstance(comm, HostStaged)
        r = comm.rank
        a = dev(fake, np.full(3, r + 1.0))
        assert await comm.all_reduce(a) is a
        b = dev(fake, np.full(2, r))
        got_b = await comm.reduce(b, root=0)
        rs = await comm.reduce_scatter(dev(fake, np.arange(7.0)))
        ag = await comm.all_gather(dev(fake, np.full((r + 1,), r)))
        g = await comm.gather(dev(fake, np.array([r])), root=2)
        s = await comm.scatter([dev(fake, np.array([j])) for j in range(W)] if r == 1 else None,
                               root=1)
        t = await comm.all_to_all([dev(fake, np.array([10 * r + j])) for j in range(W)])
        bc = await comm.broadcast(dev(fake, np.array([r, r])), root=2)
        await comm.send(dev(fake, np.array([r])), (r + 1) % W)
        rcv = await comm.recv((r - 1) % W)
        sub = await comm.new_group([1, 2])
        return (a.get(), got_b is b, b.get(), rs.get(), ag.get(),
                None if g is None else [x.get() for x in g], s, [x.get() for x in t], bc.get(),
                rcv, sub is None or isinstance(sub, HostStaged),
                all(is_device_array(x) for x in (rs, ag, *t)))

    got = asyncio.run(asynccoll.run_local(fn, W, "memory", gpu_staging=True))
    for r, o in enumerate(got):
        np.testing.assert_array_equal(o[0], np.full(3, 6.0))
        assert o[1] == (r == 0)
        np.testing.assert_array_equal(o[2], np.full(2, 3 if r == 0 else r))
        np.testing.assert_array_equal(o[3], np.array_split(np.arange(7.0) * W, W)[r])
        np.testing.assert_array_equal(o[4], [0, 1, 1, 2, 2, 2])
        assert (o[5] is None) == (r != 2)
        np.testing.assert_array_equal(o[6], [r])  # a NumPy array: the receiver gave nothing
        assert [x.item() for x in o[7]] == [10 * j + r for j in range(W)]
        np.testing.assert_array_equal(o[8], [2, 2])
        np.testing.assert_array_equal(o[9], [(r - 1) % W])
        assert o[10] and o[11]


def test_nccl_init_without_cupy_says_what_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ImportError,
                       match=r"needs CuPy built with NCCL and a CUDA GPU.*asynccoll\[gpu\]"):
        asyncio.run(asynccoll.init(backend="nccl", rank=0, world_size=1))


def test_dtype_plans_cover_every_dtype_and_op() -> None:
    from asynccoll.transport.nccl import _plan

    for dtype, op in itertools.product(ALL_DTYPES, ReduceOp):
        if op not in ops_for(dtype):
            continue
        plan = _plan(np.dtype(dtype), op)
        assert plan.kind in ("native", "widen", "gather"), (dtype, op)
        if plan.kind != "gather":
            assert plan.nccl_type and plan.nccl_op and plan.view


def test_a_send_refused_for_its_array_sends_nothing(fake: Any) -> None:
    """API.md: a non-contiguous or unsupported array is a TypeError raised before anything is
    sent. The device flag that travels beside each message must not go out either, or the
    receiver pairs it with the next message (a CuPy array would arrive as NumPy)."""
    async def fn(comm: Any) -> Any:
        if comm.rank == 0:
            for bad in (np.arange(6.0)[::2], np.array(["x"]), [1.0]):
                with pytest.raises(TypeError):
                    await comm.send(bad, 1, tag=4)
            await comm.send(dev(fake, np.arange(3.0)), 1, tag=4)
            return None
        got = await comm.recv(0, tag=4)
        return is_device_array(got), got.get() if is_device_array(got) else got

    got = run_nccl(fn, world_size=2)
    assert got[1][0], "the CuPy array arrived as NumPy: a refused send's flag went out"
    np.testing.assert_array_equal(got[1][1], np.arange(3.0))


def test_host_staged_all_gather_checks_out_before_anything_is_sent(fake: Any) -> None:
    """API.md: a bad array is an error raised before anything is sent. A CuPy ``out`` that
    cannot take the result (not a CuPy array, not C-contiguous, another dtype or trailing
    shape) must be refused before the inner communicator gathers anything."""
    async def fn(comm: Any) -> Any:
        sent: list[Any] = []
        inner = comm.inner
        real = inner.all_gather

        async def spy(array: Any, *, out: Any = None) -> Any:
            sent.append(array)
            return await real(array, out=out)

        inner.all_gather = spy
        a = dev(fake, np.ones((2, 3)))
        bad = [(np.empty((2, 3)), TypeError),
               (dev(fake, np.empty((2, 6)))[:, ::2], TypeError),
               (dev(fake, np.empty((2, 3), np.float32)), ValueError),
               (dev(fake, np.empty((2, 4))), ValueError)]
        for out, err in bad:
            with pytest.raises(err):
                await comm.all_gather(a, out=out)
        assert sent == [], "all_gather ran before its out was checked"
        good = dev(fake, np.zeros((2, 3)))
        assert await comm.all_gather(a, out=good) is good
        return good.get()

    got = asyncio.run(asynccoll.run_local(fn, 1, "memory", gpu_staging=True))
    np.testing.assert_array_equal(got[0], np.ones((2, 3)))


def test_host_staged_scatter_ignores_arrays_off_root(fake: Any) -> None:
    """API.md: ``arrays`` is ignored off root. A non-root's list must not be copied or
    checked: a TypeError there, and not on root, would leave root's scatter waiting."""
    async def fn(comm: Any) -> Any:
        r = comm.rank
        parts = ([dev(fake, np.array([10.0 * j])) for j in range(W)] if r == 0 else
                 [dev(fake, np.arange(6.0))[::2]] * W)     # ignored: not even valid
        got = await comm.scatter(parts, root=0)
        return got.get() if is_device_array(got) else got

    got = asyncio.run(asyncio.wait_for(
        asynccoll.run_local(fn, W, "memory", gpu_staging=True, timeout=5.0), 20))
    for r, o in enumerate(got):
        np.testing.assert_array_equal(o, [10.0 * r])


def test_nccl_install_hint_reads_as_a_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CuPy, ``init(backend="nccl")`` names what to install in one sentence (it read
    'needs CuPy with a CUDA GPU is required and CuPy built with NCCL')."""
    from asynccoll.transport.nccl import import_nccl

    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)
    with pytest.raises(ImportError) as info:
        import_nccl()
    assert str(info.value).startswith(
        'the "nccl" backend needs CuPy built with NCCL and a CUDA GPU: '
        'pip install "asynccoll[gpu]" ('), str(info.value)


@pytest.mark.parametrize("how", ["fails", "never_calls"])
def test_nccl_init_a_rank_that_fails_or_never_calls_init(fake: Any,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        how: str) -> None:
    """ncclCommInitRank blocks, without a timeout, until every rank called it. A rank whose
    init failed (a CUDA out-of-memory) left the others waiting for their whole timeout, and
    then ``asyncio.run`` did not return while the blocked thread lived (asyncio's executor
    thread is joined at exit: forever with real NCCL). Now its failure reaches the others at
    once, and a rank that never calls init is a CollectiveTimeout that lets the process go."""
    from asynccoll import CollectiveTimeout
    from asynccoll.transport.nccl import nccl_init

    nccl = sys.modules["cupy.cuda.nccl"]
    real = nccl.NcclCommunicator
    release = threading.Event()

    def init(ndev: int, uid: Any, rank: int) -> Any:
        if rank == 1 and how == "fails":
            raise nccl.NcclError("unhandled cuda error: out of memory")
        if rank == 1:  # as a rank that never gets there (until the test ends)
            release.wait(30.0)
            raise nccl.NcclError("released by the test")
        return real(ndev, uid, rank)

    monkeypatch.setattr(nccl, "NcclCommunicator", init)
    monkeypatch.setattr(fake_cupy, "WAIT", 12.0)  # fake NCCL's own give-up time
    port = _free_port()
    got: list[Any] = [None] * W

    def rank(r: int) -> None:
        start = time.monotonic()
        try:
            asyncio.run(nccl_init(rank=r, world_size=W, addr="127.0.0.1", port=port,
                                  timeout=2.0 if how == "never_calls" else 10.0))
            got[r] = ("no error", 0.0)
        except Exception as exc:
            got[r] = (exc, time.monotonic() - start)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(8.0)
    release.set()
    assert not any(t.is_alive() for t in threads), f"asyncio.run did not return: {got}"
    for r, (exc, took) in enumerate(got):
        assert isinstance(exc, CollectiveError), (r, exc)
        if how == "fails":
            assert "rank 1" in str(exc) and "out of memory" in str(exc), (r, exc)
            assert took < 5.0, (r, took)  # not the 10 s timeout
        else:
            assert "did not complete within 2 s" in str(exc), (r, exc)
    if how == "never_calls":
        assert any(isinstance(exc, CollectiveTimeout) for exc, _ in got), got


def test_init_makes_the_ranks_gpu_current(fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/backends/nccl.md's first example makes its array with plain ``cupy.full`` after
    ``init`` ("on this rank's GPU"). ``init`` picked GPU r for rank r but left GPU 0 current,
    so on a machine of several GPUs every rank but 0 made its array on GPU 0 and its
    all_reduce raised ValueError 'array is on GPU 0 but this communicator uses GPU 1'."""
    monkeypatch.setattr(sys.modules["cupy.cuda.runtime"], "getDeviceCount", lambda: 2)
    for var in ("ASYNCCOLL_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                "MPI_LOCALRANKID", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)

    async def fn(comm: Any) -> Any:
        a = fake.full(3, comm.rank + 1.0)  # on the current device, as CuPy makes it
        assert await comm.all_reduce(a) is a
        return comm.device, a.device.id, a.get().tolist()

    assert run_nccl(fn, world_size=2) == [(0, 0, [3.0] * 3), (1, 1, [3.0] * 3)]


def test_check_signatures_must_agree(fake: Any) -> None:
    """``check_signatures`` must be equal on every rank. A rank that checks waits over TCP for
    the signature of a rank that went straight to NCCL: they failed only at the timeout,
    naming an ``all_gather_object`` the user never called. Now init says so on every rank."""
    from asynccoll.transport.nccl import nccl_init

    port = _free_port()
    got: list[Any] = [None] * W

    def rank(r: int) -> None:
        async def main() -> None:
            comm = await nccl_init(rank=r, world_size=W, addr="127.0.0.1", port=port,
                                   timeout=10.0, check_signatures=r != 1)
            try:
                await comm.all_reduce(dev(fake, np.ones(3)))
            finally:
                await comm.close()

        start = time.monotonic()
        try:
            asyncio.run(main())
        except Exception as exc:
            got[r] = (exc, time.monotonic() - start)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for r, (exc, took) in enumerate(got):
        assert isinstance(exc, ValueError), (r, exc)
        assert "True on ranks [0, 2], False on ranks [1]" in str(exc), (r, exc)
        assert took < 5.0, (r, took)


def test_close_with_a_collective_that_never_ends(fake: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``close`` waited for the communicator's stream with a blocking ``synchronize``: with a
    device collective still in flight that can never end (its peers never call it, or gave
    up), the event loop stopped, the waiting collective could not see the failure, and the
    process hung for good. ``close`` now waits without blocking the loop, within
    ``timeout``, and aborts NCCL when the wait fails."""
    from asynccoll.transport import nccl as nccl_mod

    monkeypatch.setattr(fake.cuda.Event, "lag", 10**9)  # the GPU work never ends
    monkeypatch.setattr(fake.cuda.Stream, "launch_host_func", lambda self, fn, arg: None)
    monkeypatch.setattr(nccl_mod, "WAIT_SPIN_SECONDS", 0.0)

    async def fn(comm: Any) -> Any:
        task = asyncio.create_task(comm.all_reduce(dev(fake, np.ones(3))))
        await asyncio.sleep(0.1)  # enqueued, waiting for its event
        assert not task.done()
        start = time.monotonic()
        await comm.close()
        took = time.monotonic() - start
        with pytest.raises(CollectiveError):
            await task
        return took

    took = run_nccl(fn, world_size=2, check_signatures=False)
    assert max(took) < 2.0, took  # not the fake's 5 s synchronize (forever on a GPU)


def test_a_timeout_set_after_init_covers_send_and_recv(fake: Any) -> None:
    """``comm.timeout = T`` after init must hold for ``recv`` too. The device flag that travels
    beside each message went through a TCP subgroup that kept init's timeout: a recv waiting
    longer than that for a slow sender raised CollectiveTimeout and broke the world."""
    async def fn(comm: Any) -> Any:
        comm.timeout = 30.0
        if comm.rank == 1:
            await asyncio.sleep(2.0)  # longer than init's timeout, well within the new one
            await comm.send(dev(fake, np.arange(3.0)), 0, tag=3)
            return None
        got = await comm.recv(1, tag=3)
        return is_device_array(got), got.get().tolist()

    assert run_nccl(fn, world_size=2, timeout=1.0)[0] == (True, [0.0, 1.0, 2.0])


def test_a_bad_timeout_set_after_init_is_refused_as_on_every_backend(fake: Any) -> None:
    """``comm.timeout = "5"`` was taken (as 5.0) on nccl and with host staging, and ``None``
    raised float()'s "argument must be a string or a real number": the setter converted the
    value before the inner communicator could check it. Now the same TypeError/ValueError
    naming the timeout as on memory and tcp, and the send/recv flags keep the old one."""
    async def fn(comm: Any) -> Any:
        for bad, error in (("5", TypeError), (None, TypeError), (-1.0, ValueError)):
            with pytest.raises(error, match="timeout must be"):
                comm.timeout = bad
        comm.timeout = np.float32(2.5)
        return comm.timeout, comm._flags.timeout, type(comm._flags.timeout).__name__

    assert run_nccl(fn, world_size=2) == [(2.5, 2.5, "float")] * 2
