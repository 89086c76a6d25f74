"""Single-device fidelity: the cost model's op and block times against the same ops and blocks run alone.

    python benchmarks/fidelity.py --single-device [--device cpu|cuda] [--calibration FILE | --datasheet-only]
                                  [--quick] [--models gpt,mlp,resnet] [--precision fp32|bf16]

Levels, each forward and backward:
- op: held-out shapes of every op class (`held_out_ops`: shapes the profile did not fit on) and the
  distinct aten calls of every example model's graph with their real shapes (`planner.profiling.blockbench`);
  predicted as the plan charges an op: its time at the class's rate plus half its launch overhead in
  each phase (`planner.search.split.block_phases_s` splits a stage's overhead evenly);
- block: every planner block of examples/{gpt,mlp,resnet} at a micro-batch size, run alone on real
  tensors; predicted exactly as the plan costs a stage (`costmodel.tables.build_tables` per sample,
  times the micro-batch, plus the per-micro-batch overhead, through `block_phases_s`);
- model: the whole traced model at once against the sum of its blocks' predictions.

Two predictions: `datasheet` (the catalog's entry for the device: CPU's placeholder, or the GPU the
driver names) and `calibrated` (a `plan profile` file, `--calibration`; without one, `plan profile`
runs now without `--model`, one process, and its file is written beside the results). Only the
calibration's op-class rates and overheads are used: a file that timed this very model (`models`)
would make block totals equal the measurement by construction (`costmodel.calibrated
.scale_to_model_timing`), so its model timings are dropped, and so is its host contention factor
(wall seconds per CPU second of a job sharing the host): here one process is measured, in CPU
seconds on a CPU (`microbench.work_clock`, one compute thread, as the profiling workers run).

Errors are (predicted - measured) / measured, of forward, backward and their sum ("total"); the
summary is the mean |error| per level, per op class, per prediction, the time-weighted error of the
total (sum |predicted - measured| / sum measured), and how far apart `PASSES` measurements of the same
row are (the noise floor of this host). Rows and the report: `single_device_report`. Writes
benchmarks/results/single_device_<device>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import mean
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:   # runnable from anywhere
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.fidelity import (  # noqa: E402
    ATTEMPTS,
    HOST_SPEED_TOLERANCE,
    QUIET_WAIT_S,
    wait_until_quiet,
    wait_until_ready,
)
from benchmarks.held_out_ops import held_out_cases  # noqa: E402
from benchmarks.single_device_report import Row, summarise, summary_lines, table  # noqa: E402
from costmodel import compute  # noqa: E402
from costmodel.calibration import Calibration, CalibrationError, load_calibration, parse_calibration  # noqa: E402
from costmodel.catalog import load_catalog, load_links  # noqa: E402
from costmodel.tables import build_tables  # noqa: E402
from planner import frontend  # noqa: E402
from planner.api import DEFAULT_TRACE_BATCH, trace_model_file  # noqa: E402
from planner.core.blocks import OpCount  # noqa: E402
from planner.core.cluster import ClusterSpec, DeviceType, NodeGroup  # noqa: E402
from planner.core.errors import HetplanError  # noqa: E402
from planner.profiling import blockbench  # noqa: E402
from planner.profiling import microbench as mb  # noqa: E402
from planner.profiling.calibrate import FULL_REPEATS, QUICK_REPEATS, OtherLoad, reference_work_s  # noqa: E402
from planner.profiling.calibrate_worker import DTYPES, describe  # noqa: E402
from planner.search.split import block_phases_s  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
EXAMPLES = REPO / "examples"
MODELS = ("gpt", "mlp", "resnet")
# Micro-batch sizes per device kind: a small one (launches dominate) and the one fidelity.py's plans run
# (CPU) or one where a GPU is busier; --quick times the last only.
MICRO_BATCHES = {"cpu": {"gpt": (4, 32), "mlp": (16, 1024), "resnet": (2, 16)},
                 "cuda": {"gpt": (32, 256), "mlp": (1024, 16384), "resnet": (16, 256)}}
FLAVOURS = ("datasheet", "calibrated")
# Measurements of every row, one pass after the other: their spread is the noise floor (this shared host's
# speed moves by tens of percent within minutes; see benchmarks/fidelity.py).
PASSES = 2
PROFILE_TIMEOUT_S = {True: 120.0, False: 900.0}    # by --quick: the profile's workers, start-up included


@dataclass(frozen=True)
class Target:
    """The device measured and what predicts it: its catalog type, precision, and the calibration."""

    device: torch.device
    description: str                 # as the OS or the driver names it
    device_type: DeviceType          # catalog entry (datasheet figures)
    precision: str
    calibration: Calibration | None  # op-class rates only (see the module docstring); None: datasheet only

    @property
    def flavours(self) -> tuple[str, ...]:
        return FLAVOURS if self.calibration is not None else FLAVOURS[:1]

    def calibration_for(self, flavour: str) -> Calibration | None:
        return self.calibration if flavour == "calibrated" else None


# ---- predictions --------------------------------------------------------------------------------------
def predict_op(count: OpCount, target: Target, flavour: str) -> blockbench.PhaseTimes:
    """One op as a stage is charged for it: class rate time per phase plus half of its launch overhead."""
    cal = target.calibration_for(flavour)
    half_overhead_s = compute.ops_overhead_s((count,), target.device_type, cal) / 2
    return blockbench.PhaseTimes(
        *(compute.op_time_s(count, target.device_type, target.precision, backward, cal) + half_overhead_s
          for backward in (False, True)))


def one_device_cluster(device_type: DeviceType) -> ClusterSpec:
    """A cluster of one device of `device_type` (what build_tables costs blocks on)."""
    none = load_links()["none"]
    return ClusterSpec("single-device", (NodeGroup("device", 1, device_type, 1, none),), none,
                       device_types={device_type.name: device_type})


def predict_blocks(blocks: list[Any], micro_batch: int, target: Target,
                   flavour: str) -> tuple[list[blockbench.PhaseTimes], blockbench.PhaseTimes]:
    """Each block's forward and backward at `micro_batch`, and the whole model's, from the cost tables."""
    tables = build_tables(blocks, one_device_cluster(target.device_type), global_batch=micro_batch,
                          trace_batch=DEFAULT_TRACE_BATCH, precision_policy=target.precision,
                          calibration=target.calibration_for(flavour))
    table = tables.classes[0]
    per_block = [blockbench.PhaseTimes(*block_phases_s(table, range(b, b + 1), micro_batch, False))
                 for b in range(len(blocks))]
    return per_block, blockbench.PhaseTimes(*block_phases_s(table, range(len(blocks)), micro_batch, False))


# ---- measuring ----------------------------------------------------------------------------------------
def held_out_rows(target: Target, quick: bool, repeats: int) -> list[Row]:
    rows = []
    for case in held_out_cases(target.device.type, quick):
        m = mb.measure_case(case, target.device, DTYPES[target.precision], repeats)
        count = OpCount(m["op_class"], m["fwd_flops"], m["bwd_flops"], m["fwd_bytes"], 0.0)
        rows.append(Row("op", case.op_class, "held-out", case.label, blockbench.PhaseTimes(m["fwd_s"], m["bwd_s"]),
                        {f: predict_op(count, target, f) for f in target.flavours}, "chain"))
    return rows


def model_rows(name: str, target: Target, quick: bool, repeats: int) -> list[Row]:
    """Block, whole-model and graph-op rows of examples/<name> at each micro-batch size."""
    model_file = frontend.load_model_file(EXAMPLES / name / "model.py")
    _, blocks, _ = trace_model_file(model_file)
    sizes = MICRO_BATCHES[target.device.type][name]
    rows = []
    for micro_batch in sizes[-1:] if quick else sizes:
        source = f"{name} m={micro_batch}"
        gm, inputs = blockbench.trace_on_device(model_file, micro_batch, target.device, DTYPES[target.precision])
        run = blockbench.measure_blocks(gm, inputs, [b.last_node for b in blocks], micro_batch, target.device,
                                        repeats)
        predicted = {f: predict_blocks(blocks, micro_batch, target, f) for f in target.flavours}
        for b, block in enumerate(blocks):
            rows.append(Row("block", name, source, f"{b:2d} {block.label or block.first_node}", run.blocks[b],
                            {f: predicted[f][0][b] for f in target.flavours}))
        rows.append(Row("model", name, source, f"{name} ({len(blocks)} blocks)", run.whole,
                        {f: predicted[f][1] for f in target.flavours}))
        for call in blockbench.distinct_calls(gm, inputs):
            label = f"{call.label} (x{call.nodes})" if call.nodes > 1 else call.label
            measured = blockbench.measure_call(call, target.device, repeats)
            rows.append(Row("op", call.count.op_class, source, label, measured,
                            {f: predict_op(call.count, target, f) for f in target.flavours},
                            "chain" if call.chains else "copies"))
    return rows


@dataclass(frozen=True)
class Pass:
    """One measurement of every row, and the host's conditions meanwhile."""

    rows: list[Row]
    host: dict[str, Any]


