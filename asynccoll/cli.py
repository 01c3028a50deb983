"""Command line: ``asynccoll run | rendezvous | bench | info`` (also ``python -m asynccoll``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import secrets
import select
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from . import _exit_record

log = logging.getLogger("asynccoll.launcher")

#: seconds between SIGTERM and SIGKILL when stopping the other ranks
GRACE_SECONDS = 5.0
#: most bytes of a rank's output the launcher reads at once
PUMP_CHUNK = 1 << 16
#: the start of a line longer than this goes out before its end has come
LINE_LIMIT = 1 << 20
#: seconds a rank's unfinished line (a progress bar, a prompt) waits for more before it is shown
IDLE_FLUSH = 0.1
#: several nodes (``--nnodes``): the launchers' keys in the rendezvous store
NODES_PREFIX = "launch"
#: seconds a launcher waits for node 0's rendezvous to answer
NODES_CONNECT_SECONDS = 120.0
#: seconds after which a launcher still waiting for node 0's rendezvous says so, and then
#: between two reminders
NODES_NOTICE_SECONDS = 1.0
NODES_REMIND_SECONDS = 15.0
#: seconds between two looks at whether another node's rank failed
NODES_POLL_SECONDS = 0.2
#: seconds between two signs of life of a launcher in the store
NODES_BEAT_SECONDS = 1.0
#: seconds without a sign of life after which node 0 stops waiting for a node's launcher
NODES_STALE_SECONDS = 30.0
#: seconds without a sign of life, while node 0's ranks run, after which node 0 counts a
#: node's launcher whose connection to its rendezvous closed lost (killed, crashed) and
#: stops the job; one whose connection is open (stopped, blocked on its output, or its
#: machine gone) it counts lost after NODES_STALE_SECONDS
NODES_LOST_SECONDS = 3 * NODES_BEAT_SECONDS
#: seconds node 0 waits, at the end of an elastic job, for the others to read its totals
NODES_ACK_SECONDS = 10.0
#: seconds the launcher waits, after a rank failed because another rank did (its record in
#: ASYNCCOLL_ERROR_FILE says so), for a rank whose failure was its own, before it blames the
#: first (see asynccoll._exit_record)
BLAME_SECONDS = 3.0
#: seconds a launcher waits for an answer of node 0's rendezvous before it counts it lost
#: (node 0 counts a silent launcher out after as long: NODES_STALE_SECONDS)
NODES_CALL_SECONDS = NODES_STALE_SECONDS


def _run_loop(coro: Any) -> Any:
    """``asyncio.run`` on uvloop when it is installed."""
    _open_std_fds()
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# ------------------------------------------------------------------------------- launcher

def _write_all(stream: Any, data: bytes) -> None:
    """Write all of ``data`` to a binary stream and flush it. Under ``python -u`` (or
    ``PYTHONUNBUFFERED``) ``sys.stdout.buffer`` is a raw file, whose ``write`` may take
    only part (a full pipe and a signal, as SIGCHLD when a rank exits); a non-blocking one may
    take nothing for now."""
    view = memoryview(data)
    while True:
        try:
            if not view:
                stream.flush()  # (a buffered one's flush may find the pipe full too)
                return
            n = stream.write(view) or 0
        except BlockingIOError as exc:
            n = exc.characters_written if view else 0
        if not n:
            select.select([], [stream], [], 1.0)  # writable again, or try anyway
        view = view[n:]


def _same_file(a: Any, b: Any) -> bool:
    try:
        return os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
    except (AttributeError, OSError, ValueError):
        return False


def _open_std_fds() -> None:
    """Open /dev/null on whichever of fds 0, 1 and 2 is closed (``asynccoll run ... >&-``).
    Else the event loop's or a rank's pipe takes its number: output meant for the terminal
    goes into that pipe, and uvloop aborts the process when it closes it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # (the lowest free number: fd itself)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def _utf8_tail(data: bytes | bytearray) -> int:
    """How many bytes at the end of ``data`` are the start of a UTF-8 character whose other
    bytes have not come yet (0 when none, or when it is not UTF-8 at all)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return 0
        if byte >= 0xC0:  # the first byte of a character, which is 2, 3 or 4 bytes long
            size = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return back if back < size else 0
    return 0


_LINE_ENDS = re.compile(rb"(\r\n|\r|\n)")
#: where a rank's output stands: at the start of a line; inside a line (``_MID``); just after a
#: carriage return (``_CR``: a progress bar will draw over its line); or, after a carriage
#: return, with the line ended for it by another writer (``_ENDED_CR``: its ``\n`` is done)
_LINE, _MID, _CR, _ENDED_CR = range(4)


class _Screen:
    """One terminal or file the launcher writes to (stdout and stderr are one when they are
    the same file): which rank's output, if any, left its last line unfinished there."""

    __slots__ = ("open_by",)

    def __init__(self) -> None:
        self.open_by: _Tagger | None = None


class _Tagger:
    """Puts ``[rank] `` before every line of one output of one rank, and before every redraw
    of a line after a carriage return (``\r``: progress bars), in pieces as they come."""

    __slots__ = ("prefix", "screen", "state")

    def __init__(self, rank: int, screen: _Screen) -> None:
        self.prefix = f"[{rank}] ".encode()
        self.screen = screen
        self.state = _LINE

    def format(self, data: bytes) -> bytes:
        prefix = self.prefix
        parts = []
        if self.state in (_CR, _ENDED_CR):  # a line end now ends the line it returned over
            cut = 1 if data[:1] == b"\n" else 2 if data[:2] == b"\r\n" else 0
            if cut:
                if self.state == _CR:
                    parts.append(data[:cut])
                data = data[cut:]
                self.state = _LINE
        if not data:
            pass
        elif b"\r" not in data or data.count(b"\r") == data.count(b"\r\n"):
            # whole lines, the usual case: one replace
            lead = b"" if self.state == _MID else prefix
            if data.endswith(b"\n"):
                parts += [lead, data[:-1].replace(b"\n", b"\n" + prefix), b"\n"]
                self.state = _LINE
            else:
                parts += [lead, data.replace(b"\n", b"\n" + prefix)]
                self.state = _MID
        elif b"\n" not in data and b"\r\r" not in data:
            # redraws of one line, the usual case of a progress bar: one replace
            if data[:1] == b"\r" and self.state != _MID:
                data = data[1:]  # (nothing to return over)
            if data:
                lead = b"" if self.state == _MID else prefix
                body = data.replace(b"\r", b"\r" + prefix)
                if data.endswith(b"\r"):
                    parts += [lead, body[:-len(prefix)]]
                    self.state = _CR
                else:
                    parts += [lead, body]
                    self.state = _MID
        else:
            bits = _LINE_ENDS.split(data)  # piece, its end, piece, its end, ..., the rest
            for i in range(0, len(bits) - 1, 2):
                piece, end = bits[i], bits[i + 1]
                if piece:
                    if self.state != _MID:
                        parts.append(prefix)
                    parts += [piece, end]
                elif self.state == _MID or (self.state == _CR and end != b"\r"):
                    parts.append(end)
                elif end == b"\r":
                    continue  # back to the start of a line that has nothing yet
                elif self.state == _ENDED_CR:
                    self.state = _LINE  # (its end was written when the line was ended)
                    continue
                else:
                    parts += [prefix, end]  # an empty line
                self.state = _CR if end == b"\r" else _LINE
            if bits[-1]:
                if self.state != _MID:
                    parts.append(prefix)
                parts.append(bits[-1])
                self.state = _MID
        return b"".join(parts)


