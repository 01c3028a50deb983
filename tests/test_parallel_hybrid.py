"""Hybrid data x pipeline x tensor parallelism equals the unsplit model in one process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from conftest import run_world

from asynccoll import Communicator
from asynccoll.parallel import (
    MLP,
    SGD,
    Adam,
    Optimizer,
    load_checkpoint,
    save_checkpoint,
    train_locally,
)
from asynccoll.parallel.hybrid import Hybrid, TensorParallelStage

SIZES = [6, 9, 7, 5, 8, 3]      # 5 layers: uneven stages and uneven tensor splits
BATCH = 12
STEPS = 3


def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(5)
    return [(rng.standard_normal((BATCH, SIZES[0])), rng.standard_normal((BATCH, SIZES[-1])))
            for _ in range(STEPS)]


def make_opt(name: str) -> Optimizer:
    return SGD(lr=0.1, momentum=0.9) if name == "sgd" else Adam(lr=0.01)


async def reference(opt_name: str) -> tuple[list[float], np.ndarray]:
    return await train_locally(MLP(SIZES, seed=2), make_opt(opt_name), batches())


CONFIGS = [  # (data, pipe, tensor, strategy, optimizer, micro-batches, schedule)
    (2, 2, 1, "ddp", "sgd", 3, "1f1b"),
    (1, 2, 2, "ddp", "adam", 2, "gpipe"),
    (2, 1, 2, "zero2", "adam", 1, "1f1b"),
    (2, 2, 2, "ddp", "sgd", 2, "1f1b"),
    (2, 2, 2, "zero3", "adam", 3, "gpipe"),
    (2, 2, 2, "zero1", "sgd", 2, "1f1b"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "x".join(map(str, c[:3])) + "-"
                         + "-".join(map(str, c[3:])))
async def test_hybrid_equals_one_process(config: tuple) -> None:
    data, pipe, tensor, strategy, opt_name, micro, schedule = config
    want_losses, want = await reference(opt_name)

    async def rank(comm: Communicator) -> tuple[list[float], np.ndarray]:
        hybrid = await Hybrid.create(comm, MLP(SIZES, seed=2), data=data, pipe=pipe,
                                     tensor=tensor, optimizer=make_opt(opt_name),
                                     strategy=strategy, micro_batches=micro, schedule=schedule)
        if tensor > 1:
            assert isinstance(hybrid.stage, TensorParallelStage)
        losses = [await hybrid.step(b) for b in batches()]
        full = await hybrid.full_parameters()
        return losses, np.concatenate([full[f"layers.{i}.{k}"].reshape(-1)
                                       for i in range(len(SIZES) - 1)
                                       for k in ("weight", "bias")])

    for losses, params in await run_world(rank, data * pipe * tensor, "memory"):
        np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
        np.testing.assert_allclose(params, want, rtol=1e-6, atol=1e-12)


async def test_hybrid_over_tcp() -> None:
    want_losses, want = await reference("adam")

    async def rank(comm: Communicator) -> tuple[list[float], np.ndarray]:
        hybrid = await Hybrid.create(comm, MLP(SIZES, seed=2), data=2, pipe=2, tensor=2,
                                     optimizer=make_opt("adam"), strategy="zero2",
                                     micro_batches=2)
        losses = [await hybrid.step(b) for b in batches()]
        full = await hybrid.full_parameters()
        return losses, np.concatenate([full[f"layers.{i}.{k}"].reshape(-1)
                                       for i in range(len(SIZES) - 1)
                                       for k in ("weight", "bias")])

    for losses, params in await run_world(rank, 8, "tcp"):
        np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
        np.testing.assert_allclose(params, want, rtol=1e-6, atol=1e-12)


async def test_hybrid_shape_must_match_the_world() -> None:
    async def rank(comm: Communicator) -> None:
        with pytest.raises(ValueError, match="ranks"):
            await Hybrid.create(comm, MLP(SIZES), data=2, pipe=2, tensor=2, optimizer=SGD(0.1))

    await run_world(rank, 4, "memory")


@pytest.mark.timeout(90)
def test_hybrid_example_with_8_processes() -> None:
    import re
    import subprocess
    import sys

    from test_launcher import REPO, clean_env

    res = subprocess.run([sys.executable, "-m", "asynccoll", "run", "-n", "8",
                          "examples/train_hybrid.py", "--steps", "20"], cwd=REPO,
                         env=clean_env(), capture_output=True, text=True, timeout=80,
                         check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert len(re.findall(r"rank \d: data \d pipe \d tensor \d", out)) == 8, out
    err = re.search(r"largest relative difference to one process ([0-9.e+-]+)", out)
    assert err and float(err.group(1)) < 1e-6, out


@pytest.mark.parametrize(("data", "pipe", "tensor", "strategy"), [(2, 1, 1, "ddp"),
                                                                   (3, 2, 1, "zero2"),
                                                                   (2, 1, 2, "zero3")])
async def test_batches_that_do_not_divide_over_the_replicas(data: int, pipe: int, tensor: int,
                                                           strategy: str) -> None:
    """11 samples over 2 or 3 replicas (shares 6/5, 4/4/3): the update is that of the whole
    batch, weighted by sample, not the plain mean of the replicas' mean gradients."""
    rng = np.random.default_rng(8)
    data_batches = [(rng.standard_normal((11, SIZES[0])), rng.standard_normal((11, SIZES[-1])))
                    for _ in range(STEPS)]
    want_losses, want = await train_locally(MLP(SIZES, seed=2), make_opt("sgd"), data_batches)

    async def rank(comm: Communicator) -> tuple[list[float], float, np.ndarray]:
        hybrid = await Hybrid.create(comm, MLP(SIZES, seed=2), data=data, pipe=pipe,
                                     tensor=tensor, optimizer=make_opt("sgd"),
                                     strategy=strategy, micro_batches=2)
        losses = [await hybrid.step(b) for b in data_batches]
        evaluation = await hybrid.loss(data_batches[0])
        full = await hybrid.full_parameters()
        return losses, evaluation, np.concatenate([full[f"layers.{i}.{k}"].reshape(-1)
                                                   for i in range(len(SIZES) - 1)
                                                   for k in ("weight", "bias")])

    final = MLP(SIZES, seed=2)
    final.bind(params={s.name: want[a:a + s.size].reshape(s.shape) for s, a in zip(
        final.param_specs(), np.cumsum([0] + [s.size for s in final.param_specs()]),
        strict=False)})
    want_eval = await final.loss(data_batches[0])
    for losses, evaluation, params in await run_world(rank, data * pipe * tensor, "memory"):
        np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
        np.testing.assert_allclose(evaluation, want_eval, rtol=1e-6)
        np.testing.assert_allclose(params, want, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize(("loss", "targets", "match"), [
    ("mse", np.zeros((4, SIZES[-1])), "targets must have shape"),     # fewer rows than inputs
    ("mse", np.zeros(8), "targets must have shape"),
    ("cross_entropy", np.full(8, SIZES[-1]), "labels must lie in"),
    ("cross_entropy", np.zeros(8), "labels must be integers"),
])
async def test_tensor_parallel_last_stage_checks_targets(loss: str, targets: np.ndarray,
                                                         match: str) -> None:
    """As MLPStage: a ValueError naming the problem, never a silently broadcast loss or an
    IndexError."""
    x = np.random.default_rng(0).standard_normal((8, SIZES[0]))

    async def rank(comm: Communicator) -> None:
        hybrid = await Hybrid.create(comm, MLP(SIZES, seed=2, loss=loss), tensor=2,
                                     optimizer=make_opt("sgd"), micro_batches=4)
        with pytest.raises(ValueError, match=match):
            await hybrid.step((x, targets))

    await run_world(rank, 2, "memory")


@pytest.mark.parametrize(("data", "pipe", "tensor"), [(2, 1, 1), (2, 1, 2), (2, 2, 1)])
async def test_a_failing_replica_fails_every_rank_at_once(data: int, pipe: int,
                                                         tensor: int) -> None:
    """3 samples over 2 replicas of 2 micro-batches: replica 1's share (1 sample) cannot be
    split, and its ranks raise ValueError; the others raise CollectiveError at once, not
    after the timeout, even with a pipeline of one stage (nothing to break in its group)."""
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((3, SIZES[0])), rng.standard_normal((3, SIZES[-1])))

    async def rank(comm: Communicator) -> tuple[str, float]:
        hybrid = await Hybrid.create(comm, MLP(SIZES, seed=2), data=data, pipe=pipe,
                                     tensor=tensor, optimizer=make_opt("sgd"), micro_batches=2)
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            await hybrid.step(batch)
        except Exception as exc:
            elapsed = loop.time() - start
            await asyncio.sleep(0.5)                      # the failing ranks stay alive
            return type(exc).__name__, elapsed
        raise AssertionError("the step should have failed")

    got = await run_world(rank, data * pipe * tensor, "memory", timeout=20)
    for r, (name, elapsed) in enumerate(got):
        replica = r // (pipe * tensor)
        assert name in (("CollectiveError",) if replica == 0 else
                        ("ValueError", "CollectiveError")), got
        assert elapsed < 5, got
    assert any(name == "ValueError" for name, _ in got), got


