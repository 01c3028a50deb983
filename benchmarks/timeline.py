"""Where the time of one small collective goes, by timestamps inside the call; under the launcher.

    python -m asynccoll run -n 2 benchmarks/timeline.py              # 8-byte all_reduce
    python -m asynccoll run -n 2 benchmarks/timeline.py --nbytes 64 --iters 20000

Each rank wraps internals of the TCP transport with timestamps (the post with its socket write,
the first direct read of the lean receive, the frame's arrival: taken as predicted, or
delivered to the mailbox) and prints the median of every phase of a call: before the write,
the write, to the first poll, to the delivery, to the return. The wrappers add about a
microsecond to each phase; compare the phases with each other, and totals with
`profile_collective.py`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
from workers import run_event_loop  # benchmarks/ is on sys.path when run as a script

import asynccoll
from asynccoll import wire
from asynccoll.transport import base, tcp

PHASES = ("before the write", "post()", "to the first poll", "to the delivery", "to the return",
          "total")


def instrument(stamps: dict[str, float]) -> None:
    clock = time.perf_counter
    post, poll = tcp.TcpTransport.post, tcp.TcpTransport.poll_payload
    take, deliver = wire.BufferedFrameReader.take_staged, base.Mailbox.deliver

    def timed_post(self: Any, dst: int, head: bytes, payload: Any) -> Any:
        stamps.setdefault("w0", clock())
        pending = post(self, dst, head, payload)
        stamps.setdefault("w1", clock())
        return pending

    def timed_poll(self: Any, *args: Any) -> Any:
        stamps.setdefault("p", clock())
        return poll(self, *args)

    def timed_take(self: Any, head: bytes, payload_len: int) -> Any:
        got = take(self, head, payload_len)
        if got is not None:
            stamps.setdefault("d", clock())
        return got

    def timed_deliver(self: Any, key: Any, frame: Any) -> None:
        stamps.setdefault("d", clock())
        deliver(self, key, frame)

    tcp.TcpTransport.post = timed_post  # type: ignore[method-assign]
    tcp.TcpTransport.poll_payload = timed_poll  # type: ignore[method-assign]
    wire.BufferedFrameReader.take_staged = timed_take  # type: ignore[method-assign]
    base.Mailbox.deliver = timed_deliver  # type: ignore[method-assign]


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nbytes", type=int, default=8)
    p.add_argument("--iters", type=int, default=5000)
    args = p.parse_args()
    stamps: dict[str, float] = {}
    instrument(stamps)
    comm = await asynccoll.init(backend="tcp")
    a = np.zeros(max(1, args.nbytes // 4), np.float32)
    for _ in range(200):
        await comm.all_reduce(a)
    rows = []
    for _ in range(args.iters):
        stamps.clear()
        t0 = time.perf_counter()
        await comm.all_reduce(a)
        t1 = time.perf_counter()
        s = stamps
        if {"w0", "w1", "p", "d"} <= s.keys() and s["w1"] <= s["p"] <= s["d"]:
            rows.append((s["w0"] - t0, s["w1"] - s["w0"], s["p"] - s["w1"], s["d"] - s["p"],
                         t1 - s["d"], t1 - t0))
    med = [statistics.median(col) * 1e6 for col in zip(*rows, strict=True)] if rows else []
    text = "  ".join(f"{name} {m:.1f}" for name, m in zip(PHASES, med, strict=False))
    print(f"rank {comm.rank}, {len(rows)} calls polled (us, medians): {text}")
    await comm.close()


if __name__ == "__main__":
    run_event_loop(main())
