"""Progress on stderr when it is a terminal (a pseudo-terminal here), and not a byte of it in a pipe."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends.report.progress import CLEAR, Progress, is_terminal
from costmodel.placeholders import NOTE_PREFIX
from tests.helpers import CLUSTERS, EXAMPLES, REPO, run_plan_cli

PLAN_PHASES = ("start-up", "load", "trace", "cost", "search", "comm", "runners-up", "write")


def _read_all(fd: int, proc: subprocess.Popen, timeout_s: float) -> bytes:
    """Everything written to the pseudo-terminal whose master is `fd` until `proc` ends (and its last bytes)."""
    out = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:          # EIO: every writer of the terminal is gone
                break
            if not data:
                break
            out += data
        elif proc.poll() is not None:
            break
    return out


def _drain(fd: int) -> bytes:
    """Everything written to the pseudo-terminal's master `fd` so far: a read returns at most one buffer of it
    (a busy machine's spinner draws more than one), so read until nothing more comes for a moment."""
    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    return out


def run_on_pty(args: list[str], timeout_s: float = 300) -> tuple[int, str, bytes]:
    """Run `args` with stderr on a pseudo-terminal and stdout on a pipe: (exit code, stdout, terminal bytes)."""
    master, slave = pty.openpty()
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "TERM": "xterm"}
    env.pop("COLUMNS", None)
    with open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(args, stdin=devnull, stdout=subprocess.PIPE, stderr=slave, cwd=REPO, env=env,
                                start_new_session=True)
    os.close(slave)
    try:
        seen = _read_all(master, proc, timeout_s)
        stdout = proc.communicate(timeout=timeout_s)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        os.close(master)
    return proc.returncode, stdout, seen


def _phases(seen: bytes, label: str) -> list[str]:
    """The phase names drawn, in order, each once."""
    names = re.findall(rf"{re.escape(label)}: (.+?) \d+\.\d s\r".encode(), seen)
    return list(dict.fromkeys(n.decode() for n in names))


def test_progress_draws_each_phase_on_a_terminal_and_clears_the_line():
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty, Progress("plan", stream=tty, redraw_s=0.01) as progress:
            assert progress.enabled and is_terminal(tty)
            progress.phase("trace")
            time.sleep(0.05)                  # the spinner turns meanwhile
            progress.phase("search")
        progress.phase("late")                # after close: nothing
        seen = _drain(master)
    finally:
        os.close(master)
        os.close(slave)
    assert _phases(seen, "plan") == ["trace", "search"]
    assert seen.endswith(CLEAR.encode()) and b"late" not in seen
    assert len(re.findall(rb"plan: trace", seen)) > 1       # redrawn, each draw from the line's start
    assert all(draw.startswith(b"\x1b[K") for draw in seen.split(b"\r") if draw)


def test_progress_is_silent_off_a_terminal(monkeypatch):
    stream = io.StringIO()
    with Progress("plan", stream=stream, redraw_s=0.01) as progress:
        progress.phase("trace")
        time.sleep(0.03)
    assert stream.getvalue() == "" and not progress.enabled
    master, slave = pty.openpty()
    try:
        monkeypatch.setenv("TERM", "dumb")           # a terminal that cannot redraw a line
        with os.fdopen(slave, "w", closefd=False) as tty:
            with Progress("plan", stream=tty) as progress:
                progress.phase("trace")
            assert not progress.enabled
            tty.write("x")
            tty.flush()
        assert os.read(master, 100) == b"x"
    finally:
        os.close(master)
        os.close(slave)


@pytest.fixture(scope="module")
def mlp_args(tmp_path_factory) -> list[str]:
    return [str(EXAMPLES / "mlp" / "model.py"), "--cluster", str(CLUSTERS / "cpu-hetero-4.yaml"),
            "--global-batch", "16"]


def test_plan_on_a_terminal_shows_each_phase_then_clears(mlp_args, tmp_path):
    out = tmp_path / "out"
    code, stdout, seen = run_on_pty([sys.executable, "-m", "planner.cli", *mlp_args, "-o", str(out)])
    assert code == 0, stdout + seen.decode(errors="replace")
    assert _phases(seen, "plan") == list(PLAN_PHASES)
    # the status line is gone when the summary prints (the terminal shows stderr too: the catalog's
    # placeholder CPU figures are warned about after it)
    status = seen.split(b"plan: warning: " + NOTE_PREFIX.encode())[0]
    assert status.endswith(CLEAR.encode())
    shown = "".join(ln for ln in stdout.splitlines(keepends=True) if NOTE_PREFIX not in ln)
    assert "\r" not in stdout and shown.startswith("plan for cpu-hetero-4")


def test_plan_in_a_pipe_writes_no_progress(mlp_args, tmp_path):
    piped = run_plan_cli(*mlp_args, "-o", str(tmp_path / "out"))
    assert piped.returncode == 0, piped.stderr
    # stderr holds the placeholder note only (the catalog's CPU figures), no progress
    assert all(NOTE_PREFIX in ln for ln in piped.stderr.splitlines()) and "\r" not in piped.stderr
    assert "\r" not in piped.stdout and "\x1b" not in piped.stdout
    assert not any(f"plan: {p} " in piped.stdout for p in PLAN_PHASES)


def test_a_failing_plan_clears_the_line_before_its_one_line_error(tmp_path):
    bad = tmp_path / "model.py"
    bad.write_text("def model():\n    raise RuntimeError('boom')\n\ndef batch(b, s):\n    return (), None\n")
    code, _, seen = run_on_pty([sys.executable, "-m", "planner.cli", str(bad), "--cluster",
                                str(CLUSTERS / "cpu-hetero-4.yaml"), "-o", str(tmp_path / "out")])
    assert code == 2
    status, _, error = seen.rpartition(CLEAR.encode())
    assert b"plan: trace" in status and error.startswith(b"plan: error: ") and b"boom" in error


@pytest.mark.slow
def test_plan_run_on_a_terminal_shows_its_start_up(mlp_args, tmp_path):
    out = tmp_path / "out"
    planned = run_plan_cli(*mlp_args, "--no-runners-up", "-o", str(out))
    assert planned.returncode == 0, planned.stderr
    code, stdout, seen = run_on_pty([sys.executable, "-m", "planner.cli", "run", str(out), "--steps", "2",
                                     "--timeout", "60"])
    assert code == 0, stdout[-2000:] + seen.decode(errors="replace")[-2000:]
    phases = _phases(seen, "plan run")
    assert phases and all(p.startswith("start-up") for p in phases), phases
    assert phases == ["start-up: torchrun", "start-up: 1 worker(s) import, join, trace stages"]
    assert CLEAR.encode() in seen.rpartition(b"plan run: ")[2]     # cleared once the first step is written
    assert (Path(out) / "run" / "metrics.jsonl").is_file()
