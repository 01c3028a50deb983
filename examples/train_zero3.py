"""Fully sharded training (ZeRO-3 / FSDP): each rank keeps 1/W of the parameters, gradients
and optimizer state, and gathers a layer's parameters only while the layer runs.

    asynccoll run -n 2 examples/train_zero3.py
    python examples/train_zero3.py --local 4

It prints what each rank holds against what plain DDP would hold, then saves a checkpoint
that any number of ranks (or one plain process) can load.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile

import numpy as np

import asynccoll
from asynccoll.parallel import (
    MLP,
    AdamW,
    as_distributed,
    load_parameters,
    save_checkpoint,
    split_batch,
)

SIZES = [32, 256, 256, 256, 10]


async def train(comm: asynccoll.Communicator, steps: int, ckpt: str | None) -> None:
    model = MLP(SIZES, loss="cross_entropy", activation="relu", seed=0)
    dist = as_distributed(model, comm, AdamW(lr=1e-3), strategy="zero3")
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((10, SIZES[0])) * 2
    for step in range(steps):
        labels = rng.integers(0, 10, 128)
        x = centers[labels] + rng.standard_normal((128, SIZES[0]))
        loss = await dist.step(split_batch((x, labels), comm.rank, comm.world_size))
        if comm.rank == 0 and step % 25 == 0:
            print(f"step {step:4d}  loss {loss:.4f}", flush=True)
    mem = dist.memory()
    ddp = 4 * dist.layout.nbytes          # params + grads + AdamW's two buffers, replicated
    print(f"rank {comm.rank}: holds {mem.held / 1e6:.2f} MB (DDP would hold "
          f"{ddp / 1e6:.2f} MB), at most {mem.gathered_peak / 1e6:.2f} MB gathered at once",
          flush=True)
    if ckpt:
        await save_checkpoint(dist, ckpt)
        if comm.rank == 0:
            params = load_parameters(ckpt)
            print(f"checkpoint in {ckpt}: {len(params)} arrays, "
                  f"{sum(p.size for p in params.values())} parameters", flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", type=int, metavar="N", help="N ranks in this process")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--checkpoint", help="directory to save to (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or f"{tmp}/ckpt"
        if args.local:
            await asynccoll.run_local(lambda c: train(c, args.steps, ckpt), args.local)
            return
        async with await asynccoll.init(backend="tcp") as comm:
            # every rank must write to the same directory: rank 0 chooses it
            ckpt = await comm.broadcast_object(ckpt, root=0)
            await train(comm, args.steps, ckpt)


if __name__ == "__main__":
    asyncio.run(main())
