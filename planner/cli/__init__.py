"""The command line: `plan` (planner.cli.main dispatches to one module per command)."""

from __future__ import annotations

from planner.cli.main import entry, main

__all__ = ["entry", "main"]
