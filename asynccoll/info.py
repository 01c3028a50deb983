"""``asynccoll info``: versions, and which optional backends can run here (and why not)."""

from __future__ import annotations

import importlib
import platform
import shutil
import subprocess
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
        return (f"unavailable: CuPy not importable ({why}); the nccl backend needs CuPy with "
                f"a CUDA GPU: pip install 'asynccoll[gpu]'")
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as exc:  # CuPy without its NCCL bindings
        return f"unavailable: CuPy {version} has no NCCL bindings ({type(exc).__name__}: {exc})"
    if not getattr(nccl, "available", True):
        return f"unavailable: CuPy {version} was built without NCCL"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        nccl_version = nccl.get_version()
    except Exception as exc:  # no driver, no device
        return f"unavailable: CuPy {version} but no usable CUDA GPU ({type(exc).__name__}: {exc})"
    if count < 1:
        return f"unavailable: CuPy {version}, NCCL {nccl_version}, but no CUDA GPU visible"
    return f"available (CuPy {version}, NCCL {nccl_version}, {count} GPU(s))"


def _mpi_library() -> str:
    """The first line of the MPI library's version, without initialising MPI here.

    ``mpi4py.MPI`` initialises MPI when it is imported, unless ``mpi4py.rc`` says not to; and
    once imported that way it stays uninitialised. So unless this process imported it
    already, a child process imports it (with ``rc.initialize = False``), leaving this one
    free to use the mpi backend afterwards.

    Raises:
        RuntimeError: the child could not load the MPI library (its error as the message).
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        return str(mpi.Get_library_version()).splitlines()[0].strip()
    code = ("import mpi4py\n"
            "mpi4py.rc.initialize = False\n"
            "mpi4py.rc.finalize = False\n"
            "from mpi4py import MPI\n"
            "print(MPI.Get_library_version().splitlines()[0].strip())\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise RuntimeError(last)
    return lines[0]


def _mpi() -> str:
    version, why = _probe("mpi4py")
    if version is None:
        return (f"unavailable: mpi4py not importable ({why}); pip install 'asynccoll[mpi]' "
                f"and an MPI library (e.g. apt-get install openmpi-bin libopenmpi-dev)")
    try:
        library = _mpi_library()
    except Exception as exc:  # mpi4py present but libmpi missing or broken
        return (f"unavailable: mpi4py {version} but no usable MPI library "
                f"({type(exc).__name__}: {exc})")
    launcher = shutil.which("mpirun") or shutil.which("mpiexec")
    where = f"launcher {launcher}" if launcher else "no mpirun/mpiexec on PATH"
    return f"available (mpi4py {version}, {library}; {where})"


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
        "  tcp     available" + (" (uvloop installed: run your main with uvloop.run)"
                                 if uvloop_v else " (asyncio event loop)"),
        f"  nccl    {_nccl()}",
        f"  mpi     {_mpi()}",
    ]
    return "\n".join(lines)
