"""Step time, bytes sent and memory held per data-parallel strategy, for one model.

    asynccoll run -n 2 benchmarks/strategies.py                  # processes over TCP
    asynccoll run -n 4 benchmarks/strategies.py --sizes 512,2048,2048,512 --json out.json
    python benchmarks/strategies.py --local 2                    # ranks in one process

Every strategy (and DDP with each gradient compression) trains the same NumPy MLP on the same
data for a few warm-up steps, then ``--steps`` timed ones. Reported per rank-0 step: median
time, payload bytes this rank sent (the transport's own count) and the bytes it holds for
parameters, gradients and optimizer state (the wrapper's accounting), plus the peak of
gathered ZeRO-3 parameters. Times on a shared machine move between runs: compare rows of one
run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

import asynccoll
from asynccoll.parallel import MLP, Adam, as_distributed, split_batch

VARIANTS: list[tuple[str, str | None]] = [
    ("ddp", None), ("zero1", None), ("zero2", None), ("zero3", None),
    ("ddp", "fp16"), ("ddp", "int8"), ("ddp", "topk:0.01"),
]


async def measure(comm: asynccoll.Communicator, sizes: list[int], steps: int, batch: int,
                  strategy: str, compression: str | None) -> dict[str, Any]:
    model = MLP(sizes, seed=0, dtype=np.float32)
    dist = as_distributed(model, comm, Adam(lr=1e-4), strategy=strategy,
                          compression=compression)
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
    y = rng.standard_normal((batch, sizes[-1])).astype(np.float32)
    mine = split_batch((x, y), comm.rank, comm.world_size)
    for _ in range(2):
        await dist.step(mine)
    times, sent = [], []
    for _ in range(steps):
        await comm.barrier()
        before = comm.transport.bytes_sent
        t = time.perf_counter()
        await dist.step(mine)
        times.append(time.perf_counter() - t)
        sent.append(comm.transport.bytes_sent - before)
    mem = dist.memory()
    return {"strategy": strategy, "compression": compression or "-",
            "step_ms": float(np.median(times)) * 1e3, "sent_MB": float(np.median(sent)) / 1e6,
            "held_MB": mem.held / 1e6, "params_MB": mem.params / 1e6,
            "grads_MB": mem.grads / 1e6, "optimizer_MB": mem.optimizer / 1e6,
            "gathered_peak_MB": mem.gathered_peak / 1e6}


async def run_all(comm: asynccoll.Communicator, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for strategy, comp in VARIANTS:
        rows.append(await measure(comm, args.sizes, args.steps, args.batch, strategy, comp))
    return rows


def table(rows: list[dict[str, Any]], world_size: int, nbytes: int) -> str:
    head = ["strategy", "compression", "step_ms", "sent_MB", "held_MB", "params_MB",
            "grads_MB", "optimizer_MB", "gathered_peak_MB"]
    lines = [f"# {world_size} ranks, model {nbytes / 1e6:.2f} MB of float32 parameters",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[h]:.2f}" if isinstance(r[h], float) else str(r[h])
                                       for h in head) + " |")
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", type=int, metavar="N", help="N ranks in this process")
    parser.add_argument("--sizes", default="256,1024,1024,1024,256",
                        type=lambda s: [int(v) for v in s.split(",")])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    if args.local:
        results = await asynccoll.run_local(lambda c: run_all(c, args), args.local,
                                            backend="memory")
        rows, world = results[0], args.local
    else:
        async with await asynccoll.init(backend="tcp") as comm:
            rows, world = await run_all(comm, args), comm.world_size
            if comm.rank != 0:
                return
    nbytes = sum(a * b + b for a, b in zip(args.sizes, args.sizes[1:], strict=False)) * 4
    print(table(rows, world, nbytes), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(  # noqa: ASYNC240
            {"world_size": world, "sizes": args.sizes, "rows": rows}, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
