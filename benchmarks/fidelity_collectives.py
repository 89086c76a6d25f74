"""Do the cost model's collective figures match what gloo measures? (TP all-reduce, ZeRO-1 all-gather)

    python benchmarks/fidelity_collectives.py [--worlds 2,4] [--steps 5] [--calibration FILE | --profile]
                                              [--quick] [--out FILE]

On real gloo processes (2 and 4 ranks, one compute thread each, spawned together):

1. the link: `all_reduce` of FIT_SIZES_BYTES timed on the ranks' own group (barrier before each, median
   over repeats) and fitted to the ring model `2(n-1) * latency + 2(n-1)/n * bytes / bandwidth`, as
   `plan profile` fits its `allreduce_ring` (planner.profiling.calibrate); that fitted link prices both
   collectives below. With `--calibration FILE` (from `plan profile`; `--profile`: a `plan profile --quick`
   of this host first, into a temporary file) the tables' own links are priced too: the TP ring on the
   node's collective link (the all-reduce microbenchmark's ring, `Calibration.call_ring_link`, as
   costmodel.calibrated.collective_link gives it) and the ZeRO gather on the `loopback` network (that ring
   with the gradient sync's in-situ factor, `Calibration.ring_link`, costmodel.calibrated.inter_link);
2. TP: examples/gpt and examples/hf_llama traced on meta, rewritten by passes.tensor_parallel to this
   rank's shard of degree t = world, given the single-process weights, then forward + backward of `rows`
   samples per step; every `torch.distributed.all_reduce` the graph's autograd functions issue is
   counted, sized and timed (`fidelity_collectives_ranks.CollectiveTally`). The model's figure for the
   same graph: per sample `allreduce_s_per_sample(fwd + bwd bytes)`, plus `2 * pairs *
   allreduce_latency_s` per micro-batch (costmodel.tensor_parallel, what `at_degree` adds to a stage
   holding every block);
3. ZeRO: ZERO_TENSORS equal square fp32 weights of width w under torch's ZeroRedundancyOptimizer (AdamW,
   as backends/torchdist/program/zero.py builds it), one sharded step per repeat; the post-step
   parameter sync (one `broadcast` per parameter from its owner) is timed apart from the local step and
   compared with `costmodel.sharded_state.allgather_s(param bytes, world, ...)`; the bytes each rank
   receives with `costmodel.zero.zero_gather_bytes`.

Measured times are medians over steps of the ranks' mean (a collective ends on every rank together, so
the ranks' figures differ by how long each waited for the last to arrive). TP rows also keep
`measured_least_waiting_s`, per call the time on the rank that arrived last, summed (the wait for ranks
still computing left out, as the ring model leaves it out; on a host with fewer cores than ranks that
rank still waits for its peers to be scheduled), and `replayed_s`, the same calls issued back to back on
every rank with no compute between them (what the link fit describes).
Counts and bytes are exact and equal the model's; times are not. Prints the table and writes
benchmarks/results/fidelity_collectives.json. The ranks' side is benchmarks/fidelity_collectives_ranks.py.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import mean, median
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:   # runnable as `python benchmarks/fidelity_collectives.py` from anywhere
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.common import write_json_to  # noqa: E402
from benchmarks.fidelity_collectives_ranks import ZERO_TENSORS, measure  # noqa: E402
from costmodel.calibration import load_calibration  # noqa: E402
from costmodel.sharded_state import allgather_s  # noqa: E402
from costmodel.tensor_parallel import allreduce_latency_s, allreduce_s_per_sample  # noqa: E402
from costmodel.zero import zero_gather_bytes  # noqa: E402
from planner.core.cluster import Link  # noqa: E402
from planner.profiling.calibrate import fit_nonneg  # noqa: E402

__all__ = ["ZERO_TENSORS", "Links", "RingFit", "TPRow", "ZeroRow", "fit_ring", "main", "measure",
           "run", "table", "tp_model_s", "tp_rows", "zero_rows"]

RESULTS = REPO / "benchmarks" / "results"
TP_MODELS = ("gpt", "hf_llama")        # examples whose pairs shard at 2 and 4 (4 heads, 4 KV heads)
TP_ROWS = (8, 32)                      # samples per forward + backward (one micro-batch)
ZERO_WIDTHS = (256, 512, 1024)         # square weights: 2, 8 and 32 MiB of parameters in all
FIT_REPEATS = 9                        # of every FIT_SIZES_BYTES all-reduce (median)
DEFAULT_STEPS = 5                      # timed steps per case, after the ranks' WARMUP_STEPS
QUICK = {"steps": 2, "fit_repeats": 3, "tp_models": ("gpt",), "tp_rows": (8,), "zero_widths": (256,)}
PROFILE_TIMEOUT_S = 600


@dataclass(frozen=True)
class RingFit:
    """The ring model's per-hop latency and bandwidth, fitted to all-reduces over `world` ranks."""

    world: int
    latency_s: float
    bandwidth_bytes_s: float
    samples: tuple[tuple[int, float], ...]          # (bytes, median seconds)

    def link(self) -> Link:
        return Link("gloo-fit", self.bandwidth_bytes_s, self.latency_s)


