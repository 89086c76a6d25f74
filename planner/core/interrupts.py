"""Ctrl-C that is not lost on the way: SIGINT raises KeyboardInterrupt as Python's own handler does, and is
also remembered, so that the command can ask before it writes anything (`check`).

Python runs a signal's handler in the main thread at its next bytecode, wherever that is. When that is
inside a `__del__`, a weakref or garbage-collector callback, or a generator being closed (a `next(x for
...)` left unfinished and dropped), the KeyboardInterrupt it raises there cannot propagate: the
interpreter prints "Exception ignored in ..." and goes on. A Ctrl-C landing while CP-SAT solves is handled
once the solve returns, in whatever the main thread runs next; `plan` then went on planning and exited 0.

`kept()` installs the handler for the body (main thread only, and only where SIGINT has Python's
default handler: a command started with SIGINT ignored keeps ignoring it) and restores the previous
one after. `note()` records an interrupt another handler took (the model file's code runs under its
own, planner.frontend.user_code).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_pending = False


def note() -> None:
    """Remember a Ctrl-C (SIGINT) taken by some handler."""
    global _pending
    _pending = True


def check() -> None:
    """Raise KeyboardInterrupt if a Ctrl-C came inside `kept()`, wherever its exception went."""
    if _pending:
        raise KeyboardInterrupt


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    note()
    raise KeyboardInterrupt


@contextmanager
def kept() -> Iterator[None]:
    """SIGINT remembered while the body runs (see the module docstring); what was remembered is forgotten on
    leaving, so that `check` outside the body never raises for an earlier command's Ctrl-C."""
    global _pending
    _pending = False
    install = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if install:
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        if install:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        _pending = False
