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

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from asynccoll import Communicator, ReduceOp
from asynccoll.parallel import as_distributed
from asynccoll.parallel.optim import SGD
from asynccoll.parallel.torch_model import TorchModel

torch = pytest.importorskip("torch")
nn = torch.nn

BACKENDS = ["memory", "tcp"]
W = 2


def tensors(rank: int) -> dict[str, Any]:
    """Tensors a user could hand to a collective, each made from ``rank``."""
    base = torch.arange(12, dtype=torch.float32) + rank
    return {
        "float32": base.clone(),
        "float16": base.half(),
        "bfloat16": base.bfloat16(),
        "int64": base.long(),
        "bool": base.long() % 2 == 0,
        "transposed": base.reshape(3, 4).T,
        "stepped": base[::2],
        "requires_grad": base.clone().requires_grad_(True),
        "view": base.clone()[2:8],
        "0-d": torch.tensor(float(rank)),
        "empty": torch.empty(0),
        "parameter": nn.Parameter(base.clone()),
        "numpy-shared": torch.from_numpy(np.arange(12.0) + rank),
        "meta-device": torch.empty(12, device="meta"),   # stands in for a CUDA tensor
    }


CALLS: dict[str, Callable[[Communicator, Any], Any]] = {
    "broadcast": lambda comm, t: comm.broadcast(t, root=0),
    "reduce": lambda comm, t: comm.reduce(t, root=1),
    "all_reduce": lambda comm, t: comm.all_reduce(t),
    "reduce_scatter": lambda comm, t: comm.reduce_scatter(t),
    "all_gather": lambda comm, t: comm.all_gather(t),
    "all_gather out=": lambda comm, t: comm.all_gather(np.zeros(24, np.float32), out=t),
    "gather": lambda comm, t: comm.gather(t, root=0),
    "all_to_all": lambda comm, t: comm.all_to_all([t] * comm.world_size),
}


@pytest.mark.parametrize("backend", BACKENDS)
async def test_torch_tensors_are_a_type_error_on_every_rank(run: Any, backend: str) -> None:
    """Every kind of tensor in every collective: a TypeError that says what to pass instead,
    on every rank, before anything is sent; then the communicator works (nothing stale)."""
    async def fn(comm: Communicator) -> list[str]:
        seen = []
        for call, make in CALLS.items():
            for kind, tensor in tensors(comm.rank).items():
                with pytest.raises(TypeError, match=r"torch\.Tensor") as info:
                    await make(comm, tensor)
                seen.append(f"{call} {kind}: {info.value}")
        a = np.full(5, comm.rank + 1.0)
        await comm.all_reduce(a)
        assert a.tolist() == [3.0] * 5
        return seen

    for seen in await run(fn, W, backend):
        assert len(seen) == len(CALLS) * len(tensors(0))
        for line in seen:
            call, _, message = line.partition(": ")
            if "meta-device" in call:
                assert "on meta" in message and ".cpu().numpy()" in message, line
            elif "bfloat16" in call:
                assert "bfloat16" in message, line
            else:
                assert ".numpy()" in message, line


@pytest.mark.parametrize("backend", BACKENDS)
async def test_torch_tensor_send_sends_nothing(run: Any, backend: str) -> None:
    """A refused send leaves nothing on the wire: the peer receives the next, valid one."""
    async def fn(comm: Communicator) -> Any:
        if comm.rank == 0:
            with pytest.raises(TypeError, match=r"torch\.Tensor"):
                await comm.send(torch.ones(3), 1)
            await comm.send(np.arange(4, dtype=np.int32), 1)
            return None
        return await comm.recv(0)

    got = (await run(fn, W, backend))[1]
    assert got.dtype == np.int32 and got.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_tensors_inside_objects_are_a_type_error_on_every_rank(run: Any, backend: str
                                                                     ) -> None:
    async def fn(comm: Communicator) -> list[Any]:
        with pytest.raises(TypeError, match="Tensor"):
            await comm.broadcast_object({"w": torch.ones(2)}, root=0)
        with pytest.raises(TypeError, match="Tensor"):
            await comm.all_gather_object([torch.tensor(comm.rank)])
        return await comm.all_gather_object(comm.rank)

    assert await run(fn, W, backend) == [[0, 1], [0, 1]]