def fit_ring(world: int, samples: list[tuple[int, float]]) -> RingFit:
    """Least-squares (relative error, non-negative) fit of 2(n-1)*latency + 2(n-1)/n*bytes/bandwidth."""
    hops = [2.0 * (world - 1)] * len(samples)
    volume = [2 * (world - 1) / world * b for b, _ in samples]
    latency, per_byte = fit_nonneg([hops, volume], [s for _, s in samples])
    if per_byte <= 0:
        per_byte = min(s / v for (_, s), v in zip(samples, volume))
    return RingFit(world, latency, 1.0 / per_byte, tuple(samples))


# --- the model's figures beside the measured ones ---------------------------------------------------------


@dataclass(frozen=True)
class Links:
    """The links the model's figures are priced on: the fit of this run, and a calibration's (optional)."""

    fit: RingFit
    tp_calibrated: Link | None = None       # the tables' collective link (costmodel.calibrated.collective_link)
    zero_calibrated: Link | None = None     # the tables' loopback network (Calibration.ring_link)


def _rel(model_s: float, measured_s: float) -> float:
    return (model_s - measured_s) / measured_s if measured_s > 0 else float("nan")


def tp_model_s(fwd_bytes_per_sample: float, bwd_bytes_per_sample: float, rows: int, pairs: int,
               degree: int, link: Link) -> float:
    """costmodel.tensor_parallel's all-reduce time of one micro-batch of `rows` samples of a stage that
    holds every block: bandwidth per sample both ways, latency per pair both ways."""
    return (rows * (allreduce_s_per_sample(fwd_bytes_per_sample, degree, link)
                    + allreduce_s_per_sample(bwd_bytes_per_sample, degree, link))
            + 2 * pairs * allreduce_latency_s(degree, link))


@dataclass
class TPRow:
    model: str
    world: int
    rows: int
    calls_measured: int
    calls_model: int
    bytes_measured: int
    bytes_model: int
    measured_s: float
    model_fit_s: float
    rel_error_fit: float
    model_calibrated_s: float | None = None
    rel_error_calibrated: float | None = None
    measured_least_waiting_s: float = 0.0     # per call the last rank to arrive, summed
    replayed_s: float = 0.0                   # the same calls back to back, no compute between them
    rel_error_fit_replayed: float = 0.0       # the fitted model against replayed_s
    rel_error_fit_last: float = 0.0           # the fitted model against measured_least_waiting_s
    per_step_s: list[float] = field(default_factory=list)


@dataclass
class ZeroRow:
    world: int
    param_bytes: int
    broadcasts_measured: int
    broadcasts_model: int               # one per parameter tensor (torch's scheme)
    received_bytes_measured: int        # per rank (every rank the same: the partition is even)
    received_bytes_model: float
    measured_s: float
    local_step_s: float
    model_fit_s: float
    rel_error_fit: float
    model_calibrated_s: float | None = None
    rel_error_calibrated: float | None = None
    per_step_s: list[float] = field(default_factory=list)


def tp_rows(world: int, ranks: list[dict[str, Any]], links: Links) -> list[TPRow]:
    out = []
    for c, case in enumerate(ranks[0]["tp"]):
        per_rank = [r["tp"][c]["steps"] for r in ranks]
        step_s = [mean(s[i]["fwd"]["seconds"] + s[i]["bwd"]["seconds"] for s in per_rank)
                  for i in range(len(per_rank[0]))]
        # per call, the rank that arrived last did not wait for ranks still computing
        least_s = [sum(min(calls) for calls in zip(*(s[i]["fwd"]["call_seconds"] + s[i]["bwd"]["call_seconds"]
                                                      for s in per_rank)))
                   for i in range(len(per_rank[0]))]
        calls = {s[i]["fwd"]["calls"] + s[i]["bwd"]["calls"] for s in per_rank for i in range(len(s))}
        nbytes = {s[i]["fwd"]["bytes"] + s[i]["bwd"]["bytes"] for s in per_rank for i in range(len(s))}
        if len(calls) != 1 or len(nbytes) != 1:
            raise RuntimeError(f"TP ranks or steps issued different collectives: calls {calls}, bytes {nbytes}")
        rows, pairs = case["rows"], case["pairs"]
        fwd_b, bwd_b = case["fwd_bytes_per_sample"], case["bwd_bytes_per_sample"]
        measured = median(step_s)
        fit_s = tp_model_s(fwd_b, bwd_b, rows, pairs, world, links.fit.link())
        row = TPRow(case["model"], world, rows, calls.pop(), 2 * pairs, nbytes.pop(), rows * (fwd_b + bwd_b), measured,
                    fit_s, _rel(fit_s, measured), measured_least_waiting_s=median(least_s),
                    rel_error_fit_last=_rel(fit_s, median(least_s)), per_step_s=step_s)
        replay = [mean(r["tp"][c]["replay_s"][i] for r in ranks) for i in range(len(ranks[0]["tp"][c]["replay_s"]))]
        row.replayed_s = median(replay)
        row.rel_error_fit_replayed = _rel(fit_s, row.replayed_s)
        if links.tp_calibrated is not None:
            row.model_calibrated_s = tp_model_s(fwd_b, bwd_b, rows, pairs, world, links.tp_calibrated)
            row.rel_error_calibrated = _rel(row.model_calibrated_s, measured)
        out.append(row)
    return out


