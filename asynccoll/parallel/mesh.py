"""Process meshes: the ranks of a world laid out as ``data x pipe x tensor``.

Model parallelism splits one model over several ranks (its layers over a *pipeline*, each
layer's matrices over a *tensor* group), and data parallelism replicates the result. A
``Mesh`` gives every rank one communicator per dimension, so that the three kinds of
parallelism compose: a rank all-reduces its gradients with the ranks that hold the same part of
the model (``mesh.data``), passes activations to the next stage of its pipeline
(``mesh.pipe``), and sums partial products with the ranks that share its layers
(``mesh.tensor``).

The tensor dimension is the innermost, as in Megatron-LM: with ``D x P x T`` ranks, the rank
at coordinates ``(d, p, t)`` is ``(d * P + p) * T + t``, so tensor-parallel ranks (which talk
at every layer) are neighbours, likely on one machine, and data-parallel ranks (which talk once
per step) are the furthest apart. For ``2 x 2 x 2``:

    rank  (d, p, t)     data group   pipe group   tensor group
      0   (0, 0, 0)      [0, 4]       [0, 2]       [0, 1]
      1   (0, 0, 1)      [1, 5]       [1, 3]       [0, 1]
      2   (0, 1, 0)      [2, 6]       [0, 2]       [2, 3]
      ...
      7   (1, 1, 1)      [3, 7]       [5, 7]       [6, 7]

``MeshShape`` holds the arithmetic (no communication); ``Mesh.create`` builds the
sub-communicators with ``comm.new_group`` on every rank.

>>> shape = MeshShape.resolve(8, data=2, pipe=2, tensor=2)
>>> shape.rank_of(1, 0, 1), shape.coords_of(5)
(5, MeshCoords(data=1, pipe=0, tensor=1))
>>> shape.group("pipe", 5)
[5, 7]
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

from ..collectives import Communicator

#: The dimensions, outermost first (the tensor dimension is the innermost).
DIMS: tuple[str, ...] = ("data", "pipe", "tensor")


class MeshCoords(NamedTuple):
    """A rank's position in the mesh: its index along each dimension."""

    data: int
    pipe: int
    tensor: int


class MeshShape(NamedTuple):
    """The sizes of the three dimensions, and the rank arithmetic (no communication).

    Compares equal to a plain tuple: ``MeshShape(2, 2, 2) == (2, 2, 2)``.
    """

    data: int
    pipe: int
    tensor: int

    @classmethod
    def resolve(cls, world_size: int, *, data: int = 1, pipe: int = 1, tensor: int = 1
                ) -> MeshShape:
        """The shape of a mesh of ``world_size`` ranks. One dimension may be ``-1``: it is
        inferred as ``world_size`` divided by the other two.

        Raises:
            ValueError: a size is not a positive int (or ``-1``), several are ``-1``, or
                their product is not ``world_size``.
        """
        world_size = operator.index(world_size)
        if world_size < 1:
            raise ValueError(f"world_size must be positive, got {world_size}")
        sizes: dict[str, int] = {}
        for dim, value in zip(DIMS, (data, pipe, tensor), strict=True):
            if isinstance(value, bool):
                raise ValueError(f"mesh {dim} size must be an int, got {value!r}")
            try:
                size = operator.index(value)
            except TypeError:
                raise ValueError(f"mesh {dim} size must be an int, got {value!r}") from None
            if size < 1 and size != -1:
                raise ValueError(f"mesh {dim} size must be positive (or -1 to infer it), "
                                 f"got {size}")
            sizes[dim] = size
        inferred = [dim for dim, size in sizes.items() if size == -1]
        if len(inferred) > 1:
            raise ValueError(f"only one mesh dimension may be -1 (inferred), got "
                             f"{', '.join(inferred)}")
        if inferred:
            known = 1
            for size in sizes.values():
                if size != -1:
                    known *= size
            if world_size % known:
                raise ValueError(f"cannot infer the {inferred[0]} size: {world_size} ranks "
                                 f"do not divide by {known}")
            sizes[inferred[0]] = world_size // known
        shape = cls(**sizes)
        if shape.size != world_size:
            raise ValueError(f"mesh data={shape.data} x pipe={shape.pipe} x tensor="
                             f"{shape.tensor} has {shape.size} ranks, but the world has "
                             f"{world_size}")
        return shape

    @property
    def size(self) -> int:
        """Number of ranks: ``data * pipe * tensor``."""
        return self.data * self.pipe * self.tensor

    def rank_of(self, data: int, pipe: int, tensor: int) -> int:
        """The rank at these coordinates: ``(data * P + pipe) * T + tensor``."""
        for dim, value in zip(DIMS, (data, pipe, tensor), strict=True):
            if not 0 <= value < getattr(self, dim):
                raise ValueError(f"{dim} coordinate {value} is out of range for a mesh of "
                                 f"{getattr(self, dim)} along {dim}")
        return (data * self.pipe + pipe) * self.tensor + tensor

    def coords_of(self, rank: int) -> MeshCoords:
        """The coordinates of ``rank``."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is out of range for a mesh of {self.size} ranks")
        rest, tensor = divmod(rank, self.tensor)
        data, pipe = divmod(rest, self.pipe)
        return MeshCoords(data, pipe, tensor)

    def group(self, dim: str, rank: int) -> list[int]:
        """The ranks along ``dim`` through ``rank`` (its group of that dimension), in the
        order of their coordinate along ``dim`` (= their rank in the group)."""
        axis = _axis(dim)
        coords = list(self.coords_of(rank))
        out = []
        for i in range(self[axis]):
            coords[axis] = i
            out.append(self.rank_of(*coords))
        return out

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of dimension ``dim``, ordered by the coordinates of the other two
        dimensions (outermost first): the order ``Mesh.create`` builds them in."""
        axis = _axis(dim)
        seen: set[int] = set()
        out = []
        for rank in range(self.size):
            if rank not in seen:
                members = self.group(DIMS[axis], rank)
                seen.update(members)
                out.append(members)
        return out


