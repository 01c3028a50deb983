"""``asynccoll info``: versions, and which optional backends can run here (and why not)."""

from __future__ import annotations

import importlib
import platform
import sys

from ._version import __version__


def _probe(module: str) -> tuple[str | None, str | None]:
    """(version, None) when importable, else (None, reason)."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # any import failure is a reason to report, not to crash
        return None, f"{type(exc).__name__}: {exc}"
    return str(getattr(mod, "__version__", "unknown version")), None


def _nccl() -> str:
    version, why = _probe("cupy")
    if version is None:
        return f"unavailable (CuPy not importable: {why}; pip install 'asynccoll[gpu]')"
    try:
        import cupy
        from cupy.cuda import nccl

        count = cupy.cuda.runtime.getDeviceCount()
        return f"available (CuPy {version}, NCCL {nccl.get_version()}, {count} GPU(s))"
    except Exception as exc:
        return f"unavailable (CuPy {version} but no usable GPU/NCCL: {exc})"


def _mpi() -> str:
    version, why = _probe("mpi4py")
    if version is None:
        return f"unavailable (mpi4py not importable: {why}; pip install 'asynccoll[mpi]')"
    try:
        from mpi4py import MPI

        return f"available (mpi4py {version}, {MPI.Get_library_version().splitlines()[0]})"
    except Exception as exc:
        return f"unavailable (mpi4py {version} but no MPI runtime: {exc})"


def report() -> str:
    numpy_v, _ = _probe("numpy")
    msgpack_v, _ = _probe("msgpack")
    uvloop_v, uvloop_why = _probe("uvloop")
    torch_v, torch_why = _probe("torch")
    lines = [
        f"asynccoll {__version__}",
        f"python    {sys.version.split()[0]} ({platform.platform()})",
        f"numpy     {numpy_v}",
        f"msgpack   {msgpack_v}",
        f"uvloop    {uvloop_v or f'not installed ({uvloop_why})'}",
        f"torch     {torch_v or f'not installed ({torch_why})'}",
        "backends:",
        "  memory  available",
        "  tcp     available" + (" (uvloop)" if uvloop_v else " (asyncio event loop)"),
        f"  nccl    not implemented yet; runtime: {_nccl()}",
        f"  mpi     not implemented yet; runtime: {_mpi()}",
    ]
    return "\n".join(lines)
