"""Receive-then-add against add-as-you-receive, over a bare loopback TCP socket.

    python benchmarks/receive_and_add.py                      # 48 MiB, 4 MiB segments, 256 KiB
    python benchmarks/receive_and_add.py --chunk-kib 1024 --launches 10

The reduce half of a ring all_reduce receives each segment of a partial sum into scratch
memory and then adds it into the array (what asynccoll does: one receive per segment, straight
into a preallocated buffer). The alternative measured here receives into a small buffer that
stays in cache and adds each piece as it arrives, so the partial sums never go to memory and
back. One process sends ``--mib`` MiB in ``--segment-mib`` MiB writes; the other receives it
one way or the other (alternating launches, fresh processes each), and the script prints both
ways' medians: the receiver's wall and CPU time per message. No asynccoll code is involved:
it bounds what a receive that reduces as it reads could save (docs/performance.md, "Cores that
change speed").
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import numpy as np


def _send(port: int, nbytes: int, segment: int, reps: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        src = memoryview(np.ones(nbytes // 4, np.float32)).cast("B")
        for _ in range(reps):
            for off in range(0, nbytes, segment):
                s.sendall(src[off:off + segment])
            s.recv(1)  # the receiver is done with this message


def _recv_exact(c: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = c.recv_into(view[got:])
        if not n:
            raise EOFError("the sender closed early")
        got += n


def one_launch(mode: str, nbytes: int, segment: int, chunk: int, reps: int
               ) -> tuple[float, float]:
    """Median (wall, CPU) seconds per message of the receiver, in a fresh sender process."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                _send(ls.getsockname()[1], nbytes, segment, reps)
            finally:
                os._exit(0)
        c, _ = ls.accept()
    target = np.ones(nbytes // 4, np.float32)
    scratch = np.empty(nbytes // 4, np.float32) if mode == "scratch" else None
    bounce = np.empty(chunk // 4, np.float32)
    bview = memoryview(bounce).cast("B")
    walls, cpus = [], []
    with c:
        for _ in range(reps):
            t, cpu = time.perf_counter(), time.process_time()
            if scratch is not None:
                sview = memoryview(scratch).cast("B")
                for off in range(0, nbytes, segment):
                    _recv_exact(c, sview[off:off + segment])
                    lo, hi = off // 4, (off + segment) // 4
                    np.add(target[lo:hi], scratch[lo:hi], out=target[lo:hi])
            else:
                off = 0
                while off < nbytes:
                    n = c.recv_into(bview, min(chunk, nbytes - off))
                    if not n:
                        raise EOFError("the sender closed early")
                    if n % 4:  # whole floats only
                        _recv_exact(c, bview[n:n + 4 - n % 4])
                        n += 4 - n % 4
                    lo = off // 4
                    np.add(target[lo:lo + n // 4], bounce[:n // 4], out=target[lo:lo + n // 4])
                    off += n
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - cpu)
            c.send(b"k")
    os.waitpid(pid, 0)
    if not np.array_equal(target, np.full_like(target, 1 + reps)):  # ones, added reps times
        raise AssertionError(f"{mode}: the sums are wrong")
    skip = min(2, reps - 1)  # the first messages fault their memory in
    return statistics.median(walls[skip:]), statistics.median(cpus[skip:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=48,
                   help="message size (default: what a rank receives in the reduce half of a "
                        "64 MiB all_reduce over 4 ranks)")
    p.add_argument("--segment-mib", type=int, default=4, help="the sender's writes")
    p.add_argument("--chunk-kib", type=int, default=256, help="the small buffer's size")
    p.add_argument("--reps", type=int, default=20, help="messages per launch")
    p.add_argument("--launches", type=int, default=5, help="launches of each way, alternating")
    a = p.parse_args(argv)
    nbytes, segment, chunk = a.mib << 20, a.segment_mib << 20, a.chunk_kib << 10
    if nbytes % segment or segment % 4 or chunk % 4 or chunk < 4:
        p.error("--mib must be a multiple of --segment-mib, sizes multiples of 4 bytes")
    got: dict[str, list[tuple[float, float]]] = {"scratch": [], "as-you-go": []}
    for _ in range(a.launches):
        for mode in got:
            got[mode].append(one_launch(mode, nbytes, segment, chunk, a.reps))
    print(f"# {a.mib} MiB in {a.segment_mib} MiB writes; as-you-go reads {a.chunk_kib} KiB at "
          f"a time; medians of {a.launches} launches x {a.reps} messages")
    med = {m: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
           for m, v in got.items()}
    for mode, (wall, cpu) in med.items():
        print(f"{mode:>10}: wall {wall * 1e3:7.2f} ms, receiver CPU {cpu * 1e3:7.2f} ms")
    (w0, c0), (w1, c1) = med["scratch"], med["as-you-go"]
    print(f"as-you-go / scratch: wall {w1 / w0:.3f} x, CPU {c1 / c0:.3f} x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
