"""Training in one process, the way the distributed wrappers train: the reference they equal.

``train_locally`` binds a model to one flat parameter buffer and one flat gradient buffer
and applies a flat optimizer after every whole batch, exactly the arithmetic of
``DistributedModel`` with one rank. Tests and examples compare a
distributed run (any strategy, world size, pipeline or tensor split) with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .layout import FlatLayout
from .model import Model
from .optim import Optimizer


async def train_locally(model: Model, optimizer: Optimizer, batches: Iterable[Any]
                        ) -> tuple[list[float], np.ndarray]:
    """Train ``model`` alone on each of ``batches`` in turn (forward, backward, one optimizer
    step). Returns the losses and the final parameters, flat, in ``param_specs`` order.

    The model is left bound to the flat buffers (its ``parameters()`` are views of the
    returned array).
    """
    lay = FlatLayout(model.param_specs(), 1, 0)
    current = model.parameters()
    params = np.empty(lay.size, lay.dtype)
    for s in lay.specs:
        a, b = lay.offsets[s.name]
        params[a:b] = np.asarray(current[s.name]).reshape(-1)
    grads = np.zeros_like(params)
    model.bind(params=lay.views(params), grads=lay.views(grads))
    losses = []
    for batch in batches:
        grads.fill(0)
        losses.append(await model.forward_backward(batch))
        optimizer.step(params, grads)
    return losses, params


def flat_parameters(model: Model) -> np.ndarray:
    """The model's parameters end to end, in ``param_specs`` order (a new array)."""
    current = model.parameters()
    return np.concatenate([np.asarray(current[s.name]).reshape(-1) for s in model.param_specs()])


__all__ = ["flat_parameters", "train_locally"]
