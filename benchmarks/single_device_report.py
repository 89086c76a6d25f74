"""The single-device benchmark's rows and what it prints and writes of them (`benchmarks/single_device.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from statistics import mean, median
from typing import Any

from planner.profiling.blockbench import PhaseTimes

PHASES = ("fwd", "bwd", "total")
LEVELS = ("op", "block", "model")
US_PER_S = 1e6


def total_s(t: PhaseTimes) -> float:
    return t.fwd_s + t.bwd_s


@dataclass(frozen=True)
class Row:
    """One thing timed and predicted: an op, a block or a whole model."""

    level: str                       # op | block | model
    group: str                       # op class (op level), model (block and model levels)
    source: str                      # held-out | <model> m=<micro-batch>
    name: str
    measured: PhaseTimes
    predicted: Mapping[str, PhaseTimes]   # by flavour
    timed_as: str = ""               # ops: "chain" or "copies" (planner.profiling.blockbench, microbench.measure_case)
    passes: tuple[PhaseTimes, ...] = ()   # each measurement pass (`measured` is their mean)

    def error(self, flavour: str, phase: str) -> float | None:
        """(predicted - measured) / measured of `phase`; None where nothing was measured (an op without
        a gradient has no backward)."""
        p, m = self.predicted[flavour], self.measured
        pred, meas = {"fwd": (p.fwd_s, m.fwd_s), "bwd": (p.bwd_s, m.bwd_s),
                      "total": (p.fwd_s + p.bwd_s, m.fwd_s + m.bwd_s)}[phase]
        return (pred - meas) / meas if meas > 0 else None

    @property
    def pass_spread(self) -> float | None:
        """How far apart the passes' fwd+bwd are, relative to their mean (None with one pass)."""
        if len(self.passes) < 2:
            return None
        totals = [total_s(p) for p in self.passes]
        return (max(totals) - min(totals)) / mean(totals)

    def as_json(self) -> dict[str, Any]:
        return {"level": self.level, "group": self.group, "source": self.source, "name": self.name,
                **({"timed_as": self.timed_as} if self.timed_as else {}), "measured": _phases_json(self.measured),
                "measured_passes": [_phases_json(p) for p in self.passes],
                "predicted": {f: _phases_json(p) for f, p in self.predicted.items()},
                "error": {f: {ph: self.error(f, ph) for ph in PHASES} for f in self.predicted}}


def _phases_json(t: PhaseTimes) -> dict[str, float]:
    return {"fwd_s": t.fwd_s, "bwd_s": t.bwd_s}


def _mean_abs(values: list[float | None]) -> float | None:
    known = [abs(v) for v in values if v is not None]
    return mean(known) if known else None


def _weighted_error(rows: list[Row], flavour: str) -> float:
    """sum |predicted - measured| / sum measured of fwd+bwd: where the time goes, so rows of a few
    microseconds (an op without a gradient has almost no backward) weigh as little as they cost."""
    measured_s = sum(total_s(r.measured) for r in rows)
    return sum(abs(total_s(r.predicted[flavour]) - total_s(r.measured)) for r in rows) / measured_s


def summarise(rows: list[Row]) -> dict[str, Any]:
    """Mean |error| per prediction: per level (ops also split into held-out and graph ops) and per op
    class, for forward, backward and total; with the number of rows, the time-weighted error, and the
    median spread between measurement passes (the noise floor)."""
    def stats(selected: list[Row], flavour: str) -> dict[str, Any]:
        spreads = [r.pass_spread for r in selected if r.pass_spread is not None]
        return {"rows": len(selected), **{ph: _mean_abs([r.error(flavour, ph) for r in selected]) for ph in PHASES},
                "total_weighted": _weighted_error(selected, flavour),
                "pass_spread_median": median(spreads) if spreads else None}

    ops = [r for r in rows if r.level == "op"]
    groups = {"op": ops, "op held-out": [r for r in ops if r.source == "held-out"],
              "op graph": [r for r in ops if r.source != "held-out"],
              **{level: [r for r in rows if r.level == level] for level in LEVELS[1:]}}
    classes = sorted({r.group for r in ops})
    return {f: {**{k: stats(v, f) for k, v in groups.items() if v},
                "op_class": {c: stats([r for r in ops if r.group == c], f) for c in classes}}
            for f in rows[0].predicted}


def _pct(value: float | None) -> str:
    return f"{value:+.0%}" if value is not None else "-"


def table(rows: list[Row]) -> str:
    """One line per row: measured and predicted microseconds of the last prediction (calibrated when
    there is one) with its errors, and the datasheet's error of the total."""
    flavour = list(rows[0].predicted)[-1]
    head = (f"{'level':5s} {'source':14s} {'name':46s} {'meas fwd':>9s} {'bwd us':>8s} | {flavour[:5] + ' fwd':>10s} "
            f"{'bwd us':>8s} {'err fwd':>7s} {'bwd':>5s} {'total':>6s} | {'datasheet':>9s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        p = r.predicted[flavour]
        lines.append(f"{r.level:5s} {r.source:14.14s} {r.name:46.46s} {r.measured.fwd_s * US_PER_S:9.1f} "
                     f"{r.measured.bwd_s * US_PER_S:8.1f} | {p.fwd_s * US_PER_S:10.1f} {p.bwd_s * US_PER_S:8.1f} "
                     f"{_pct(r.error(flavour, 'fwd')):>7s} {_pct(r.error(flavour, 'bwd')):>5s} "
                     f"{_pct(r.error(flavour, 'total')):>6s} | {_pct(r.error('datasheet', 'total')):>9s}")
    return "\n".join(lines)


def summary_lines(summary: dict[str, Any]) -> list[str]:
    lines = ["mean |error| (fwd / bwd / total; time-weighted total; passes' median spread):"]
    for flavour, by_group in summary.items():
        parts = {**{k: v for k, v in by_group.items() if k != "op_class"},
                 **{f"op {c}": v for c, v in by_group["op_class"].items()}}
        for key, s in parts.items():
            lines.append(f"  {flavour:10s} {key:16s} {_pct(s['fwd']):>6s} / {_pct(s['bwd']):>6s} / "
                         f"{_pct(s['total']):>6s}; {_pct(s['total_weighted']):>6s}; "
                         f"{_pct(s['pass_spread_median']):>6s}  ({s['rows']} rows)".replace("+", ""))
    return lines
