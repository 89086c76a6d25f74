"""ASCII Gantt chart of a simulated iteration, one row per rank, for the terminal."""

from __future__ import annotations

import math

from backends.report.text import format_time
from backends.sim.engine import OPTIMIZER_LABEL, SYNC_LABEL, SimResult, Span

DEFAULT_WIDTH = 100          # characters of the time axis
DEFAULT_MAX_RANKS = 32       # rows shown; the rest are summarised in one line
IDLE_CHAR = "."
SYNC_CHAR = "="
OPTIMIZER_CHAR = "o"
LEGEND = (f"F/B forward/backward (label `stage kind micro` where it fits), {SYNC_CHAR} gradient sync, "
          f"{OPTIMIZER_CHAR} optimizer, {IDLE_CHAR} idle")


def _fill_char(label: str) -> str:
    if label.startswith(SYNC_LABEL):
        return SYNC_CHAR
    if label == OPTIMIZER_LABEL:
        return OPTIMIZER_CHAR
    return "F" if "F" in label else "B"


def _row(spans: list[Span], width: int, cell_s: float) -> str:
    cells = [IDLE_CHAR] * width
    for sp in spans:
        first = min(width - 1, int(sp.start_s / cell_s))
        last = max(first + 1, min(width, math.ceil(sp.end_s / cell_s)))
        char = _fill_char(sp.label)
        text = sp.label if sp.label[:1].isdigit() and last - first > len(sp.label) else ""
        for c in range(first, last):
            k = c - first
            cells[c] = text[k] if k < len(text) else char
    return "".join(cells)


def render_gantt(result: SimResult, width: int = DEFAULT_WIDTH, max_ranks: int = DEFAULT_MAX_RANKS) -> str:
    """The timeline as text: a header, one row per rank (at most `max_ranks`), a legend."""
    if result.iteration_s <= 0 or not result.timeline:
        return "empty timeline\n"
    cell_s = result.iteration_s / width
    by_rank: dict[int, list[Span]] = {}
    for sp in result.timeline:
        by_rank.setdefault(sp.rank, []).append(sp)
    ranks = sorted(by_rank)
    head = (f"iteration {format_time(result.iteration_s)}, bubble {result.bubble_fraction:.0%}, "
            f"one column = {format_time(cell_s)}")
    axis = "      0" + " " * (width - 1 - len(format_time(result.iteration_s))) + format_time(result.iteration_s)
    lines = [head, axis]
    for rank in ranks[:max_ranks]:
        lines.append(f"r{rank:<4} |{_row(by_rank[rank], width, cell_s)}|")
    if len(ranks) > max_ranks:
        lines.append(f"... {len(ranks) - max_ranks} more ranks")
    lines.append(LEGEND)
    return "\n".join(lines) + "\n"
