"""The command line with real processes: ``python -m asynccoll run | rendezvous | info``.

Each test starts real interpreters (the launcher and its ranks, or ranks by hand) running the
scripts in ``tests/helpers/``, reads their output line by line with a deadline, and checks
exit codes, the rank prefixes, PeerLostError detection times and that no rank outlives the
launcher. Every child prints ``PID <pid>`` first; the ``reaper`` fixture SIGKILLs whatever is
still alive at teardown, so a failing test never leaves processes behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
HELPERS = REPO / "tests" / "helpers"

#: environment variables a launcher or torchrun may have left in our own environment
_WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT")

PID_LINE = re.compile(r"^(?:\[(\d+)\] )?PID (\d+)$")
LOST_LINE = re.compile(r"^\[(\d+)\] LOST rank=(\S+) after=([0-9.]+)")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ASYNCCOLL_") and k not in _WORLD_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                        if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_fixed_port() -> int:
    """A port that is free now and outside the ephemeral range, for a server that must listen
    on a port chosen in advance (MASTER_PORT). Outside the range, no outgoing connection can
    take it in the meantime, and a client retrying before the server listens cannot connect
    to itself (TCP self-connect)."""
    lo, hi = _ephemeral_range()
    candidates = [p for p in range(20000, 32000) if not lo <= p <= hi] or list(range(hi + 1,
                                                                                   65535))
    rng = random.Random()
    for port in rng.sample(candidates, min(200, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found")


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's process reused the pid
        return True
    # a zombie still answers signal 0; it is gone for our purposes
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


class Proc:
    """A child process whose merged stdout/stderr a thread collects line by line."""

    def __init__(self, args: Sequence[str], env: dict[str, str]) -> None:
        self.args = list(args)
        self.started = time.monotonic()
        self.popen = subprocess.Popen(
            self.args, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        with self.popen.stdout as out:
            for raw in out:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                with self._cond:
                    self.lines.append(line)
                    self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def wait_for(self, predicate: Callable[[list[str]], bool], timeout: float) -> bool:
        """Wait until ``predicate(lines)`` holds (True) or the output ended / time ran out."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.lines):
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    return predicate(self.lines)
                self._cond.wait(left)
            return True

    def finish(self, timeout: float) -> int:
        """Wait for exit and the end of the output; fail the test (showing output) on timeout."""
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.args} did not exit within {timeout} s; output so far:\n"
                        f"{self.output}")
        self._thread.join(10)
        return code

    def child_pids(self) -> list[int]:
        with self._cond:
            return [int(m.group(2)) for line in self.lines if (m := PID_LINE.match(line))]

    def kill(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)
        self._thread.join(10)