NUMPY_VIEWS = ["float32", "float16", "int64", "bool", "view", "0-d", "empty", "parameter",
               "numpy-shared", "requires_grad"]


def numpy_view(tensor: Any) -> np.ndarray:
    return tensor.detach().numpy()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_numpy_views_of_tensors_work_in_place(run: Any, backend: str) -> None:
    """``tensor.numpy()`` of every kind NumPy can view: results land in the tensor (and in
    no other part of a larger tensor it is a view of), equal to a NumPy reference."""
    async def fn(comm: Communicator) -> None:
        for kind in NUMPY_VIEWS:
            ref = [numpy_view(tensors(r)[kind]).copy() for r in range(W)]
            logical = ref[0].dtype == bool
            total = (np.logical_or.reduce(ref) if logical
                     else np.sum(ref, axis=0).astype(ref[0].dtype))
            op = ReduceOp.BOR if logical else ReduceOp.SUM

            t = tensors(comm.rank)[kind]
            a = numpy_view(t)
            assert await comm.all_reduce(a, op=op) is a
            assert np.array_equal(numpy_view(t), total), kind

            t = tensors(comm.rank)[kind]
            await comm.broadcast(numpy_view(t), root=1)
            assert np.array_equal(numpy_view(t), ref[1]), kind

            t = tensors(comm.rank)[kind]
            await comm.reduce(numpy_view(t), root=0, op=op)
            assert np.array_equal(numpy_view(t), total if comm.rank == 0 else ref[comm.rank])

            a = numpy_view(tensors(comm.rank)[kind])
            gathered = await comm.gather(a, root=1)
            if comm.rank == 1:
                assert all(np.array_equal(g, r) for g, r in zip(gathered, ref, strict=True))
            got = await comm.all_to_all([a] * W)
            assert all(np.array_equal(g, r) for g, r in zip(got, ref, strict=True)), kind
            if a.ndim:
                assert np.array_equal(await comm.all_gather(a), np.concatenate(ref)), kind
                if not logical:
                    block = await comm.reduce_scatter(a)
                    assert np.array_equal(block, np.array_split(total, W)[comm.rank]), kind

        # the rest of a larger tensor is left alone
        big = torch.arange(20, dtype=torch.float64) + comm.rank
        await comm.all_reduce(big[5:15].numpy())
        expect = np.arange(20.0) + comm.rank
        expect[5:15] = 2 * np.arange(5.0, 15.0) + 1
        assert np.array_equal(big.numpy(), expect)

    await run(fn, W, backend)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_non_contiguous_tensor_views_are_a_type_error(run: Any, backend: str) -> None:
    async def fn(comm: Communicator) -> None:
        for kind in ("transposed", "stepped"):
            t = tensors(comm.rank)[kind]
            before = t.clone()
            with pytest.raises(TypeError, match="C-contiguous"):
                await comm.all_reduce(t.numpy())
            assert torch.equal(t, before)
            # what the message suggests works, on a copy
            c = np.ascontiguousarray(t.numpy())
            await comm.all_reduce(c)
            assert np.array_equal(c, sum(tensors(r)[kind].numpy() for r in range(W)))

    await run(fn, W, backend)


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


# ----------------------------------------------------------------------- TorchModel + DDP

