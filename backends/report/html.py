"""`plan inspect OUT --html report.html`: the plan as one self-contained page.

No network is needed to read it: CSS, SVG and a few lines of JavaScript are inline. It shows the
cluster with each device coloured by the replica and stage it serves, the simulated timeline of
one iteration per rank (zoom; hover a bar for its action, micro-batch and duration), memory per
device as stacked parts against capacity, why this plan and not the runners-up, where the step's
time goes, and the solver's facts. Every name from the spec or the plan is escaped.
"""

from __future__ import annotations

from collections.abc import Sequence

from backends.report.idle import idle_causes
from backends.report.memory_parts import memory_parts
from backends.report.svg import MemoryRow, cluster_svg, esc, memory_svg, replica_groups, timeline_svg
from backends.report.text import GIB, RUNNERS_UP_HEADER, format_time, layout, runners_up_rows, stage_ranks
from backends.sim import SimResult
from planner.core.cluster import ClusterSpec
from planner.core.ir import Plan

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; } td, th { padding: 3px 10px; border-bottom: 1px solid #eee; text-align: right; }
td:first-child, th:first-child { text-align: left; }
.scroll { overflow: auto; max-height: 640px; border: 1px solid #eee; }
svg text { font: 11px monospace; } svg text.h { font-weight: bold; }
rect.node { fill: none; stroke: #888; } rect.capacity { fill: #f4f4f4; stroke: #bbb; }
rect.span:hover, rect.device:hover, rect.mem:hover { stroke: #000; stroke-width: 1; }
.facts td { text-align: left; } .note { color: #666; }
"""

# zoom the timeline: stretch the time axis (bars and the axis' end), not the labels
SCRIPT = """
let zoom = 1;
function zoomTimeline(factor) {
  zoom = Math.max(1, Math.min(64, zoom * factor));
  const svg = document.getElementById('timeline-svg');
  const left = Number(svg.dataset.timeLeft), base = Number(svg.dataset.baseWidth);
  for (const el of svg.querySelectorAll('.span, .axis-end')) {
    if (el.dataset.x === undefined) {
      el.dataset.x = el.getAttribute('x');
      el.dataset.w = el.getAttribute('width') || 0;
    }
    el.setAttribute('x', left + (Number(el.dataset.x) - left) * zoom);
    if (el.tagName === 'rect') el.setAttribute('width', Number(el.dataset.w) * zoom);
  }
  svg.setAttribute('width', left + (base - left) * zoom);
  document.getElementById('zoom-level').textContent = zoom.toFixed(0) + 'x';
}
"""


TITLE_PREFIX = "hetplan: "
PAGE_MARK = f"<title>{TITLE_PREFIX}"     # how `plan inspect --html` knows a page it wrote (the head's first lines)


def render_html(plan: Plan, spec: ClusterSpec | None, sim: SimResult | None) -> str:
    """The whole report; without `spec` (the cluster spec is gone) there is no cluster picture,
    without `sim` no timeline, and the page says so."""
    e, s = plan.estimates, plan.solver
    title = f"{TITLE_PREFIX}{plan.inputs.cluster_name}, global batch {plan.global_batch}"
    sections = [
        f"<h1>{esc(title)}</h1>",
        f"<p>{len(plan.replicas)} replica(s) on {plan.world_size} device(s): {esc(layout(plan))}. "
        f"Estimated step {format_time(e.iteration_s)}, {e.throughput_samples_s:,.1f} samples/s, "
        f"bubble {e.bubble_fraction:.0%}.</p>",
        "<h2>Where the time goes</h2>" + _time_table(plan, sim),
        "<h2>Cluster</h2>" + (f'<div class="scroll" id="cluster">{cluster_svg(plan, spec)}</div>' if spec else
                              '<p class="note">no cluster picture: the cluster spec was not found</p>'),
        "<h2>Timeline of one iteration (simulated)</h2>" + _timeline_section(plan, sim),
        "<h2>Memory per device</h2>" + f'<div class="scroll" id="memory">{memory_svg(_memory_rows(plan, spec))}</div>',
        "<h2>Why this plan</h2>" + _runners_up(plan),
        "<h2>Replicas</h2>" + _replica_table(plan),
        "<h2>Solver</h2>" + _facts([("strategy", s.strategy), ("status", s.status),
                                    ("objective", format_time(s.objective_s)), ("bound", format_time(s.bound_s)),
                                    ("gap", f"{s.gap:.2%}"), ("candidate replica shapes", s.configurations)]),
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>{CSS}</style><script>{SCRIPT}</script></head>"
            "<body>" + "\n".join(sections) + "</body></html>\n")


def _time_table(plan: Plan, sim: SimResult | None) -> str:
    e = plan.estimates
    rows = [("pipelines (slowest replica)", format_time(e.pipeline_s)), ("gradient sync", format_time(e.sync_s)),
            ("step (estimate)", f"{format_time(e.iteration_s)}, bubble {e.bubble_fraction:.0%}"),
            ("bubble by cause", idle_causes(plan))]
    if sim is not None:
        rows.append(("step (simulated)", f"{format_time(sim.iteration_s)}, bubble {sim.bubble_fraction:.0%}"))
    if e.cost_per_sample is not None:
        rows.append(("cost", f"${e.cost_per_sample * 1e6:.4g} per million samples"))
    return _facts(rows)


def _timeline_section(plan: Plan, sim: SimResult | None) -> str:
    if sim is None:
        return '<p class="note">no timeline: the cluster spec was not found, so the plan was not simulated</p>'
    controls = ('<p><button onclick="zoomTimeline(2)">zoom in</button> <button onclick="zoomTimeline(0.5)">'
                'zoom out</button> <span id="zoom-level">1.0x</span> <span class="note">forward bars light, '
                'backward dark, gradient sync blue, optimizer orange</span></p>')
    return controls + f'<div class="scroll" id="timeline">{timeline_svg(plan, sim)}</div>'


def _memory_rows(plan: Plan, spec: ClusterSpec | None) -> list[MemoryRow]:
    """One row per device of each group of identical replicas (its stages together under interleaved
    1F1B), fullest first."""
    rows = []
    for group in replica_groups(plan):
        for st in group.first.device_stages:
            ranks = stage_ranks(st)
            rows.append(MemoryRow(f"rank {ranks} {st.device_label} ({st.device_type})", group.count * st.tp_degree,
                                  memory_parts(plan, st.rank, spec), plan.estimates.capacity_bytes[st.rank]))
    return sorted(rows, key=lambda r: -sum(r.parts_bytes) / max(r.capacity_bytes, 1.0))


def _runners_up(plan: Plan) -> str:
    rows = runners_up_rows(plan)
    if not rows:
        return '<p class="note">no runners-up recorded (a baseline strategy, or --no-runners-up)</p>'
    return _table(RUNNERS_UP_HEADER, rows)


def _replica_table(plan: Plan) -> str:
    rows = []
    for group in replica_groups(plan):
        r = group.first
        rows.append([f"{r.index}" + (f" (x{group.count})" if group.count > 1 else ""), r.node_group,
                     len(r.stages), r.batch_share, f"{len(r.micro_batch_sizes)} x {max(r.micro_batch_sizes)}",
                     r.schedule, "yes" if any(st.recompute for st in r.stages) else "no",
                     format_time(r.estimated_s),
                     f"{max(plan.estimates.memory_bytes[st.rank] for st in r.stages) / GIB:.2f}"])
    return _table(["replica", "node group", "stages", "share", "micro-batches", "schedule", "recompute",
                   "est", "max GiB"], rows)


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _facts(pairs: Sequence[tuple[str, object]]) -> str:
    return '<table class="facts">' + "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in pairs) + \
        "</table>"