async def test_checkpoints_of_the_parts_reshard_and_never_mix(tmp_path: Path) -> None:
    """Every part of a split model (stage, tensor shard) checkpoints its data group into a
    directory of its own, which resumes on fewer replicas step for step. All parts saving
    into one directory used to replace each other's files (FileNotFoundError at the save or
    the load, or one part's parameters loaded into every part: silent garbage where the
    shards have the same shapes); it is a ValueError on every rank now, and a part that
    loads another part's directory is one too."""
    sizes = [6, 8, 8, 8, 3]              # even splits: every tensor shard has the same shapes
    rng = np.random.default_rng(8)
    data = [(rng.standard_normal((8, 6)), rng.standard_normal((8, 3))) for _ in range(4)]

    def part(hybrid: Hybrid) -> Path:
        return tmp_path / f"p{hybrid.mesh.coords.pipe}-t{hybrid.mesh.coords.tensor}"

    async def train(comm: Communicator) -> dict[str, np.ndarray]:
        hybrid = await Hybrid.create(comm, MLP(sizes, seed=2), data=2, pipe=2, tensor=2,
                                     optimizer=Adam(lr=0.01), strategy="zero1")
        for batch in data[:2]:
            await hybrid.step(batch)
        with pytest.raises(ValueError, match="a directory of its own"):
            await save_checkpoint(hybrid.dist, tmp_path / "shared")
        await save_checkpoint(hybrid.dist, part(hybrid))
        for batch in data[2:]:
            await hybrid.step(batch)
        return await hybrid.full_parameters()

    want = (await run_world(train, 8, "memory"))[0]

    async def resume(comm: Communicator, swap: bool) -> dict[str, np.ndarray]:
        hybrid = await Hybrid.create(comm, MLP(sizes, seed=7), data=1, pipe=2, tensor=2,
                                     optimizer=Adam(lr=0.01), strategy="ddp")
        if swap:                         # tensor rank 0 loads rank 1's directory and back
            other = part(hybrid).with_name(part(hybrid).name[:-1]
                                           + str(1 - hybrid.mesh.coords.tensor))
            with pytest.raises(ValueError, match="model-parallel part"):
                await load_checkpoint(hybrid.dist, other)
        await load_checkpoint(hybrid.dist, part(hybrid))
        for batch in data[2:]:
            await hybrid.step(batch)
        return await hybrid.full_parameters()

    for swap in (False, True):
        for got in await run_world(lambda c, s=swap: resume(c, s), 4, "memory"):
            assert sorted(got) == sorted(want)
            for name, value in got.items():
                np.testing.assert_allclose(value, want[name], rtol=1e-9, atol=1e-12,
                                           err_msg=name)


