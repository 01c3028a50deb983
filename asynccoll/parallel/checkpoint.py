"""Checkpoints of data-parallel training that load into any number of ranks.

A checkpoint is a directory:

* ``meta.json``: format version, strategy, world size, the flat layout (every parameter's name,
  shape, unit and flat range; every rank's shard as flat ranges), the dtype, the optimizer's
  class, hyperparameters and step count;
* ``shard-RRRRR-ID.npz``, one per rank: ``params`` (the rank's shard of the flat parameters,
  in the order of its ranges) and ``opt.NAME`` for every optimizer buffer (the same ranges);
* ``buffers-ID.npz``, written by rank 0: the model's persistent buffers (BatchNorm's running
  statistics...; ``Model.buffer_specs``) by name, rank 0's, as torch's ``state_dict()`` holds
  them; ``meta.json`` lists them (name, shape, dtype) under ``buffers``.

``ID`` (``files`` in ``meta.json``) is new for every save, and ``meta.json`` is replaced last,
once every rank's files are on disk: a save cut short (a rank killed, a full disk) leaves the
previous checkpoint whole, never a mix of two saves. The next save removes the files of the
saves ``meta.json`` no longer names. (Version 1 checkpoints, ``shard-RRRRR.npz`` and
``buffers.npz`` without ``ID``, still load.)

Every rank writes only its own shard, whatever the strategy (replicated state is cut the same
way), so the files add up to one copy of everything. Loading reassembles the whole flat arrays
from the ranges and gives each new rank its part, so a checkpoint saved by N ranks with one
strategy loads into M ranks with any strategy, or into a plain model in one process
(``load_parameters``). The directory must be visible to every rank (one machine, or a
shared file system). Error-feedback residuals of gradient compression are not saved: they
restart from zero.

A model split over ranks (``Model.model_parallel_groups``: pipeline stages, tensor shards,
``Hybrid``) has one ``DistributedModel`` per part, over that part's data group, and every part
saves into a directory of its own (parts that name the same one get a ``ValueError``);
``meta.json`` records the part (``model_parallel``: ``[rank, size]`` in each group), and a part
loads only its own directory, with any number of data ranks.

Loading copies the saved buffers into every rank's model (names and shapes must match the
model's persistent buffers). A checkpoint written before buffers were saved (no ``buffers``
in ``meta.json``) still loads: the model's buffers are then left as they are, and a warning
is logged if the model has any.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import os
import re
import secrets
import zipfile
import zlib
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..ops import ReduceOp
from ._failure import break_comm
from .data_parallel import DistributedModel
from .model import Model

FORMAT = "asynccoll-checkpoint"
VERSION = 2
#: the versions read_meta accepts (1: file names without the save's id)
READABLE_VERSIONS = (1, 2)
BUFFERS_FILE = "buffers.npz"
#: what a save writes into a checkpoint's directory (and so may remove there): shards, the
#: buffers, and the temporary files of a write cut short
_OURS = re.compile(r"(shard-\d{5}|buffers)(-[0-9a-f]+)?\.npz(\.tmp\d+)?|meta\.json\.tmp\d+")

log = logging.getLogger("asynccoll.parallel.checkpoint")

T = TypeVar("T")


def _shard_file(path: Path, rank: int, tag: str | None) -> Path:
    return path / (f"shard-{rank:05d}.npz" if tag is None else f"shard-{rank:05d}-{tag}.npz")


def _buffers_file(path: Path, tag: str | None) -> Path:
    return path / (BUFFERS_FILE if tag is None else f"buffers-{tag}.npz")


def _tag(meta: dict[str, Any]) -> str | None:
    """The id in the names of the checkpoint's files (``None``: version 1 names)."""
    tag = meta.get("files")
    if tag is not None and not (isinstance(tag, str) and re.fullmatch(r"[0-9a-f]+", tag)):
        raise ValueError(f"meta.json: bad 'files' {tag!r}")
    return tag


