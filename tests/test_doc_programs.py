"""The complete programs of the guides run as the pages say: each is copied out of its page
into a file and started the way the text next to it says (``asynccoll run ...`` or ``python``),
as a reader would. A guide's program that names something it never defines or imports, or
that defines a coroutine and never runs it, fails here.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = [sys.executable, "-m", "asynccoll"]


def program(page: str, marker: str) -> str:
    """The one ```python block of ``docs/<page>`` that contains ``marker``."""
    text = (REPO / "docs" / page).read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
              if marker in b]
    assert len(blocks) == 1, f"{page}: {len(blocks)} python blocks contain {marker!r}"
    return blocks[0]


def run(tmp_path: Path, source: str, name: str, args: list[str]) -> str:
    """``source`` saved as ``name`` in ``tmp_path`` and started with ``args`` there."""
    (tmp_path / name).write_text(source, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCCOLL_")}
    res = subprocess.run([*args, name], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=50, check=False)
    assert res.returncode == 0, f"{name} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res.stdout


@pytest.mark.timeout(60)
def test_training_guide_program_runs_under_the_launcher(tmp_path: Path) -> None:
    """training.md: "Run it with `asynccoll run -n 4 train.py`" (2 ranks here)."""
    source = program("training.md", "# train.py")
    out = run(tmp_path, source, "train.py", [*LAUNCHER, "run", "-n", "2"])
    assert sorted(re.findall(r"^\[(\d)\] rank \1: loss \d", out, re.MULTILINE)) == ["0", "1"]


@pytest.mark.timeout(60)
def test_training_guide_program_runs_in_one_process(tmp_path: Path) -> None:
    """training.md: "or in one process with `asyncio.run(asynccoll.run_local(train, 4))` in
    place of `asyncio.run(main())`"."""
    source = program("training.md", "# train.py")
    assert source.count("asyncio.run(main())") == 1
    source = source.replace("asyncio.run(main())",
                            "print(asyncio.run(asynccoll.run_local(train, 4)))")
    out = run(tmp_path, source, "train_local.py", [sys.executable])
    losses = ast.literal_eval(out.strip().splitlines()[-1])  # a list of 4 floats
    assert len(losses) == 4 and all(0 < loss < 1 for loss in losses)


@pytest.mark.timeout(60)
def test_parameter_server_program_runs_under_the_launcher(tmp_path: Path) -> None:
    """async_training.md: "Saved as `ps.py`, `asynccoll run --elastic -n 4 ps.py` runs it"
    (1 server and 2 workers here)."""
    source = program("async_training.md", "AsyncSGD(model, comm")
    out = run(tmp_path, source, "ps.py", [*LAUNCHER, "run", "--elastic", "-n", "3"])
    assert sorted(re.findall(r"^\[(\d)\] worker \1: last loss", out, re.MULTILINE)) == ["1", "2"]
    # the server: version, accepted, scaled, rejected, lost: 2 workers x 100 pushes, none lost
    assert re.search(r"^\[0\] 200 \d+ \d+ 0 \(\)$", out, re.MULTILINE), out


@pytest.mark.timeout(60)
def test_elastic_program_runs_under_the_launcher(tmp_path: Path) -> None:
    """async_training.md: "saved as `elastic_min.py`, it runs the same way: `asynccoll run -n 3
    --min-nodes 2 --max-nodes 4 elastic_min.py`" (2 processes here)."""
    source = program("async_training.md", "ElasticTrainer(group, build")
    out = run(tmp_path, source, "elastic_min.py",
              [*LAUNCHER, "run", "-n", "2", "--min-nodes", "2", "--max-nodes", "2"])
    assert sorted(re.findall(r"^\[(\d)\] step 300, loss", out, re.MULTILINE)) == ["0", "1"]
