"""Process meshes: every rank's data / pipe / tensor groups hold exactly the right ranks, the
three dimensions communicate at once without mixing data, and bad shapes are refused."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import BACKENDS, run_world

from asynccoll import Communicator
from asynccoll.parallel.mesh import DIMS, Mesh, MeshCoords, MeshShape

SHAPES = [(8, 2, 2, 2), (4, 1, 2, 2), (4, 2, 1, 2), (6, 3, 2, 1), (6, 1, 3, 2), (2, 1, 1, 2),
          (1, 1, 1, 1)]


def expected(world: int, d: int, p: int, t: int, rank: int) -> dict[str, list[int]]:
    """Brute force: the ranks that differ from ``rank`` only along each dimension."""
    coords = {r: ((r // t) // p, (r // t) % p, r % t) for r in range(world)}
    mine = coords[rank]
    out = {}
    for axis, dim in enumerate(DIMS):
        members = [r for r in range(world)
                   if all(coords[r][a] == mine[a] for a in range(3) if a != axis)]
        out[dim] = sorted(members, key=lambda r: coords[r][axis])
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("world", "d", "p", "t"), SHAPES)
async def test_groups_hold_the_right_ranks(backend: str, world: int, d: int, p: int,
                                           t: int) -> None:
    async def rank(comm: Communicator) -> None:
        mesh = await Mesh.create(comm, data=d, pipe=p, tensor=t)
        assert mesh.shape == (d, p, t)
        r = comm.rank
        assert mesh.coords == MeshCoords((r // t) // p, (r // t) % p, r % t)
        assert mesh.shape.rank_of(*mesh.coords) == r
        want = expected(world, d, p, t, r)
        for dim in DIMS:
            group = mesh.comm(dim)
            assert group is getattr(mesh, dim)
            assert group.world_size == getattr(mesh.shape, dim)
            assert group.rank == getattr(mesh.coords, dim)
            members = await group.all_gather_object(comm.rank)
            assert members == want[dim] == mesh.ranks(dim), (dim, members, want[dim])
        marked = [line for line in mesh.describe().splitlines() if line.startswith("*")]
        assert len(marked) == 1 and marked[0].startswith(f"*{r:5d}  {tuple(mesh.coords)}")
        await mesh.close()

    await run_world(rank, world, backend)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_three_dimensions_communicate_at_once(backend: str) -> None:
    """All-reduces on the data, pipe and tensor groups in flight together: each sums only
    its own group's ranks."""
    async def rank(comm: Communicator) -> None:
        mesh = await Mesh.create(comm, data=-1, pipe=2, tensor=2)
        assert mesh.shape == (2, 2, 2)
        arrays = {dim: np.full(1000, float(comm.rank) * (i + 1) + 1000 * i)
                  for i, dim in enumerate(DIMS)}
        for _ in range(3):
            got = dict(zip(DIMS, await asyncio.gather(
                *(mesh.comm(dim).all_reduce(arrays[dim].copy()) for dim in DIMS)), strict=True))
            for i, dim in enumerate(DIMS):
                members = mesh.ranks(dim)
                want = sum(float(r) * (i + 1) + 1000 * i for r in members)
                np.testing.assert_array_equal(got[dim], np.full(1000, want))

    await run_world(rank, 8, backend)


def test_shape_arithmetic() -> None:
    shape = MeshShape.resolve(24, data=-1, pipe=3, tensor=4)
    assert shape == (2, 3, 4) and shape.size == 24
    for r in range(24):
        assert shape.rank_of(*shape.coords_of(r)) == r
    assert shape.group("tensor", 5) == [4, 5, 6, 7]          # tensor ranks are neighbours
    assert shape.group("pipe", 5) == [1, 5, 9]
    assert shape.group("data", 5) == [5, 17]
    assert len(shape.groups("pipe")) == 8
    assert sorted(r for g in shape.groups("data") for r in g) == list(range(24))
    assert MeshShape.resolve(6, tensor=-1) == (1, 1, 6)


@pytest.mark.parametrize(("world", "sizes", "match"), [
    (8, {"data": 2, "pipe": 2}, "4 ranks, but the world has 8"),
    (2, {}, "1 ranks, but the world has 2"),
    (6, {"data": -1, "pipe": 4}, "cannot infer"),
    (4, {"data": -1, "pipe": -1}, "only one"),
    (4, {"data": 0, "pipe": 4}, "positive"),
    (4, {"tensor": 2.0}, "int"),
    (4, {"pipe": True, "data": 4}, "int"),
])
def test_bad_shapes_raise(world: int, sizes: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MeshShape.resolve(world, **sizes)


async def test_bad_shapes_raise_before_communicating() -> None:
    async def rank(comm: Communicator) -> None:
        with pytest.raises(ValueError, match="world has 4"):
            await Mesh.create(comm, data=3)
        with pytest.raises(ValueError, match="mesh dimension"):
            MeshShape.resolve(4, data=4).group("model", 0)
        mesh = await Mesh.create(comm, data=-1)          # still usable afterwards
        assert mesh.shape == (4, 1, 1)
        with pytest.raises(ValueError, match="other dimensions"):
            mesh.ranks("data", data=1)
        assert mesh.ranks("data", pipe=0) == [0, 1, 2, 3]

    await run_world(rank, 4, "memory")


async def test_ranks_that_disagree_on_the_shape_all_raise() -> None:
    async def rank(comm: Communicator) -> str:
        sizes = {"data": 2, "pipe": 2} if comm.rank else {"pipe": 4}
        with pytest.raises(ValueError, match="different mesh shapes") as info:
            await Mesh.create(comm, **sizes)
        return str(info.value)

    got = await run_world(rank, 4, "memory")
    assert all("rank 0: (1, 4, 1)" in g and "rank 1: (2, 2, 1)" in g for g in got)
