"""Pipeline-parallel training: an MLP cut into stages, one per rank (optionally replicated
data-parallel over a process mesh).

    asynccoll run -n 2 examples/train_pipeline.py                   # 2 stages, over TCP
    asynccoll run -n 4 examples/train_pipeline.py --data 2          # 2 replicas x 2 stages
    python examples/train_pipeline.py --local 4                     # 4 stages in one process
    python examples/train_pipeline.py --local 4 --schedule gpipe    # compare the peaks

Every rank draws the same batches (same seed). The first stage of each replica reads the
inputs, the last one the targets; activations and gradients travel between the stages
micro-batch by micro-batch. Rank 0 prints the mesh and the schedule's timeline, then the loss;
each stage reports the most micro-batches it held activations for: with 1F1B, stage ``i`` of
``P`` holds at most ``P - i``, with GPipe all of them.
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np

import asynccoll
from asynccoll.parallel import MLP, Adam, DistributedModel, split_batch
from asynccoll.parallel.mesh import Mesh
from asynccoll.parallel.pipeline import PipelineParallel, split_mlp, timeline

SIZES = [16, 64, 64, 64, 64, 1]          # 5 layers: up to 5 stages


async def train(comm: asynccoll.Communicator, args: argparse.Namespace) -> float:
    mesh = await Mesh.create(comm, data=args.data, pipe=-1)
    stages, micro = mesh.shape.pipe, args.micro_batches
    if comm.rank == 0:
        print(mesh.describe(), flush=True)
        print(f"\n{args.schedule} schedule, {stages} stages x {micro} micro-batches "
              f"(F = forward, B = backward of a micro-batch):", flush=True)
        print(timeline(args.schedule, stages, micro), flush=True)
    stage = split_mlp(MLP(SIZES, seed=0), stages)[mesh.coords.pipe]
    pp = PipelineParallel(stage, mesh.pipe, micro_batches=micro, schedule=args.schedule)
    dist = DistributedModel(pp, mesh.data, Adam(lr=3e-3))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((SIZES[0], 1)) / 4
    test_x = rng.standard_normal((256, SIZES[0]))
    test = (test_x, np.sin(test_x @ w))
    every = max(1, args.steps // 10)
    for step in range(args.steps):
        x = rng.standard_normal((args.batch, SIZES[0]))
        share = split_batch((x, np.sin(x @ w)), mesh.coords.data, mesh.shape.data)
        loss = await dist.step(share)
        if comm.rank == 0 and step % every == 0:
            print(f"step {step:4d}  loss {loss:.5f}", flush=True)
    final = await dist.loss(test)
    if comm.rank == 0:
        print(f"step {args.steps:4d}  loss {final:.5f} (test set)", flush=True)
    if mesh.coords.data == 0:
        print(f"stage {mesh.coords.pipe} of {stages}: {args.schedule} x{micro}, held at most "
              f"{pp.peak_activations} micro-batches (layers {stage.start}..{stage.stop - 1})",
              flush=True)
    return final


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", type=int, metavar="N", help="N ranks in this process")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--data", type=int, default=1, help="data-parallel replicas")
    args = parser.parse_args()
    if args.local:
        await asynccoll.run_local(lambda c: train(c, args), args.local)
        return
    async with await asynccoll.init(backend="tcp") as comm:
        await train(comm, args)


if __name__ == "__main__":
    asyncio.run(main())