async def test_a_part_that_cannot_save_or_load_fails_every_part(tmp_path: Path) -> None:
    """Pipeline stages (2 data replicas each) save into directories of their own. When one
    stage could not write its files, the other stage committed its checkpoint and returned;
    when one could not read its directory, the other loaded its own and went on: a job that
    resumes 'if there is a checkpoint' trained one stage from step N and the other from the
    step before, or afresh, without a word. Every rank of every part now raises (the others
    an error of the same class naming the rank and its part), no part commits, no model
    changes."""
    (tmp_path / "a-file").write_text("not a directory")
    rng = np.random.default_rng(3)
    data = [(rng.standard_normal((8, 6)), rng.standard_normal((8, 3))) for _ in range(2)]

    async def rank(comm: Communicator) -> list[str]:
        hybrid = await Hybrid.create(comm, MLP([6, 7, 5, 3], seed=2), data=2, pipe=2,
                                     tensor=1, optimizer=SGD(lr=0.1), strategy="ddp")
        pipe = hybrid.mesh.coords.pipe
        own = tmp_path / f"p{pipe}"
        await hybrid.step(data[0])
        await save_checkpoint(hybrid.dist, own)
        saved = (own / "meta.json").read_bytes()
        await hybrid.step(data[1])
        errors = []
        # stage 1's directory cannot be made (a file is in the way)
        with pytest.raises(OSError) as info:
            await save_checkpoint(hybrid.dist, tmp_path / "a-file" / "p1" if pipe else own)
        errors.append(f"{type(info.value).__name__}: {info.value}")
        assert (own / "meta.json").read_bytes() == saved       # stage 0 committed nothing
        before = {k: v.copy() for k, v in hybrid.dist.model.parameters().items()}
        # stage 1 finds no checkpoint, stage 0 its own
        with pytest.raises(FileNotFoundError) as info2:
            await load_checkpoint(hybrid.dist, tmp_path / "nothing" if pipe else own)
        errors.append(f"{type(info2.value).__name__}: {info2.value}")
        for k, v in hybrid.dist.model.parameters().items():
            np.testing.assert_array_equal(v, before[k], err_msg=k)
        return errors

    async with asyncio.timeout(30):
        got = await run_world(rank, 4, "memory")
    for r, (save_error, load_error) in enumerate(got):
        assert save_error.startswith("NotADirectoryError"), (r, save_error)
        assert "no meta.json" in load_error, (r, load_error)
    # the ranks of stage 0 name a rank of stage 1 and its error
    named = [e for errors in got for e in errors if "of the model part [[1, 2]]" in e]
    assert len(named) == 4, got


