"""Text formatting shared by every report: times in the unit that reads best, aligned tables, a plan's
layout in one line. The one place that turns numbers into words for the terminal.

Names come from a spec or a plan file, which a user may not have written: `printable` escapes what a
terminal would act on (ANSI escapes, line breaks), and every table cell goes through it.
"""

from __future__ import annotations

from collections import Counter

from planner.core.errors import printable
from planner.core.ir import Plan

__all__ = ["GIB", "RUNNERS_UP_HEADER", "format_time", "layout", "printable", "runners_up_rows", "signed_time",
           "table"]

GIB = float(1 << 30)


def table(header: list[str], rows: list[list[str]]) -> str:
    """Aligned columns: the first left-aligned, the others right-aligned, a rule under the header; every
    cell printable (control characters escaped)."""
    header, rows = [printable(h) for h in header], [[printable(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


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


def layout(plan: Plan) -> str:
    """Replicas as `group:stages x count`, largest first: `a100:2st x4 + v100:4st x1`."""
    shapes = Counter((printable(r.node_group), len(r.stages)) for r in plan.replicas)
    return " + ".join(f"{g}:{s}st x{n}" for (g, s), n in sorted(shapes.items(), key=lambda kv: (-kv[1], kv[0])))


RUNNERS_UP_HEADER = ["plan", "est step", "sim step", "devices", "layout", "vs chosen"]


def runners_up_rows(plan: Plan) -> list[list[str]]:
    """The chosen plan, then each alternative the search saw, simulated on the same clock (empty: none
    recorded); cells as RUNNERS_UP_HEADER names them."""
    s = plan.solver
    if not s.runners_up:
        return []
    chosen = [f"{s.strategy} (chosen)", format_time(plan.estimates.iteration_s),
              format_time(s.simulated_iteration_s) if s.simulated_iteration_s is not None else "-",
              str(plan.world_size), layout(plan), "-"]
    return [chosen] + [[u.name, format_time(u.estimated_iteration_s), format_time(u.simulated_iteration_s),
                        str(u.devices_used), u.layout, u.why_slower] for u in s.runners_up]