def _parent_death_signal() -> Any:
    """Linux: a ``preexec_fn`` for a rank's process that has the kernel SIGKILL it when the
    launcher dies (``prctl(PR_SET_PDEATHSIG)``), since a launcher killed with SIGKILL cannot
    stop its ranks; None elsewhere, or where the call is not available."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def die_with_launcher() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # it died before that: too late to be told
            os._exit(1)

    return die_with_launcher


#: Variables that size BLAS / OpenMP thread pools; ``run`` sets OMP_NUM_THREADS if none is set.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _shape_text(shape: dict[str, Any]) -> str:
    """A launcher's ``-n``, ``--nnodes`` and elastic settings, as on its command line, and
    the job id its processes use (when they use one)."""
    text = f"-n {shape['n']} --nnodes {shape['nnodes']}"
    if shape.get("min_nodes") is None:
        text += " (not elastic)"
    else:
        text += f" --min-nodes {shape['min_nodes']} --max-nodes {shape['max_nodes']}"
    return text + (f" (job id {shape['job']!r})" if shape.get("job") else "")


def _failure_text(failed: dict[str, Any]) -> str:
    """What another node's launcher said went wrong (its record under ``launch/failed``)."""
    if failed.get("lost") is not None:
        return _lost_text(int(failed["lost"]), bool(failed.get("gone")))
    if failed["rank"] is None:
        return f"the launcher of node {failed['node']} was interrupted"
    why = f" (its error came from rank {failed['from']})" if "from" in failed else ""
    return (f"rank {failed['rank']} (node {failed['node']}) exited with code "
            f"{failed['code']}{why}")


def _lost_text(node: int, gone: bool) -> str:
    """Why node 0 counted ``node``'s launcher lost while its ranks ran: ``gone``, its
    connection closed (the process is gone), else no sign of life for NODES_STALE_SECONDS."""
    if gone:
        return (f"node {node}'s launcher is gone (its connection to node 0 closed, and it gave "
                f"no sign of life for {NODES_LOST_SECONDS:g} s: killed, or crashed)")
    return (f"node {node}'s launcher gave no sign of life for {NODES_STALE_SECONDS:g} s (its "
            f"machine gone, or cut off)")


