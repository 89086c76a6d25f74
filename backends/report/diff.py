"""`plan diff A B`: what changed between two plans, and what it costs.

Side by side: devices (how many, and which), replicas and their stages, batch shares, micro-batches, schedules,
recompute, gradient compressors and activation compressors, the estimates; then the estimate's
delta explained the way the runners-up are (pipeline, gradient sync, devices).
"""

from __future__ import annotations

from collections import Counter

from backends.report.idle import idle_causes
from backends.report.text import GIB, format_time, layout, printable, signed_time, table
from planner.core.cluster import parse_label
from planner.core.ir import Plan


def diff_text(a: Plan, b: Plan, name_a: str = "A", name_b: str = "B") -> str:
    """The two plans' differences as text; a line saying so when they plan the same thing."""
    rows = [[label, va, vb] for label, va, vb in _facts(a, b) if va != vb]
    same = [label for label, va, vb in _facts(a, b) if va == vb]
    head = f"plan diff: {printable(name_a)} -> {printable(name_b)}"
    if not rows:
        return f"{head}\nthe same plan: {', '.join(same)} all equal\n"
    parts = [head, table(["", printable(name_a), printable(name_b)], rows)]
    if same:
        parts.append("unchanged: " + ", ".join(same))
    parts.append("what it costs: " + explain(a, b))
    return "\n\n".join(parts) + "\n"


def explain(a: Plan, b: Plan) -> str:
    """The estimate's change from `a` to `b`, by its parts."""
    ea, eb = a.estimates, b.estimates
    ratio = eb.iteration_s / ea.iteration_s if ea.iteration_s > 0 else float("inf")
    verdict = f"{ratio:.2f}x the step time" if ratio >= 1 else f"{1 / ratio:.2f}x faster"
    parts = [f"pipeline {signed_time(eb.pipeline_s - ea.pipeline_s)} (bubble {ea.bubble_fraction:.0%} -> "
             f"{eb.bubble_fraction:.0%})", f"gradient sync {signed_time(eb.sync_s - ea.sync_s)}"]
    if a.world_size != b.world_size:
        parts.append(f"{a.world_size} -> {b.world_size} devices")
    peak_a, peak_b = max(ea.memory_bytes) / GIB, max(eb.memory_bytes) / GIB
    if abs(peak_a - peak_b) > 0.005:
        parts.append(f"fullest device {peak_a:.2f} -> {peak_b:.2f} GiB")
    return f"{verdict} ({signed_time(eb.iteration_s - ea.iteration_s)}): " + "; ".join(parts)


def _facts(a: Plan, b: Plan) -> list[tuple[str, str, str]]:
    out = []
    for label, fn in (
        ("cluster", lambda p: printable(p.inputs.cluster_name)),
        ("global batch", lambda p: str(p.global_batch)),
        ("devices used", lambda p: str(p.world_size)),
        ("devices", _device_set),
        ("layout", layout),
        ("stage blocks", _stage_blocks),
        ("batch shares", lambda p: " ".join(str(r.batch_share) for r in p.replicas)),
        ("micro-batches", lambda p: " ".join(f"{len(r.micro_batch_sizes)}x{max(r.micro_batch_sizes)}"
                                             for r in p.replicas)),
        ("schedules", lambda p: _counted(r.schedule for r in p.replicas)),
        ("recompute", lambda p: f"{sum(st.recompute for r in p.replicas for st in r.stages)} stage(s)"),
        ("precision", lambda p: _counted(st.precision for r in p.replicas for st in r.stages)),
        ("gradient compressors", lambda p: _counted(g.compressor for g in p.grad_groups) or "none"),
        ("activation compressors", lambda p: _counted(e.compressor for e in p.p2p) or "none"),
        ("estimated step", lambda p: format_time(p.estimates.iteration_s)),
        ("pipelines", lambda p: format_time(p.estimates.pipeline_s)),
        ("gradient sync", lambda p: format_time(p.estimates.sync_s)),
        ("throughput", lambda p: f"{p.estimates.throughput_samples_s:,.1f} samples/s"),
        ("bubble", lambda p: f"{p.estimates.bubble_fraction:.0%}"),
        ("bubble by cause", idle_causes),
        ("fullest device", lambda p: f"{max(p.estimates.memory_bytes) / GIB:.2f} GiB"),
        ("simulated step", lambda p: format_time(p.solver.simulated_iteration_s)
         if p.solver.simulated_iteration_s is not None else "-"),
    ):
        out.append((label, fn(a), fn(b)))
    return out


def _device_set(plan: Plan) -> str:
    """The devices the plan runs on, whatever its rank order, node by node (`group/node:local` labels):
    `a100/0:0-3`, and nodes alike in a row as one, `a100/0-63:0-7, h100/64-65:0-3` (a plan re-planned on
    other devices differs here alone); a label that is not one (a hand-edited plan) as it is, last."""
    nodes: dict[tuple[str, int], list[int]] = {}
    odd: list[str] = []
    for label in plan.devices:
        try:
            group, node, local = parse_label(label)
        except ValueError:
            odd.append(label)
            continue
        nodes.setdefault((group, node), []).append(local)
    runs: list[tuple[str, list[int], str]] = []          # (group, nodes in a row, their locals)
    for (group, node), locals_ in sorted(nodes.items()):
        mine = _ranges(locals_)
        if runs and runs[-1][0] == group and runs[-1][2] == mine and runs[-1][1][-1] + 1 == node:
            runs[-1][1].append(node)
        else:
            runs.append((group, [node], mine))
    return printable(", ".join([*(f"{group}/{_ranges(row)}:{mine}" for group, row, mine in runs), *odd]))


def _ranges(numbers: list[int]) -> str:
    """`0-3` for 0 1 2 3, `0,2` for 0 2."""
    out: list[tuple[int, int]] = []                   # (first, last) of each run
    for n in sorted(numbers):
        if out and out[-1][1] + 1 == n:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in out)


def _stage_blocks(plan: Plan) -> str:
    """Each distinct pipeline's cuts, as block ranges: `0-9|10-19 x3`."""
    splits = Counter("|".join(f"{st.first_block}-{st.last_block}" for st in r.stages) for r in plan.replicas)
    return ", ".join(f"{s} x{n}" if n > 1 else s for s, n in sorted(splits.items()))


def _counted(values) -> str:
    counts = Counter(values)
    return ", ".join(f"{v} x{n}" for v, n in sorted(counts.items()))
