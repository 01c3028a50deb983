"""Data-parallel training (DDP) of a small network, every rank on its share of each batch.

    asynccoll run -n 2 examples/train_ddp.py              # processes over TCP
    asynccoll run -n 2 examples/train_ddp.py --torch      # the same with a torch.nn model
    python examples/train_ddp.py --local 4                # 4 ranks as coroutines of one process

Every rank draws the same batches (same seed) and trains on its slice; DDP averages the
gradients, so all ranks take the same steps and end with the same parameters, those one
process would reach on the whole batches.
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np

import asynccoll
from asynccoll.parallel import MLP, Adam, Model, as_distributed, split_batch

SIZES = [16, 64, 64, 1]


def make_model(use_torch: bool) -> Model:
    if not use_torch:
        return MLP(SIZES, seed=0)
    import torch

    from asynccoll.parallel import TorchModel

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                              torch.nn.Linear(64, 64), torch.nn.Tanh(),
                              torch.nn.Linear(64, 1)).double()
    return TorchModel(net, torch.nn.functional.mse_loss)


async def train(comm: asynccoll.Communicator, steps: int, use_torch: bool) -> float:
    model = make_model(use_torch)
    dist = as_distributed(model, comm, Adam(lr=3e-3), strategy="ddp")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((SIZES[0], 1)) / 4
    test_x = rng.standard_normal((256, SIZES[0]))
    test = (test_x, np.sin(test_x @ w))
    for step in range(steps):
        x = rng.standard_normal((64, SIZES[0]))
        loss = await dist.step(split_batch((x, np.sin(x @ w)), comm.rank, comm.world_size))
        if comm.rank == 0 and step % 50 == 0:
            print(f"step {step:4d}  loss on rank 0's share {loss:.5f}", flush=True)
    final = await dist.loss(test)
    print(f"rank {comm.rank}: test loss after {steps} steps {final:.5f}", flush=True)
    if hasattr(model, "close"):
        model.close()
    return final


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", type=int, metavar="N", help="N ranks in this process")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--torch", action="store_true", help="train a torch.nn model")
    args = parser.parse_args()
    if args.local:
        await asynccoll.run_local(lambda c: train(c, args.steps, args.torch), args.local)
        return
    async with await asynccoll.init(backend="tcp") as comm:
        await train(comm, args.steps, args.torch)


if __name__ == "__main__":
    asyncio.run(main())
