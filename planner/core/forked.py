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
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")
_OK, _RAISED = 0, 1


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
def forked(fn: Callable[[], T], enabled: bool = True) -> Iterator[Child[T]]:
    """`fn` started in a forked child (in this process, on `result()`, where `can_fork` is false or the
    caller asks for no fork)."""
    if not (enabled and can_fork()):
        yield Child(fn, None, None)
        return
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:                                     # the child: compute, send, leave
        os.close(read_fd)
        code = 0
        try:
            try:
                message = pickle.dumps((_OK, fn()))
            except BaseException as exc:             # noqa: BLE001 - every failure goes to the parent
                message = _raised(exc)
            with os.fdopen(write_fd, "wb") as pipe:
                pipe.write(message)
        except BaseException:                        # noqa: BLE001 - unpicklable, or the parent left
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    child: Child[T] = Child(fn, pid, read_fd)
    try:
        yield child
    finally:
        child.stop()