def measure_pass(target: Target, models: list[str], quick: bool, repeats: int, quiet_wait_s: float,
                 reference_s: float | None) -> Pass:
    """Every row once, started when the host is ready (`host_ready`); the reference work's time over the
    profile's is taken before the held-out ops, before each model and at the end."""
    speeds = {"start": host_ready(quiet_wait_s, reference_s)}
    load_before = os.getloadavg()[0]
    with OtherLoad() as other:
        rows = held_out_rows(target, quick, repeats)
        for name in models:
            speeds[name] = reference_work_s() / reference_s if reference_s else 1.0
            rows += model_rows(name, target, quick, repeats)
    speeds["end"] = reference_work_s() / reference_s if reference_s else 1.0
    return Pass(rows, {"load_average_1min_before": load_before, "other_cores_during": other.cores,
                       "speed_ratio_to_profile": speeds})


def combine_passes(passes: list[list[Row]]) -> list[Row]:
    """Each row measured as the mean of its passes (which it keeps)."""
    combined = []
    for same in zip(*passes, strict=True):
        times = tuple(r.measured for r in same)
        measured = blockbench.PhaseTimes(mean(t.fwd_s for t in times), mean(t.bwd_s for t in times))
        combined.append(replace(same[0], measured=measured, passes=times))
    return combined


