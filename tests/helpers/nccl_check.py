"""The ``"nccl"`` backend on real GPUs: a few collectives checked against NumPy.

Run by tests/test_nccl.py as ``asynccoll run -n N tests/helpers/nccl_check.py`` (N = number of
GPUs, one rank per GPU; or two ranks on one GPU, see ``split_hosts``); prints ``OK rank R``
when every result is right on this rank.
"""

from __future__ import annotations

import asyncio
import os

import cupy
import numpy as np

import asynccoll
from asynccoll import ReduceOp


def split_hosts() -> None:
    """With ``ASYNCCOLL_CHECK_SPLIT_HOSTS=1``, give this rank its own ``NCCL_HOSTID``.

    NCCL refuses two ranks of one host on one GPU ("Duplicate GPU detected"); ranks with
    different host ids are taken for separate machines and connected through NCCL's socket
    transport (on loopback with ``NCCL_SOCKET_IFNAME=lo``), which lets a one-GPU machine run a
    real multi-rank NCCL world. Must run before the first NCCL call of the process.
    """
    if os.environ.get("ASYNCCOLL_CHECK_SPLIT_HOSTS") == "1":
        os.environ["NCCL_HOSTID"] = f"asynccoll-check-{os.environ['ASYNCCOLL_RANK']}"


def data(dtype: str, n: int, rank: int) -> np.ndarray:
    rng = np.random.default_rng([n, rank])
    if np.dtype(dtype).kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    real = rng.integers(-4, 5, n).astype(np.float64)
    return (real + 1j * rng.integers(-4, 5, n) if np.dtype(dtype).kind == "c"
            else real).astype(dtype)


async def main() -> None:
    split_hosts()
    async with await asynccoll.init(backend="nccl", timeout=60.0) as comm:
        r, w = comm.rank, comm.world_size
        cases = [("float32", ReduceOp.SUM), ("float64", ReduceOp.AVG), ("int16", ReduceOp.SUM),
                 ("int64", ReduceOp.BXOR), ("bool", ReduceOp.BXOR), ("complex64", ReduceOp.SUM),
                 ("complex128", ReduceOp.PROD), ("uint8", ReduceOp.MAX), ("float16", ReduceOp.MIN)]
        for dtype, op in cases:
            for n in (1, 1000, 1 << 20):
                a = cupy.asarray(data(dtype, n, r))
                assert await comm.all_reduce(a, op) is a
                every = [data(dtype, n, j) for j in range(w)]
                ufunc = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
                         ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum,
                         ReduceOp.BXOR: np.bitwise_xor}[op]
                want = ufunc.reduce(np.stack(every), axis=0, dtype=dtype)
                if op is ReduceOp.AVG:
                    want = want / w
                np.testing.assert_allclose(a.get(), want, rtol=1e-6, err_msg=f"{dtype} {op}")
                rows = await comm.reduce_scatter(cupy.asarray(data(dtype, n, r)), op)
                np.testing.assert_allclose(rows.get(), np.array_split(want, w)[r], rtol=1e-6)
        for op, ufunc in ((ReduceOp.MIN, np.minimum), (ReduceOp.MAX, np.maximum)):
            def nans(j: int) -> np.ndarray:  # each rank its own NaN positions (NCCL drops NaN)
                x = np.arange(7 * w + 1, dtype=np.float32) + j
                x[j::w + 2] = np.nan
                return x

            want = ufunc.reduce(np.stack([nans(j) for j in range(w)]), axis=0)
            a = cupy.asarray(nans(r))
            await comm.all_reduce(a, op)
            np.testing.assert_array_equal(a.get(), want, err_msg=f"NaN {op}")
            rows = await comm.reduce_scatter(cupy.asarray(nans(r)), op)
            np.testing.assert_array_equal(rows.get(), np.array_split(want, w)[r])
        got = await comm.all_gather(cupy.full((r + 1, 3), r, cupy.int32))
        np.testing.assert_array_equal(
            got.get(), np.concatenate([np.full((j + 1, 3), j, np.int32) for j in range(w)]))
        b = cupy.arange(10.0) * (r + 1)
        await comm.broadcast(b, root=w - 1)
        np.testing.assert_array_equal(b.get(), np.arange(10.0) * w)
        g = await comm.gather(cupy.full(4, r, cupy.float16), root=0)
        if r == 0:
            assert g is not None and [int(x[0]) for x in g] == list(range(w))
        s = await comm.scatter([cupy.full(j + 1, j) for j in range(w)] if r == 0 else None)
        np.testing.assert_array_equal(s.get(), np.full(r + 1, r))
        t = await comm.all_to_all([cupy.full(2, 10 * r + j) for j in range(w)])
        assert [int(x[0]) for x in t] == [10 * j + r for j in range(w)]
        if w > 1:
            await comm.send(cupy.arange(5) + r, (r + 1) % w, tag=3)
            x = await comm.recv((r - 1) % w, tag=3)
            assert isinstance(x, cupy.ndarray) and int(x[0]) == (r - 1) % w
        sub = await comm.new_group(list(reversed(range(w))))
        assert sub is not None and sub.rank == w - 1 - r
        c = cupy.ones(3)
        await asyncio.gather(sub.all_reduce(c), comm.all_reduce(cupy.ones(5)))
        np.testing.assert_array_equal(c.get(), np.full(3, float(w)))
        await sub.close()
        await comm.barrier()
        print(f"OK rank {r}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