class OddParams(nn.Module):
    """Parameters and buffers of every awkward kind: transposed and stepped (non-contiguous),
    two views of one tensor, a NumPy array's memory, 0-d, empty; a transposed buffer and an
    expanded one (stride 0)."""

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(0)

        def rand(*shape: int) -> Any:
            return torch.from_numpy(rng.uniform(-0.5, 0.5, shape).astype(np.float32))

        self.w_t = nn.Parameter(rand(4, 3).T)                   # (3, 4), non-contiguous
        self.w_step = nn.Parameter(rand(3, 6)[:, ::2])          # (3, 3), stepped
        big = rand(6)
        self.b1, self.b2 = nn.Parameter(big[:3]), nn.Parameter(big[3:])
        self.w_np = nn.Parameter(torch.from_numpy(np.eye(3, dtype=np.float32)))
        self.scale = nn.Parameter(torch.tensor(1.25))
        self.nothing = nn.Parameter(torch.empty(0))
        self.register_buffer("shift_t", rand(3, 2).T)           # (2, 3), non-contiguous
        self.register_buffer("shift_x", rand(1, 3).expand(2, 3))

    def forward(self, x: Any) -> Any:
        h = torch.tanh(x @ self.w_t.T + self.b1)
        h = torch.tanh(h @ self.w_step.T + self.b2) @ self.w_np
        return h * self.scale + self.nothing.sum() + (self.shift_t + self.shift_x).sum(0)


def loss_fn(out: Any, target: Any) -> Any:
    return ((out - target) ** 2).mean()


def odd_batches(rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(10 + rank)
    return [(rng.standard_normal((5, 4)).astype(np.float32),
             rng.standard_normal((5, 3)).astype(np.float32)) for _ in range(3)]


def plain_torch_reference() -> dict[str, np.ndarray]:
    """SGD on the gradient averaged over the ranks' batches, in plain torch."""
    module = OddParams()
    per_rank = [odd_batches(r) for r in range(W)]
    for step in range(3):
        module.zero_grad()
        for batches in per_rank:
            x, y = batches[step]
            (loss_fn(module(torch.from_numpy(x)), torch.from_numpy(y)) / W).backward()
        with torch.no_grad():
            for p in module.parameters():
                p -= 0.1 * p.grad
    return {n: p.detach().numpy().copy() for n, p in module.named_parameters()}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
async def test_torch_module_with_odd_parameters_trains_as_plain_torch(run: Any,
                                                                       strategy: str) -> None:
    async def fn(comm: Communicator) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        module = OddParams()
        with TorchModel(module, loss_fn, units=[module]) as model:
            dist = as_distributed(model, comm, SGD(lr=0.1), strategy=strategy)
            for batch in odd_batches(comm.rank):
                await dist.step(batch)
            full = await dist.full_parameters()
            if strategy != "zero3":          # the module holds the trained values itself
                for name, p in module.named_parameters():
                    assert np.array_equal(p.detach().numpy(), full[name]), name
            await dist.sync_buffers()
            return full, {n: b.numpy().copy() for n, b in module.named_buffers()}

    ref = plain_torch_reference()
    results = await run(fn, W, "memory")
    for params, buffers in results:
        assert set(params) == set(ref)
        for name, value in ref.items():
            np.testing.assert_allclose(params[name], value, rtol=1e-5, atol=1e-6,
                                       err_msg=name)
        for name, value in OddParams().named_buffers():
            assert np.array_equal(buffers[name], value.numpy()), name


def test_torch_model_refuses_what_numpy_cannot_hold() -> None:
    """Clear errors when the model is built (not in the middle of a collective)."""
    with pytest.raises(ValueError, match="is on meta; TorchModel needs CPU tensors"):
        TorchModel(nn.Linear(2, 2, device="meta"), loss_fn)
    with pytest.raises(TypeError, match="bfloat16, which NumPy does not have"):
        TorchModel(nn.Linear(2, 2).bfloat16(), loss_fn)
    module = nn.Linear(2, 2)
    module.register_buffer("stat", torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"buffer 'stat' has dtype torch\.bfloat16"):
        TorchModel(module, loss_fn)
    module = copy.deepcopy(nn.Linear(2, 2))
    module.register_buffer("stat", torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match="buffer 'stat' is on meta"):
        TorchModel(module, loss_fn)