# ---- calibration --------------------------------------------------------------------------------------
def op_rates_only(path: Path) -> Calibration:
    """The calibration in `path` with its op-class rates and overheads only: model timings dropped and the
    contention factor set to 1 (see the module docstring). Errors name the file and the field."""
    load_calibration(path)                      # validates, with the one-line errors of `plan --calibration`
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc.pop("models", None)
    doc["host_sharing"] = {**doc["host_sharing"], "contention_factor": 1.0}
    return parse_calibration(doc, str(path))


def profile_now(device_kind: str, quick: bool, out: Path, quiet_wait_s: float) -> Path:
    """`plan profile` (one computing process, no model) into `out`, once the host is quiet; repeated (up to
    `ATTEMPTS` times, not with `quick`) while the host's speed moved during it, as benchmarks/fidelity.py."""
    from planner.profiling.calibrate import profile, write_calibration

    for attempt in range(1, ATTEMPTS + 1):
        if quiet_wait_s > 0:
            wait_until_quiet(quiet_wait_s)
        print(f"profiling this {device_kind} ({'quick' if quick else 'full'}, no model) ...", flush=True)
        doc = profile(quick=quick, concurrency=1, device=device_kind, timeout_s=PROFILE_TIMEOUT_S[quick])
        write_calibration(doc, out)
        before_s, after_s = doc["host_load"]["reference_work_s"]
        if quick or abs(after_s / before_s - 1.0) <= HOST_SPEED_TOLERANCE:
            break
        print(f"  the host's speed moved during the profile ({after_s / before_s:.2f}x): "
              f"{'profiling again' if attempt < ATTEMPTS else 'kept'}", file=sys.stderr, flush=True)
    return out


def host_ready(quiet_wait_s: float, reference_s: float | None) -> float:
    """`fidelity.wait_until_ready` (no waiting with `quiet_wait_s` 0): the reference work's time now over
    the profile's `reference_s` (1.0 without one)."""
    if quiet_wait_s > 0:
        return wait_until_ready(quiet_wait_s, reference_s)
    return reference_work_s() / reference_s if reference_s else 1.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise HetplanError("no CUDA device here", field="--device", fix="pass --device cpu, or run on a GPU machine")
    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


def make_target(device: torch.device, calibration: Calibration | None, precision: str) -> Target:
    """The device's catalog type (checked against the calibration's) and the precision to time in."""
    catalog_name, description = describe(device)
    catalog = load_catalog()
    if catalog_name not in catalog:
        raise HetplanError(f"the device `{description}` matches no catalog type", field="--device",
                           fix="add it to costmodel/catalog/devices.yaml")
    device_type = catalog[catalog_name]
    if calibration is not None and not calibration.matches(device_type):
        raise CalibrationError(f"calibrates `{calibration.device_name}`, the device here is `{catalog_name}`",
                               file=calibration.source, field="device.name",
                               fix=f"profile this device: plan profile --device {device.type}")
    if precision == "auto":
        precision = compute.best_precision(device_type, "auto")
    measured = calibration is None or calibration.rates(precision, "matmul") is not None
    if precision not in DTYPES or not device_type.supports(precision) or not measured:
        raise HetplanError(f"precision {precision} is not available here", field="--precision",
                           fix="use fp32, or bf16 on a GPU that has it")
    return Target(device, description, device_type, precision, calibration)