async def test_a_save_of_a_part_cancelled_at_once_fails_every_rank_at_once(
        tmp_path: Path) -> None:
    """A save cancelled on one rank breaks the communicator, so that the others raise at
    once (save_checkpoint's contract). Cancelled while it looked up its directory (the
    first thing a save of a split model does), it did not: every other rank waited in the
    next collective until its timeout (CollectiveTimeout after 5 s here)."""
    async def rank(comm: Communicator) -> tuple[str, float]:
        hybrid = await Hybrid.create(comm, MLP([4, 5, 3], seed=1), data=2, pipe=2, tensor=1,
                                     optimizer=SGD(lr=0.1))
        began = asyncio.get_running_loop().time()
        task = asyncio.ensure_future(
            save_checkpoint(hybrid.dist, tmp_path / f"p{hybrid.mesh.coords.pipe}"))
        if comm.rank == 3:
            await asyncio.sleep(0)          # the save runs up to its first wait
            task.cancel()
        try:
            await task
            outcome = "saved"
        except BaseException as exc:  # (the outcome is what the test checks)
            outcome = type(exc).__name__
        return outcome, asyncio.get_running_loop().time() - began

    async with asyncio.timeout(30):
        got = await run_world(rank, 4, "memory", timeout=5.0)
    assert got[3][0] == "CancelledError", got
    for outcome, took in got[:3]:
        assert outcome == "CollectiveError", got
        assert took < 2.0, got
