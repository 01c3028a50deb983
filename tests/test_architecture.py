"""The layering rules of STYLE.md, read from the source with ``ast``.

* ``asynccoll/wire.py`` (sans-IO) imports nothing of asynccoll except ``errors``, and no I/O;
  ``wire_stream.py``, split off it, nothing but ``wire``; ``wire`` imports it only lazily, for
  the names it still re-exports.
* ``asynccoll/collectives.py``, ``algorithms.py`` and ``call.py`` never import a concrete
  transport (memory, tcp, nccl, mpi, and the modules split off them: tcp_world, mpi_world).
* ``transport/tcp_world.py`` (forming worlds) builds on ``transport/tcp.py`` (the data path);
  ``tcp.py`` imports it only lazily, for the names it still re-exports, so either imports
  first.
* nothing under ``asynccoll/parallel/`` imports ``asynccoll.transport`` or ``asynccoll.wire``
  (nor ``wire_stream``).
* ``import asynccoll`` imports no optional dependency (torch, cupy, mpi4py).
* no module keeps obvious module-level mutable state (a dict/list/set bound to a name that is
  not an ALL_CAPS constant).
* no ``print(`` outside the command line (``cli.py``) and the benchmark (``bench*.py``).

Imports are collected everywhere in a module (also inside functions: a lazy import is still
an import), with relative imports resolved against the module's package.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "asynccoll"
MODULES = sorted(PACKAGE.rglob("*.py"))

CONCRETE_TRANSPORTS = ("asynccoll.transport.memory", "asynccoll.transport.tcp",
                       "asynccoll.transport.tcp_world", "asynccoll.transport.nccl",
                       "asynccoll.transport.mpi", "asynccoll.transport.mpi_world")
OPTIONAL_DEPENDENCIES = ("torch", "cupy", "mpi4py")
MUTABLE_CALLS = frozenset({"dict", "list", "set", "defaultdict", "OrderedDict", "Counter",
                           "deque", "bytearray", "WeakValueDictionary", "WeakKeyDictionary",
                           "WeakSet"})
#: "module:name" of module-level mutable bindings that are deliberate (none so far).
MUTABLE_STATE_ALLOWED: frozenset[str] = frozenset()
PRINT_ALLOWED = ("cli.py",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def imports_of(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """Absolute names of everything ``source`` imports: ``import X`` gives ``X``, and
    ``from X import y`` gives ``X.y`` (``y`` may be a submodule; ``*`` gives ``X``)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            found.update(base if alias.name == "*" else f"{base}.{alias.name}"
                         for alias in node.names)
    return found


def imports(path: Path) -> set[str]:
    return imports_of(path.read_text(), module_name(path), is_package=path.name == "__init__.py")


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_import_resolution_itself():
    """The checks below are only as good as this resolver."""
    src = ("import os, numpy as np\nfrom . import wire\nfrom ..transport import tcp\n"
           "from .base import Transport\nfrom asynccoll.errors import X\n"
           "def f():\n    import torch\n")
    got = imports_of(src, "asynccoll.parallel.ddp")
    assert got == {"os", "numpy", "asynccoll.parallel.wire", "asynccoll.transport.tcp",
                   "asynccoll.parallel.base.Transport", "asynccoll.errors.X", "torch"}
    assert "asynccoll.wire" in imports_of("from .. import wire", "asynccoll.parallel.ddp")
    assert imports_of("from . import base\nfrom ..wire import X", "asynccoll.transport",
                      is_package=True) == {"asynccoll.transport.base", "asynccoll.wire.X"}
    assert MODULES and any(p.name == "wire.py" for p in MODULES)


def top_level_imports(path: Path) -> set[str]:
    """What ``path`` imports at module level (not inside functions)."""
    tree = ast.parse(path.read_text())
    return {n for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)
            for n in imports_of(ast.unparse(node), module_name(path))}


@pytest.mark.parametrize(("module", "allowed"), [
    ("wire.py", ("asynccoll.errors", "asynccoll.wire_stream")),
    ("wire_stream.py", ("asynccoll.wire",)),
])
def test_wire_is_sans_io_and_imports_only_errors(module: str, allowed: tuple[str, ...]) -> None:
    found = imports(PACKAGE / module)
    ours = {n for n in found if within(n, "asynccoll")}
    bad = {n for n in ours if not any(within(n, a) for a in allowed)}
    assert not bad, f"{module} may import only {allowed}, imports {sorted(bad)}"
    io = {n for n in found if n.split(".")[0] in {"asyncio", "socket", "selectors", "uvloop"}}
    assert not io, f"{module} is sans-IO, but imports {sorted(io)}"