def zero_rows(world: int, ranks: list[dict[str, Any]], links: Links) -> list[ZeroRow]:
    out = []
    for c, case in enumerate(ranks[0]["zero"]):
        per_rank = [r["zero"][c]["steps"] for r in ranks]
        step_s = [mean(s[i]["seconds"] for s in per_rank) for i in range(len(per_rank[0]))]
        received = {s[i]["received_bytes"] for s in per_rank for i in range(len(s))}
        calls = {s[i]["calls"] for s in per_rank for i in range(len(s))}
        if len(calls) != 1:
            raise RuntimeError(f"ZeRO ranks issued different numbers of broadcasts: {calls}")
        nbytes = case["param_bytes"]
        measured = median(step_s)
        fit = links.fit
        fit_s = allgather_s(nbytes, world, fit.bandwidth_bytes_s, fit.latency_s)
        row = ZeroRow(world, nbytes, calls.pop(), case["tensors"], max(received), zero_gather_bytes(nbytes, world),
                      measured, median(mean(s[i]["local_step_s"] for s in per_rank) for i in range(len(step_s))),
                      fit_s, _rel(fit_s, measured), per_step_s=step_s)
        if len(received) != 1:
            row.received_bytes_measured = -max(received)        # uneven partition: flagged, never equal
        if links.zero_calibrated is not None:
            cal = links.zero_calibrated
            row.model_calibrated_s = allgather_s(nbytes, world, cal.bandwidth_bytes_s, cal.latency_s)
            row.rel_error_calibrated = _rel(row.model_calibrated_s, measured)
        out.append(row)
    return out


def _fit_of(world: int, ranks: list[dict[str, Any]]) -> RingFit:
    samples = [(int(b), mean(r["fit"][i][1] for r in ranks)) for i, (b, _) in enumerate(ranks[0]["fit"])]
    return fit_ring(world, samples)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:8.2f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+6.0f}%"


def table(fits: list[RingFit], tp: list[TPRow], zero: list[ZeroRow]) -> str:
    lines = ["link fits (ring model of all_reduce on the ranks' group):"]
    lines += [f"  {f.world} ranks: {f.latency_s * 1e6:7.1f} us per hop, {f.bandwidth_bytes_s / 1e6:7.1f} MB/s"
              for f in fits]
    lines += ["", "TP all-reduce per step (forward + backward of one micro-batch):",
              f"  {'model':>8} {'t':>2} {'rows':>4} {'calls':>9} {'bytes':>17} {'meas ms':>8} {'last ms':>8} "
              f"{'replay':>8} {'fit ms':>8} {'err':>7} {'err last':>8} {'err rep':>7} {'cal ms':>8} {'err':>7}"]
    for r in tp:
        lines.append(f"  {r.model:>8} {r.world:>2} {r.rows:>4} {r.calls_measured:>4}/{r.calls_model:<4} "
                     f"{r.bytes_measured:>8}/{r.bytes_model:<8} {_ms(r.measured_s)} {_ms(r.measured_least_waiting_s)} "
                     f"{_ms(r.replayed_s)} {_ms(r.model_fit_s)} {_pct(r.rel_error_fit)}  {_pct(r.rel_error_fit_last)} "
                     f"{_pct(r.rel_error_fit_replayed)} "
                     f"{_ms(r.model_calibrated_s)} {_pct(r.rel_error_calibrated)}")
    lines += ["", "ZeRO-1 parameter sync after the step (ZeroRedundancyOptimizer, AdamW):",
              f"  {'z':>2} {'MiB':>5} {'bcasts':>7} {'received/rank':>19} {'meas ms':>8} {'fit ms':>8} {'err':>7} "
              f"{'cal ms':>8} {'err':>7}"]
    for z in zero:
        lines.append(f"  {z.world:>2} {z.param_bytes / 2**20:>5.0f} {z.broadcasts_measured:>3}/{z.broadcasts_model:<3} "
                     f"{z.received_bytes_measured:>9}/{z.received_bytes_model:<9.0f} {_ms(z.measured_s)} "
                     f"{_ms(z.model_fit_s)} {_pct(z.rel_error_fit)} {_ms(z.model_calibrated_s)} "
                     f"{_pct(z.rel_error_calibrated)}")
    return "\n".join(lines)