class _Launcher:
    def __init__(self, n: int, command: list[str], *, addr: str, port: int, token: str,
                 bind: str, elastic: tuple[int, int] | None = None,
                 max_restarts: int = 0, nnodes: int = 1, node_rank: int = 0) -> None:
        self.n = n
        #: several nodes: this launcher starts ranks node_rank * n ... node_rank * n + n - 1 of
        #: a world of nnodes * n; node 0's launcher hosts the rendezvous
        self.nnodes, self.node_rank = nnodes, node_rank
        #: several nodes: the connection to the rendezvous through which the launchers tell
        #: each other that a rank failed, and that their ranks ended
        self.client: Any = None
        #: several nodes: why node 0's rendezvous counts as lost (it stopped answering)
        self.lost: str | None = None
        #: several nodes: this launcher stopped its ranks because it lost node 0's rendezvous
        #: (and said so)
        self.stopped_for_lost = False
        #: node 0: the nodes whose launchers it stopped waiting for (no sign of life)
        self.nodes_gone: set[int] = set()
        #: node 0: the rendezvous it hosts
        self.server: Any = None
        #: several nodes, not node 0: a connection to node 0's rendezvous in a job id of its
        #: own (``_presence_job``), open as long as this launcher lives: node 0 sees it close
        #: when this launcher dies (``_watch_beats``)
        self.presence: Any = None
        #: (min_nodes, max_nodes) in elastic mode: a failed rank does not stop the others
        self.elastic = elastic
        self.restarts_left = max_restarts
        self.succeeded = 0
        #: elastic: replacements started so far (their labels come after every node's ranks)
        self.replacements = 0
        #: elastic: processes that exited after leaving the job (not counted as succeeded)
        self.left = 0
        #: the job id its processes use (ASYNCCOLL_JOB_ID; elastic, the launcher sets it):
        #: the namespace of the rendezvous that holds their roster, or their membership and
        #: where leavers say so. Every node's launcher must have the same
        self.job = os.environ.get("ASYNCCOLL_JOB_ID") or ""
        if elastic is not None and not self.job:
            from .elastic import DEFAULT_JOB

            self.job = DEFAULT_JOB
        #: elastic: this launcher's connection to the rendezvous in the job's namespace,
        #: open from before its processes start until after they ended. Through it the
        #: launcher reads who left; holding it keeps the job's keys in the server while
        #: none of the job's processes is connected (the last one left, or died and its
        #: replacement has not connected yet), since the server drops a job's keys with its
        #: last connection
        self.hold: Any = None
        self.watchers: list[asyncio.Future[None]] = []
        #: per process (in the order of ``procs``), the reading of its stdout and stderr,
        #: which children it started may hold open after it has gone
        self.outputs: list[asyncio.Future[Any]] = []
        self.command = command
        self.addr = addr
        self.port = port
        self.token = token
        self.bind = bind
        self.procs: list[asyncio.subprocess.Process] = []
        self.first_failure: tuple[int, int] | None = None
        #: the job's failure is a victim's (a rank that failed because of another, blamed
        #: when no culprit came in time, here or on another node): a culprit whose own
        #: failure shows later takes its place, on every node
        self.relayed = False
        #: where each rank leaves its record at exit (ASYNCCOLL_ERROR_FILE): the folder
        self.records: str | None = None
        #: the ranks whose failure came from another rank, in the order they exited:
        #: (rank, exit code, the rank its failure came from)
        self.victims: list[tuple[int, int, int]] = []
        #: while the launcher waits for the rank the first of them failed because of
        self.blaming: asyncio.Future[None] | None = None
        self.stopping = False
        #: a Ctrl-C (or SIGTERM, SIGHUP) arrived: the ranks it stops are not replaced
        self.interrupted = False
        #: the launcher's exit code once interrupted: 128 + the first signal that came
        #: (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP), as a shell reports a process
        #: that such a signal ended
        self.interrupt_code = 128 + signal.SIGINT
        #: sys.stdout / sys.stderr once whoever reads them has gone (a broken pipe)
        self.closed_outputs: set[Any] = set()
        #: per output (sys.stdout, sys.stderr), where the ranks' lines go
        self.screens: dict[Any, _Screen] = {}
        #: run in each rank's process before its program: the kernel kills it if this
        #: launcher dies (SIGKILL, a crash), rather than leave it running unseen
        self.die_with_launcher = _parent_death_signal()

    def env(self, rank: int, rdv_port: int, local: int) -> dict[str, str]:
        env = dict(os.environ)
        world = self.n * self.nnodes
        env.update({
            "ASYNCCOLL_RANK": str(rank), "RANK": str(rank),
            "ASYNCCOLL_LOCAL_RANK": str(local), "LOCAL_RANK": str(local),
            "ASYNCCOLL_NODE_RANK": str(self.node_rank), "GROUP_RANK": str(self.node_rank),
            "ASYNCCOLL_WORLD_SIZE": str(world), "WORLD_SIZE": str(world),
            "ASYNCCOLL_LOCAL_WORLD_SIZE": str(self.n), "LOCAL_WORLD_SIZE": str(self.n),
            "ASYNCCOLL_ADDR": self.addr, "MASTER_ADDR": self.addr,
            "ASYNCCOLL_PORT": str(rdv_port), "MASTER_PORT": str(rdv_port),
            "ASYNCCOLL_RENDEZVOUS": f"{self.addr}:{rdv_port}",
            "ASYNCCOLL_TOKEN": self.token,
            "PYTHONUNBUFFERED": "1",
        })
        if self.records is not None:
            env[_exit_record.ENV] = self._record_path(rank)
        else:
            env.pop(_exit_record.ENV, None)  # (one of a launcher that started this one)
        # N processes whose BLAS/OpenMP pools each start one thread per core oversubscribe
        # the machine N times (a 10x slowdown of NumPy training on 2 cores): share the cores,
        # as torchrun does, unless the user chose
        if not any(v in os.environ for v in THREAD_VARS):
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.n))
        if self.elastic is not None:
            env["ASYNCCOLL_ELASTIC"] = "1"
            env["ASYNCCOLL_MIN_NODES"] = str(self.elastic[0])
            env["ASYNCCOLL_MAX_NODES"] = str(self.elastic[1])
            env["ASYNCCOLL_JOB_ID"] = self.job
        return env

    async def spawn(self, rank: int, rdv_port: int, local: int) -> None:
        """Start the process labelled ``rank``, the ``local``-th of this node, and watch it."""
        proc = await asyncio.create_subprocess_exec(
            *self.command, env=self.env(rank, rdv_port, local),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, limit=1 << 20, preexec_fn=self.die_with_launcher)
        assert proc.stdout is not None and proc.stderr is not None
        output = asyncio.gather(self._pump(rank, proc.stdout, sys.stdout),
                                self._pump(rank, proc.stderr, sys.stderr))
        self.procs.append(proc)
        self.outputs.append(output)
        if self.interrupted:  # (a Ctrl-C while it started, sent to those that ran then)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGINT)
        self.watchers.append(asyncio.ensure_future(self._watch(rank, proc, output, rdv_port,
                                                               local)))

    async def _pump(self, rank: int, stream: asyncio.StreamReader, out: Any) -> None:
        """Copy ``stream`` to ``out``, each line prefixed with ``[rank] ``, and each redraw
        after a carriage return too (a progress bar keeps its prefix). What a read brings goes
        out in one write, up to its last line end or carriage return; the start of a line
        whose end has not come goes out once the rank has written nothing for ``IDLE_FLUSH``
        seconds (progress bars, prompts) or once it passes ``LINE_LIMIT``, never in the
        middle of a UTF-8 character. A line left unfinished when another rank (or the
        launcher) writes to the same terminal or file is ended there; its rest comes on a
        line of its own, prefixed again."""
        tagger = _Tagger(rank, self._screen(out))
        begun = bytearray()  # the start of a line whose end has not come yet
        due: float | None = None  # when that goes out, if nothing ends it before
        loop = asyncio.get_running_loop()
        while True:
            try:
                if due is not None:
                    async with asyncio.timeout_at(due):
                        chunk = await stream.read(PUMP_CHUNK)
                else:
                    chunk = await stream.read(PUMP_CHUNK)
            except TimeoutError:
                end = len(begun) - _utf8_tail(begun)
            else:
                if not chunk:  # the end of its output: the rest, and a line end
                    self._emit(tagger, out, bytes(begun))
                    if tagger.screen.open_by is tagger:
                        tagger.screen.open_by = None
                        self._write(out, b"\n")
                    return
                begun += chunk
                end = begun.rfind(b"\n") + 1
                cr = begun.rfind(b"\r", end)
                if cr >= 0:  # up to a redraw after it, which goes out with its \r
                    end = len(begun) if cr == len(begun) - 1 else cr
                if len(begun) - end >= LINE_LIMIT:
                    end = len(begun) - _utf8_tail(begun)
            if end:
                self._emit(tagger, out, bytes(begun[:end]))
                del begun[:end]
                due = None
            if due is None and len(begun) > _utf8_tail(begun):  # (dots, one by one: shown)
                due = loop.time() + IDLE_FLUSH

    def _screen(self, out: Any) -> _Screen:
        """The screen of ``out``: that of another output that is the same file (``2>&1``,
        one terminal), else its own."""
        screen = self.screens.get(out)
        if screen is None:
            screen = next((s for o, s in self.screens.items() if _same_file(o, out)),
                          _Screen())
            self.screens[out] = screen
        return screen

    def _emit(self, tagger: _Tagger, out: Any, data: bytes) -> None:
        text = tagger.format(data)
        if not text:
            return
        screen = tagger.screen
        other = screen.open_by
        if other is not None and other is not tagger:  # end the line it left unfinished
            other.state = _ENDED_CR if other.state == _CR else _LINE
            text = b"\n" + text
        screen.open_by = tagger if tagger.state in (_MID, _CR) else None
        self._write(out, text)

    def _say(self, message: str) -> None:
        """Write the launcher's own ``message`` to stderr, on a line of its own (waiting
        while a non-blocking stderr is full, rather than failing)."""
        out = sys.stderr
        if out is None:
            return
        data = message.encode(getattr(out, "encoding", None) or "utf-8", "backslashreplace")
        screen = self._screen(out)
        if screen.open_by is not None:
            other, screen.open_by = screen.open_by, None
            other.state = _ENDED_CR if other.state == _CR else _LINE
            data = b"\n" + data
        with contextlib.suppress(OSError, ValueError):
            out.flush()
        self._write(out, data)

    def _write(self, out: Any, data: bytes) -> None:
        if out is None or out in self.closed_outputs:
            return  # still read, so that the rank never blocks on a full pipe
        try:
            _write_all(out.buffer, data)
        except BrokenPipeError:
            # whoever read our output stopped (``asynccoll run ... | head``): the job goes
            # on, its output to that stream is dropped, and nothing left in the stream's
            # buffer fails again at exit
            self.closed_outputs.add(out)
            with contextlib.suppress(OSError, ValueError):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, out.fileno())
                os.close(null)

    async def _watch(self, rank: int, proc: asyncio.subprocess.Process,
                     output: asyncio.Future[Any], rdv_port: int, local: int) -> None:
        """Act on the exit of ``proc`` as soon as it exits (not once its output is closed:
        children it started may hold that open), then wait for the end of its output."""
        code = await proc.wait()
        if code == 0 and await self._has_left(rank, proc.pid):
            self.left += 1
            self._say(f"asynccoll run: rank {rank} left the job; the others go on\n")
        elif code == 0:
            self.succeeded += 1
        elif self.interrupted:
            pass  # stopped by the Ctrl-C (or SIGTERM, SIGHUP) that main reports
        elif self.elastic is not None and not self.stopping:
            # elastic: the others re-form without it; a replacement joins if restarts are left
            log.info("rank %d exited with %s; the others go on", rank, code)
            if self.restarts_left > 0 and not self.interrupted:
                self.restarts_left -= 1
                # labels no other node's process has: after every node's ranks, then in turns
                label = self.n * self.nnodes + self.replacements * self.nnodes + self.node_rank
                self.replacements += 1
                self._say(f"asynccoll run: rank {rank} exited with code {code}; "
                          f"starting a replacement as [{label}]\n")
                await self.spawn(label, rdv_port, local)   # (in its place: its GPU, say)
            else:
                self._say(f"asynccoll run: rank {rank} exited with code {code}; "
                          f"the others go on\n")
        elif code != 0 and ((self.first_failure is None and not self.stopping)
                            or (self.relayed and not self._stopped_by_us(code))):
            record = (_exit_record.read(self._record_path(rank))
                      if self.records is not None else None)
            if record is None:  # its own failure (or killed: it could write nothing)
                await self._fail(rank, code)
            elif self.first_failure is None:
                self.victims.append((rank, code, record["peer"]))
                if self.blaming is None:
                    self.blaming = asyncio.ensure_future(self._blame_later())
                await self.blaming
        await output

    async def _fail(self, rank: int, code: int, came_from: int | None = None) -> None:
        """The job failed with rank ``rank``'s exit ``code``: say so, stop the other ranks
        and tell the other nodes. ``came_from``: the rank its failure came from, when no
        rank was seen failing on its own (a culprit's failure seen later replaces it)."""
        self.first_failure, self.relayed = (rank, code), came_from is not None
        log.info("rank %d exited with %s; stopping the other ranks", rank, code)
        why = f" (its error came from rank {came_from})" if came_from is not None else ""
        self._say(f"asynccoll run: rank {rank} exited with code {code}{why}; "
                  f"stopping the others\n")
        await asyncio.gather(self.stop(), self._tell_nodes(rank, code, came_from))

    def _stopped_by_us(self, code: int) -> bool:
        """Whether a rank's exit ``code`` is that of the signals ``stop`` sends."""
        return self.stopping and code in (-signal.SIGTERM, -signal.SIGKILL)

    async def _blame_later(self) -> None:
        """A rank failed because another did: wait up to BLAME_SECONDS for the rank whose
        failure was its own (its exit here, or another node's word), which is then blamed
        (``_watch``, ``_watch_nodes``); without one, blame the first of those victims. The
        other ranks are not stopped meanwhile: a culprit stopped would exit with the code of
        the signal, not its own."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BLAME_SECONDS
        while self.first_failure is None and not self.stopping and not self.interrupted:
            if loop.time() >= deadline:
                break
            if self.client is None and all(p.returncode is not None for p in self.procs):
                break  # (every rank here exited: no culprit will come)
            await asyncio.sleep(0.02)
        if self.first_failure is None and not self.stopping and not self.interrupted:
            rank, code, peer = self.victims[0]
            await self._fail(rank, code, peer)

    # -- several nodes ----------------------------------------------------------------------

    async def _tell_nodes(self, rank: int | None, code: int, came_from: int | None = None,
                          lost: int | None = None, gone: bool = False) -> None:
        """Several nodes: tell the other launchers that ``rank`` of this node failed with
        ``code`` (None: the launcher was interrupted, or, with ``lost``, node 0 lost that
        node's launcher; ``gone``, its connection closed), unless a failure is known
        already. ``came_from``: the rank its
        failure came from (a victim blamed when no culprit came in time). A failure of a
        rank's own replaces a victim's record, so that every node blames the same rank (see
        ``_final_blame``)."""
        if self.client is None:
            return
        mine: dict[str, Any] = {"node": self.node_rank, "rank": rank, "code": code}
        if came_from is not None:
            mine["from"] = came_from
        if lost is not None:
            mine["lost"], mine["gone"] = lost, gone
        record, key = json.dumps(mine), f"{NODES_PREFIX}/failed"
        try:
            swapped, there = await self._ask(self.client.compare_set(key, None, record))
            if (not swapped and there is not None and rank is not None and came_from is None
                    and json.loads(there).get("from") is not None):
                await self._ask(self.client.compare_set(key, there, record))
        except Exception as exc:  # node 0's launcher is gone: its ranks go with it
            log.warning("could not tell the other nodes that rank %s failed: %s", rank, exc)

    async def _watch_nodes(self) -> None:
        """Several nodes: stop this node's ranks as soon as another node says one of its
        ranks failed (or its launcher was interrupted), or (not elastic) once node 0's
        rendezvous is lost: its launcher is gone, and its ranks with it."""
        key = f"{NODES_PREFIX}/failed"
        while True:
            try:
                value = await self._ask(self.client.get(key, wait=False))
            except KeyError:
                await asyncio.sleep(NODES_POLL_SECONDS)
                continue
            except Exception as exc:
                if self.elastic is not None or self.node_rank == 0:
                    self._say(f"asynccoll run: lost the rendezvous of node 0 ({exc}); this "
                              f"node's processes go on\n")
                elif self.first_failure is None and not self.stopping and not self.interrupted:
                    # (nobody could tell this node that the job failed any more; node 0's
                    # ranks die with their launcher)
                    self.first_failure = (-1, 1)
                    self.stopped_for_lost = True
                    self._say(f"asynccoll run: lost the rendezvous of node 0 ({exc}): its "
                              f"launcher is gone; stopping this node's ranks\n")
                    await self.stop()
                return
            failed = json.loads(value)
            if failed["node"] == self.node_rank:
                return  # ours: reported and acted on where it happened
            code = int(failed["code"])
            if self.first_failure is None and not self.stopping and not self.interrupted:
                self.first_failure = (-1 if failed["rank"] is None else int(failed["rank"]),
                                      code)
                self.relayed = failed.get("from") is not None
                self._say(f"asynccoll run: {_failure_text(failed)}; stopping this node's "
                          f"ranks\n")
                await self.stop()
            return

    @staticmethod
    def _presence_job(node: int) -> str:
        """The job id of the connection by which ``node``'s launcher shows it lives."""
        return f"{NODES_PREFIX}/node/{node}"

    async def _watch_beats(self) -> None:
        """Node 0, not elastic, while its ranks run: count another node's launcher lost, then
        stop this node's ranks and tell the other nodes, once its heartbeat has not moved
        for NODES_LOST_SECONDS and its connection to this rendezvous (``presence``) closed
        (SIGKILL, a crash: the kernel took its ranks with it, and this node's ranks may not
        notice, none being in a collective with them), or for NODES_STALE_SECONDS with the
        connection open (its machine gone; a launcher stopped or blocked on its output for
        a while is not lost). A node whose ranks ended (``done``), or whose launcher has
        given no beat yet (not started its ranks), is not watched."""
        c = self.client
        loop = asyncio.get_running_loop()
        seen: dict[int, tuple[bytes, float]] = {}  # node: (last beat, when it changed)
        present: set[int] = set()  # nodes whose launcher's presence node 0 has seen
        while True:
            await asyncio.sleep(NODES_POLL_SECONDS)
            lost, gone = None, False
            try:
                for k in sorted(set(range(1, self.nnodes)) - self.nodes_gone):
                    try:
                        await self._ask(c.get(f"{NODES_PREFIX}/done/{k}", wait=False))
                        continue
                    except KeyError:
                        pass
                    beat, now = await self._beat(k), loop.time()
                    there = self.server is not None and self._presence_job(k) in self.server.jobs
                    if there:
                        present.add(k)
                    last = seen.get(k)
                    if beat is None:
                        continue
                    if last is None or last[0] != beat:
                        seen[k] = (beat, now)
                        continue
                    silent = now - last[1]
                    gone = k in present and not there
                    if (gone and silent > NODES_LOST_SECONDS) or silent > NODES_STALE_SECONDS:
                        lost = k
                        break
            except Exception:  # (its own rendezvous not answering: _watch_nodes says so)
                return
            if (self.first_failure is not None or self.victims or self.stopping
                    or self.interrupted):
                return  # (the job ends anyway: its failure is told as it is)
            if lost is not None:
                self.nodes_gone.add(lost)
                self.first_failure = (-1, 1)
                self._say(f"asynccoll run: {_lost_text(lost, gone)}; stopping this node's "
                          f"ranks\n")
                await asyncio.gather(self.stop(),
                                     self._tell_nodes(None, 1, lost=lost, gone=gone))
                return

    async def _ask(self, call: Any) -> Any:
        """Await a call to node 0's rendezvous, for at most NODES_CALL_SECONDS (a machine
        cut off the network answers nothing): past that, the rendezvous counts as lost, and
        every later call fails at once."""
        from .errors import RendezvousError

        if self.lost is not None:
            call.close()
            raise RendezvousError(self.lost)
        try:
            async with asyncio.timeout(NODES_CALL_SECONDS):
                return await call
        except TimeoutError:
            self.lost = (f"no answer from the rendezvous at {self.addr}:{self.port} for "
                         f"{NODES_CALL_SECONDS:g} s")
            raise RendezvousError(self.lost) from None

    async def _connect_nodes(self) -> bool:
        """Several nodes: connect to node 0's rendezvous (waiting for it to start, and
        saying so after NODES_NOTICE_SECONDS, then every NODES_REMIND_SECONDS: a wrong
        --addr or --port, or node 0's launcher not started yet)."""
        from .rendezvous import RendezvousClient

        where = f"node 0's rendezvous at {self.addr}:{self.port}"
        connecting = asyncio.ensure_future(RendezvousClient.connect(
            self.addr, self.port, token=self.token, timeout=NODES_CONNECT_SECONDS))
        try:
            waited, step = 0.0, NODES_NOTICE_SECONDS
            while not (await asyncio.wait([connecting], timeout=step))[0]:
                if not waited:
                    self._say(f"asynccoll run: node {self.node_rank} waiting for {where} "
                              f"(node 0's launcher; up to {NODES_CONNECT_SECONDS:g} s) ...\n")
                waited += step
                if waited > step:
                    self._say(f"asynccoll run: node {self.node_rank} still waiting for "
                              f"{where} ({waited:.0f} s of {NODES_CONNECT_SECONDS:g} s)\n")
                step = NODES_REMIND_SECONDS
            self.client = connecting.result()
        except Exception as exc:
            self._say(f"asynccoll run: node {self.node_rank} cannot reach the rendezvous at "
                      f"{self.addr}:{self.port} (node 0's launcher): {exc}\n")
            return False
        finally:
            if not connecting.done():  # (interrupted)
                connecting.cancel()
                await asyncio.gather(connecting, return_exceptions=True)
        return True

    async def _join_nodes(self) -> tuple[str, int] | None:
        """Several nodes, before this node's ranks start: check this launcher against the
        job in node 0's store. Node 0's launcher (the first to connect: it hosts the
        rendezvous) records the job's shape, which every other node's must have. One
        launcher at a time holds a node rank: another is refused while the holder shows
        signs of life (one restarted after its predecessor died takes its place). A job that
        failed already starts nothing more. Returns (what is wrong, the exit code), or None."""
        c = self.client
        lo, hi = self.elastic if self.elastic is not None else (None, None)
        mine = {"n": self.n, "nnodes": self.nnodes, "min_nodes": lo, "max_nodes": hi,
                "job": self.job}
        if self.node_rank == 0:
            await self._ask(c.set(f"{NODES_PREFIX}/shape", json.dumps(mine)))
        else:
            theirs = json.loads(await self._ask(
                c.get(f"{NODES_PREFIX}/shape", timeout=NODES_CALL_SECONDS / 2)))
            if theirs != mine:
                return (f"node {self.node_rank}'s launcher was started with "
                        f"{_shape_text(mine)}, node 0's with {_shape_text(theirs)}: every "
                        f"node needs the same -n, --nnodes, --min-nodes, --max-nodes and "
                        f"ASYNCCOLL_JOB_ID", 2)
        me = f"{c.local_address[0]}, pid {os.getpid()}"
        key = f"{NODES_PREFIX}/node/{self.node_rank}"
        swapped, holder = await self._ask(c.compare_set(key, None, me))
        if not swapped:
            # another launcher holds this node rank: still there if its heartbeat moves
            beat = await self._beat(self.node_rank)
            await asyncio.sleep(2.5 * NODES_BEAT_SECONDS)
            if await self._beat(self.node_rank) == beat:
                swapped, _ = await self._ask(c.compare_set(key, holder, me))
            if not swapped:
                who = holder.decode(errors="replace") if holder else "?"
                return (f"--node-rank {self.node_rank} is taken: another launcher ({who}) "
                        f"runs node {self.node_rank} of this job", 2)
            log.info("node %d: took the place of a launcher that gave no sign of life (%s)",
                     self.node_rank, holder)
            await self._ask(c.delete(f"{NODES_PREFIX}/done/{self.node_rank}"))
        if self.elastic is None:
            try:
                failed = json.loads(await self._ask(c.get(f"{NODES_PREFIX}/failed",
                                                          wait=False)))
            except KeyError:
                return None
            code = int(failed["code"])
            self.first_failure = (-1, code)
            return (f"the job failed already ({_failure_text(failed)}); not starting this "
                    f"node's ranks", code if code > 0 else 128 - code)
        return None

    async def _beat(self, node: int) -> bytes | None:
        """The last sign of life of ``node``'s launcher in the store (None: none yet)."""
        try:
            return bytes(await self._ask(self.client.get(f"{NODES_PREFIX}/alive/{node}",
                                                         wait=False)))
        except KeyError:
            return None

    async def _heartbeat(self) -> None:
        """Several nodes: a sign of life in the store every NODES_BEAT_SECONDS, until this
        node's ranks ended (node 0 stops waiting for a launcher that gave none for
        NODES_STALE_SECONDS: killed, or its machine gone)."""
        key = f"{NODES_PREFIX}/alive/{self.node_rank}"
        beat = 0
        while True:
            beat += 1
            with contextlib.suppress(Exception):  # (node 0's rendezvous is gone: said elsewhere)
                await self.client.set(key, str(beat))
            await asyncio.sleep(NODES_BEAT_SECONDS)

    async def _end_nodes(self) -> tuple[int, int] | None:
        """Several nodes, once this node's ranks ended: say so in the store, elastic with how
        many of its processes succeeded and left. Node 0 keeps the rendezvous up until every
        node's ranks ended (see ``_wait_for_nodes``); elastic, it then publishes the job's
        totals, which the other nodes wait for. Returns those totals, (succeeded, left), for
        an elastic job (None: one node, or node 0's rendezvous is gone)."""
        c = self.client
        if c is None:
            return None
        try:
            if self.elastic is not None:
                await self._ask(c.add(f"{NODES_PREFIX}/succeeded", self.succeeded))
                await self._ask(c.add(f"{NODES_PREFIX}/left", self.left))
            asking = self.relayed and self.node_rank != 0
            if asking:  # (node 0 answers once every node's ranks ended: see _final_blame)
                await self._ask(c.add(f"{NODES_PREFIX}/asking", 1))
            await self._ask(c.set(f"{NODES_PREFIX}/done/{self.node_rank}", b"1"))
            if self.node_rank == 0:
                ended = await self._wait_for_nodes()
                if self.elastic is None:
                    await self._final_blame()
                    return None
                totals = (int(await c.get(f"{NODES_PREFIX}/succeeded", wait=False)),
                          int(await c.get(f"{NODES_PREFIX}/left", wait=False)))
                await c.set(f"{NODES_PREFIX}/totals", f"{totals[0]} {totals[1]}")
                # (until the others read them: closing the rendezvous would cut them off)
                for _ in range(int(NODES_ACK_SECONDS / (NODES_POLL_SECONDS / 4))):
                    if await c.add(f"{NODES_PREFIX}/read", 0) >= ended:
                        break
                    await asyncio.sleep(NODES_POLL_SECONDS / 4)
                return totals
            if self.elastic is None:
                if asking:
                    await self._final_blame()
                return None
            loop = asyncio.get_running_loop()
            began, said = loop.time(), False
            while True:  # (node 0's launcher answers once every node's processes ended)
                try:
                    succeeded, left = (await self._ask(c.get(f"{NODES_PREFIX}/totals",
                                                             wait=False))).split()
                except KeyError:
                    pass
                else:
                    await self._ask(c.add(f"{NODES_PREFIX}/read", 1))
                    return int(succeeded), int(left)
                if not said and loop.time() - began > 2.0:
                    said = True
                    self._say("asynccoll run: this node's processes ended; waiting for the "
                              "other nodes' (the job's result comes from node 0)\n")
                await asyncio.sleep(NODES_POLL_SECONDS)
        except Exception as exc:
            if not self.stopped_for_lost:  # (said already: see _watch_nodes)
                self._say(f"asynccoll run: lost the rendezvous of node 0 ({exc})\n")
            return None

    async def _final_blame(self) -> None:
        """Several nodes, not elastic, once this node's ranks ended: whom the job's failure
        is finally blamed on. A launcher that blamed a victim (a rank whose failure came
        from another, when no culprit came in time) may hear of the culprit later: a
        culprit's record replaces a victim's in the store (``_tell_nodes``), once the
        culprit's node sees its exit. Every node's ranks have ended when node 0 reads it
        here; node 0 then tells the nodes that asked (``asking``) and waits for them to read
        it (up to NODES_ACK_SECONDS) before it closes the rendezvous."""
        c = self.client
        if self.node_rank == 0:
            if self.relayed:
                self._adopt(await self._ask(c.get(f"{NODES_PREFIX}/failed", wait=False)))
            await self._ask(c.set(f"{NODES_PREFIX}/ended", b"1"))
            asking = int(await self._ask(c.add(f"{NODES_PREFIX}/asking", 0)))
            for _ in range(int(NODES_ACK_SECONDS / (NODES_POLL_SECONDS / 4))):
                if not asking or await self._ask(c.add(f"{NODES_PREFIX}/read", 0)) >= asking:
                    break
                await asyncio.sleep(NODES_POLL_SECONDS / 4)
            return
        # (node 0 sets 'ended' once every node's ranks ended, or it gave up on them)
        await self._ask(c.get(f"{NODES_PREFIX}/ended", timeout=NODES_CALL_SECONDS / 2))
        self._adopt(await self._ask(c.get(f"{NODES_PREFIX}/failed", wait=False)))
        await self._ask(c.add(f"{NODES_PREFIX}/read", 1))

    def _adopt(self, value: bytes) -> None:
        """Blame the culprit of the record ``value`` of ``launch/failed`` instead of the
        victim this launcher blamed (``relayed``), when it is another node's culprit."""
        failed = json.loads(value)
        if (not self.relayed or failed["node"] == self.node_rank or failed["rank"] is None
                or failed.get("from") is not None):
            return
        self.first_failure, self.relayed = (int(failed["rank"]), int(failed["code"])), False
        self._say(f"asynccoll run: {_failure_text(failed)}, a failure of its own: the "
                  f"rank blamed above failed because of it\n")

    async def _wait_for_nodes(self) -> int:
        """Node 0: keep the rendezvous up until every other node's ranks ended, not waiting
        for a launcher that gave no sign of life for NODES_STALE_SECONDS (``nodes_gone``).
        Once the job failed (not elastic), or this launcher is interrupted, only the nodes
        whose launchers connected are waited for: until they stopped their ranks, which they
        do as soon as they read the failure here. Returns how many other nodes' ranks
        ended."""
        c = self.client
        loop = asyncio.get_running_loop()
        began, said, told = loop.time(), False, False
        seen: dict[int, tuple[bytes | None, float]] = {}  # node: (last beat, when it changed)
        gone = self.nodes_gone
        while True:
            failed = self.interrupted
            if self.interrupted and not told and self.first_failure is None:
                told = True  # (interrupted after this node's ranks ended: the others stop)
                await self._tell_nodes(None, self.interrupt_code)
            if not failed and self.elastic is None:
                try:
                    failed = bool(await c.get(f"{NODES_PREFIX}/failed", wait=False))
                except KeyError:
                    pass
            now, waiting = loop.time(), []
            for k in sorted(set(range(1, self.nnodes)) - gone):
                try:
                    await c.get(f"{NODES_PREFIX}/done/{k}", wait=False)
                    continue
                except KeyError:
                    pass
                beat = await self._beat(k)
                if beat is None and failed:
                    continue  # never connected: it learns of the failure when it does
                last = seen.get(k)
                if last is None or last[0] != beat:
                    seen[k] = (beat, now)
                elif now - last[1] > NODES_STALE_SECONDS:
                    gone.add(k)
                    self._say(f"asynccoll run: node {k}'s launcher gave no sign of life for "
                              f"{NODES_STALE_SECONDS:g} s; not waiting for it\n")
                    continue
                waiting.append(k)
            if not waiting:
                return self.nnodes - 1 - len(gone)
            if not said and now - began > 2.0:
                said = True
                self._say(f"asynccoll run: keeping the rendezvous up until the ranks of node(s) "
                          f"{', '.join(map(str, waiting))} end\n")
            await asyncio.sleep(NODES_POLL_SECONDS)

    async def _has_left(self, rank: int, pid: int) -> bool:
        """Whether the process labelled ``rank`` left the elastic job (``ElasticGroup.leave``
        says so in the store) rather than finished its work."""
        if self.elastic is None:
            return False
        from .elastic import PREFIX

        key = f"{PREFIX}/left/{rank}"
        if self.hold is None:
            return False
        try:
            return bool(await self.hold.get(key, wait=False) == str(pid).encode())
        except Exception:  # not there (KeyError), or node 0's rendezvous is gone
            return False

    def _signal_all(self, sig: int) -> None:
        """Send ``sig`` to the process group of every rank that runs, or that has exited
        but left children holding its output open."""
        for proc, output in zip(self.procs, self.outputs, strict=True):
            if proc.returncode is None or not output.done():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)

    async def _wait_all(self) -> None:
        """Until every rank has exited and its output is closed."""
        await asyncio.gather(*(p.wait() for p in self.procs))
        await asyncio.wait(self.outputs)

    async def stop(self, first: int = signal.SIGTERM) -> None:
        self.stopping = True
        self._signal_all(first)
        try:
            async with asyncio.timeout(GRACE_SECONDS):
                await self._wait_all()
        except TimeoutError:
            self._signal_all(signal.SIGKILL)
            await asyncio.gather(*(p.wait() for p in self.procs))

    def _record_path(self, rank: int) -> str:
        assert self.records is not None
        return os.path.join(self.records, f"rank-{rank}.json")

    async def main(self) -> int:
        self.records = tempfile.mkdtemp(prefix="asynccoll-run-")
        try:
            return await self._main()
        finally:
            shutil.rmtree(self.records, ignore_errors=True)

    async def _main(self) -> int:
        from .rendezvous import RendezvousServer

        server = None
        if self.node_rank == 0:  # (the other nodes' ranks use node 0's)
            server = RendezvousServer(self.bind, self.port, token=self.token)
            try:
                await server.start()
            except OSError as exc:
                self._say(f"asynccoll run: cannot start the rendezvous server on "
                          f"{self.bind}:{self.port}: {self._bind_error(exc)}\n")
                return 1
            self.server = server
        rdv_port = server.port if server is not None else self.port
        try:
            if self.nnodes > 1:
                code = await self._interruptible(self._meet_nodes())
                if code is not None:
                    return code
            if self.elastic is not None:
                code = await self._interruptible(self._hold_job(rdv_port))
                if code is not None:
                    return code
            return await self._run(rdv_port)
        finally:
            if self.hold is not None:
                await self.hold.close()
            if self.presence is not None:
                await self.presence.close()
            if self.client is not None:
                await self.client.close()
            if server is not None:
                await server.close()

    def _bind_error(self, exc: OSError) -> str:
        """Why node 0's rendezvous could not bind, and what to change (asyncio's message
        says neither)."""
        if exc.errno == errno.EADDRINUSE:
            which = ("node 0's launcher of this job started twice, or another job's; give "
                     "another --port" if self.nnodes > 1 else
                     "give another --port, or none (a free one)")
            return f"address already in use (another program listens there: {which})"
        if exc.errno == errno.EADDRNOTAVAIL:
            return ("address not available (--bind, else --addr, must be an address of this "
                    "machine)")
        return str(exc)

    async def _hold_job(self, rdv_port: int) -> int | None:
        """Elastic, before this node's processes start: connect to the rendezvous (node 0's)
        in the job's namespace, as they will (``hold``). None, or the launcher's exit code
        when it cannot."""
        from .rendezvous import RendezvousClient

        try:
            self.hold = await RendezvousClient.connect(
                self.addr, rdv_port, token=self.token, job=self.job,
                timeout=NODES_CALL_SECONDS)
        except Exception as exc:
            where = f"{self.addr}:{rdv_port}" + (" (node 0's launcher)" if self.node_rank else "")
            self._say(f"asynccoll run: cannot reach the rendezvous at {where}: {exc}\n")
            return 1
        return None

    async def _meet_nodes(self) -> int | None:
        """Several nodes, before this node's ranks start: connect to node 0's rendezvous
        and join the job there; None, or the launcher's exit code when it must not start
        its ranks."""
        if not await self._connect_nodes():
            return 1
        try:
            refused = await self._join_nodes()
        except Exception as exc:
            self._say(f"asynccoll run: lost the rendezvous of node 0 ({exc})\n")
            return 1
        if refused is not None:
            why, code = refused
            self._say(f"asynccoll run: {why}\n")
            if code != 2:  # (the job failed: this node's part of it is over)
                await self._end_nodes()
            return code
        if self.node_rank != 0:
            from .rendezvous import RendezvousClient

            try:
                self.presence = await RendezvousClient.connect(
                    self.addr, self.port, token=self.token,
                    job=self._presence_job(self.node_rank), timeout=NODES_CALL_SECONDS)
            except Exception as exc:  # (node 0 then counts it lost only once it is silent)
                log.warning("could not show node 0 that this launcher lives: %s", exc)
        return None

    def _note_interrupt(self, sig: int) -> None:
        """A Ctrl-C, SIGTERM or SIGHUP (``sig``) came: the first one sets the exit code."""
        if not self.interrupted:
            self.interrupted, self.interrupt_code = True, 128 + sig

    async def _interruptible(self, coro: Any) -> Any:
        """Await ``coro`` (before any rank started), ending it on Ctrl-C, SIGTERM or SIGHUP:
        then say so, tell the other nodes, and return 128 + the signal (130 for Ctrl-C; no
        traceback, nothing left)."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(coro)

        def on_interrupt(sig: int) -> None:
            self._note_interrupt(sig)
            task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is None:
                continue
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, on_interrupt, sig)
        try:  # (_run replaces the handlers with its own)
            return await task
        except asyncio.CancelledError:
            if not self.interrupted or not task.cancelled():
                raise
        self._say("asynccoll run: interrupted before this node's ranks started\n")
        await self._tell_nodes(None, self.interrupt_code)
        return self.interrupt_code

    async def _run(self, rdv_port: int) -> int:
        """Start this node's ranks and watch them until they end; the exit code."""
        loop = asyncio.get_running_loop()
        interrupted = asyncio.Event()

        def on_interrupt(sig: int) -> None:
            if interrupted.is_set():  # second Ctrl-C: no more patience
                self._signal_all(signal.SIGKILL)
            interrupted.set()
            self._note_interrupt(sig)
            self._signal_all(signal.SIGINT)

        # (SIGHUP: the terminal went away; the ranks, in sessions of their own, would not know)
        for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is not None:
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, on_interrupt, sig)
        nodes = ([asyncio.ensure_future(self._watch_nodes()),
                  asyncio.ensure_future(self._heartbeat())] if self.client is not None else [])
        if self.client is not None and self.node_rank == 0 and self.elastic is None:
            nodes.append(asyncio.ensure_future(self._watch_beats()))
        try:
            for local in range(self.n):
                if self.interrupted:  # (Ctrl-C while they start: those started have it)
                    break
                await self.spawn(self.node_rank * self.n + local, rdv_port, local)
            interrupt = asyncio.ensure_future(interrupted.wait())
            # (the list grows when an elastic run starts a replacement)
            while not interrupt.done() and not all(w.done() for w in self.watchers):
                # (only those still running: a finished one would end every wait at once)
                waiting: list[asyncio.Future[Any]] = [
                    *(w for w in self.watchers if not w.done()), interrupt]
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if interrupt.done():
                self._say("asynccoll run: interrupted; stopping the ranks\n")
                await self._tell_nodes(None, self.interrupt_code)
                try:
                    async with asyncio.timeout(GRACE_SECONDS):
                        await self._wait_all()
                except TimeoutError:
                    await self.stop(signal.SIGKILL)
                await asyncio.gather(*self.watchers, return_exceptions=True)
            else:
                interrupt.cancel()
                await asyncio.gather(*self.watchers)
        finally:
            if any(p.returncode is None for p in self.procs):
                await self.stop()
            for task in nodes:
                task.cancel()
            await asyncio.gather(*nodes, return_exceptions=True)
        # (node 0: until the other nodes' ranks ended, or know that they must)
        totals = await self._end_nodes()
        if self.interrupted:
            return self.interrupt_code
        if self.elastic is not None:
            succeeded, left = totals if totals is not None else (self.succeeded, self.left)
            if succeeded < self.elastic[0]:
                where = " on all nodes" if totals is not None else ""
                gone = f" ({left} left the job)" if left else ""
                self._say(f"asynccoll run: only {succeeded} processes succeeded{where}, "
                          f"fewer than --min-nodes {self.elastic[0]}{gone}\n")
                return 1
            return 0
        if self.first_failure is not None:
            code = self.first_failure[1]
            return code if code > 0 else 128 - code
        if self.nodes_gone:
            self._say(f"asynccoll run: the ranks of this node succeeded; those of node(s) "
                      f"{', '.join(map(str, sorted(self.nodes_gone)))}, whose launcher "
                      f"vanished, may not have\n")
            return 1
        return 0