def _write_atomic(target: Path, write: Any) -> None:
    """Write ``target`` whole or not at all (a temporary file, on disk, then renamed)."""
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _sync_dir(path: Path) -> None:
    """Make the renames in ``path`` durable (where the platform can)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_other_saves(root: Path, tag: str) -> None:
    """Remove what earlier (or cut short) saves left in ``root``: files of ours whose names
    do not carry ``tag``."""
    for entry in root.iterdir():
        if _OURS.fullmatch(entry.name) and f"-{tag}." not in entry.name:
            with contextlib.suppress(OSError):
                entry.unlink()


async def save_checkpoint(dist: DistributedModel, path: str | os.PathLike[str]) -> None:
    """Save ``dist``'s parameters and optimizer state under directory ``path``.

    A collective: every rank of ``dist.comm`` calls it. Returns once every shard and the
    metadata are on disk. Until then ``path`` holds the checkpoint saved there before, if
    any, whole: a save that fails or is cut short on any rank leaves it loadable.

    Raises:
        ValueError: the model is split over ranks (``Model.model_parallel_groups``) and
            another part saves into ``path`` too (on every rank, before anything is written).
        OSError: a rank could not write its files (a full disk...): that rank raises its own
            error, every other rank an ``OSError`` naming it, and ``path`` keeps the
            checkpoint saved there before; the ranks may go on training together.
    """
    root = Path(path)
    part = await _own_directory(dist, root)
    await dist.start()                  # before the first pass, rank 0's parameters win
    params, buffers, step = dist.shard_state()
    arrays = {"params": params, **{f"opt.{k}": v for k, v in buffers.items()}}
    meta = None
    model_buffers: dict[str, np.ndarray] = {}
    if dist.rank == 0:
        opt = dist.optimizer
        model_buffers = dist.local_buffers(persistent_only=True)    # rank 0's, as DDP's
        meta = {
            "format": FORMAT, "version": VERSION, "strategy": dist.strategy,
            "layout": dist.layout.describe(), "step": step,
            "optimizer": None if opt is None else {
                "class": type(opt).__name__, "hyper": opt.state_dict().get("hyper", {}),
                "buffers": sorted(buffers)},
            "buffers": [{"name": n, "shape": list(v.shape), "dtype": v.dtype.str}
                        for n, v in model_buffers.items()],
        }
        if part:
            meta["model_parallel"] = part

    # this save's files get names of their own; meta.json, replaced once all are written,
    # says which files are the checkpoint
    tag = await dist.comm.broadcast_object(secrets.token_hex(8) if dist.rank == 0 else None)

    def write() -> None:
        root.mkdir(parents=True, exist_ok=True)
        _write_atomic(_shard_file(root, dist.rank, tag),
                      lambda f: np.savez(f, **arrays))  # type: ignore[arg-type]
        if meta is not None:
            _write_atomic(_buffers_file(root, tag),
                          lambda f: np.savez(f, **model_buffers))  # type: ignore[arg-type]

    def commit() -> None:
        assert meta is not None
        _write_atomic(root / "meta.json",
                      lambda f: f.write(json.dumps({**meta, "files": tag}, indent=1).encode()))
        _sync_dir(root)
        _remove_other_saves(root, tag)

    # each phase runs in a thread (the event loop keeps serving the other ranks), then every
    # rank learns whether every rank's succeeded: a rank that could not write its files (a full
    # disk) raises, the others too, and none commits nor waits for it
    kept = "; the checkpoint saved there before, if any, is left whole"
    await _on_every_rank(dist, root, "write its files", lambda: asyncio.to_thread(write), kept)
    await _on_every_rank(dist, root, "write meta.json",
                         None if meta is None else lambda: asyncio.to_thread(commit), kept)


async def _on_every_rank(dist: DistributedModel, root: str | os.PathLike[str], what: str,
                         work: Callable[[], Awaitable[T]] | None, then: str = "") -> T | None:
    """Await ``work()`` (``None``: nothing to do on this rank) and return its result, once
    every rank of ``dist.comm`` knows that every rank's succeeded (a collective, which also
    serves as a barrier), and, for a model split over ranks, every rank of the other parts
    (the agreement goes on along each of ``model_parallel_groups``: a part whose checkpoint
    could not be written or read must not leave the others saved or loaded without it). If
    it failed here, its exception is raised; if it failed on another rank, an exception of
    the same built-in class (``OSError`` or ``ValueError``, or ``OSError`` for any other)
    naming that rank and its error. A cancelled rank breaks ``dist.comm``, so that the
    others do not wait for its answer until the timeout."""
    comm = dist.comm
    error: Exception | None = None
    result = None
    try:
        if work is not None:
            result = await work()
    except asyncio.CancelledError:
        await break_comm(comm)
        raise
    except Exception as exc:
        error = exc
    reports = await comm.all_gather_object(
        None if error is None else [type(error).__name__, str(error)])
    failed = next(([f"rank {r}", *report] for r, report in enumerate(reports)
                   if report is not None), None)
    groups = dist.model.model_parallel_groups()
    if groups and failed is not None:
        failed[0] += f" of the model part {_model_part(dist.model)}"
    for g in groups:  # (every rank takes the same path through them: a collective each)
        if failed is None:
            failed = next((f for f in await g.comm.all_gather_object(None) if f is not None),
                          None)
        else:
            await g.comm.all_gather_object(failed)
    if error is not None:
        raise error
    if failed is not None:
        where, name, message = failed
        text = f"{root}: {where} could not {what} ({name}: {message}){then}"
        kind = getattr(builtins, name, None)
        if not (isinstance(kind, type) and issubclass(kind, (OSError, ValueError))):
            kind = OSError
        try:
            raised = kind(text)
        except TypeError:  # a class built from more than a message (UnicodeDecodeError)
            raised = ValueError(text) if issubclass(kind, ValueError) else OSError(text)
        raise raised
    return result


def _model_part(model: Model) -> list[list[int]]:
    """Which part of a model split over ranks this rank holds: ``[rank, size]`` in each of
    its ``model_parallel_groups`` (innermost first); empty for a model whole on every rank."""
    return [[g.comm.rank, g.comm.world_size] for g in model.model_parallel_groups()]


async def _own_directory(dist: DistributedModel, root: Path) -> list[list[int]]:
    """This rank's ``_model_part``, once sure that no other part of the model saves into
    ``root`` (a collective over the model-parallel groups, then ``dist.comm``)."""
    part = _model_part(dist.model)
    if not part:
        return part
    try:
        where = await asyncio.to_thread(os.path.realpath, root)
    except asyncio.CancelledError:  # (as in _on_every_rank: the others must not wait for it)
        await break_comm(dist.comm)
        raise
    clash = None
    for g in dist.model.model_parallel_groups():
        others = [r for r, p in enumerate(await g.comm.all_gather_object(where))
                  if p == where and r != g.comm.rank]
        if others and clash is None:
            clash = others
    flag = np.array([clash is not None])
    await dist.comm.all_reduce(flag, op=ReduceOp.BOR)   # every rank of the save agrees
    if flag[0]:
        who = f"its ranks {clash} in a model-parallel group" if clash else "other parts"
        raise ValueError(f"{root}: the model is split over ranks (pipeline stages, tensor "
                         f"shards) and {who} save into this directory too; every part needs "
                         f"a directory of its own (their files would replace each other's)")
    return part


#: what reading a damaged or truncated .npz raises (FileNotFoundError is let through)
_DAMAGED = (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error)


def _damaged(file: Path, exc: BaseException) -> ValueError:
    return ValueError(f"{file}: damaged or cut short, numpy cannot read it "
                      f"({type(exc).__name__}: {exc})")


@contextlib.contextmanager
def _open_npz(file: Path) -> Iterator[Any]:
    """``numpy.load`` of one of a checkpoint's ``.npz`` files (no pickles); a ``ValueError``
    naming it if it is not one (damaged, cut short). The file is opened here, so that it is
    closed whatever numpy raises (its own open leaks the file on a damaged archive)."""
    with open(file, "rb") as f:
        try:
            z = np.load(f)
        except _DAMAGED as exc:
            raise _damaged(file, exc) from exc
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise ValueError(f"{file}: not an .npz archive")
        with z:
            yield z


def _member(z: Any, file: Path, key: str) -> np.ndarray:
    """Array ``key`` of the open ``.npz`` ``z`` (a ``ValueError`` naming ``file`` if it
    lacks it, or if it is damaged)."""
    if key not in z.files:
        raise ValueError(f"{file}: lacks {key!r}")
    try:
        return np.asarray(z[key])
    except _DAMAGED as exc:
        raise _damaged(file, exc) from exc


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's metadata (``meta.json``), checked for format and version."""
    file = Path(path) / "meta.json"
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is not a checkpoint: no meta.json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: damaged, not JSON ({exc})") from exc
    if (not isinstance(meta, dict) or meta.get("format") != FORMAT
            or meta.get("version") not in READABLE_VERSIONS):
        raise ValueError(f"{file}: not an {FORMAT} file of version "
                         f"{' or '.join(map(str, READABLE_VERSIONS))}")
    return meta