@pytest.fixture
def reaper() -> Iterator[Callable[..., Proc]]:
    """``start(args, env)``: a :class:`Proc`; at teardown every one (and every child pid it
    reported) still alive is SIGKILLed."""
    procs: list[Proc] = []

    def start(args: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(args, env if env is not None else clean_env())
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        for pid in proc.child_pids():
            if pid_exists(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


def launcher(*args: str) -> list[str]:
    return [sys.executable, "-m", "asynccoll", "run", *args]


def assert_all_gone(pids: list[int], grace: float = 5.0) -> None:
    deadline = time.monotonic() + grace
    alive = [p for p in pids if pid_exists(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if pid_exists(p)]
    assert not alive, f"processes still alive after the launcher exited: {alive}"


def rank_lines(output: str, rank: int, text: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(f"[{rank}] ")
            and text in line]


# ------------------------------------------------------------------------------- success

@pytest.mark.parametrize("ranks", [2, 4])
def test_run_all_gather_check(reaper: Callable[..., Proc], ranks: int) -> None:
    """Direct all_gathers between real processes, with uneven blocks, point-to-point frames
    ahead of the blocks and late ranks mixed in: every result exact, and every rank read
    some blocks straight off the wire and received others the usual way."""
    proc = reaper(launcher("-n", str(ranks), str(HELPERS / "all_gather_check.py")))
    code = proc.finish(60)
    out = proc.output
    assert code == 0, out
    for r in range(ranks):
        assert rank_lines(out, r, f"OK rank {r}"), out
        (line,) = rank_lines(out, r, "direct ")
        direct, usual = (int(x) for x in re.findall(r"\d+", line.split("] ", 1)[1])[:2])
        assert direct > 0 and usual > 0, line


def test_run_allreduce_check(reaper: Callable[..., Proc]) -> None:
    proc = reaper(launcher("-n", "3", str(HELPERS / "allreduce_check.py")))
    code = proc.finish(45)
    out = proc.output
    assert code == 0, out
    for r in range(3):
        assert rank_lines(out, r, f"OK rank {r}"), out
    assert len(proc.child_pids()) == 3
    assert_all_gone(proc.child_pids())


def test_run_quickstart(reaper: Callable[..., Proc]) -> None:
    proc = reaper(launcher("-n", "2", str(REPO / "examples" / "quickstart.py")))
    code = proc.finish(45)
    out = proc.output
    assert code == 0, out
    for r in range(2):
        lines = rank_lines(out, r, "all_reduce")
        assert lines, out
        assert any("[1.0, 3.0, 5.0, 7.0]" in line for line in lines), out


def test_run_output_read_by_a_reader_that_stops(tmp_path: Path) -> None:
    """``asynccoll run ... | head -1``: once whoever reads the launcher's output is gone, the
    job still runs to its end (the ranks' output drained, never blocking them) and exits 0,
    with no traceback about the broken pipe."""
    err = tmp_path / "stderr"
    with open(err, "wb") as errf:
        popen = subprocess.Popen(launcher("-n", "2", str(HELPERS / "chatty.py")), cwd=REPO,
                                 env=clean_env(), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=errf, start_new_session=True)
        pids: list[int] = []
        try:
            assert popen.stdout is not None
            first = popen.stdout.readline().decode()
            m = PID_LINE.match(first.rstrip("\n"))
            assert m, first
            pids.append(int(m.group(2)))
            popen.stdout.close()  # the reader goes away
            code = popen.wait(60)
        finally:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait(10)
    text = err.read_text()
    assert code == 0, text
    assert "Traceback" not in text and "BrokenPipe" not in text, text
    assert_all_gone(pids)


def test_run_output_lines_longer_than_a_mebibyte_are_passed_on_whole(
        reaper: Callable[..., Proc], tmp_path: Path) -> None:
    """A rank printing a 3 MB line (a large array, a progress bar's carriage returns): the
    launcher read lines with StreamReader.readline, which drops what it buffered once a line
    passes its 1 MiB limit, so about 2.3 MB of it never came out. Now every byte does, in
    prefixed pieces, and the lines after it too."""
    script = tmp_path / "long_line.py"
    script.write_text(
        "import sys\n"
        "sys.stdout.write('x' * 3_000_000 + '\\n')\n"
        "sys.stdout.write('after\\n')\n")
    proc = reaper(launcher("-n", "2", str(script)))
    code = proc.finish(60)
    out = proc.output
    assert code == 0, out[-2000:]
    for r in range(2):
        pieces = [line for line in proc.lines if line.startswith(f"[{r}] x")]
        assert sum(len(line) - len(f"[{r}] ") for line in pieces) == 3_000_000, len(out)
        assert set("".join(line[len(f"[{r}] "):] for line in pieces)) == {"x"}
        assert f"[{r}] after" in proc.lines, out[-2000:]


@pytest.mark.parametrize("module", [False, True])
def test_run_passes_dashed_arguments_after_a_double_dash(reaper: Callable[..., Proc],
                                                         tmp_path: Path, module: bool) -> None:
    """``asynccoll run -n 2 -m -- mod --flag -n 5``: the '--' that ends the launcher's own
    options went on to Python as the module name ('No module named --'); with a script it
    happened to work. Both run the program with its arguments as given."""
    (tmp_path / "show_args.py").write_text("import sys\nprint('ARGS', sys.argv[1:])\n")
    target = ["-m", "--", "show_args"] if module else ["--", str(tmp_path / "show_args.py")]
    proc = reaper(launcher("-n", "2", *target, "--flag", "-n", "5", "--"),
                  clean_env(PYTHONPATH=os.pathsep.join((str(tmp_path), str(REPO)))))
    code = proc.finish(60)
    assert code == 0, proc.output
    for r in range(2):
        assert f"[{r}] ARGS ['--flag', '-n', '5', '--']" in proc.lines, proc.output


async def test_run_output_survives_a_stdout_that_takes_part_of_each_write() -> None:
    """Under PYTHONUNBUFFERED (set in many containers) the launcher's sys.stdout.buffer is a
    raw file, whose write takes only part of the data when a signal (SIGCHLD: a rank exited)
    interrupts it on a full pipe; the launcher dropped the rest (output read through a pipe
    lost hundreds of KB and ran one rank's piece into another's). Every byte goes out."""
    from asynccoll.cli import _Launcher

    class ShortWrites(io.RawIOBase):
        """Takes at most 1000 bytes a call, and nothing every third call."""

        def __init__(self) -> None:
            self.got = bytearray()
            self.calls = 0

        def writable(self) -> bool:
            return True

        def fileno(self) -> int:
            return 1

        def write(self, b: Any) -> int | None:
            self.calls += 1
            if self.calls % 3 == 0:
                return None
            n = min(len(b), 1000)
            self.got += bytes(b[:n])
            return n

    class Out:
        buffer = ShortWrites()

    stream = asyncio.StreamReader(limit=1 << 20)
    stream.feed_data(b"x" * 300_000 + b"\nafter\n")
    stream.feed_eof()
    launcher = _Launcher(1, ["script.py"], addr="127.0.0.1", port=0, token="t",
                         bind="127.0.0.1")
    await asyncio.wait_for(launcher._pump(3, stream, Out), 30)
    assert bytes(Out.buffer.got) == b"[3] " + b"x" * 300_000 + b"\n[3] after\n"


def test_run_output_survives_a_non_blocking_stdout_pipe(tmp_path: Path) -> None:
    """A launcher whose stdout is a non-blocking pipe (O_NONBLOCK set on it by whoever shares
    it) with a reader that falls behind: without PYTHONUNBUFFERED, the flush of its buffered
    stdout raised BlockingIOError, a traceback ended the launcher and most of the output was
    lost. It waits until the pipe takes the rest."""
    script = tmp_path / "loud.py"
    script.write_text("for i in range(1500):\n    print(f'line {i:05d} ' + 'x' * 1000)\n")
    env = clean_env()
    del env["PYTHONUNBUFFERED"]
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        popen = subprocess.Popen(
            [sys.executable, "-m", "asynccoll", "run", "-n", "2", str(script)], cwd=REPO,
            env=env, stdin=subprocess.DEVNULL, stdout=w, stderr=subprocess.PIPE,
            start_new_session=True)
    finally:
        os.close(w)
    got = bytearray()
    try:
        time.sleep(1.0)  # the ranks fill the pipe meanwhile
        deadline = time.monotonic() + 60
        with open(r, "rb", buffering=0) as reader:
            while time.monotonic() < deadline:
                piece = reader.read(1 << 16)
                if not piece:
                    break
                got += piece
        _, err = popen.communicate(timeout=60)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
    assert popen.returncode == 0, err.decode(errors="replace")[-2000:]
    lines = got.decode().splitlines()
    for rank in range(2):
        assert [ln for ln in lines if ln.startswith(f"[{rank}] ")] == [
            f"[{rank}] line {i:05d} " + "x" * 1000 for i in range(1500)]
    assert len(lines) == 3000


def _wait_for_output(fd: int, got: bytearray, want: bytes, timeout: float) -> bool:
    """Read ``fd`` into ``got`` until ``want`` is in it (True) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while want not in got:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return False
        piece = os.read(fd, 1 << 16)
        if not piece:
            return want in got
        got += piece
    return True


def test_run_shows_a_progress_bar_as_it_is_drawn(tmp_path: Path) -> None:
    r"""A rank drawing a progress bar (tqdm: ``\r`` and the bar, no newline until the end):
    nothing of it showed until the newline (or 1 MiB) came, and then the redraws after the
    first one had no ``[rank]``. Each redraw shows now, while the rank waits, prefixed, on
    stderr (where it wrote it), stdout untouched."""
    script = tmp_path / "bar.py"
    script.write_text(
        "import os, sys, time\n"
        "for i in range(3):\n"
        "    sys.stderr.write(f'\\rstep {i}')\n"
        "    deadline = time.monotonic() + 15\n"
        "    while not os.path.exists(sys.argv[1] + str(i)) and time.monotonic() < deadline:\n"
        "        time.sleep(0.02)\n"
        "sys.stderr.write('\\n')\n")
    flag = str(tmp_path / "seen")
    popen = subprocess.Popen(launcher("-n", "1", str(script), flag), cwd=REPO, env=clean_env(),
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert popen.stderr is not None
        got = bytearray()
        for i in range(3):
            t0 = time.monotonic()
            shown = _wait_for_output(popen.stderr.fileno(), got, f"[0] step {i}".encode(), 10)
            assert shown, f"redraw {i} not shown in 10 s: {bytes(got)!r}"
            assert time.monotonic() - t0 < 5
            Path(flag + str(i)).touch()
        out, err = popen.communicate(timeout=30)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
    assert popen.returncode == 0, bytes(got + err)
    assert bytes(got + err) == b"[0] step 0\r[0] step 1\r[0] step 2\n"
    assert out == b""


class _Collected:
    """A launcher output (as sys.stdout: ``.buffer``) that keeps what it is given."""

    def __init__(self) -> None:
        self.got = bytearray()
        self.buffer = self
        self.wrote = asyncio.Event()

    def write(self, b: Any) -> int:
        self.got += bytes(b)
        self.wrote.set()
        return len(b)

    async def shows(self, expected: bytes, timeout: float = 10.0) -> bool:
        """Whether what it was given becomes ``expected`` within ``timeout``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while bytes(self.got) != expected:
                    self.wrote.clear()
                    await self.wrote.wait()
        return bytes(self.got) == expected

    def flush(self) -> None:
        pass


def _bare_launcher() -> Any:
    from asynccoll.cli import _Launcher

    return _Launcher(1, ["script.py"], addr="127.0.0.1", port=0, token="t", bind="127.0.0.1")


async def test_run_output_shows_an_unfinished_line_whole_characters_only() -> None:
    """A rank that wrote the start of a line and paused (a prompt, a bar, ``print(end='')``)
    showed nothing until the line ended; and a line over 1 MiB went out in pieces cut
    anywhere, a UTF-8 character split in two between them (undecodable on both sides).
    The start shows after a short pause, up to its last whole character."""
    from asynccoll.cli import LINE_LIMIT

    out = _Collected()
    launcher = _bare_launcher()
    stream = asyncio.StreamReader(limit=1 << 20)
    pump = asyncio.ensure_future(launcher._pump(3, stream, out))
    try:
        stream.feed_data(b"loss 0.25 " + "€".encode()[:2])
        assert await out.shows(b"[3] loss 0.25 ")
        await asyncio.sleep(0.3)
        assert bytes(out.got) == b"[3] loss 0.25 ", "half a character went out"
        stream.feed_data("€".encode()[2:] + b"\n")
        long = "é" * (LINE_LIMIT // 2 + 12_345)  # more than LINE_LIMIT bytes, cut mid-way
        stream.feed_data(b"x" + long.encode() + b"\n")
        stream.feed_eof()
        await asyncio.wait_for(pump, 30)
    finally:
        pump.cancel()
    text = bytes(out.got).decode()  # every byte of every character, in order
    assert text == "[3] loss 0.25 €\n[3] x" + long + "\n"


async def test_run_output_shows_progress_dots_as_they_come() -> None:
    """A rank printing a dot every few hundredths of a second (``print('.', end='')``): the
    line shows as it grows, not only once the rank pauses or ends the line."""
    out = _Collected()
    stream = asyncio.StreamReader(limit=1 << 20)
    pump = asyncio.ensure_future(_bare_launcher()._pump(0, stream, out))
    try:
        t0 = time.monotonic()
        while not out.got and time.monotonic() - t0 < 5:
            stream.feed_data(b".")
            await asyncio.sleep(0.03)
        assert out.got.startswith(b"[0] ."), bytes(out.got)
        assert time.monotonic() - t0 < 1.0
        stream.feed_data(b"\n")
        stream.feed_eof()
        await asyncio.wait_for(pump, 30)
    finally:
        pump.cancel()
    assert re.fullmatch(rb"\[0\] \.+\n", out.got), bytes(out.got)


@pytest.mark.parametrize("pieces, shown", [
    ([b"a\n", b"\n", b"b"], b"[2] a\n[2] \n[2] b"),                   # lines, an empty one
    ([b"\r 1%", b"\r 2%\r", b" 3%\n"], b"[2]  1%\r[2]  2%\r[2]  3%\n"),  # a bar, each redraw
    ([b"a\r", b"\r\n", b"b\r\n"], b"[2] a\r\r\n[2] b\r\n"),            # \r\n ends the line
    ([b"a\r", b"\n", b"\r\rb"], b"[2] a\r\n[2] b"),                     # (split between reads)
    ([b"\r\r", b"\r"], b""),                                            # nothing to return over
])
def test_run_output_prefixes_every_line_and_redraw(pieces: list[bytes], shown: bytes) -> None:
    """What one rank's output becomes, read in the pieces given: every line and every
    redraw after a carriage return starts with the prefix, whichever way it is cut; a line
    end after a carriage return ends the line (no empty prefixed line)."""
    from asynccoll.cli import _Screen, _Tagger

    tagger = _Tagger(2, _Screen())
    assert b"".join(tagger.format(p) for p in pieces) == shown


async def test_run_output_keeps_each_line_to_one_rank() -> None:
    r"""Two ranks writing to one terminal: a line shown unfinished (a bar) is ended before
    another rank's line, and goes on prefixed again, so no line holds two ranks' text; a
    redraw after ``\r`` keeps its prefix, ``\r\n`` line ends pass as they are."""
    out = _Collected()
    launcher = _bare_launcher()
    streams = [asyncio.StreamReader(limit=1 << 20) for _ in range(2)]
    pumps = [asyncio.ensure_future(launcher._pump(r, s, out)) for r, s in enumerate(streams)]
    try:
        streams[0].feed_data(b"\r 10%|#")
        assert await out.shows(b"[0]  10%|#")
        streams[0].feed_data(b"\r 20%|##")
        assert await out.shows(b"[0]  10%|#\r[0]  20%|##")
        streams[1].feed_data(b"epoch 1\r\n")
        assert await out.shows(b"[0]  10%|#\r[0]  20%|##\n[1] epoch 1\r\n")
        streams[0].feed_data(b"\r 30%|###\n")
        for s in streams:
            s.feed_eof()
        await asyncio.wait_for(asyncio.gather(*pumps), 30)
    finally:
        for p in pumps:
            p.cancel()
    assert bytes(out.got) == (b"[0]  10%|#\r[0]  20%|##\n[1] epoch 1\r\n"
                              b"[0]  30%|###\n")


@pytest.mark.parametrize("closed", [0, 1, 2])
def test_run_with_a_standard_stream_closed(tmp_path: Path, closed: int) -> None:
    """``asynccoll run ... >&-`` (or ``2>&-``, ``<&-``, as some job schedulers and daemons
    start programs): the first pipe took the free descriptor, and uvloop aborted the ranks
    and the launcher (``Assertion `fd > STDERR_FILENO' failed``; asyncio: a traceback about
    ``None.buffer``). The job runs; what would go to the closed stream is dropped."""
    script = tmp_path / "both.py"
    script.write_text("import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\n")
    res = subprocess.run(["sh", "-c", f'exec "$@" {closed}>&-', "sh",
                           *launcher("-n", "2", str(script))], cwd=REPO, env=clean_env(),
                         capture_output=True, timeout=60, check=False)
    out, err = res.stdout.decode(), res.stderr.decode()
    assert res.returncode == 0, out + err
    assert "Traceback" not in err and "Assertion" not in err, err
    for rank in range(2):
        if closed != 1:
            assert f"[{rank}] to stdout" in out.splitlines(), out
        if closed != 2:
            assert f"[{rank}] to stderr" in err.splitlines(), err


def test_run_says_why_it_stops_on_a_full_non_blocking_stderr(tmp_path: Path) -> None:
    """The launcher's stderr a non-blocking pipe that is full for now (a reader that falls
    behind): its 'rank N exited with code C; stopping the others' was lost (the write
    failed with BlockingIOError). It waits until the pipe takes it."""
    script = tmp_path / "fails.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    sys.exit(3)\n"
                      "time.sleep(30)\n")
    r, w = os.pipe()
    os.set_blocking(w, False)
    filled = 0
    with contextlib.suppress(BlockingIOError):
        while True:
            filled += os.write(w, b"." * 4096)
    try:
        popen = subprocess.Popen(launcher("-n", "2", str(script)), cwd=REPO, env=clean_env(),
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=w, start_new_session=True)
    finally:
        os.close(w)
    got = bytearray()
    try:
        time.sleep(2.0)  # rank 1 has failed by now
        deadline = time.monotonic() + 30
        with open(r, "rb", buffering=0) as reader:
            while time.monotonic() < deadline and (piece := reader.read(1 << 16)):
                got += piece
        code = popen.wait(30)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
    text = got[filled:].decode(errors="replace")
    assert code == 3, text
    assert text == "asynccoll run: rank 1 exited with code 3; stopping the others\n"


def test_run_reports_a_failed_rank_once(reaper: Callable[..., Proc], tmp_path: Path) -> None:
    """A failed rank was reported twice, in two wordings: a log record
    ('... asynccoll.launcher WARNING: rank 1 exited with 3; stopping the other ranks') and
    'asynccoll run: rank 1 exited with code 3; stopping the others'. Once now."""
    script = tmp_path / "fails.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    sys.exit(3)\n"
                      "time.sleep(30)\n")
    proc = reaper(launcher("-n", "2", str(script)))
    assert proc.finish(30) == 3, proc.output
    assert [line for line in proc.lines if "exited" in line] == [
        "asynccoll run: rank 1 exited with code 3; stopping the others"], proc.output


def test_info() -> None:
    res = subprocess.run([sys.executable, "-m", "asynccoll", "info"], cwd=REPO, env=clean_env(),
                         capture_output=True, text=True, timeout=30, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    for backend in ("memory", "tcp", "nccl", "mpi"):
        assert backend in res.stdout, res.stdout


# ------------------------------------------------------------------------------- failures

@pytest.mark.parametrize("mode", ["killed_before", "killed_during"])
def test_rank_killed(reaper: Callable[..., Proc], mode: str) -> None:
    """Rank 2 SIGKILLs itself; ranks 0 and 1 raise PeerLostError naming it, fast."""
    proc = reaper(launcher("-n", "3", str(HELPERS / "faulty.py"), mode))
    code = proc.finish(40)
    out = proc.output
    print(f"\n--- {mode} ---\n{out}")
    assert code != 0, out
    lost = {int(m.group(1)): (m.group(2), float(m.group(3)))
            for line in out.splitlines() if (m := LOST_LINE.match(line))}
    assert set(lost) == {0, 1}, f"every survivor must report the loss:\n{out}"
    for r, (who, after) in lost.items():
        assert who == "2", f"rank {r} blamed rank {who}, not 2:\n{out}"
        assert after < 10.0, f"rank {r} took {after} s to notice:\n{out}"
    print(f"{mode}: PeerLostError after " + ", ".join(
        f"rank {r}: {after:.3f} s" for r, (_, after) in sorted(lost.items())))
    pids = proc.child_pids()
    assert len(pids) == 3, out
    assert_all_gone(pids)


@pytest.mark.timeout(60)
def test_rank_raises_in_user_code(reaper: Callable[..., Proc]) -> None:
    """Rank 1 raises; the launcher stops the others long before their 30 s collective timeout."""
    t0 = time.monotonic()
    proc = reaper(launcher("-n", "3", str(HELPERS / "faulty.py"), "raise"))
    code = proc.finish(40)
    wall = time.monotonic() - t0
    out = proc.output
    assert code != 0, out
    assert rank_lines(out, 1, "RuntimeError: deliberate failure in user code"), out
    assert wall < 20.0, f"the run took {wall:.1f} s:\n{out}"
    assert_all_gone(proc.child_pids())


def test_ctrl_c_stops_everything(reaper: Callable[..., Proc]) -> None:
    proc = reaper(launcher("-n", "3", str(HELPERS / "faulty.py"), "forever"))
    ready = proc.wait_for(lambda lines: sum(line.endswith("] READY") for line in lines) == 3,
                          timeout=30)
    assert ready, proc.output
    pids = proc.child_pids()
    assert len(pids) == 3
    time.sleep(0.3)  # a few collectives in flight
    t0 = time.monotonic()
    proc.popen.send_signal(signal.SIGINT)
    code = proc.finish(15)
    elapsed = time.monotonic() - t0
    assert code == 130, proc.output
    assert elapsed < 10.0, f"the launcher took {elapsed:.1f} s to stop:\n{proc.output}"
    # one account of the interruption: the ranks it stopped are not reported as failures
    # (it said "rank N exited with code 130; stopping the others" after it)
    assert "asynccoll run: interrupted; stopping the ranks" in proc.output, proc.output
    assert "stopping the others" not in proc.output, proc.output
    assert "the others go on" not in proc.output, proc.output
    print(f"\nCtrl-C: launcher exited with {code} after {elapsed:.2f} s")
    assert_all_gone(pids)


# ------------------------------------------------------------------ without the launcher

LISTENING = re.compile(r"^asynccoll rendezvous: listening on [^\s:]+:(\d+)$", re.M)


def test_standalone_rendezvous_and_hand_started_ranks(reaper: Callable[..., Proc]) -> None:
    token = "hand-started-token"
    # port 0: the server picks a free port and says which on stdout, so nothing can race us
    # for it
    rdv = reaper([sys.executable, "-m", "asynccoll", "rendezvous", "--port", "0",
                  "--token", token])
    assert rdv.wait_for(lambda lines: any(LISTENING.search(x) for x in lines), 30), rdv.output
    match = LISTENING.search(rdv.output)
    assert match is not None
    port = int(match.group(1))

    ranks = [reaper([sys.executable, str(HELPERS / "allreduce_check.py")], clean_env(
        ASYNCCOLL_RENDEZVOUS=f"127.0.0.1:{port}", ASYNCCOLL_RANK=str(r),
        ASYNCCOLL_WORLD_SIZE="2", ASYNCCOLL_TOKEN=token)) for r in range(2)]
    for r, p in enumerate(ranks):
        code = p.finish(45)
        assert code == 0, p.output
        assert f"OK rank {r}" in p.output, p.output
    assert rdv.popen.poll() is None, "the standalone rendezvous server went away:\n" + rdv.output

    rdv.popen.send_signal(signal.SIGINT)
    code = rdv.finish(10)
    assert code == 0, f"rendezvous exited with {code} on SIGINT:\n{rdv.output}"
    assert token not in rdv.output


def test_torchrun_style_environment(reaper: Callable[..., Proc]) -> None:
    for _attempt in range(3):
        port = free_fixed_port()
        # rank 1 first: it must wait (retrying) for rank 0 to host the rendezvous on MASTER_PORT
        ranks = {r: reaper([sys.executable, str(HELPERS / "allreduce_check.py")], clean_env(
            RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
            for r in (1, 0)}
        if ranks[0].finish(45) != 0 and "address already in use" in ranks[0].output:
            ranks[1].kill()  # someone took the port between our check and rank 0's bind
            continue
        for r, p in ranks.items():
            code = p.finish(45)
            assert code == 0, p.output
            assert f"OK rank {r}" in p.output, p.output
        return
    pytest.fail("could not find a free MASTER_PORT in 3 attempts")


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_launcher_idles_while_the_last_rank_runs_on(reaper: Callable[..., Proc],
                                                    tmp_path: Path) -> None:
    """Once one rank has finished, the launcher waits for the others without spinning a core
    (asyncio.wait on a finished watcher returns at once, every time)."""
    script = tmp_path / "uneven.py"
    script.write_text(
        "import os, sys, time\n"
        "print(f'PID {os.getpid()}', flush=True)\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(4)\n"
        "print('DONE', flush=True)\n")
    proc = reaper(launcher("-n", "2", str(script)))
    assert proc.wait_for(lambda lines: "[0] DONE" in lines, 20), proc.output
    time.sleep(0.5)  # rank 0's watcher has finished by now
    before = _cpu_seconds(proc.popen.pid)
    time.sleep(2.0)
    used = _cpu_seconds(proc.popen.pid) - before
    code = proc.finish(20)
    assert code == 0, proc.output
    assert used < 0.5, f"the launcher used {used:.2f} s of CPU in 2 s of waiting"


def test_a_failed_rank_whose_child_keeps_its_output_open(reaper: Callable[..., Proc],
                                                         tmp_path: Path) -> None:
    """Rank 1 starts a child (which inherits its stdout, as DataLoader workers or helper
    processes do) and fails; rank 0 hangs. The launcher still notices the failure at once,
    stops rank 0, leaves no process behind (the child included) and exits non-zero."""
    script = tmp_path / "leaves_a_child.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "print(f'PID {os.getpid()}', flush=True)\n"
        "if os.environ['RANK'] == '1':\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import os, time; "
        "print(f\"PID {os.getpid()}\", flush=True); time.sleep(120)'])\n"
        "    time.sleep(0.5)  # the child printed its PID line\n"
        "    raise SystemExit('rank 1 failed')\n"
        "time.sleep(120)\n")
    t0 = time.monotonic()
    proc = reaper(launcher("-n", "2", str(script)))
    code = proc.finish(30)
    wall = time.monotonic() - t0
    out = proc.output
    assert code != 0, out
    assert "rank 1 exited with code 1" in out, out
    assert wall < 15.0, f"the run took {wall:.1f} s:\n{out}"
    pids = proc.child_pids()
    assert len(pids) == 3, out
    assert_all_gone(pids)


def test_rendezvous_port_in_use(reaper: Callable[..., Proc]) -> None:
    """``--port`` naming a port that is taken: a one-line error naming it, no traceback, no
    rank started."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = reaper(launcher("-n", "2", "--port", str(port),
                               str(HELPERS / "allreduce_check.py")))
        code = proc.finish(30)
    out = proc.output
    assert code != 0, out
    assert "Traceback" not in out, out
    assert f"127.0.0.1:{port}" in out and "in use" in out, out
    assert not proc.child_pids(), out


def test_rendezvous_port_out_of_range() -> None:
    res = subprocess.run(launcher("-n", "2", "--port", "70000", str(HELPERS / "chatty.py")),
                         cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=30,
                         check=False)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and "--port must be 0-65535" in res.stderr, res.stderr



@pytest.mark.parametrize("args, message", [
    # the kernel takes a port modulo 65536: 99999 would listen on 34463, unannounced
    (["rendezvous", "--port", "99999"], "--port must be 0-65535, got 99999"),
    (["rendezvous", "--port", "-1"], "--port must be 0-65535, got -1"),
    (["rendezvous", "--host", "no-such-host.invalid", "--port", "0", "--token", "t"],
     "cannot listen on no-such-host.invalid:0"),
    (["run", "-n", "2", "--elastic", "--max-restarts", "-1", "x.py"],
     "--max-restarts must be >= 0, got -1"),
])
def test_bad_command_line_values_are_one_line_errors(args: list[str], message: str) -> None:
    """A value the command cannot use: one line naming it on stderr, no traceback, a nonzero
    exit, at once (the rendezvous server did not listen somewhere else, or forever)."""
    res = subprocess.run([sys.executable, "-m", "asynccoll", *args], cwd=REPO,
                         env=clean_env(), capture_output=True, text=True, timeout=30,
                         check=False)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and message in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.mark.parametrize("command", [["rendezvous", "--port", "0"],
                                     ["run", "-n", "1", "x.py"]])
@pytest.mark.parametrize("value", ["abc", "0", "inf"])
def test_a_bad_handshake_timeout_variable_is_a_one_line_error(command: list[str],
                                                              value: str) -> None:
    """ASYNCCOLL_HANDSHAKE_TIMEOUT that is no number of seconds: one line naming it and
    exit 2 before anything starts (it was a traceback and exit 1, from the launcher's
    rendezvous or from the standalone server)."""
    env = clean_env()
    env["ASYNCCOLL_HANDSHAKE_TIMEOUT"] = value
    res = subprocess.run([sys.executable, "-m", "asynccoll", *command], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=30, check=False)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith(f"asynccoll {command[0]}: ASYNCCOLL_HANDSHAKE_TIMEOUT="), \
        res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_standalone_rendezvous_port_in_use() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "asynccoll", "rendezvous", "--port",
                              str(port), "--token", "t"], cwd=REPO, env=clean_env(),
                             capture_output=True, text=True, timeout=30, check=False)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in res.stderr and "in use" in res.stderr


def test_standalone_rendezvous_without_token_warns_once_naming_its_port(
        reaper: Callable[..., Proc]) -> None:
    """Without a token, `asynccoll rendezvous` warned before binding, naming --port as given:
    'can reach 127.0.0.1:0' (beside the server's own warning with the real port beyond
    loopback), and a warning about a server that never listened when the port was taken.
    Now the server's warning alone, naming where it listens."""
    rdv = reaper([sys.executable, "-m", "asynccoll", "rendezvous", "--port", "0"], clean_env())
    assert rdv.wait_for(lambda lines: any(LISTENING.search(x) for x in lines), 30), rdv.output
    match = LISTENING.search(rdv.output)
    assert match is not None
    port = int(match.group(1))
    rdv.popen.send_signal(signal.SIGINT)
    assert rdv.finish(10) == 0, rdv.output
    warnings = [line for line in rdv.lines if "token" in line]
    assert len(warnings) <= 1, rdv.output
    assert all(f"127.0.0.1:{port} " in line for line in warnings), rdv.output

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        res = subprocess.run([sys.executable, "-m", "asynccoll", "rendezvous", "--port",
                              str(taken.getsockname()[1])], cwd=REPO, env=clean_env(),
                             capture_output=True, text=True, timeout=30, check=False)
    assert res.returncode == 1, res.stdout + res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "cannot listen on 127.0.0.1" in res.stderr


def test_hangup_stops_everything(reaper: Callable[..., Proc]) -> None:
    """SIGHUP (the terminal or the ssh session of the launcher went away) stops the ranks
    too: they run in sessions of their own, so nothing else would tell them."""
    proc = reaper(launcher("-n", "2", str(HELPERS / "faulty.py"), "forever"))
    ready = proc.wait_for(lambda lines: sum(line.endswith("] READY") for line in lines) == 2,
                          timeout=30)
    assert ready, proc.output
    pids = proc.child_pids()
    proc.popen.send_signal(signal.SIGHUP)
    code = proc.finish(15)
    assert code != 0, proc.output
    assert_all_gone(pids)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143),
                                           (signal.SIGHUP, 129)],
                         ids=["ctrl-c", "sigterm", "sighup"])
def test_an_interrupted_launcher_exits_128_plus_the_signal(
        reaper: Callable[..., Proc], tmp_path: Path, sig: signal.Signals, code: int) -> None:
    """SIGTERM (or SIGHUP) to ``asynccoll run`` stopped the ranks and exited 130, the code
    of a Ctrl-C: a batch system that sent SIGTERM read it as an interrupt by hand. The exit
    code is 128 + the signal, as a shell reports a process that the signal ended."""
    script = tmp_path / "sleeps.py"
    script.write_text("import os, time\nprint(f'PID {os.getpid()}', flush=True)\n"
                      "print('READY', flush=True)\ntime.sleep(30)\n")
    proc = reaper(launcher("-n", "1", str(script)))
    assert proc.wait_for(lambda lines: any(line.endswith("] READY") for line in lines), 20), \
        proc.output
    pids = proc.child_pids()
    proc.popen.send_signal(sig)
    assert proc.finish(15) == code, proc.output
    assert "asynccoll run: interrupted; stopping the ranks" in proc.output, proc.output
    assert_all_gone(pids)


# ------------------------------------------------------------------------- whom to blame

BLAME = str(HELPERS / "blame.py")


def test_the_rank_whose_failure_was_its_own_is_blamed_not_a_victim(
        reaper: Callable[..., Proc]) -> None:
    """Rank 1 fails in its own code and takes 1.5 s to clean up before it exits with code 7;
    ranks 0 and 2, whose all_reduce raised PeerLostError naming it, exit with code 1 first.
    The launcher blamed the first rank to exit ('rank 0 exited with code 1') and exited 1:
    it now names rank 1, from the records its victims leave at exit, with its code."""
    proc = reaper(launcher("-n", "3", BLAME, "slow", "1"))
    code = proc.finish(40)
    out = proc.output
    assert rank_lines(out, 1, "CULPRIT exits"), out
    said = [line for line in proc.lines if line.startswith("asynccoll run:")]
    assert said == ["asynccoll run: rank 1 exited with code 7; stopping the others"], out
    assert code == 7, out
    assert_all_gone(proc.child_pids())


def test_a_killed_rank_is_blamed_not_its_victims(reaper: Callable[..., Proc]) -> None:
    """Rank 1 is SIGKILLed (no record of its own); its victims' records name it as lost."""
    proc = reaper(launcher("-n", "3", BLAME, "killed", "1"))
    code = proc.finish(40)
    out = proc.output
    said = [line for line in proc.lines if line.startswith("asynccoll run:")]
    assert said == ["asynccoll run: rank 1 exited with code -9; stopping the others"], out
    assert code == 128 + signal.SIGKILL, out
    assert_all_gone(proc.child_pids())


@pytest.mark.parametrize(("error", "peer"), [
    ("lost", 2), ("relayed-lost", 3), ("relayed", 1), ("timeout", None), ("closed", None),
    ("own-mismatch", None), ("none", None)])
def test_a_rank_record_names_the_rank_its_failure_came_from(error: str,
                                                             peer: int | None) -> None:
    """What rank 0's record says of its broken world: the rank lost, the rank that aborted
    (or the one lost, which it relayed), or nothing when the failure was its own."""
    from asynccoll._exit_record import peer_cause
    from asynccoll.errors import (
        CollectiveError,
        CollectiveTimeout,
        CommunicatorClosedError,
        PeerLostError,
    )

    exc = {"lost": PeerLostError("world rank 2 has closed its communicator", rank=2),
           "relayed-lost": PeerLostError("world rank 1 aborted: lost world rank 3", rank=3),
           "relayed": CollectiveError("world rank 1 aborted: all_reduce(...) mismatch"),
           "timeout": CollectiveTimeout("no progress for 30 s"),
           "closed": CommunicatorClosedError("the communicator was closed"),
           "own-mismatch": CollectiveError("ranks disagree: world rank 1 called broadcast"),
           "none": None}[error]
    assert peer_cause(exc, 0) == peer


async def test_ctrl_c_while_the_ranks_start_starts_no_more(tmp_path: Path) -> None:
    """Ctrl-C after the launcher started the first of its ranks and before the others: it
    went on starting them, after the SIGINT was sent to those that ran, so they ran on
    until the SIGKILL 5 s later. It starts no more, and ends at once."""
    from asynccoll.cli import _Launcher

    script = tmp_path / "sleeps.py"
    script.write_text("import time\ntime.sleep(30)\n")
    launcher = _Launcher(4, [sys.executable, str(script)], addr="127.0.0.1", port=0,
                         token="t", bind="127.0.0.1")
    spawn = launcher.spawn

    async def spawn_then_ctrl_c(rank: int, rdv_port: int, local: int) -> None:
        await spawn(rank, rdv_port, local)
        if rank == 1:  # (the loop's handler runs at the next start's first wait)
            os.kill(os.getpid(), signal.SIGINT)

    launcher.spawn = spawn_then_ctrl_c  # type: ignore[method-assign]
    began = time.monotonic()
    try:
        code = await asyncio.wait_for(launcher._run(0), 20)
    finally:
        launcher._signal_all(signal.SIGKILL)
    assert code == 130
    assert time.monotonic() - began < 3.0
    assert len(launcher.procs) <= 3
    # (ended by the SIGINT: killed by it, or its KeyboardInterrupt; not SIGKILLed)
    assert all(p.returncode in (-signal.SIGINT, 1) for p in launcher.procs), \
        [p.returncode for p in launcher.procs]
