"""Domain errors. Raised inside the flow; turned into one line and an exit code by the CLI only."""

from __future__ import annotations


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
        return " ".join(text.split())


class SpecError(HetplanError):
    """The cluster spec (or the device catalog) is missing, malformed or inconsistent."""


class ModelFileError(HetplanError):
    """The model file cannot be loaded, lacks a required function, or cannot be traced."""


class PlanningError(HetplanError):
    """No plan satisfies the constraints (e.g. the model fits on no device)."""

    exit_code = 3


class PlanFileError(HetplanError):
    """A plan directory or plan.json is missing or not readable."""


class PassError(HetplanError):
    """A pass broke its contract (raised by the pass manager with the pass history)."""

    exit_code = 4
