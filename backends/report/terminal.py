"""Terminal summary of a plan (what `plan` prints and `plan inspect` shows). Every table fits `width`
columns (backends.report.text.table: TERMINAL, the terminal's width, by default; None: never cut, as
for summary.txt)."""

from __future__ import annotations

from backends.report import text
from backends.report.gantt import render_gantt
from backends.report.idle import idle_causes
from backends.report.resilience import checkpoint_lines, lineage_line
from backends.report.text import GIB, RUNNERS_UP_HEADER, TERMINAL, format_time, printable, runners_up_rows, table
from backends.sim import simulate_plan
from planner.core.cluster import ClusterSpec
from planner.core.ir import Plan


def summary(plan: Plan, width: int | None = TERMINAL, warnings: bool = True) -> str:
    """The plan's head lines, stages and gradient groups, then its warnings (`warnings=False`: shown elsewhere,
    as `plan` prints them on stderr)."""
    e, s = plan.estimates, plan.solver
    devices_used = plan.world_size
    head = [
        f"plan for {printable(plan.inputs.cluster_name)}: {len(plan.replicas)} replica(s) on {devices_used} "
        f"device(s), global batch {plan.global_batch}, {len(plan.blocks)} blocks",
        f"estimated step {format_time(e.iteration_s)} (pipelines {format_time(e.pipeline_s)} + gradient sync "
        f"{format_time(e.sync_s)}), {e.throughput_samples_s:,.1f} samples/s, bubble {e.bubble_fraction:.0%}",
        f"bubble by cause: {idle_causes(plan)}",
        f"search: {printable(s.strategy)}, {printable(s.status)}, objective {format_time(s.objective_s)}, "
        f"bound {format_time(s.bound_s)}, gap {s.gap:.2%}, {s.configurations} candidate replica shapes",
    ]
    head += text.placeholder_lines(plan)   # estimates on placeholder figures: say so up front
    if e.cost_per_sample is not None:
        head.append(f"cost: ${e.cost_per_sample * 1e6:.4g} per million samples")
    head += checkpoint_lines(plan)
    replaced = lineage_line(plan)
    if replaced is not None:
        head.insert(0, replaced)
    rows = []
    for r in plan.replicas:
        for st in r.stages:
            ranks = str(st.rank) if st.tp_degree == 1 else f"{st.rank}-{st.ranks[-1]} tp{st.tp_degree}"
            rows.append([
                ranks, f"{r.index}/{st.index}", st.device_label, st.device_type, st.precision,
                f"{st.first_block}-{st.last_block}", "yes" if st.recompute else "no", str(r.batch_share),
                "x".join(map(str, r.micro_batch_sizes[:1])) + f" x{len(r.micro_batch_sizes)}", r.schedule,
                f"{e.memory_bytes[st.rank] / GIB:.2f}/{e.capacity_bytes[st.rank] / GIB:.1f}",
                format_time(e.busy_s[st.rank])])
    stages = table(["rank", "rep/stage", "device", "type", "prec", "blocks", "recompute", "share", "micro",
                     "schedule", "mem GiB", "busy"], rows, width)
    groups = [[str(g.index), ",".join(map(str, g.ranks)) if len(g.ranks) <= 8 else f"{len(g.ranks)} ranks",
               str(len(g.params)), f"{g.nbytes / 2**20:.2f}", g.compressor + (" zero" if g.zero else ""),
               format_time(g.estimated_s)]
              for g in plan.grad_groups[:12]]
    more = f"\n... {len(plan.grad_groups) - 12} more gradient groups" if len(plan.grad_groups) > 12 else ""
    grads = table(["group", "ranks", "params", "MiB", "compressor", "est"], groups, width) + more if groups else \
        "no gradient synchronisation (one replica)"
    tail = "\n" + warnings_section(plan) if warnings and plan.warnings else ""
    return "\n".join(head) + "\n\n" + stages + "\n\n" + grads + "\n" + tail


def warnings_section(plan: Plan) -> str:
    """Why a run of the plan will not equal training on one process, one line per cause."""
    return "warnings:\n" + "".join(f"  {printable(w)}\n" for w in plan.warnings)


def runners_up_section(plan: Plan, width: int | None = TERMINAL) -> str:
    """Why this plan: the alternatives the search saw, simulated on the same clock."""
    rows = runners_up_rows(plan)
    if not rows:
        return "(no runners-up recorded: planned with a baseline strategy or --no-runners-up)"
    return "why this plan:\n" + table(RUNNERS_UP_HEADER, rows, width)


def memory_table(plan: Plan, width: int | None = TERMINAL) -> str:
    """Estimated peak memory per rank against its device, fullest first."""
    e = plan.estimates
    order = sorted(range(plan.world_size), key=lambda r: -e.memory_bytes[r] / e.capacity_bytes[r])
    rows = [[str(r), plan.devices[r], f"{e.memory_bytes[r] / GIB:.2f}", f"{e.capacity_bytes[r] / GIB:.1f}",
             f"{e.memory_bytes[r] / e.capacity_bytes[r]:.0%}"] for r in order[:12]]
    return table(["rank", "device", "est GiB", "capacity GiB", "used"], rows, width)


def simulation_section(plan: Plan, spec: ClusterSpec) -> str:
    """The event simulation of one iteration: time, bubbles and a Gantt chart."""
    sim = simulate_plan(plan, spec)
    head = (f"simulated step {format_time(sim.iteration_s)} (estimate {format_time(plan.estimates.iteration_s)}), "
            f"bubble {sim.bubble_fraction:.0%}")
    return head + "\n" + render_gantt(sim)