def read_full(path: str | os.PathLike[str]) -> tuple[dict[str, Any], np.ndarray,
                                                      dict[str, np.ndarray]]:
    """Reassemble the whole flat parameters and optimizer buffers of a checkpoint."""
    root = Path(path)
    meta = read_meta(root)
    lay = meta["layout"]
    dtype = np.dtype(lay["dtype"])
    size = int(lay["size"])
    params = np.empty(size, dtype)
    names = (meta["optimizer"] or {}).get("buffers", [])
    buffers = {n: np.empty(size, dtype) for n in names}
    filled = np.zeros(size, bool)
    for rank, ranges in enumerate(lay["shards"]):
        file = _shard_file(root, rank, _tag(meta))
        with _open_npz(file) as z:
            targets = [("params", params)] + [(f"opt.{n}", buffers[n]) for n in names]
            for key, whole in targets:
                piece = _member(z, file, key).reshape(-1)
                if piece.size != sum(b - a for a, b in ranges):
                    raise ValueError(f"{root}: shard {rank} {key} has {piece.size} values, "
                                     f"its ranges {sum(b - a for a, b in ranges)}")
                pos = 0
                for a, b in ranges:
                    whole[a:b] = piece[pos:pos + b - a]
                    pos += b - a
        for a, b in ranges:
            filled[a:b] = True
    if not filled.all():
        raise ValueError(f"{root}: the shards do not cover every parameter")
    return meta, params, buffers