def _environment_problem(command: str) -> str | None:
    """A variable the launcher's rendezvous (or every rank) would refuse, as one line: say it
    before anything starts, not as a traceback (or N of them)."""
    from .handshake import handshake_timeout

    try:
        handshake_timeout()
    except ValueError as exc:
        return f"asynccoll {command}: {exc}"
    return None


def _cmd_run(args: argparse.Namespace) -> int:
    problem = _environment_problem("run")
    if problem:
        sys.stderr.write(problem + "\n")
        return 2
    if args.n < 1:
        sys.stderr.write("asynccoll run: -n must be >= 1\n")
        return 2
    if args.script[:1] == ["--"]:  # ``run -n 2 -m -- module --its-options``
        args.script = args.script[1:]
    if not args.script:
        sys.stderr.write("asynccoll run: give a script (or -m module) to run\n")
        return 2
    if not 0 <= args.port <= 65535:
        sys.stderr.write(f"asynccoll run: --port must be 0-65535, got {args.port}\n")
        return 2
    if args.module:
        command = [sys.executable, "-m", *args.script]
    else:
        command = [sys.executable, *args.script]
    token = args.token or os.environ.get("ASYNCCOLL_TOKEN") or secrets.token_hex(16)
    if args.nnodes < 1:
        sys.stderr.write(f"asynccoll run: --nnodes must be >= 1, got {args.nnodes}\n")
        return 2
    elastic = None
    if args.elastic or args.min_nodes is not None or args.max_nodes is not None:
        total = args.n * args.nnodes  # (processes, on every node: not machines)
        lo = args.min_nodes if args.min_nodes is not None else 1
        hi = args.max_nodes if args.max_nodes is not None else max(total, lo)
        if not 1 <= lo <= hi or total > hi:
            sys.stderr.write(f"asynccoll run: need 1 <= --min-nodes ({lo}) <= --max-nodes "
                             f"({hi}) and -n ({args.n}) x --nnodes ({args.nnodes}) <= "
                             f"--max-nodes\n")
            return 2
        elastic = (lo, hi)
    elif args.max_restarts:
        sys.stderr.write("asynccoll run: --max-restarts needs --elastic\n")
        return 2
    if args.max_restarts < 0:
        sys.stderr.write(f"asynccoll run: --max-restarts must be >= 0, "
                         f"got {args.max_restarts}\n")
        return 2
    if args.nnodes > 1:
        problem = None
        if args.node_rank is None:
            problem = "--nnodes > 1 needs --node-rank (0 on the node that hosts the rendezvous)"
        elif not 0 <= args.node_rank < args.nnodes:
            problem = f"--node-rank must be 0-{args.nnodes - 1}, got {args.node_rank}"
        elif not args.port:
            problem = "--nnodes > 1 needs --port (the same on every node)"
        elif not (args.token or os.environ.get("ASYNCCOLL_TOKEN")):
            problem = ("--nnodes > 1 needs a token shared by every node: set ASYNCCOLL_TOKEN "
                       "(or --token)")
        if problem:
            sys.stderr.write(f"asynccoll run: {problem}\n")
            return 2
    elif args.node_rank not in (None, 0):
        sys.stderr.write(f"asynccoll run: --node-rank must be 0 with one node, got "
                         f"{args.node_rank}\n")
        return 2
    launcher = _Launcher(args.n, command, addr=args.addr, port=args.port, token=token,
                         bind=args.bind or args.addr, elastic=elastic,
                         max_restarts=args.max_restarts, nnodes=args.nnodes,
                         node_rank=args.node_rank or 0)
    return int(_run_loop(launcher.main()))


