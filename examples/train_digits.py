"""Data-parallel training (DDP) on a real data set: scikit-learn's handwritten digits.

    asynccoll run -n 2 examples/train_digits.py           # 2 processes over TCP
    python examples/train_digits.py --local 4             # 4 ranks as coroutines of one process

The 1797 8x8 images ship inside scikit-learn (no download): 1438 train the network, the other
359 test it. A NumPy MLP 64-64-10 (ReLU, cross-entropy) learns with Adam on global batches of
32 images; each rank takes its share of every batch (``split_batch``) and DDP averages the
gradients, so the ranks stay identical and, up to rounding, the result does not depend on the
number of ranks. At
the end every rank scores its share of the test images and one ``all_reduce`` adds up the
counts.

With the defaults (20 epochs, seed 0) it reaches a **test accuracy of 0.986** (354 of 359
images) with 1, 2 or 4 ranks and 0.983 with 3 (the average gradient is summed in another
order, so the rounding differs), after well under a second of training on a 2-core machine;
seeds 1-4 give 0.969-0.981, and ``--epochs 3`` gives 0.950. Rank 0 shows a progress bar
(tqdm when it is installed, a plain one otherwise).

Needs scikit-learn (``pip install scikit-learn``; it is part of the ``test`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

import asynccoll
from asynccoll.parallel import MLP, Adam, as_distributed, split_batch

SIZES = [64, 64, 10]
TEST_FRACTION = 0.2


def load(seed: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """(train, test) pairs of (images scaled to [0, 1], integer labels): the same on every
    rank, since every rank draws the permutation from the same seed."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = digits.data.astype(np.float64) / 16.0
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = round(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


class PlainBar:
    """A progress bar for when tqdm is not installed: one line per update of ``set``."""

    def __init__(self, total: int, desc: str, width: int = 30) -> None:
        self.total, self.desc, self.width, self.n = total, desc, width, 0
        self.postfix = ""

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def close(self) -> None:
        done = self.width * self.n // max(self.total, 1)
        print(f"{self.desc} [{'#' * done}{'.' * (self.width - done)}] {self.n}/{self.total} "
              f"{self.postfix}", flush=True)


def progress_bar(total: int, desc: str) -> Any:
    """tqdm when it is installed, else :class:`PlainBar`."""
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainBar(total, desc)
    return tqdm(total=total, desc=desc, file=sys.stdout, leave=True, mininterval=0.2,
                dynamic_ncols=True)


def batches(n: int, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    order = rng.permutation(n)
    for start in range(0, n, batch_size):
        yield order[start:start + batch_size]


async def train(comm: asynccoll.Communicator, *, epochs: int, batch_size: int, lr: float,
                seed: int, quiet: bool = False) -> float:
    (x, y), (x_test, y_test) = load(seed)
    model = MLP(SIZES, activation="relu", loss="cross_entropy", seed=seed)
    dist = as_distributed(model, comm, Adam(lr=lr), strategy="ddp")
    rng = np.random.default_rng(seed + 1)      # the same shuffles on every rank
    steps_per_epoch = -(-len(y) // batch_size)
    show = comm.rank == 0 and not quiet
    started = time.perf_counter()
    for epoch in range(epochs):
        bar = progress_bar(steps_per_epoch, f"epoch {epoch + 1:2d}/{epochs}") if show else None
        losses = []
        for idx in batches(len(y), batch_size, rng):
            if len(idx) < comm.world_size:     # every rank needs at least one sample
                continue
            share = split_batch((x[idx], y[idx]), comm.rank, comm.world_size)
            losses.append(await dist.step(share))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.set_postfix_str(f"loss {np.mean(losses):.4f}")
            bar.close()
    seconds = time.perf_counter() - started

    # every rank scores its share of the test set; one all_reduce adds the counts up
    xs, ys = split_batch((x_test, y_test), comm.rank, comm.world_size)
    correct = int(np.sum(np.argmax(model.predict(xs), axis=1) == ys))
    counts = await comm.all_reduce(np.array([correct, len(ys)], dtype=np.int64))
    accuracy = float(counts[0] / counts[1])
    print(f"rank {comm.rank}: test accuracy {accuracy:.3f} ({counts[0]} of {counts[1]}) "
          f"after {epochs} epochs, {dist.steps} steps, {seconds:.1f} s", flush=True)
    return accuracy


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", type=int, metavar="N",
                        help="run N ranks as coroutines of this process (memory backend)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args()
    options = dict(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                   quiet=args.quiet)
    if args.local:
        await asynccoll.run_local(lambda comm: train(comm, **options), args.local)
        return
    async with await asynccoll.init(backend="tcp") as comm:
        await train(comm, **options)


if __name__ == "__main__":
    asyncio.run(main())