def read_buffers(path: str | os.PathLike[str]) -> dict[str, np.ndarray] | None:
    """The model buffers a checkpoint holds, by name (rank 0's at the save), or ``None``
    for a checkpoint written before buffers were saved."""
    root = Path(path)
    return _read_buffers(root, read_meta(root))


def _read_buffers(root: Path, meta: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """``read_buffers`` of the checkpoint in ``root`` whose ``meta.json`` says ``meta`` (read
    once, with the shards: a save landing between two reads could pair two saves)."""
    listed = meta.get("buffers")
    if listed is None:
        return None
    if not listed:
        return {}
    out: dict[str, np.ndarray] = {}
    file = _buffers_file(root, _tag(meta))
    with _open_npz(file) as z:
        for entry in listed:
            name = entry["name"]
            value = _member(z, file, name)
            if (list(value.shape) != list(entry["shape"])
                    or value.dtype != np.dtype(entry["dtype"])):
                raise ValueError(f"{root}: buffer {name!r} is {value.dtype} {value.shape}, "
                                 f"meta.json says {entry['dtype']} {tuple(entry['shape'])}")
            out[name] = value
    return out


def _named(params: list[tuple[str, tuple[int, ...]]]) -> str:
    """``params`` (name, shape) for a message: the first four, and how many more."""
    if not params:
        return "none"
    shown = ", ".join(f"{name} {shape}" for name, shape in params[:4])
    return shown + (f" and {len(params) - 4} more" if len(params) > 4 else "")


def _check_layout(meta: dict[str, Any], dist_layout: dict[str, Any], where: str) -> None:
    old = [(p["name"], tuple(p["shape"])) for p in meta["layout"]["params"]]
    new = [(p["name"], tuple(p["shape"])) for p in dist_layout["params"]]
    if old != new:
        saved, model = [x for x in old if x not in new], [x for x in new if x not in old]
        if saved or model:
            detail = (f"only the checkpoint has {_named(saved)}, only the model "
                      f"{_named(model)}")
        else:
            at = next(i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b)
            detail = (f"the same parameters in another order: the checkpoint's #{at} is "
                      f"{old[at][0]!r}, the model's {new[at][0]!r}")
        raise ValueError(f"{where}: the checkpoint's parameters do not match the model's "
                         f"({detail})")
    if meta["layout"]["dtype"] != dist_layout["dtype"]:
        raise ValueError(f"{where}: checkpoint dtype {meta['layout']['dtype']}, model "
                         f"{dist_layout['dtype']}")


async def load_checkpoint(dist: DistributedModel, path: str | os.PathLike[str]) -> None:
    """Load a checkpoint saved with any number of ranks and any strategy into ``dist``.

    A collective: every rank calls it (each reads the files it needs, then all ranks
    synchronise, and load only if every rank could read and check them: no rank trains on
    another state than the others). Every rank's model buffers become
    the saved ones (rank 0's at the save); a checkpoint without buffers (written by an older
    asynccoll) leaves them as they are.

    Raises:
        ValueError: the checkpoint's parameters, optimizer or buffers do not fit ``dist``,
            or it holds another part of a model split over ranks (nothing of the model is
            changed then).
        OSError: a file could not be read (``FileNotFoundError``: no checkpoint there).
            When a rank fails, alone or not, every rank raises (the others an error of the
            same built-in class naming that rank) and no rank's model is changed.
    """
    async def read() -> tuple[dict[str, Any], np.ndarray, dict[str, np.ndarray],
                              dict[str, np.ndarray] | None]:
        meta, params, buffers = await asyncio.to_thread(read_full, path)
        saved_part, part = meta.get("model_parallel"), _model_part(dist.model)
        if saved_part is not None and saved_part != part:
            raise ValueError(f"{path}: saved by the model-parallel part {saved_part} ([rank, "
                             f"size] in each group), this rank holds the part {part}: load "
                             f"every part from the directory it was saved into")
        _check_layout(meta, dist.layout.describe(), str(path))
        model_buffers = await asyncio.to_thread(_read_buffers, Path(path), meta)
        opt = meta.get("optimizer")
        if dist.optimizer is not None and opt is not None:
            mine = type(dist.optimizer).__name__
            if opt["class"] != mine:
                raise ValueError(f"{path}: saved with optimizer {opt['class']}, loading into "
                                 f"{mine}")
        specs = dist.model.buffer_specs()
        if model_buffers is None:
            if specs and dist.rank == 0:
                log.warning("%s holds no model buffers (saved by an older asynccoll): the "
                            "model's buffers (%s...) are left as they are", path, specs[0].name)
        else:
            try:
                dist.check_buffers(model_buffers)  # (before anything is loaded)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
        return meta, params, buffers, model_buffers

    # nothing is loaded on any rank unless every rank could read and check the checkpoint
    got = await _on_every_rank(dist, path, "load it", read,
                               "; no rank's model was changed")
    assert got is not None
    meta, params, buffers, model_buffers = got
    opt = meta.get("optimizer")
    if dist.optimizer is not None and opt is not None:
        dist.load_full_state(params, buffers, int(meta["step"]), opt.get("hyper"))
    else:
        dist.load_full_state(params, {}, int(meta["step"]))
    if model_buffers is not None:
        dist.load_buffers(model_buffers)


def load_parameters(path: str | os.PathLike[str], model: Model | None = None
                    ) -> dict[str, np.ndarray]:
    """The checkpoint's parameters by name (whole arrays), in one process, no communicator.

    With ``model``, also copies them into the model's parameter arrays (names and shapes
    must match), and the checkpoint's buffers into the model's buffers (``read_buffers``
    returns them).
    """
    meta, flat, _ = read_full(path)
    saved_buffers = _read_buffers(Path(path), meta) if model is not None else None
    out = {}
    for p in meta["layout"]["params"]:
        a, b = p["range"]
        out[p["name"]] = flat[a:b].reshape(p["shape"]).copy()
    if model is not None:
        current = model.parameters()
        for name, value in out.items():
            if name not in current or current[name].shape != value.shape:
                raise ValueError(f"{path}: parameter {name} {value.shape} does not fit the model")
        buffers = model.buffers()
        specs = {s.name: s for s in model.buffer_specs()}
        for name, value in (saved_buffers or {}).items():
            if name not in specs or specs[name].shape != value.shape:
                raise ValueError(f"{path}: buffer {name} {value.shape} does not fit the model")
        for name, value in out.items():
            current[name][...] = value
        for name, value in (saved_buffers or {}).items():
            np.copyto(buffers[name], value.astype(specs[name].dtype, copy=False))
    return out


__all__ = ["load_checkpoint", "load_parameters", "read_buffers", "read_meta",
           "save_checkpoint"]
