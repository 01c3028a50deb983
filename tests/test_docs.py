"""The documentation site builds with ``mkdocs build --strict`` (every page in the nav, no
broken link or anchor, every docstring renders), and the pages say what the repository does.

Needs the docs packages (``pip install ".[docs]"``; the ``test`` extra includes them).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS_PACKAGES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def _missing_docs_packages() -> list[str]:
    missing = []
    for name in DOCS_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            missing.append(name)
    return missing


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for this module with ``mkdocs build --strict``."""
    missing = _missing_docs_packages()
    if missing:
        pytest.skip(f"the docs packages are not installed ({', '.join(missing)}): "
                    f"pip install '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
                         check=False)
    assert res.returncode == 0, f"mkdocs build --strict failed:\n{res.stdout}\n{res.stderr}"
    return out


def page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text(encoding="utf-8")


@pytest.mark.timeout(300)
def test_site_builds_strict(site: Path) -> None:
    assert (site / "index.html").is_file()
    for name in ("getting_started", "concepts", "collectives", "migration", "protocol",
                 "backends/memory", "backends/tcp", "training", "performance",
                 "reference/asynccoll", "reference/parallel", "reference/elastic"):
        assert (site / name / "index.html").is_file(), name


@pytest.mark.timeout(300)
def test_protocol_page_is_the_spec_itself(site: Path) -> None:
    source = (REPO / "docs" / "protocol.md").read_text(encoding="utf-8")
    assert '--8<-- "protocol/SPEC.md"' in source        # included at build time, not copied
    spec = (REPO / "protocol" / "SPEC.md").read_text(encoding="utf-8")
    html = page(site, "protocol")
    headings = re.findall(r"^#{1,3} (.+)$", spec, flags=re.MULTILINE)
    assert len(headings) > 10
    for heading in headings:
        words = re.sub(r"[`*]", "", heading).split()[-1]
        assert words in html, heading


@pytest.mark.timeout(300)
def test_api_reference_renders_the_docstrings(site: Path) -> None:
    html = page(site, "reference/asynccoll")
    for name in ("init", "run_local", "Communicator.all_reduce", "Communicator.new_group",
                 "PeerLostError", "CollectiveTimeout", "ReduceOp"):
        assert f'id="asynccoll.{name}"' in html, name
    assert "Every rank ends with bit-identical values" in html   # a docstring's text
    html = page(site, "reference/parallel")
    for name in ("as_distributed", "DistributedModel.step", "MLP", "Adam", "split_batch"):
        assert f'id="asynccoll.parallel.{name}"' in html, name
    assert 'id="asynccoll.elastic.ElasticGroup"' in page(site, "reference/elastic")


@pytest.mark.timeout(300)
def test_reference_lists_the_names_the_guides_use(site: Path) -> None:
    """The guides' names for gradient clipping, buffers and checkpoints are in the API
    reference and importable from ``asynccoll.parallel``: training.md said ``read_buffers(path)``
    returns a checkpoint's buffers, but ``asynccoll.parallel`` had no such name, and
    ``last_grad_norm`` (an attribute documented by a comment) was not on the page."""
    import asynccoll.parallel

    html = page(site, "reference/parallel")
    for name in ("read_buffers", "BufferSpec", "ModelParallelGroup",
                 "Model.buffer_specs", "Model.model_parallel_groups",
                 "DistributedModel.clip_grad_norm", "DistributedModel.last_grad_norm",
                 "DistributedModel.sync_buffers", "DistributedModel.full_buffers",
                 "PipelineParallel.last_grad_norm"):
        assert f'id="asynccoll.parallel.{name}"' in html, name
        assert hasattr(asynccoll.parallel, name.split(".")[0]), name
    assert "read_buffers" in asynccoll.parallel.__all__


def test_getting_started_shows_the_readme_quickstart() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Quickstart\s+```bash\n(.*?)```", readme, flags=re.DOTALL)
    assert block is not None, "README.md lost its Quickstart section"
    commands = block.group(1).strip().splitlines()
    assert commands == ['pip install . && asynccoll run -n 3 examples/quickstart.py',
                        'pip install ".[test]" && python -m pytest']
    guide = (REPO / "docs" / "getting_started.md").read_text(encoding="utf-8")
    for command in commands:
        assert command in guide


def test_every_page_is_in_the_nav() -> None:
    """``mkdocs build --strict`` only warns about pages left out of the nav when
    ``validation.omitted_files`` says so; check it directly too, without mkdocs."""
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\s*- (?:[^:\n]+: )?([\w/.-]+\.md)\s*$", nav, flags=re.MULTILINE))
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert pages <= listed, f"pages not in mkdocs.yml's nav: {sorted(pages - listed)}"


def test_memory_page_states_where_the_direct_all_reduce_starts() -> None:
    """docs/backends/memory.md names the size above which the in-process all_reduce is the
    direct algorithm; it is Tuning.small_bytes (the page said 64 KiB, the code 128 KiB)."""
    import asynccoll

    text = (REPO / "docs" / "backends" / "memory.md").read_text(encoding="utf-8")
    found = re.search(r"above (\d+) KiB\s+\(`Tuning.small_bytes`\), `all_reduce`\s+uses the "
                      r"direct algorithm", text)
    assert found is not None, "memory.md no longer says where the direct all_reduce starts"
    at = int(found.group(1)) * 1024
    tuning = asynccoll.Tuning()
    assert at == tuning.small_bytes
    assert tuning.all_reduce(at, 4, lends=True) != "direct"
    assert tuning.all_reduce(at + 8, 4, lends=True) == "direct"
