"""A one-line status on the terminal while a command works: a spinner, the phase's name and the time
spent in it (`| plan: search 2.3 s`), on stderr, redrawn a few times a second; the line is cleared when
the command is done.

Only on a terminal: when stderr is a pipe, a file, CI's log or a test's capture (or TERM is `dumb`),
nothing at all is written, so what such output holds is unchanged. Each draw starts with a carriage
return and an erase-line and ends with a carriage return, so whatever another process prints on the
same terminal (a `plan run` worker's first lines) writes over the status rather than after it.

    with Progress("plan") as progress:
        progress.phase("trace")     # drawn at once, then kept turning by a background thread
        ...
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from types import TracebackType
from typing import TextIO

from backends.report.text import isatty
from planner.core.errors import printable

REDRAW_S = 0.1                   # how often the spinner turns
SPINNER = "|/-\\"                # ASCII: every terminal and encoding shows it
CLEAR = "\r\x1b[K"               # to the line's start, erase to its end


def is_terminal(stream: TextIO | None) -> bool:
    """Whether `stream` writes to a terminal that understands a redrawn line."""
    return os.environ.get("TERM") != "dumb" and isatty(stream)


class Progress:
    """The status line of one command (`label`: "plan", "plan run", ...) on `stream` (stderr), drawn only
    when that is a terminal; `phase(name)` names what runs now. Use it as a context manager: leaving the
    block, however it is left, stops the redraw and clears the line."""

    def __init__(self, label: str, stream: TextIO | None = None, redraw_s: float = REDRAW_S) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = is_terminal(self.stream)
        self.redraw_s = redraw_s
        self._phase: str | None = None
        self._phase_started = time.monotonic()
        self._turns = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def phase(self, name: str) -> None:
        """Show `name` as the phase now running (drawn at once: a phase shorter than a redraw still shows);
        the same name again changes nothing, and after `close` nothing shows."""
        if not self.enabled or self._closed or name == self._phase:
            return
        with self._lock:
            self._phase, self._phase_started = name, time.monotonic()
            self._draw()
        if self._thread is None:
            self._thread = threading.Thread(target=self._turn, name="hetplan-progress", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop redrawing and clear the line (nothing written when nothing was shown); for good."""
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            if self.enabled and self._phase is not None:
                self._write(CLEAR)
            self._phase = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _turn(self) -> None:
        while not self._stop.wait(self.redraw_s):
            with self._lock:
                if self._phase is None:
                    return
                self._turns += 1
                self._draw()

    def _draw(self) -> None:
        text = (f"{SPINNER[self._turns % len(SPINNER)]} {self.label}: {printable(self._phase or '')} "
                f"{time.monotonic() - self._phase_started:.1f} s")
        # one line narrower than the terminal: a wrapped status could not be redrawn in place
        self._write(CLEAR + text[:max(self._columns() - 1, 1)] + "\r")

    def _columns(self) -> int:
        """The terminal's width (a terminal that does not say, size 0: COLUMNS or 80)."""
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            columns = 0
        return columns if columns > 0 else shutil.get_terminal_size().columns

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):    # the terminal went away: stay silent from now on
            self.enabled = False