def _axis(dim: str) -> int:
    try:
        return DIMS.index(dim)
    except ValueError:
        raise ValueError(f"mesh dimension must be one of {', '.join(DIMS)}, got "
                         f"{dim!r}") from None


class Mesh:
    """This rank's place in a ``data x pipe x tensor`` mesh and its communicator along each
    dimension. Build it with ``create`` (a collective over the world communicator).

    Attributes:
        world: the communicator the mesh was built over.
        shape: the ``MeshShape``.
        coords: this rank's ``MeshCoords``; its rank in each dimension's communicator is
            its coordinate along that dimension.
        data, pipe, tensor: this rank's communicator along each dimension (a size-1
            dimension still has one, of size 1).
    """

    def __init__(self, world: Communicator, shape: MeshShape,
                 comms: dict[str, Communicator]) -> None:
        self.world = world
        self.shape = shape
        self.coords = shape.coords_of(world.rank)
        self.data = comms["data"]
        self.pipe = comms["pipe"]
        self.tensor = comms["tensor"]

    @classmethod
    async def create(cls, comm: Communicator, *, data: int = 1, pipe: int = 1,
                     tensor: int = 1) -> Mesh:
        """Lay the ranks of ``comm`` out as ``data x pipe x tensor``; every rank calls it with
        the same sizes. A size left out is 1; one may be ``-1`` (inferred).

        It first checks that the ranks agree on the shape, then creates every group of every
        dimension with ``comm.new_group`` (all of them on every rank, in one order): one
        small all-gather per group, ``W/D + W/P + W/T`` in all.

        Raises:
            ValueError: the sizes do not multiply to ``comm.world_size`` (raised before any
                communication), or ranks passed different shapes (on every rank).
            CollectiveError: a rank failed or left while the groups were being built.
        """
        shape = MeshShape.resolve(comm.world_size, data=data, pipe=pipe, tensor=tensor)
        shapes = await comm.all_gather_object(list(shape))
        if any(tuple(s) != shape for s in shapes):
            detail = ", ".join(f"rank {r}: {tuple(s)}" for r, s in enumerate(shapes))
            raise ValueError(f"ranks asked for different mesh shapes ({detail})")
        comms: dict[str, Communicator] = {}
        for dim in DIMS:
            for members in shape.groups(dim):       # the same calls, in one order, everywhere
                group = await comm.new_group(members)
                if group is not None:
                    comms[dim] = group
        assert set(comms) == set(DIMS), "every rank is in one group per dimension"
        return cls(comm, shape, comms)

    # ------------------------------------------------------------------------- queries

    @property
    def rank(self) -> int:
        """This rank in the world communicator."""
        return self.world.rank

    def comm(self, dim: str) -> Communicator:
        """This rank's communicator along ``dim`` (``"data"``, ``"pipe"`` or ``"tensor"``)."""
        return {"data": self.data, "pipe": self.pipe, "tensor": self.tensor}[DIMS[_axis(dim)]]

    def ranks(self, dim: str, **fixed: int) -> list[int]:
        """The world ranks of a group of dimension ``dim``, in group-rank order.

        By default this rank's group; ``fixed`` coordinates of the other dimensions pick
        another one: ``mesh.ranks("pipe", data=1, tensor=0)``.
        """
        axis = _axis(dim)
        unknown = set(fixed) - set(DIMS)
        if unknown or DIMS[axis] in fixed:
            raise ValueError(f"ranks({dim!r}): the fixed coordinates may only name the other "
                             f"dimensions, got {sorted(fixed)}")
        coords = self.coords._replace(**fixed)._replace(**{DIMS[axis]: 0})
        return self.shape.group(dim, self.shape.rank_of(*coords))

    def describe(self) -> str:
        """A table of every rank's coordinates and groups, this rank marked with ``*``."""
        s = self.shape
        lines = [f"mesh data={s.data} x pipe={s.pipe} x tensor={s.tensor} "
                 f"({s.size} ranks, tensor innermost: rank = (d*{s.pipe} + p)*{s.tensor} + t)",
                 "  rank  (d, p, t)   data group      pipe group      tensor group"]
        for rank in range(s.size):
            c = s.coords_of(rank)
            mark = "*" if rank == self.rank else " "
            groups = "  ".join(f"{_fmt(s.group(dim, rank)):14s}" for dim in DIMS)
            lines.append(f"{mark}{rank:5d}  ({c.data}, {c.pipe}, {c.tensor})   {groups}".rstrip())
        return "\n".join(lines)

    def __repr__(self) -> str:
        s, c = self.shape, self.coords
        return (f"<Mesh {s.data}x{s.pipe}x{s.tensor} rank {self.rank} at (data={c.data}, "
                f"pipe={c.pipe}, tensor={c.tensor})>")

    # ------------------------------------------------------------------------ lifetime

    async def close(self) -> None:
        """Close the three sub-communicators (not the world's). Idempotent."""
        for c in (self.data, self.pipe, self.tensor):
            await c.close()

    async def __aenter__(self) -> Mesh:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _fmt(ranks: list[int]) -> str:
    return "[" + ", ".join(map(str, ranks)) + "]"


__all__ = ["DIMS", "Mesh", "MeshCoords", "MeshShape"]
