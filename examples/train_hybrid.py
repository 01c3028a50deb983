"""Hybrid 3D training: data parallel x pipeline parallel x tensor parallel, one configuration.

    asynccoll run -n 8 examples/train_hybrid.py                  # 2 x 2 x 2 over TCP
    asynccoll run -n 4 examples/train_hybrid.py --data 1         # 1 x 2 x 2
    python examples/train_hybrid.py --local 8                    # ranks in one process

The model is a NumPy MLP; it is cut into ``--pipe`` stages, each stage's layers are split
Megatron-style over ``--tensor`` ranks, and ``--data`` replicas of that pipeline train on their
share of every batch with the chosen data-parallel strategy. Every rank prints its place in
the mesh; rank 0 prints the loss, and at the end the script checks the result against the
same steps in one process.
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np

import asynccoll
from asynccoll.parallel import MLP, Adam, train_locally
from asynccoll.parallel.hybrid import Hybrid

SIZES = [16, 64, 64, 64, 64, 4]


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    x = rng.standard_normal((32, SIZES[0]))
    return x, np.sin(x[:, :SIZES[-1]])


async def one_process(steps: int) -> np.ndarray:
    _, params = await train_locally(MLP(SIZES, seed=0), Adam(lr=3e-3),
                                    (batch(step) for step in range(steps)))
    return params


async def train(comm: asynccoll.Communicator, args: argparse.Namespace) -> None:
    hybrid = await Hybrid.create(comm, MLP(SIZES, seed=0), data=args.data, pipe=args.pipe,
                                 tensor=args.tensor, optimizer=Adam(lr=3e-3),
                                 strategy=args.strategy, micro_batches=args.micro_batches,
                                 schedule=args.schedule)
    c = hybrid.mesh.coords
    print(f"rank {comm.rank}: data {c.data} pipe {c.pipe} tensor {c.tensor}, layers "
          f"{hybrid.layers[c.pipe][0]}..{hybrid.layers[c.pipe][1] - 1}", flush=True)
    for step in range(args.steps):
        loss = await hybrid.step(batch(step))
        if comm.rank == 0 and step % 20 == 0:
            print(f"step {step:3d}  loss {loss:.5f}", flush=True)
    full = await hybrid.full_parameters()
    if comm.rank == 0:
        got = np.concatenate([full[s.name].reshape(-1) for s in MLP(SIZES).param_specs()])
        want = await one_process(args.steps)
        err = float(np.max(np.abs(got - want) / (np.abs(want) + 1e-12)))
        print(f"final loss {loss:.5f}; largest relative difference to one process "
              f"{err:.1e}", flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", type=int, metavar="N", help="N ranks in this process")
    parser.add_argument("--data", type=int, default=-1, help="data-parallel size (-1: the rest)")
    parser.add_argument("--pipe", type=int, default=2)
    parser.add_argument("--tensor", type=int, default=2)
    parser.add_argument("--strategy", default="zero1", choices=["ddp", "zero1", "zero2", "zero3"])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if args.local:
        await asynccoll.run_local(lambda c: train(c, args), args.local)
        return
    async with await asynccoll.init(backend="tcp") as comm:
        await train(comm, args)


if __name__ == "__main__":
    asyncio.run(main())
