"""Running the model file's code: under a time limit, and with its exits and interrupts reported.

Planning imports the model file and calls its functions like any Python import would; `user_code()`
wraps each such call so that

- code that never returns is stopped after the time limit (`--trace-timeout`) as the model file's
  error (SIGALRM, so only in the main thread; elsewhere the code runs without a limit);
- `sys.exit()` and a `KeyboardInterrupt` the code raises itself are the model file's error, not an
  exit of `plan` (`sys.exit(0)` in a model file made `plan` exit 0 with nothing written);
- a real Ctrl-C (SIGINT) while the code runs is `Interrupted`, the user's doing: `plan` exits 130.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from planner.core import interrupts
from planner.core.errors import Interrupted, ModelFileError

RETRY_ALARM_S = 1.0   # should the code swallow the alarm's exception, it comes again this much later


class _TimeUp(BaseException):
    """Raised by the alarm inside the user's code: a BaseException, so that no `except Exception` in it
    (or in torch.export, or in the tracer's fallback) catches it and carries on."""


@contextmanager
def user_code(file: str, what: str, time_limit_s: float | None, *, field: str | None = None,
              fix: str = "make it return, or raise --trace-timeout") -> Iterator[None]:
    """Run the body as the model file's code `what` (e.g. "model()"): see the module docstring."""
    in_main = threading.current_thread() is threading.main_thread()
    timed_out = False
    start = time.monotonic()

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        nonlocal timed_out
        timed_out = True
        signal.setitimer(signal.ITIMER_REAL, RETRY_ALARM_S)
        raise _TimeUp

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        interrupts.note()
        raise Interrupted

    previous_sigint = signal.getsignal(signal.SIGINT) if in_main else None
    catch_sigint = in_main and previous_sigint not in (signal.SIG_IGN, None)
    if catch_sigint:
        signal.signal(signal.SIGINT, on_sigint)
    limit_s = time_limit_s if in_main and hasattr(signal, "setitimer") else None
    armed = limit_s is not None
    previous_alarm, previous_delay = None, 0.0
    if limit_s is not None:
        previous_alarm = signal.signal(signal.SIGALRM, on_alarm)
        previous_delay, _ = signal.setitimer(signal.ITIMER_REAL, limit_s)
        if previous_delay and previous_delay <= limit_s:   # an outer limit comes first: keep it
            signal.setitimer(signal.ITIMER_REAL, previous_delay)
            signal.signal(signal.SIGALRM, previous_alarm)
            armed = False
    try:
        yield
    except BaseException as exc:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)   # first: no second alarm while this is handled
        if timed_out:   # whatever the code made of the alarm's exception
            raise ModelFileError(f"{what} did not finish within {time_limit_s:g} s", file=file, field=field,
                                 fix=fix) from None
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Interrupted):
            raise ModelFileError(f"{what} raised KeyboardInterrupt", file=file, field=field,
                                 fix="do not raise KeyboardInterrupt in the model file") from exc
        if isinstance(exc, SystemExit):
            raise ModelFileError(f"{what} called sys.exit({exc.code!r})", file=file, field=field,
                                 fix="a model file defines functions; it must not exit (guard a script's "
                                     "code with `if __name__ == '__main__':`)") from exc
        raise
    finally:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous_alarm)
            if previous_delay:   # give an outer timer what is left of its time
                signal.setitimer(signal.ITIMER_REAL, max(1e-3, previous_delay - (time.monotonic() - start)))
        if catch_sigint:
            signal.signal(signal.SIGINT, previous_sigint)
