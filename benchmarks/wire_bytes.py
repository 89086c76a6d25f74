"""Bytes on the wire per training step, measured by the emitted program, against the cost model.

    python benchmarks/wire_bytes.py                  # 5 runs of the GPT on 4 gloo ranks, ~2 min
    python benchmarks/wire_bytes.py --stages 1       # 4 replicas x 1 stage (one gradient group)

Each run plans examples/gpt/model.py on examples/clusters/cpu-hetero-4.yaml (`--use-all-devices`,
2 stages x 2 replicas by default, micro-batches of 2) with a forced gradient compressor and an
activation compressor (pairs below), runs STEPS steps with `plan run`, and reads the metrics lines:

  gradients    `grad_wire_bytes_by_group`: payload this rank handed to the group's collectives,
               measured by the compressors' counters (a CollectiveTap for `none`), last step (PowerSGD
               runs vanilla all-reduces for its first costmodel POWERSGD_START_ITER steps)
  activations  `p2p_bytes`: bytes of the tensors each rank sent to its pipeline neighbours

The model figures come from costmodel.compression on the group's parameter shapes (payload per
rank) and on the edge's activation bytes; "link bytes" applies the collective's factor (ring
all-reduce 2(R-1)/R, ring all-gather R-1 of the payload). Prints tables and writes
benchmarks/results/wire_bytes.json; exit status 1 if a measurement differs from its model figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from backends.torchdist.program.gradsync import group_payload_bytes  # noqa: E402
from benchmarks.convergence import MODEL, plan_program, run_program, table  # noqa: E402
from costmodel import activation_compression as activation_costs  # noqa: E402
from costmodel import compression as costs  # noqa: E402
from planner import frontend  # noqa: E402
from planner.core.ir import Plan  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
STEPS = costs.POWERSGD_START_ITER + 2
LR = 1e-3
PAIRS = (("none", "none"), ("fp16", "fp16"), ("bf16", "bf16"), ("powersgd", "int8"), ("onebit", "int8"))
"""(gradient compressor, activation compressor) per run."""


def link_factor(algorithm: str, ranks: int) -> float:
    """Bytes a rank moves over its link per payload byte: ring all-reduce or ring all-gather."""
    return (ranks - 1) if algorithm == "allgather" else 2 * (ranks - 1) / ranks


def measure(grad: str, act: str, stages: int, workdir: Path,
            shapes: dict[str, tuple[int, ...]]) -> tuple[list[dict], list[dict]]:
    """One run: per-group and per-edge rows of measured vs model bytes."""
    out = workdir / f"{grad}-{act}"
    extra = ("--micro-batch", "2", "--activation-compression", act) if stages > 1 else ()
    plan_program(out, grad, stages=stages, extra=extra)
    plan = Plan.load(out)
    last = [m for m in run_program(out, STEPS, lr=LR) if m["step"] == STEPS - 1]
    groups = []
    for g in plan.grad_groups:
        measured = sorted({m["grad_wire_bytes_by_group"][str(g.index)] for m in last if m["rank"] in g.ranks})
        model = group_payload_bytes(g, shapes)
        groups.append({"compressor": g.compressor, "group": g.index, "ranks": list(g.ranks),
                       "params": len(g.params), "uncompressed_bytes": g.nbytes, "measured_bytes": measured,
                       "model_bytes": model, "model_link_bytes": model * link_factor(g.algorithm, len(g.ranks)),
                       "algorithm": g.algorithm, "estimated_s": g.estimated_s,
                       "match": measured == [model]})
    edges = []
    for e in plan.p2p:
        micro = plan.replicas[e.replica].micro_batch_sizes
        element_bytes = costs.FP32_BYTES   # CPU stages compute in fp32
        model = sum(activation_costs.activation_wire_bytes(e.compressor, e.bytes_per_sample * m, element_bytes)
                    for m in micro)
        uncompressed = sum(e.bytes_per_sample * m for m in micro)
        for rank, direction in ((e.src_rank, "activations"), (e.dst_rank, "gradients")):
            measured = sorted({m["p2p_bytes"] for m in last if m["rank"] == rank})
            edges.append({"compressor": e.compressor, "replica": e.replica, "rank": rank,
                          "direction": direction, "uncompressed_bytes": uncompressed,
                          "measured_bytes": measured, "model_bytes": model, "match": measured == [model]})
    return groups, edges


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=2, choices=[1, 2])
    p.add_argument("--out", type=Path, default=RESULTS / "wire_bytes.json")
    args = p.parse_args(argv)
    module = frontend.build_on_meta(frontend.load_model_file(MODEL))
    shapes = {name: tuple(t.shape) for name, t in module.named_parameters()}
    groups, edges = [], []
    with tempfile.TemporaryDirectory(prefix="hetplan-wire-") as tmp:
        for grad, act in PAIRS:
            g, e = measure(grad, act if args.stages > 1 else "none", args.stages, Path(tmp), shapes)
            groups += g
            edges += e
            print(f"{grad}/{act}: done", flush=True)
    rows = [[r["compressor"], str(r["group"]), ",".join(map(str, r["ranks"])), f"{r['uncompressed_bytes']:,.0f}",
             "/".join(f"{b:,}" for b in r["measured_bytes"]), f"{r['model_bytes']:,.0f}",
             f"{r['uncompressed_bytes'] / max(r['model_bytes'], 1):.1f}x", f"{r['model_link_bytes']:,.0f}",
             r["algorithm"], "yes" if r["match"] else "NO"] for r in groups]
    print(f"\nGradient payload per rank, step {STEPS - 1} (GPT, cpu-hetero-4, {args.stages} stage(s))\n")
    print(table(["compressor", "group", "ranks", "fp32 bytes", "measured", "model", "saving", "model link bytes",
                 "collective", "equal"], rows))
    if edges:
        rows = [[r["compressor"], str(r["replica"]), str(r["rank"]), r["direction"],
                 f"{r['uncompressed_bytes']:,.0f}", "/".join(f"{b:,}" for b in r["measured_bytes"]),
                 f"{r['model_bytes']:,.0f}", "yes" if r["match"] else "NO"] for r in edges]
        print("\nPipeline bytes sent per rank and step\n")
        print(table(["compressor", "replica", "rank", "sends", "fp32 bytes", "measured", "model", "equal"], rows))
    ok = all(r["match"] for r in groups + edges)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(MODEL.relative_to(REPO)), "stages": args.stages,
                                    "step": STEPS - 1, "all_match": ok, "gradient_groups": groups,
                                    "pipeline_edges": edges}, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
