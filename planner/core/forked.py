"""One step of planning run in a forked child while this process does another (`with forked(fn) as
child: ...; child.result()`): on a host with a spare core, two independent steps at once, which threads
cannot give (the interpreter lock holds pure-Python work to one core).

The child is a copy of this process at the fork (the traced model, the cost tables), so `fn` needs no
arguments sent; it returns its value (or raises) through a pipe, pickled. Only the thread that forks
lives on in the child: fork where no other thread holds a lock the child needs (between steps, not
inside the search's worker pool), and give the child pure-Python work: torch's intra-op thread pool
(OpenMP) does not survive a fork, so a real tensor operation there (a model file's batch() computing
its labels) waits forever for threads the child does not have. Off Linux (macOS forks a process badly
once system frameworks have started threads) or on a host of one core, `fn` runs in this process when
its result is asked for, so the plan is the same either way.

The child never outlives its parent's use of it: leaving the block (an exception in the parent's own
step included) kills a child still running and reaps it, and a child silent past the parent's wait is
killed and its step made in the parent. The child leaves by `os._exit`, so it runs no exit handler of
the parent's and flushes none of its buffers; an exception it raised is re-raised in the parent (a
KeyboardInterrupt too: Ctrl-C reaches both processes).

`forked_until(prepare, finish)` is a child that starts on `prepare()` at once (work worth doing early, on
a core that would idle) and then waits for a message: `send(message)` gives it, and `result()` is the
child's `finish(prepared, message)`. Its output goes nowhere (what it prepares may never be asked for; its
errors come back through the pipe), and an error of `prepare` is raised only if a message asks for it.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, NoReturn, TypeVar

T = TypeVar("T")
P = TypeVar("P")
M = TypeVar("M")
_OK, _RAISED = 0, 1
_LENGTH_BYTES = 8


class Child(Generic[T]):
    """A forked child computing `fn()`, or `fn` itself where it will run in this process."""

    def __init__(self, fn: Callable[[], T], pid: int | None, read_fd: int | None) -> None:
        self._fn, self._pid, self._read_fd = fn, pid, read_fd
        self._done = False

    def result(self, timeout_s: float | None = None) -> T:
        """`fn()`'s value, waiting for the child; its exception re-raised here. A child that has sent
        nothing after `timeout_s` is killed and `fn` runs here instead: a child stuck on a lock the fork
        left held costs time, never the plan."""
        if self._pid is None:
            self._done = True
            return self._fn()
        assert self._read_fd is not None
        ready, _, _ = select.select([self._read_fd], [], [], timeout_s)
        if not ready:
            self.stop()
            self._pid = None
            return self.result()
        with os.fdopen(self._read_fd, "rb") as pipe:
            self._read_fd = None
            data = pipe.read()
        os.waitpid(self._pid, 0)
        self._done = True
        if not data:
            raise RuntimeError("a forked planning step died without a result (killed, or out of memory)")
        status, payload = pickle.loads(data)
        if status == _RAISED:
            raise payload
        return payload

    def stop(self) -> None:
        """Kill the child unless its result was taken, and reap it; close the pipe."""
        if self._read_fd is not None:
            os.close(self._read_fd)
            self._read_fd = None
        if self._pid is not None and not self._done:
            try:
                os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self._pid, 0)
            self._done = True


def _raised(exc: BaseException) -> bytes:
    """`exc` pickled for the parent, or where it does not pickle, a RuntimeError that names it."""
    try:
        return pickle.dumps((_RAISED, exc))
    except Exception:                                # noqa: BLE001 - any pickling failure
        return pickle.dumps((_RAISED, RuntimeError(f"{type(exc).__name__}: {exc}")))


def can_fork() -> bool:
    """Whether a forked child would run beside this process: Linux, and a second core."""
    return sys.platform.startswith("linux") and (os.cpu_count() or 1) > 1


@contextmanager
def forked(fn: Callable[[], T], enabled: bool = True, niceness: int = 0) -> Iterator[Child[T]]:
    """`fn` started in a forked child (in this process, on `result()`, where `can_fork` is false or the
    caller asks for no fork); `niceness`: the child's scheduling priority that much lower (os.nice), for a
    step that should take only a core the others leave idle."""
    if not (enabled and can_fork()):
        yield Child(fn, None, None)
        return
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:                                     # the child: compute, send, leave
        os.close(read_fd)

        def compute() -> T:
            if niceness:
                os.nice(niceness)
            return fn()

        _answer(write_fd, compute)
    os.close(write_fd)
    child: Child[T] = Child(fn, pid, read_fd)
    try:
        yield child
    finally:
        child.stop()


class Waiting(Generic[P, M, T]):
    """A forked child that made `prepare()` and waits for the message to `finish` it with (or where it
    cannot fork, both made in this process by `result`). `send` the message, then take the `result`."""

    def __init__(self, prepare: Callable[[], P], finish: Callable[[P, M], T], pid: int | None,
                 read_fd: int | None, send_fd: int | None) -> None:
        self._prepare, self._finish = prepare, finish
        self._pid, self._read_fd, self._send_fd = pid, read_fd, send_fd
        self._child: Child[T] | None = None

    def send(self, message: M) -> None:
        """Give the child its message: it finishes now, while this process goes on (once only)."""
        if self._child is not None:
            raise RuntimeError("a waiting child takes one message")
        if self._send_fd is not None:
            data = pickle.dumps(message)
            try:
                _write_all(self._send_fd, len(data).to_bytes(_LENGTH_BYTES, "little") + data)
            except OSError:                          # the child is gone: Child.result says so
                pass
        self._close_send()
        self._child = Child(lambda: self._finish(self._prepare(), message), self._pid, self._read_fd)

    def result(self, timeout_s: float | None = None) -> T:
        """`finish(prepare(), message)` for the message sent, made by the child from what it prepared; as
        Child.result, a child silent past `timeout_s` is killed and both steps run here."""
        if self._child is None:
            raise RuntimeError("send the waiting child its message first")
        return self._child.result(timeout_s)

    def stop(self) -> None:
        """Kill the child unless its result was taken, and reap it; close the pipes."""
        self._close_send()
        if self._child is None:
            self._child = Child(_never_asked, self._pid, self._read_fd)
        self._child.stop()

    def _close_send(self) -> None:
        if self._send_fd is not None:
            os.close(self._send_fd)
            self._send_fd = None


@contextmanager
def forked_until(prepare: Callable[[], P], finish: Callable[[P, M], T],
                 enabled: bool = True) -> Iterator[Waiting[P, M, T]]:
    """`prepare` started in a forked child that then waits for `send(message)` (both in this process, on
    `result`, where `can_fork` is false or the caller asks for no fork)."""
    if not (enabled and can_fork()):
        yield Waiting(prepare, finish, None, None, None)
        return
    read_fd, write_fd = os.pipe()
    message_read_fd, send_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:                                     # the child: prepare, wait, finish, send, leave
        try:
            os.close(read_fd)
            os.close(send_fd)
            _silence()
            prepared: P | None = None
            failed: BaseException | None = None
            try:
                prepared = prepare()
            except BaseException as exc:             # noqa: BLE001 - raised only if a message asks
                failed = exc
            message = _read_message(message_read_fd)
        except BaseException:                        # noqa: BLE001 - the parent left, or Ctrl-C
            message = None
        if message is None:                          # nothing asked: leave
            os._exit(0)

        def finished() -> T:
            if failed is not None:
                raise failed
            return finish(prepared, message)         # type: ignore[arg-type]

        _answer(write_fd, finished)
    os.close(write_fd)
    os.close(message_read_fd)
    waiting: Waiting[P, M, T] = Waiting(prepare, finish, pid, read_fd, send_fd)
    try:
        yield waiting
    finally:
        waiting.stop()


def _answer(write_fd: int, compute: Callable[[], Any]) -> NoReturn:
    """In a child: `compute()`'s value, or the exception it raised, pickled to the parent through
    `write_fd`; then the child leaves by os._exit, whatever happens."""
    code = 0
    try:
        try:
            out = pickle.dumps((_OK, compute()))
        except BaseException as exc:                 # noqa: BLE001 - every failure goes to the parent
            out = _raised(exc)
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(out)
    except BaseException:                            # noqa: BLE001 - unpicklable, or the parent left
        code = 1
    finally:
        os._exit(code)


def _never_asked() -> Any:
    raise RuntimeError("a stopped child's step was asked for")


def _silence() -> None:
    """Send this process's stdout and stderr to /dev/null, the streams and the descriptors both."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    sys.stdout = sys.stderr = open(os.devnull, "w")     # open as long as this child lives


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_message(fd: int) -> Any:
    """The length-prefixed pickled message on `fd`, or None at its end without one (the length, not the
    pipe's end, closes it: a process forked later may still hold the pipe's write end)."""
    header = _read_exactly(fd, _LENGTH_BYTES)
    if header is None:
        return None
    data = _read_exactly(fd, int.from_bytes(header, "little"))
    return None if data is None else pickle.loads(data)


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
