"""Command line: ``asynccoll run | rendezvous | bench | info`` (also ``python -m asynccoll``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("asynccoll.launcher")

#: seconds between SIGTERM and SIGKILL when stopping the other ranks
GRACE_SECONDS = 5.0


def _run_loop(coro: Any) -> Any:
    """``asyncio.run`` on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# ------------------------------------------------------------------------------- launcher

#: Variables that size BLAS / OpenMP thread pools; ``run`` sets OMP_NUM_THREADS if none is set.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


class _Launcher:
    def __init__(self, n: int, command: list[str], *, addr: str, port: int, token: str,
                 bind: str) -> None:
        self.n = n
        self.command = command
        self.addr = addr
        self.port = port
        self.token = token
        self.bind = bind
        self.procs: list[asyncio.subprocess.Process] = []
        self.first_failure: tuple[int, int] | None = None
        self.stopping = False

    def env(self, rank: int, rdv_port: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "ASYNCCOLL_RANK": str(rank), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "ASYNCCOLL_WORLD_SIZE": str(self.n), "WORLD_SIZE": str(self.n),
            "LOCAL_WORLD_SIZE": str(self.n),
            "ASYNCCOLL_ADDR": self.addr, "MASTER_ADDR": self.addr,
            "ASYNCCOLL_PORT": str(rdv_port), "MASTER_PORT": str(rdv_port),
            "ASYNCCOLL_RENDEZVOUS": f"{self.addr}:{rdv_port}",
            "ASYNCCOLL_TOKEN": self.token,
            "PYTHONUNBUFFERED": "1",
        })
        # N processes whose BLAS/OpenMP pools each start one thread per core oversubscribe
        # the machine N times (a 10x slowdown of NumPy training on 2 cores): share the cores,
        # as torchrun does, unless the user chose
        if not any(v in os.environ for v in THREAD_VARS):
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.n))
        return env

    async def _pump(self, rank: int, stream: asyncio.StreamReader, out: Any) -> None:
        prefix = f"[{rank}] ".encode()
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line longer than the limit: pass it through in pieces
                line = await stream.read(1 << 16)
            if not line:
                return
            out.buffer.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.buffer.flush()

    async def _watch(self, rank: int, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        await asyncio.gather(self._pump(rank, proc.stdout, sys.stdout),
                             self._pump(rank, proc.stderr, sys.stderr))
        code = await proc.wait()
        if code != 0 and self.first_failure is None and not self.stopping:
            self.first_failure = (rank, code)
            log.warning("rank %d exited with %s; stopping the other ranks", rank, code)
            sys.stderr.write(f"asynccoll run: rank {rank} exited with code {code}; "
                             f"stopping the others\n")
            await self.stop()

    def _signal_all(self, sig: int) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)

    async def stop(self, first: int = signal.SIGTERM) -> None:
        self.stopping = True
        self._signal_all(first)
        try:
            async with asyncio.timeout(GRACE_SECONDS):
                await asyncio.gather(*(p.wait() for p in self.procs))
        except TimeoutError:
            self._signal_all(signal.SIGKILL)
            await asyncio.gather(*(p.wait() for p in self.procs))

    async def main(self) -> int:
        from .rendezvous import RendezvousServer

        server = RendezvousServer(self.bind, self.port, token=self.token)
        await server.start()
        loop = asyncio.get_running_loop()
        interrupted = asyncio.Event()

        def on_interrupt() -> None:
            if interrupted.is_set():  # second Ctrl-C: no more patience
                self._signal_all(signal.SIGKILL)
            interrupted.set()
            self._signal_all(signal.SIGINT)

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, on_interrupt)
        try:
            for rank in range(self.n):
                proc = await asyncio.create_subprocess_exec(
                    *self.command, env=self.env(rank, server.port),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    start_new_session=True, limit=1 << 20)
                self.procs.append(proc)
            watchers = [asyncio.ensure_future(self._watch(r, p)) for r, p in enumerate(self.procs)]
            interrupt = asyncio.ensure_future(interrupted.wait())
            while not interrupt.done() and not all(w.done() for w in watchers):
                await asyncio.wait([*watchers, interrupt], return_when=asyncio.FIRST_COMPLETED)
            if interrupt.done():
                sys.stderr.write("asynccoll run: interrupted; stopping the ranks\n")
                try:
                    async with asyncio.timeout(GRACE_SECONDS):
                        await asyncio.gather(*(p.wait() for p in self.procs))
                except TimeoutError:
                    await self.stop(signal.SIGKILL)
                await asyncio.gather(*watchers, return_exceptions=True)
                return 130
            interrupt.cancel()
            await asyncio.gather(*watchers)
        finally:
            if any(p.returncode is None for p in self.procs):
                await self.stop()
            await server.close()
        if self.first_failure is not None:
            code = self.first_failure[1]
            return code if code > 0 else 128 - code
        return 0