def run(worlds: tuple[int, ...], settings: dict[str, Any], calibration: Path | None) -> dict[str, Any]:
    """Measure every world size, price the same collectives, and return the JSON document."""
    cal = load_calibration(calibration) if calibration is not None else None
    fits: list[RingFit] = []
    tp: list[TPRow] = []
    zero: list[ZeroRow] = []
    load: list[dict[str, float]] = []
    for world in worlds:
        before = os.getloadavg()[0]
        ranks = measure(world, settings)
        load.append({"world": world, "load_average_1min_before": before, "after": os.getloadavg()[0]})
        fit = _fit_of(world, ranks)
        links = Links(fit, cal.call_ring_link("intra") if cal else None, cal.ring_link("loopback") if cal else None)
        fits.append(fit)
        tp += tp_rows(world, ranks, links)
        zero += zero_rows(world, ranks, links)
    return {"what": "collectives the program issues, measured on gloo ranks of this host, against the cost model",
            "link": "fit: ring model fitted in this run to all_reduce on the same ranks (FIT_SIZES_BYTES); "
                    "calibrated: the tables' links from --calibration (TP: the collective link, "
                    "Calibration.call_ring_link; ZeRO: the loopback network, Calibration.ring_link)",
            "calibration": str(calibration) if calibration else None, "settings": settings,
            "calibrated_links": {"tp_intra_collective": asdict(cal.call_ring_link("intra")),
                                 "zero_loopback_ring": asdict(cal.ring_link("loopback"))} if cal else None,
            "torch_version": torch.__version__, "cpu_cores": os.cpu_count(), "host_load": load,
            "fits": [asdict(f) for f in fits],
            "tp": [asdict(r) for r in tp], "zero": [asdict(z) for z in zero],
            "mean_abs_rel_error": {
                "tp_fit": mean(abs(r.rel_error_fit) for r in tp) if tp else None,
                "tp_fit_last": mean(abs(r.rel_error_fit_last) for r in tp) if tp else None,
                "tp_fit_replayed": mean(abs(r.rel_error_fit_replayed) for r in tp) if tp else None,
                "zero_fit": mean(abs(z.rel_error_fit) for z in zero) if zero else None,
                "tp_calibrated": mean(abs(r.rel_error_calibrated) for r in tp if r.rel_error_calibrated is not None)
                if cal and tp else None,
                "zero_calibrated": mean(abs(z.rel_error_calibrated) for z in zero
                                        if z.rel_error_calibrated is not None) if cal and zero else None}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="2,4", help="gloo world sizes (TP degree = ZeRO group = world)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--calibration", type=Path, default=None, help="a `plan profile` file: price its links too")
    p.add_argument("--profile", action="store_true",
                   help="first run `plan profile --quick --concurrency <largest world>` into a temporary file "
                        "and price its links (instead of --calibration)")
    p.add_argument("--quick", action="store_true", help="fewest cases and steps (a smoke run)")
    p.add_argument("--out", type=Path, default=RESULTS / "fidelity_collectives.json")
    args = p.parse_args(argv)
    settings: dict[str, Any] = {"steps": args.steps, "fit_repeats": FIT_REPEATS, "tp_models": list(TP_MODELS),
                                "tp_rows": list(TP_ROWS),
                                "zero_widths": list(ZERO_WIDTHS)}
    if args.quick:
        settings.update({k: list(v) if isinstance(v, tuple) else v for k, v in QUICK.items()})
    worlds = tuple(int(w) for w in args.worlds.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        calibration = args.calibration
        if args.profile:
            calibration = Path(tmp, "calibration.json")
            subprocess.run([sys.executable, "-m", "planner.cli", "profile", "--quick", "--concurrency",
                            str(max(worlds)), "--out", str(calibration)], check=True, timeout=PROFILE_TIMEOUT_S)
        doc = run(worlds, settings, calibration)
    if args.profile:
        doc["calibration"] = f"`plan profile --quick --concurrency {max(worlds)}` run by --profile"
    fits = [RingFit(f["world"], f["latency_s"], f["bandwidth_bytes_s"], tuple(f["samples"])) for f in doc["fits"]]
    print(table(fits, [TPRow(**r) for r in doc["tp"]], [ZeroRow(**z) for z in doc["zero"]]))
    print(f"\nwrote {write_json_to(args.out, doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
