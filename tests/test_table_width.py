"""Tables fit the terminal: the widest free-text column is cut with an ellipsis, never a number; a
table that fits, or one printed where there is no terminal, is unchanged."""

from __future__ import annotations

import io
import os
import pty
import sys

import pytest

from backends.report import text
from backends.report.terminal import memory_table, runners_up_section, summary
from backends.report.text import table, terminal_width
from planner.api import PlanOptions, plan
from planner.cli.main import main
from planner.core.ir import Plan
from tests.helpers import CLUSTERS, EXAMPLES

HEADER = ["plan", "est step", "devices", "layout", "vs chosen"]
ROWS = [["ilp (chosen)", "593.4 us", "4", "a100:1st x4", "-"],
        ["megatron", "844.4 us", "32", "v100:2st x8 + a100:2st x4 + p100:2st x4",
         "1.42x slower: pipeline +111.5 us (bubble 67% vs 3%); gradient sync +139.5 us; 32 devices vs 4"],
        ["uniform", "931.9 us", "32", "v100:1st x16 + a100:1st x8 + p100:1st x8", "1.57x slower: gradient sync"]]


def _grid(shown: str) -> list[list[str]]:
    """The rows of a table as printed, each cell's wrapped lines joined again (a row starts where its
    second column, a number that never wraps, has a value)."""
    lines = shown.splitlines()
    spans, at = [], 0
    for dashes in lines[1].split("  "):
        spans.append((at, at + len(dashes)))
        at += len(dashes) + 2
    rows: list[list[str]] = []
    for line in lines[2:]:
        cells = [line[a:b].strip() for a, b in spans]
        if cells[1]:
            rows.append(cells)
        else:
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells)]
    return rows


def test_a_table_that_fits_is_unchanged():
    whole = table(HEADER, ROWS, width=None)
    assert len({len(line) for line in whole.splitlines()}) == 1 and "\u2026" not in whole
    assert table(HEADER, ROWS, width=1000) == whole
    assert table(HEADER, ROWS, width=len(whole.splitlines()[0])) == whole
    assert _grid(whole) == ROWS


def test_the_widest_free_text_column_wraps_first_and_nothing_is_lost():
    whole = table(HEADER, ROWS, width=None)
    fitted = table(HEADER, ROWS, width=120)
    assert len(whole.splitlines()[0]) > 120 and all(len(line) <= 120 for line in fitted.splitlines())
    # only `vs chosen` (the widest) gave way: megatron's reason wraps onto more lines, left-aligned
    lines = fitted.splitlines()
    assert len(lines) > len(whole.splitlines()) and lines[3].startswith("megatron")
    assert lines[-1].startswith("uniform") and lines[-1].endswith("  1.57x slower: gradient sync")
    assert "v100:2st x8 + a100:2st x4 + p100:2st x4" in lines[3] and "844.4 us" in lines[3]
    assert _grid(fitted) == ROWS and "\u2026" not in fitted


def test_narrower_both_free_columns_wrap_and_a_long_reason_ends_in_an_ellipsis():
    fitted = table(HEADER, ROWS, width=70)
    assert all(len(line) <= 70 for line in fitted.splitlines())
    grid = _grid(fitted)
    assert [r[:3] for r in grid] == [r[:3] for r in ROWS]            # names and numbers as they were
    assert grid[1][3] == ROWS[1][3]                                  # the layout wraps, whole
    tight = _grid(table(HEADER, ROWS, width=50))
    assert [r[:3] for r in tight] == [r[:3] for r in ROWS]
    reason = tight[1][4]
    assert reason.endswith("\u2026") and ROWS[1][4].startswith(reason[:-1].rsplit(" ", 1)[0])
    assert len(table(HEADER, ROWS, width=50).splitlines()) <= 2 + 3 * text.MAX_WRAP_LINES


def test_numbers_are_never_cut_even_when_the_table_stays_wide():
    header = ["rank", "est GiB", "capacity GiB", "busy"]
    rows = [[str(r), f"{r * 1.25:.2f}", "80.0", "1.234 ms"] for r in range(3)]
    assert table(header, rows, width=10) == table(header, rows, width=None)
    # a free-text column is narrowed no further than its header or MIN_CUT_WIDTH
    cut = table(["name", "GiB"], [["x" * 40, "1.0"]], width=5).splitlines()
    assert len(cut[1].split("  ")[0]) == text.MIN_CUT_WIDTH and cut[2].endswith("1.0")


def test_control_characters_stay_escaped_when_cut():
    rows = [["evil", "\x1b[2J" + "y" * 60, "1"]]
    cut = table(["name", "note", "n"], rows, width=30)
    assert "\x1b" not in cut and "\\x1b[2J" in cut


def test_width_comes_from_columns_or_the_terminal_and_is_none_in_a_pipe(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert terminal_width() is None
    assert table(HEADER, ROWS) == table(HEADER, ROWS, width=None)      # no terminal: whole
    monkeypatch.setenv("COLUMNS", "90")
    assert terminal_width() == 90
    assert all(len(line) <= 90 for line in table(HEADER, ROWS).splitlines())
    monkeypatch.delenv("COLUMNS")
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            monkeypatch.setattr(sys, "stdout", tty)
            assert terminal_width() is not None       # a terminal (one of size 0 reads as 80, shutil's fallback)
    finally:
        os.close(master)
        os.close(slave)


def test_ascii_output_gets_three_dots(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    cut = table(HEADER, ROWS, width=50)
    assert "\u2026" not in cut and "..." in cut


@pytest.fixture(scope="module")
def gpt_plan():
    return plan(EXAMPLES / "gpt" / "model.py", CLUSTERS / "seed-mixed-32.yaml", PlanOptions(global_batch=64)).plan


def _table_lines(section: str) -> list[str]:
    return [ln for ln in section.splitlines() if ln and not ln.startswith(("plan for", "estimated", "search"))]


def test_reports_fit_a_narrow_terminal(gpt_plan):
    p = gpt_plan
    whole = runners_up_section(p, None)
    assert max(map(len, whole.splitlines())) > 160 and "\u2026" not in whole
    for width in (80, 100):
        for section in (runners_up_section(p, width), memory_table(p, width)):
            assert all(len(ln) <= width for ln in _table_lines(section)), (width, max(section.splitlines(), key=len))
    # the stage table holds numbers and short names (device, type, ...) only: none narrower than
    # MIN_CUT_WIDTH, so it stays as it is (~105 columns) rather than cut a number
    assert summary(p, 80) == summary(p, None)
    assert max(map(len, _table_lines(summary(p, None)))) <= 120


def test_plan_inspect_fits_columns_and_plan_keeps_summary_txt_whole(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("COLUMNS", "100")
    assert main([str(EXAMPLES / "gpt" / "model.py"), "--cluster", str(CLUSTERS / "seed-mixed-32.yaml"),
                 "--global-batch", "64", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    saved = (out / "summary.txt").read_text()
    assert "\u2026" not in saved            # the file has its tables whole, whatever the terminal
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    why = shown[shown.index("why this plan:"):].split("\n\n")[0].splitlines()
    assert all(len(line) <= 100 for line in why) and len(why) > 3 + len(Plan.load(out).solver.runners_up)
    assert why[3].startswith("ilp (chosen)") and printed.splitlines()[0] == saved.splitlines()[0]
