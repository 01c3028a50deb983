"""The ``"nccl"`` backend against raw NCCL calls on the same communicator, in one run.

    asynccoll run -n 2 benchmarks/nccl_overhead.py                  # one rank per GPU
    asynccoll run -n 2 benchmarks/nccl_overhead.py --split-hosts    # two ranks, one GPU

Per size, as medians over ``--rounds`` rounds that alternate the ways of calling (each round's
figure is the median of ``--iters`` calls; rank 0 prints):

* ``raw``: ``ncclAllReduce`` through ``cupy.cuda.nccl`` on the backend's own NCCL
  communicator, then ``stream.synchronize()`` (the floor: NCCL and a blocking wait);
* ``asynccoll``: ``await comm.all_reduce(a)`` (signature check over TCP, the default);
* ``nocheck``: the same with ``check_signatures=False``;
* ``tcp-check``: the signature check's TCP exchange alone (one small ``all_gather_object``).

``--split-hosts`` gives each rank its own ``NCCL_HOSTID``, so that NCCL, which refuses two
ranks of one machine on one GPU, connects them through its socket transport on loopback: the
figures are then those of that transport (and of two processes sharing a GPU, which is slow
without MPS, ``nvidia-cuda-mps-control -d``), and only the differences between the rows say
something about asynccoll. ``--poll-only`` measures the wait of the previous versions (the
CUDA event polled with sleeps, no host function) for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

from workers import parse_size  # benchmarks/ is on sys.path when run as a script

LABELS = ("raw", "asynccoll", "nocheck", "tcp-check")


async def once(label: str, comm: Any, a: Any, stream: Any, nccl: Any) -> None:
    if label == "raw":
        comm.nccl_comm.allReduce(a.data.ptr, a.data.ptr, a.size, nccl.NCCL_FLOAT32,
                                 nccl.NCCL_SUM, stream.ptr)
        stream.synchronize()
    elif label == "tcp-check":
        await comm.inner.all_gather_object([0, "all_reduce <f4 (16,) 0", None])
    else:
        comm.check_signatures = label == "asynccoll"
        await comm.all_reduce(a)


async def main(args: argparse.Namespace) -> None:
    import cupy
    from cupy.cuda import nccl

    import asynccoll
    from asynccoll.transport.nccl import WAIT_SPIN_SECONDS as spin

    comm: Any = await asynccoll.init(backend="nccl", timeout=120.0)
    async with comm:
        with cupy.cuda.Device(comm.device):
            stream = cupy.cuda.Stream(non_blocking=True)
        if comm.rank == 0:
            gpu = cupy.cuda.runtime.getDeviceProperties(comm.device)["name"].decode()
            print(f"# {comm.world_size} ranks, NCCL {nccl.get_version()}, CuPy "
                  f"{cupy.__version__}, {gpu}"
                  f"{', split hosts' if args.split_hosts else ''}"
                  f"{', poll only' if args.poll_only else ''}, spin {spin:g} s; "
                  "median us (ratio to raw)",
                  flush=True)
            print(f"{'bytes':>10} " + " ".join(f"{label:>20}" for label in LABELS), flush=True)
        for nbytes in args.sizes:
            with cupy.cuda.Device(comm.device):
                a = cupy.ones(max(1, nbytes // 4), cupy.float32)
            iters = args.iters if nbytes <= (1 << 20) else max(10, args.iters // 5)
            rounds: dict[str, list[float]] = {label: [] for label in LABELS}
            for _ in range(args.rounds):
                for label in LABELS:
                    for _ in range(3):  # warm-up
                        await once(label, comm, a, stream, nccl)
                    times = []
                    for _ in range(iters):
                        t0 = time.perf_counter()
                        await once(label, comm, a, stream, nccl)
                        times.append(time.perf_counter() - t0)
                    rounds[label].append(statistics.median(times) * 1e6)
            await comm.barrier()
            if comm.rank == 0:
                med = {label: statistics.median(v) for label, v in rounds.items()}
                print(f"{nbytes:>10} " + " ".join(
                    f"{med[label]:>11.1f} ({med[label] / med['raw']:>5.2f}x)" for label in LABELS),
                    flush=True)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=lambda t: [parse_size(x) for x in t.split(",")],
                   default=[8, 64 << 10, 1 << 20, 16 << 20], help="bytes, e.g. 8,64K,1M,16M")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--split-hosts", action="store_true",
                   help="one NCCL_HOSTID per rank: several ranks on one GPU (socket transport)")
    p.add_argument("--poll-only", action="store_true",
                   help="wait as before host functions woke long waits (event polled only)")
    p.add_argument("--spin", type=float, default=None,
                   help="override the waits' spin (s; asynccoll.transport.nccl.WAIT_SPIN_SECONDS)")
    return p.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse(sys.argv[1:])
    if ARGS.split_hosts:
        os.environ["NCCL_HOSTID"] = f"asynccoll-bench-{os.environ.get('ASYNCCOLL_RANK', '0')}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
    if ARGS.spin is not None:
        from asynccoll.transport import nccl as backend

        backend.WAIT_SPIN_SECONDS = ARGS.spin
    if ARGS.poll_only:
        from asynccoll.transport.nccl import NcclCommunicator

        NcclCommunicator._signal_after = lambda self, event, loop: None  # type: ignore[method-assign]
    asyncio.run(main(ARGS))
