"""Domain errors. Raised inside the flow; turned into one line and an exit code by the CLI only."""

from __future__ import annotations

MAX_MESSAGE_CHARS = 2000   # one line stays one screen or so, whatever a message quotes

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """`text` with every character a terminal would act on (control characters: ANSI escapes, newlines,
    carriage returns, ...) written as its Python escape (`\\x1b`, `\\n`), so a name from a spec or a plan
    prints as one inert line."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _ESCAPES.get(ch) or ascii(ch)[1:-1] for ch in text)


class HetplanError(Exception):
    """An error a user can act on: names the file, the field and the fix."""

    exit_code = 2

    def __init__(self, message: str, *, file: str | None = None, field: str | None = None,
                 fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.file = file
        self.field = field
        self.fix = fix

    def one_line(self) -> str:
        where = ": ".join(part for part in (self.file, self.field) if part)
        text = f"{where}: {self.message}" if where else self.message
        if self.fix:
            text += f" (fix: {self.fix})"
        text = printable(" ".join(text.split()))     # whitespace runs to one space, then nothing a terminal acts on
        return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 3] + "..."


class SpecError(HetplanError):
    """The cluster spec (or the device catalog) is missing, malformed or inconsistent."""


class ModelFileError(HetplanError):
    """The model file cannot be loaded, lacks a required function, or cannot be traced."""


class PlanningError(HetplanError):
    """No plan satisfies the constraints (e.g. the model fits on no device)."""

    exit_code = 3


class PlanFileError(HetplanError):
    """A plan directory or plan.json is missing or not readable."""


class OptionError(HetplanError):
    """An option of `plan` (a PlanOptions field) is outside what it may be."""


class OutputDirError(HetplanError):
    """The output directory cannot be written or must not be replaced (it holds the user's files)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) while planning ran the user's code: the user's, not the model file's, doing."""


class PassError(HetplanError):
    """A pass broke its contract (raised by the pass manager with the pass history)."""

    exit_code = 4