def _cmd_run(args: argparse.Namespace) -> int:
    if args.n < 1:
        sys.stderr.write("asynccoll run: -n must be >= 1\n")
        return 2
    if not args.script:
        sys.stderr.write("asynccoll run: give a script (or -m module) to run\n")
        return 2
    if args.module:
        command = [sys.executable, "-m", *args.script]
    else:
        command = [sys.executable, *args.script]
    token = args.token or os.environ.get("ASYNCCOLL_TOKEN") or secrets.token_hex(16)
    launcher = _Launcher(args.n, command, addr=args.addr, port=args.port, token=token,
                         bind=args.bind or args.addr)
    return int(_run_loop(launcher.main()))


# ------------------------------------------------------------------------------ rendezvous

def _cmd_rendezvous(args: argparse.Namespace) -> int:
    from .rendezvous import serve

    token = args.token or os.environ.get("ASYNCCOLL_TOKEN")
    if token is None:
        log.warning("no token: any process that can reach %s:%d can join", args.host, args.port)
    with contextlib.suppress(KeyboardInterrupt):
        _run_loop(serve(args.host, args.port, token))
    return 0


# ------------------------------------------------------------------------------------ info

def _cmd_info(args: argparse.Namespace) -> int:
    from .info import report

    print(report())
    return 0


# ----------------------------------------------------------------------------------- bench

def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return int(bench_main(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asynccoll",
                                     description="collective communication for asyncio")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more (-v: INFO, -vv: DEBUG)")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="start N local processes of a script, one per rank")
    run.add_argument("-n", "--nproc", dest="n", type=int, required=True, help="number of ranks")
    run.add_argument("--addr", default="127.0.0.1",
                     help="address the ranks use to reach the rendezvous (default 127.0.0.1)")
    run.add_argument("--port", type=int, default=0,
                     help="rendezvous port (default: a free one)")
    run.add_argument("--bind", default=None, help="address the rendezvous binds (default --addr)")
    run.add_argument("--token", default=None,
                     help="shared secret (default: $ASYNCCOLL_TOKEN or a fresh random one)")
    run.add_argument("-m", dest="module", action="store_true",
                     help="run a module (like python -m) instead of a script")
    run.add_argument("script", nargs=argparse.REMAINDER, help="script.py [args...]")
    run.set_defaults(func=_cmd_run)

    rdv = sub.add_parser("rendezvous", help="run a standalone rendezvous server")
    rdv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    rdv.add_argument("--port", type=int, default=29500, help="port (default 29500)")
    rdv.add_argument("--token", default=None, help="shared secret (default $ASYNCCOLL_TOKEN)")
    rdv.set_defaults(func=_cmd_rendezvous)

    info = sub.add_parser("info", help="versions and which optional backends are available")
    info.set_defaults(func=_cmd_info)

    from .bench import add_arguments

    bench = sub.add_parser("bench", help="nccl-tests-style collective benchmark")
    add_arguments(bench)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