# ---- entry --------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fidelity.py --single-device", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--calibration", type=Path, default=None,
                   help="`plan profile` file of this device (default: profile now, without --model)")
    p.add_argument("--datasheet-only", action="store_true", help="no calibration: predict from the catalog only")
    p.add_argument("--quick", action="store_true", help="one op per class, one micro-batch, fewer repeats, one pass")
    p.add_argument("--passes", type=int, default=None,
                   help=f"measurements of every row, one after the other (default {PASSES}, 1 with --quick)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated example models")
    p.add_argument("--precision", default="auto", help="fp32 | bf16 | auto (the planner's choice: fp32 on CPU)")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/single_device_<device>.json")
    p.add_argument("--quiet-wait", type=float, default=None,
                   help="seconds to wait for other processes to leave the cores free (default: 0 with --quick)")
    return p


def calibration_of(args: argparse.Namespace, device: torch.device, out: Path,
                   quiet_wait_s: float) -> tuple[Calibration | None, dict[str, Any]]:
    """The calibration to predict with (profiled now without --calibration; none with --datasheet-only),
    and what the results record about it."""
    if args.datasheet_only:
        return None, {"used": "none (--datasheet-only)"}
    path = args.calibration or profile_now(device.type, args.quick, out.with_name(f"{out.stem}_calibration.json"),
                                           quiet_wait_s)
    cal = op_rates_only(path)
    host_load = json.loads(path.read_text(encoding="utf-8")).get("host_load", {})
    return cal, {"path": str(path), "profiled_now": args.calibration is None, "device": cal.device_name,
                 "measured_at": cal.measured_at, "concurrent_processes": cal.concurrent_processes,
                 "reference_work_s": host_load.get("reference_work_s"),
                 "used": "op-class rates and per-op overheads only (model timings and contention factor left out)"}


def run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    device = resolve_device(args.device)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if not (EXAMPLES / m / "model.py").is_file()]
    if unknown:
        raise HetplanError(f"no example model {unknown[0]!r}", field="--models",
                           fix=f"use some of: {', '.join(MODELS)}")
    out = args.out or RESULTS / f"single_device_{device.type}.json"
    args.passes = args.passes or (1 if args.quick else PASSES)
    quiet_wait_s = args.quiet_wait if args.quiet_wait is not None else (0.0 if args.quick else QUIET_WAIT_S)
    calibration, calibration_record = calibration_of(args, device, out, quiet_wait_s)
    target = make_target(device, calibration, args.precision)
    if device.type == "cpu":
        torch.set_num_threads(1)      # one compute thread, as the profiling workers and the CPU program
    repeats = QUICK_REPEATS if args.quick else FULL_REPEATS
    # measured once the host is quiet and runs the reference work at the profile's speed (benchmarks/fidelity.py)
    profile_reference = calibration_record.get("reference_work_s")
    reference_s = mean(profile_reference) if profile_reference else None
    passes = []
    for n in range(args.passes):
        print(f"pass {n + 1} of {args.passes}", flush=True)
        passes.append(measure_pass(target, models, args.quick, repeats, quiet_wait_s, reference_s))
    rows = combine_passes([p.rows for p in passes])
    host = {"passes": [p.host for p in passes],
            "what": "per pass: load average before; other processes' cores while measuring; reference work time "
                    "(planner.profiling.calibrate.reference_work_s) before the held-out ops, before each model and at "
                    "the "
                    "end / in the profile"}
    summary = summarise(rows)
    print(table(rows))
    print("\n".join(summary_lines(summary)))
    for n, p in enumerate(passes):
        print(f"pass {n + 1}: other processes used {p.host['other_cores_during'] or 0.0:.2f} cores; host speed / the "
              f"profile's: {', '.join(f'{k} {v:.2f}' for k, v in p.host['speed_ratio_to_profile'].items())}")
    print(f"{target.description}, {target.precision}; {time.perf_counter() - start:.0f} s")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": {"kind": device.type, "name": target.description, "catalog_type": target.device_type.name},
        "torch_version": torch.__version__, "precision": target.precision, "threads": torch.get_num_threads(),
        "quick": args.quick, "repeats": repeats, "passes": args.passes,
        "clock": "CPU seconds of this process" if device.type == "cpu" else "wall seconds, device synchronised",
        "calibration": calibration_record, "host": host, "summary": summary,
        "rows": [r.as_json() for r in rows]}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry: one line and a non-zero exit code for a domain error."""
    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except HetplanError as exc:
        print(f"fidelity --single-device: error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
