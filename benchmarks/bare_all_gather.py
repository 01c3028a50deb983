"""What an all_gather costs without a library around it: the lower bound for asynccoll's.

    python benchmarks/bare_all_gather.py -n 4 --size 1M --iters 3000     # bare sockets
    mpirun --oversubscribe --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo \\
        -n 4 python benchmarks/bare_all_gather.py --mpi --size 1M --iters 3000   # Open MPI

Without ``--mpi`` it forks ``-n`` processes joined by a full mesh of loopback TCP
connections (``TCP_NODELAY``, reno as between asynccoll's ranks) and runs the direct
all_gather asynccoll uses up to 4 ranks, with nothing else: every rank sends its block to
every other (non-blocking ``send``), hands its core over once (``sched_yield``) where every
core is shared by two or more ranks, as asynccoll does, copies its own block, then reads
each peer's block straight into the output with ``recv_into``, yielding whenever a pass over
the sockets moved nothing. No framing, no matching, no event loop. With ``--mpi`` (under
``mpirun``) it times ``MPI_Allgather`` of the same buffers instead.

``--size`` is the gathered output (as in ``compare.py``, rounded down to whole float32
blocks). Every rank prints its mean and median time per call and its CPU time per call split
into user and system time (from ``os.times``, 10 ms ticks: use a few thousand calls), and the
bare loop also the CPU time of its two phases: posting the sends, and the rest (own copy and
receives, finishing the sends).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import numpy as np


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def summary(rank: int, times: list[float], seconds: float, cpu: os.times_result,
            iters: int, extra: str = "") -> str:
    return (f"[{rank}] mean {seconds / iters * 1e6:.1f} us, median "
            f"{statistics.median(times) * 1e6:.1f} us, CPU per call: user "
            f"{cpu.user / iters * 1e6:.1f} us, system {cpu.system / iters * 1e6:.1f} us{extra}")


def say(line: str) -> None:
    """One line in one write: the ranks print at the same time."""
    os.write(1, (line + "\n").encode())


def times_since(t0: os.times_result) -> os.times_result:
    t1 = os.times()
    return os.times_result((t1.user - t0.user, t1.system - t0.system, 0.0, 0.0, 0.0))


def bare_rank(rank: int, n: int, per: int, iters: int, warmup: int,
              socks: dict[int, socket.socket], hand_over: bool) -> None:
    mine = np.full(per // 4, rank, np.float32)
    out = np.zeros(per * n // 4, np.float32)
    ob, mb = out.data.cast("B"), mine.data.cast("B")
    peers = [(rank + d) % n for d in range(1, n)]  # staggered, as asynccoll's
    for s in socks.values():
        s.setblocking(False)
    times: list[float] = []
    phases: list[tuple[int, int]] = []
    t0 = 0.0
    o0 = os.times()
    for it in range(warmup + iters):
        if it == warmup:
            t0, o0 = time.perf_counter(), os.times()
        start = time.perf_counter()
        a = time.thread_time_ns()
        sent = dict.fromkeys(peers, 0)
        got = dict.fromkeys(peers, 0)
        for p in peers:
            try:
                sent[p] += socks[p].send(mb)
            except BlockingIOError:
                pass
        b = time.thread_time_ns()
        if hand_over:
            os.sched_yield()
        ob[rank * per:(rank + 1) * per] = mb
        busy = True
        while busy:
            busy = moved = False
            for p in peers:
                if sent[p] < per:
                    busy = True
                    try:
                        k = socks[p].send(mb[sent[p]:])
                        sent[p] += k
                        moved = moved or k > 0
                    except BlockingIOError:
                        pass
                if got[p] < per:
                    busy = True
                    try:
                        k = socks[p].recv_into(ob[p * per + got[p]:(p + 1) * per])
                        if not k:
                            raise ConnectionError(f"rank {p} closed its connection")
                        got[p] += k
                        moved = True
                    except BlockingIOError:
                        pass
            if busy and not moved:
                os.sched_yield()
        if it >= warmup:
            times.append(time.perf_counter() - start)
            phases.append((b - a, time.thread_time_ns() - b))
    seconds = time.perf_counter() - t0
    cpu = times_since(o0)
    for p in range(n):
        if not (out[p * per // 4:(p + 1) * per // 4] == p).all():
            raise AssertionError(f"rank {rank}: rank {p}'s block arrived wrong")
    extra = (f"; sends {statistics.mean(x[0] for x in phases) / 1e3:.1f} us, the rest "
             f"{statistics.mean(x[1] for x in phases) / 1e3:.1f} us (thread CPU, incl. yields)")
    say(summary(rank, times, seconds, cpu, iters, extra))


def bare(n: int, per: int, iters: int, warmup: int) -> int:
    listeners = []
    for _ in range(n):
        lst = socket.socket()
        lst.bind(("127.0.0.1", 0))
        lst.listen(n)
        listeners.append(lst)
    conns: list[dict[int, socket.socket]] = [{} for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            dialled = socket.create_connection(listeners[b].getsockname())
            accepted, _ = listeners[b].accept()
            for s in (dialled, accepted):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if hasattr(socket, "TCP_CONGESTION"):
                    try:
                        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"reno")
                    except OSError:
                        pass
            conns[a][b], conns[b][a] = dialled, accepted
    for lst in listeners:
        lst.close()
    hand_over = n >= 2 * len(os.sched_getaffinity(0))  # as asynccoll's Transport.hands_over
    children = []
    for r in range(n):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                # only this rank's ends stay open here, so that a rank that fails closes its
                # connections and the others see the end of the stream instead of waiting
                for other in range(n):
                    if other != r:
                        for s in conns[other].values():
                            s.close()
                bare_rank(r, n, per, iters, warmup, conns[r], hand_over)
            except BaseException as exc:  # reported here; the exit code tells the parent
                print(f"[{r}] failed: {exc!r}", file=sys.stderr, flush=True)
                code = 1
            os._exit(code)
        children.append(pid)
    for ends in conns:
        for s in ends.values():
            s.close()
    failed = 0
    for pid in children:
        _, status = os.waitpid(pid, 0)
        failed |= status != 0
    return int(failed)


def mpi(per: int, iters: int, warmup: int) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mine = np.full(per // 4, comm.rank, np.float32)
    out = np.zeros(per * comm.size // 4, np.float32)
    for _ in range(warmup):
        comm.Allgather(mine, out)
    comm.Barrier()
    times = []
    t0, o0 = time.perf_counter(), os.times()
    for _ in range(iters):
        c = time.perf_counter()
        comm.Allgather(mine, out)
        times.append(time.perf_counter() - c)
    seconds = time.perf_counter() - t0
    say(summary(comm.rank, times, seconds, times_since(o0), iters))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--ranks", type=int, default=4)
    p.add_argument("--size", type=parse_size, default=1 << 20,
                   help="bytes of the gathered output (float32), default 1M")
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=300, help="untimed calls first")
    p.add_argument("--mpi", action="store_true", help="time MPI_Allgather (run under mpirun)")
    a = p.parse_args(argv)
    if a.mpi:
        from mpi4py import MPI

        size = MPI.COMM_WORLD.size
    else:
        size = a.ranks
    if size < 2 or a.size < 4 * size:
        p.error("need at least 2 ranks and one float32 per rank")
    per = a.size // 4 // size * 4  # bytes of a rank's block (compare.py's rounding)
    if a.iters < 1 or a.warmup < 0:
        p.error("--iters must be at least 1 and --warmup at least 0")
    return mpi(per, a.iters, a.warmup) if a.mpi else bare(size, per, a.iters, a.warmup)


if __name__ == "__main__":
    raise SystemExit(main())
