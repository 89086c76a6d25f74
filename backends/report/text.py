"""Text formatting shared by every report: times in the unit that reads best, aligned tables, a plan's
layout in one line. The one place that turns numbers into words for the terminal.

Names come from a spec or a plan file, which a user may not have written: `printable` escapes what a
terminal would act on (ANSI escapes, line breaks), and every table cell goes through it.

Tables fit the terminal (hetplan's own few lines, no dependency): wider than `terminal_width()`, the
widest free-text column (a layout, a reason) is narrowed first, a character at a time, never a column of
numbers; a narrowed column's cells wrap onto up to MAX_WRAP_LINES lines, and what is left after those
is cut with an ellipsis. A table that fits, or one printed where there is no terminal, is unchanged.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap
from collections import Counter
from typing import TextIO

from costmodel.placeholders import noted_device_type
from planner.core.errors import printable
from planner.core.ir import Plan, StagePlan

__all__ = ["GIB", "NO_PLAN_DEVICES", "RUNNERS_UP_HEADER", "SAME_AS_CHOSEN", "TERMINAL", "format_time", "isatty",
           "layout", "placeholder_lines", "printable", "runners_up_rows", "signed_time", "table",
           "terminal_width"]

GIB = float(1 << 30)
TERMINAL = -1            # `table(width=...)`'s default: fit terminal_width()
MIN_CUT_WIDTH = 10       # a free-text column is never narrowed below this (or its header)
MAX_WRAP_LINES = 6       # a narrowed column's cell wraps onto at most this many lines, then is cut
GAP = "  "
# a cell that reads as a number, with its unit or as a ratio / range / count: such columns are never cut
NUMBER = re.compile(r"[-+~]?\$?\d[\d.,]*(e[-+]?\d+)?( ?(%|x|s|ms|us|ns|B|KiB|MiB|GiB|samples/s))?"
                    r"([/:x-][\d.,]+( ?(%|s|ms|us|GiB|MiB))?)?")


def isatty(stream: TextIO | None) -> bool:
    """Whether `stream` writes to a terminal (False for None, a closed stream or one without a file)."""
    if stream is None:
        return False
    try:
        return stream.isatty()
    except (ValueError, AttributeError, OSError):    # closed, or not a real stream
        return False


def terminal_width() -> int | None:
    """The columns a table should fit: COLUMNS when set, else the width of the terminal stdout writes to;
    None when stdout is not a terminal (a pipe, a file, a test's capture: tables stay whole)."""
    if not (os.environ.get("COLUMNS", "").strip().isdigit() or isatty(sys.stdout)):
        return None
    return shutil.get_terminal_size().columns


def table(header: list[str], rows: list[list[str]], width: int | None = TERMINAL) -> str:
    """Aligned columns: the first left-aligned, the others right-aligned, a rule under the header; every
    cell printable (control characters escaped). Fitted into `width` columns (TERMINAL: terminal_width();
    None: never narrowed) by narrowing the widest free-text columns, whose cells then wrap (left-aligned)."""
    header, rows = [printable(h) for h in header], [[printable(c) for c in r] for r in rows]
    natural = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    limit = terminal_width() if width == TERMINAL else width
    widths = natural
    if limit is not None and sum(widths) + len(GAP) * (len(widths) - 1) > limit:
        widths = _fitted(header, rows, widths, limit)
    narrowed = [w < n for w, n in zip(widths, natural)]
    mark = _ellipsis()

    def lines(cells: list[str]) -> list[str]:
        parts = [_wrapped(c, w, mark) for c, w in zip(cells, widths)]
        return [GAP.join((p[k] if k < len(p) else "").ljust(w) if i == 0 or narrowed[i] else
                         (p[k] if k < len(p) else "").rjust(w) for i, (p, w) in enumerate(zip(parts, widths)))
                for k in range(max(map(len, parts)))]

    out = lines(header) + lines(["-" * w for w in widths])
    for r in rows:
        out += lines(r)
    return "\n".join(ln.rstrip() for ln in out) if any(narrowed) else "\n".join(out)


def _wrapped(cell: str, w: int, mark: str) -> list[str]:
    """`cell` on lines of at most `w` characters (one line when it fits): broken at spaces where it can,
    at most MAX_WRAP_LINES, the last cut with `mark` when more is left."""
    if len(cell) <= w:
        return [cell]
    wrapped = textwrap.wrap(cell, w, break_on_hyphens=False) or [cell[:w]]
    if len(wrapped) > MAX_WRAP_LINES:
        rest = " ".join(wrapped[MAX_WRAP_LINES - 1:])
        wrapped = wrapped[:MAX_WRAP_LINES - 1] + [rest[:max(w - len(mark), 0)] + mark]
    return wrapped


def _fitted(header: list[str], rows: list[list[str]], widths: list[int], limit: int) -> list[int]:
    """Column widths within `limit`: the widest free-text column loses a character at a time (so the widest
    ones end alike, as rich collapses them), down to MIN_CUT_WIDTH (or its header); columns of numbers keep
    their width, so a table may stay wider."""
    free = [i for i in range(len(header)) if any(r[i] and r[i] != "-" and not NUMBER.fullmatch(r[i]) for r in rows)]
    least = {i: min(widths[i], max(len(header[i]), MIN_CUT_WIDTH)) for i in free}
    widths = list(widths)
    excess = sum(widths) + len(GAP) * (len(widths) - 1) - limit
    while excess > 0:
        cuttable = [i for i in free if widths[i] > least[i]]
        if not cuttable:
            break
        widest = max(cuttable, key=lambda i: (widths[i], i))
        widths[widest] -= 1
        excess -= 1
    return widths


def _ellipsis() -> str:
    """One-character ellipsis where stdout can write it, else three dots."""
    try:
        "\u2026".encode(getattr(sys.stdout, "encoding", None) or "ascii")
    except (UnicodeEncodeError, LookupError):
        return "..."
    return "\u2026"


def format_time(seconds: float) -> str:
    """Seconds in the unit that reads best (s, ms, us)."""
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def signed_time(seconds: float) -> str:
    """A time difference with its sign: `+1.200 ms`, `-3.0 us`."""
    return ("+" if seconds >= 0 else "-") + format_time(abs(seconds))


def stage_ranks(stage: StagePlan) -> str:
    """A stage's ranks as the reports name them: its rank, or its tensor-parallel shards' range and degree."""
    return str(stage.rank) if stage.tp_degree == 1 else f"{stage.rank}-{stage.ranks[-1]} (tp {stage.tp_degree})"


def layout(plan: Plan) -> str:
    """Replicas as `group:stages x count`, largest first: `a100:2st x4 + v100:4st x1`."""
    shapes = Counter((printable(r.node_group), len(r.stages)) for r in plan.replicas)
    return " + ".join(f"{g}:{s}st x{n}" for (g, s), n in sorted(shapes.items(), key=lambda kv: (-kv[1], kv[0])))


RUNNERS_UP_HEADER = ["plan", "est step", "sim step", "devices", "layout", "vs chosen"]
# planner.runners_up records a first try that is the chosen plan with this reason (shown in the chosen row,
# "ilp (chosen) = data parallel"), and one that has no plan with this device count (its reason says why)
SAME_AS_CHOSEN = "the chosen plan"
NO_PLAN_DEVICES = 0


def placeholder_lines(plan: Plan) -> list[str]:
    """A head line when the plan's estimates rest on placeholder figures (its `costmodel.placeholders`
    warnings): which device types, and the command that measures them."""
    types = [t for t in (noted_device_type(w) for w in plan.warnings) if t is not None]
    if not types:
        return []
    return [f"estimates from placeholder figures for {', '.join(printable(t) for t in types)} (not measured; may be "
            "many times too fast): `plan profile`, then plan with --calibration FILE"]


def runners_up_rows(plan: Plan) -> list[list[str]]:
    """The chosen plan, then each alternative the search saw, simulated on the same clock (empty: none
    recorded); cells as RUNNERS_UP_HEADER names them."""
    s = plan.solver
    if not s.runners_up:
        return []
    also = "".join(f" = {u.name}" for u in s.runners_up if u.why_slower == SAME_AS_CHOSEN)
    chosen = [f"{s.strategy} (chosen){also}", format_time(plan.estimates.iteration_s),
              format_time(s.simulated_iteration_s) if s.simulated_iteration_s is not None else "-",
              str(plan.world_size), layout(plan), "-"]
    rows = [chosen]
    for u in s.runners_up:
        if u.why_slower == SAME_AS_CHOSEN:
            continue
        if u.devices_used == NO_PLAN_DEVICES:
            rows.append([u.name, "-", "-", "-", "-", u.why_slower])
        else:
            rows.append([u.name, format_time(u.estimated_iteration_s), format_time(u.simulated_iteration_s),
                         str(u.devices_used), u.layout, u.why_slower])
    return rows
