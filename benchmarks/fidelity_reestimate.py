"""A recorded fidelity run's plans estimated again by today's cost model, against that run's measurements.

For a change of the cost model that should not move the plans: each configuration of RESULTS (a
`benchmarks/fidelity.py` output) is planned again as fidelity.py plans it (same model, cluster, stages,
micro-batch, strategy and calibration file), nothing is run, and the new estimates are compared with the
peaks and steps RESULTS measured. A configuration whose plan changed (other shares or stages) is flagged:
its measurement no longer belongs to it. Prints a table per configuration and per model (tuned beside
held out: peak memory and step time, mean |error| before and now) and writes JSON. RESULTS must have been
measured with the calibration file as it is now (fidelity.py writes both).

    python benchmarks/fidelity_reestimate.py benchmarks/results/fidelity_held_out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from statistics import mean

from fidelity import HELD_OUT, RESULTS, plan_configuration  # benchmarks/: it puts the checkout on sys.path


def _errors(predicted: list[float], measured: list[float]) -> list[float]:
    return [p / m - 1.0 for p, m in zip(predicted, measured)]


def reestimate(recorded: dict, calibration: Path, work: Path) -> list[dict]:
    rows = []
    for c in recorded["configurations"]:
        config = plan_configuration(c["model"], c["cluster"], c["stages"], c["micro_batch"], c["global_batch"],
                                    calibration, work, c.get("strategy", "ilp"))
        plan = config.plan
        shares = [r["batch_share"] for r in plan["replicas"]]
        new_memory = list(plan["estimates"]["memory_bytes"])
        rows.append({
            "name": c["name"], "model": c["model"], "held_out": c["model"] in HELD_OUT,
            "same_plan": shares == c["shares"] and len(new_memory) == len(c["measured_memory_bytes"]),
            "recorded_memory_bytes": c["predicted_memory_bytes"], "memory_bytes": new_memory,
            "measured_memory_bytes": c["measured_memory_bytes"],
            "recorded_memory_errors": _errors(c["predicted_memory_bytes"], c["measured_memory_bytes"]),
            "memory_errors": _errors(new_memory, c["measured_memory_bytes"]),
            "recorded_step_s": c["predicted_step_s"], "step_s": plan["estimates"]["iteration_s"],
            "measured_step_s": c["measured_step_s"],
            "recorded_step_error": c["predicted_step_s"] / c["measured_step_s"] - 1.0,
            "step_error": plan["estimates"]["iteration_s"] / c["measured_step_s"] - 1.0})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'configuration':34s} {'plan':5s} {'memory error before':>20s} {'now':>8s} "
             f"{'step estimate before':>21s} {'now':>8s} {'measured':>9s} {'step error before':>18s} {'now':>7s}"]
    for r in rows:
        lines.append(f"{r['name']:34s} {'same' if r['same_plan'] else 'MOVED':5s} "
                     f"{max(r['recorded_memory_errors'], key=abs):>+20.2%} {max(r['memory_errors'], key=abs):>+8.2%} "
                     f"{r['recorded_step_s'] * 1e3:>18.1f} ms {r['step_s'] * 1e3:>5.1f} ms "
                     f"{r['measured_step_s'] * 1e3:>6.1f} ms "
                     f"{r['recorded_step_error']:>+18.1%} {r['step_error']:>+7.1%}")
    lines.append("")
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        before = mean(abs(e) for r in mine for e in r["recorded_memory_errors"])
        now = mean(abs(e) for r in mine for e in r["memory_errors"])
        under = max([0.0] + [-e for r in mine for e in r["memory_errors"]])
        steps_before = mean(abs(r["recorded_step_error"]) for r in mine)
        steps_now = mean(abs(r["step_error"]) for r in mine)
        lines.append(f"{model:12s} {'held out' if mine[0]['held_out'] else 'tuned':8s} peak memory mean |error| "
                     f"{before:.2%} -> {now:.2%}, under by {under:.2%} at most; step time mean |error| "
                     f"{steps_before:.1%} -> {steps_now:.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="a benchmarks/fidelity.py output")
    p.add_argument("--calibration", type=Path, default=None, help="default: the one RESULTS names")
    p.add_argument("--out", type=Path, default=RESULTS / "fidelity_reestimate.json")
    args = p.parse_args(argv)
    recorded = json.loads(args.results.read_text())
    calibration = args.calibration or Path(recorded["calibration"])
    with tempfile.TemporaryDirectory(prefix="hetplan-reestimate-") as tmp:
        rows = reestimate(recorded, calibration, Path(tmp))
    print(table(rows))
    args.out.write_text(json.dumps({"results": str(args.results), "calibration": str(calibration),
                                    "configurations": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