# ------------------------------------------------------------------------------ rendezvous

async def _serve_announced(host: str, port: int, token: str | None) -> None:
    """``rendezvous.serve`` that says where it listens, on stdout (with ``--port 0`` that is
    the only way to know)."""
    from .rendezvous import RendezvousServer

    async with RendezvousServer(host, port, token=token) as server:
        print(f"asynccoll rendezvous: listening on {server.host}:{server.port}", flush=True)
        await asyncio.get_running_loop().create_future()  # until Ctrl-C


def _cmd_rendezvous(args: argparse.Namespace) -> int:
    problem = _environment_problem("rendezvous")
    if problem:
        sys.stderr.write(problem + "\n")
        return 2
    if not 0 <= args.port <= 65535:  # the kernel would take it modulo 65536
        sys.stderr.write(f"asynccoll rendezvous: --port must be 0-65535, got {args.port}\n")
        return 2
    # without a token, the server warns once it listens beyond loopback, naming the port it
    # got (warning here, before binding, named --port 0 and a port it never got)
    token = args.token or os.environ.get("ASYNCCOLL_TOKEN")
    try:
        with contextlib.suppress(KeyboardInterrupt):
            _run_loop(_serve_announced(args.host, args.port, token))
    except OSError as exc:  # the address is taken, not ours, or not an address
        sys.stderr.write(f"asynccoll rendezvous: cannot listen on {args.host}:{args.port}: "
                         f"{exc}\n")
        return 1
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

    run = sub.add_parser(
        "run", help="start N local processes of a script, one per rank",
        description="Start N local processes of a script, one per rank, with a rendezvous "
                    "for them. Each line of a rank's output is prefixed with [rank] (its "
                    "stdout to stdout, its stderr to stderr); the start of an unfinished line "
                    "shows after 0.1 s without more, and a progress bar redrawn after a "
                    "carriage return keeps its prefix. When a rank fails, the others are "
                    "stopped and the launcher exits with its code (unless --elastic): that of "
                    "the rank whose failure was its own, not of one that failed because of "
                    "it (see ASYNCCOLL_ERROR_FILE in docs/backends/tcp.md). A job "
                    "on several machines runs one launcher on each (--nnodes, --node-rank): "
                    "a failure on any node stops every node's ranks. Ctrl-C, SIGTERM or "
                    "SIGHUP stops the ranks (on every node), and the launcher exits with 128 "
                    "+ the signal: 130, 143 or 129.")
    run.add_argument("-n", "--nproc", dest="n", type=int, required=True,
                     help="number of ranks (on this node)")
    run.add_argument("--nnodes", type=int, default=1,
                     help="nodes of the job: one launcher on each starts N ranks; node 0's "
                          "hosts the rendezvous on --addr:--port (default 1)")
    run.add_argument("--node-rank", type=int, default=None,
                     help="this node's index, 0 to NNODES-1 (its ranks: NODE_RANK*N to "
                          "NODE_RANK*N+N-1)")
    run.add_argument("--addr", default="127.0.0.1",
                     help="address the ranks use to reach the rendezvous (default 127.0.0.1; "
                          "with --nnodes > 1: node 0's address, the same on every node)")
    run.add_argument("--port", type=int, default=0,
                     help="rendezvous port (default: a free one)")
    run.add_argument("--bind", default=None, help="address the rendezvous binds (default --addr)")
    run.add_argument("--token", default=None,
                     help="shared secret (default: $ASYNCCOLL_TOKEN or a fresh random one; "
                          "a token given here is visible in ps, prefer the variable)")
    run.add_argument("--elastic", action="store_true",
                     help="elastic job: a failed rank does not stop the others, which re-form "
                          "(see asynccoll.elastic); implied by --min-nodes/--max-nodes")
    run.add_argument("--min-nodes", type=int, default=None,
                     help="elastic: fewest processes a generation forms with (default 1)")
    run.add_argument("--max-nodes", type=int, default=None,
                     help="elastic: most processes in a generation (default -n)")
    run.add_argument("--max-restarts", type=int, default=0,
                     help="elastic: start a replacement for a failed rank, this many times")
    run.add_argument("-m", dest="module", action="store_true",
                     help="run a module (like python -m) instead of a script")
    run.add_argument("script", nargs=argparse.REMAINDER, help="script.py [args...]")
    run.set_defaults(func=_cmd_run)

    rdv = sub.add_parser(
        "rendezvous", help="run a standalone rendezvous server",
        description="A standalone rendezvous server: ranks reach it with "
                    "ASYNCCOLL_RENDEZVOUS=HOST:PORT. One server can serve several jobs, one "
                    "after another or at once: give each job's ranks its own ASYNCCOLL_JOB_ID "
                    "(or init(job=...)); a job's keys and roster go when its last connection "
                    "closes. ASYNCCOLL_HANDSHAKE_TIMEOUT (seconds, default 5) bounds how long "
                    "a connection may take to authenticate.")
    rdv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    rdv.add_argument("--port", type=int, default=29500, help="port (default 29500)")
    rdv.add_argument("--token", default=None,
                     help="shared secret (default $ASYNCCOLL_TOKEN; a token given here is "
                          "visible in ps, prefer the variable)")
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
