"""PyTorch tensors given to asynccoll, everywhere a user could pass them.

The contract (API.md, docs/collectives.md): collectives take NumPy arrays. A torch tensor is
a ``TypeError`` raised before anything is sent, on every rank that passes one, and the
communicator goes on; its NumPy view (``tensor.numpy()``, which shares the tensor's memory)
works in place, so the result lands in the tensor. ``TorchModel`` and the data-parallel
wrappers take torch modules whose parameters and buffers are views, non-contiguous, 0-d or
empty, and train them as plain torch does; what they cannot take (a tensor not on the CPU, a
dtype NumPy lacks) is refused when the model is built.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from asynccoll import Communicator

BACKENDS = ["memory", "tcp"]
W = 2


# ------------------------------------------------------------------ NumPy array subclasses

@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("backend", BACKENDS)
async def test_numpy_matrix_is_a_type_error_before_anything_is_sent(run: Any, backend: str
                                                                    ) -> None:
    """A numpy.matrix stays 2-D when flattened: large all_reduces and reduces, and
    reduce_scatter, failed halfway (memoryview/reshape errors on one rank, the world broken
    for the others). It is refused up front on every rank; the communicator goes on."""
    async def fn(comm: Communicator) -> None:
        big = np.matrix(np.ones((256, 256), np.float32))      # 256 KiB: ring / direct
        small = np.matrix(np.ones((4, 6), np.float32))
        for call in (lambda: comm.all_reduce(big), lambda: comm.reduce(big, root=0),
                     lambda: comm.reduce_scatter(small), lambda: comm.all_reduce(small),
                     lambda: comm.all_gather(small), lambda: comm.gather(small),
                     lambda: comm.all_to_all([small] * W)):
            with pytest.raises(TypeError, match=r"numpy\.matrix"):
                await call()
        a = np.asarray(big).copy()
        await comm.all_reduce(a)
        assert (a == 2).all()

    await run(fn, W, backend)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_other_ndarray_subclasses_work_in_place(run: Any, backend: str,
                                                      tmp_path: Any) -> None:
    async def fn(comm: Communicator) -> None:
        mm = np.memmap(tmp_path / f"r{comm.rank}", np.float32, "w+", shape=(256, 256))
        mm[...] = comm.rank + 1
        assert await comm.all_reduce(mm) is mm
        assert (np.asarray(mm) == 3).all()
        rec = np.arange(24.0).reshape(4, 6).view(np.recarray)
        block = await comm.reduce_scatter(rec)
        assert np.array_equal(block, np.array_split(2 * np.arange(24.0).reshape(4, 6),
                                                    W)[comm.rank])

    await run(fn, W, backend)