def _fresh_interpreter(code: str, what: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new Python process, with the checkout on its path (imports happen
    in the order the code gives); it must succeed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, f"{what}: {proc.stderr}"
    return proc


def test_wire_stream_sits_above_wire():
    """``wire_stream`` imports ``wire``; ``wire`` reaches ``wire_stream`` only from its module
    ``__getattr__`` (the names that moved keep importing from ``wire``)."""
    assert not {n for n in top_level_imports(PACKAGE / "wire.py")
                if within(n, "asynccoll.wire_stream")}
    for first in ("asynccoll.wire_stream", "asynccoll.wire"):
        code = (f"import {first}\n"
                "from asynccoll import wire, wire_stream\n"
                "from asynccoll.wire import BufferedFrameReader, HeadCache, HeaderMemo, "
                "ReduceOnRead\n"
                "assert BufferedFrameReader is wire_stream.BufferedFrameReader\n"
                "assert wire.PayloadSink is wire_stream.PayloadSink\n"
                "assert {'BufferedFrameReader', 'HeadCache', 'HeaderMemo', 'ReduceOnRead'} "
                "<= set(wire.__all__)\n")
        _fresh_interpreter(code, f"importing {first} first")


@pytest.mark.parametrize("module", ["collectives.py", "algorithms.py", "call.py"])
def test_collectives_never_import_a_concrete_transport(module: str) -> None:
    found = imports(PACKAGE / module)
    bad = {n for n in found for t in CONCRETE_TRANSPORTS if within(n, t)}
    assert not bad, f"{module} imports concrete transports: {sorted(bad)}"


def test_tcp_world_sits_above_the_tcp_data_path():
    """``tcp_world`` imports ``tcp``; ``tcp`` reaches ``tcp_world`` only from its module
    ``__getattr__`` (the names that moved keep importing from ``tcp``)."""
    assert not {n for n in top_level_imports(PACKAGE / "transport" / "tcp.py")
                if within(n, "asynccoll.transport.tcp_world")}
    assert "asynccoll.transport.tcp.TcpTransport" in imports(PACKAGE / "transport" / "tcp_world.py")
    for first in ("asynccoll.transport.tcp_world", "asynccoll.transport.tcp"):
        code = (f"import {first}\n"
                "from asynccoll.transport import tcp, tcp_world\n"
                "from asynccoll.transport.tcp import MESH_RANKS, startup_peers, tcp_init, "
                "tcp_local_world, tcp_store_world, world_crowded\n"
                "assert tcp_init is tcp_world.tcp_init\n"
                "assert startup_peers is tcp_world.startup_peers\n"
                "assert {'tcp_init', 'tcp_local_world', 'tcp_store_world'} <= set(tcp.__all__)\n")
        _fresh_interpreter(code, f"importing {first} first")


def test_parallel_uses_the_communicator_only():
    parallel = PACKAGE / "parallel"
    offenders = {}
    for path in sorted(parallel.rglob("*.py")) if parallel.is_dir() else []:
        bad = {n for n in imports(path)
               if within(n, "asynccoll.transport") or within(n, "asynccoll.wire")
               or within(n, "asynccoll.wire_stream")}
        if bad:
            offenders[rel(path)] = sorted(bad)
    assert not offenders, f"parallel/ must use Communicator only: {offenders}"


def test_import_asynccoll_pulls_in_no_optional_dependency():
    code = ("import sys, asynccoll\n"
            f"print(sorted(m for m in {OPTIONAL_DEPENDENCIES!r} if m in sys.modules))\n")
    proc = _fresh_interpreter(code, "import asynccoll")
    assert proc.stdout.strip() == "[]", f"import asynccoll imported {proc.stdout.strip()}"


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Module-level statements, looking into if/try/with blocks but not defs or classes."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If | ast.With):
            out += _top_level(node.body) + _top_level(getattr(node, "orelse", []))
        elif isinstance(node, ast.Try):
            out += _top_level(node.body) + _top_level(node.orelse) + _top_level(node.finalbody)
            for handler in node.handlers:
                out += _top_level(handler.body)
    return out


def _is_mutable(value: ast.expr | None) -> bool:
    if isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp
                  | ast.SetComp):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else (
            func.attr if isinstance(func, ast.Attribute) else None)
        return name in MUTABLE_CALLS
    return False


def _is_constant_name(name: str) -> bool:
    core = name.strip("_")
    return (name.startswith("__") and name.endswith("__")) or (core.isupper() and bool(core))


def mutable_module_state(source: str) -> list[str]:
    found = []
    for node in _top_level(ast.parse(source).body):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if not _is_mutable(value):
            continue
        for target in targets:
            if isinstance(target, ast.Name) and not _is_constant_name(target.id):
                found.append(target.id)
    # a function that rebinds a module's name (``global x; x = ...``) keeps state there too
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Global):
            found += [name for name in node.names if not _is_constant_name(name)]
    return found


def test_mutable_state_detector_itself():
    src = ("_cache = {}\nREGISTRY = {}\n__all__ = ['x']\nx: list[int] = []\n"
           "pending = set()\nfrom collections import defaultdict\nd = defaultdict(list)\n"
           "if True:\n    later = [1]\nn = 3\nt = (1, 2)\n_UFUNCS: dict = {}\n"
           "def f():\n    local = {}\nclass C:\n    attr = []\n"
           "_latest = None\ndef g(t):\n    global _latest\n    _latest = t\n")
    assert mutable_module_state(src) == ["_cache", "x", "pending", "d", "later", "_latest"]


@pytest.mark.parametrize("path", MODULES, ids=rel)
def test_no_module_level_mutable_state(path):
    names = [n for n in mutable_module_state(path.read_text())
             if f"{module_name(path)}:{n}" not in MUTABLE_STATE_ALLOWED]
    assert not names, (f"{rel(path)} binds mutable objects at module level: {names}; "
                       f"keep state in objects (or name a true constant in ALL_CAPS)")


def _print_allowed(path: Path) -> bool:
    inside = path.relative_to(PACKAGE).as_posix()
    return inside in PRINT_ALLOWED or inside.startswith("bench")


@pytest.mark.parametrize("path", [p for p in MODULES if not _print_allowed(p)], ids=rel)
def test_no_print_outside_the_command_line(path):
    calls = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id == "print"]
    assert not calls, f"{rel(path)} calls print() on lines {calls}; use logging"
