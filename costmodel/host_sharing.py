"""CPU processes of one host share its cores: the wall seconds per CPU second a plan's processes see
come from how many of them the plan puts on the host, not from how many the profile happened to run.

`plan profile --concurrency K` times compute in CPU seconds and measures the share of a core each of
its K workers got (`host_sharing.contention_factor`, wall per CPU second). That one figure says how
many cores the host gave the job: with K at least the host's cores it measured them all (K / factor
cores, other load included); with fewer, it measured K of them and the rest are taken as free. A job
of P single-threaded processes (the emitted CPU program runs one per device) then gets

    factor(P) = max(1, P * factor(K) / K)          when K >= the host's cores
    factor(P) = max(factor(K), P / cores)          when K <  the host's cores

so a profile taken with 4 workers on 2 cores (factor 2) prices a 2-process plan at factor 1, not 2.

Who counts the processes: `host_processes` reads them from the spec (every process of a `loopback`
cluster is on this host; elsewhere one node's devices share it), and `plan_host_processes` from a
plan. The search prices every candidate at the spec's count; `priced_process_notes` says when the
chosen plan runs fewer processes on the host, and by how much its CPU compute is then over-priced.
"""

from __future__ import annotations

import dataclasses

from costmodel.calibrated import HOST_LOCAL_NETWORK
from costmodel.calibration import Calibration, ModelTiming, OpClassRates
from planner.core.cluster import ClusterSpec
from planner.core.ir import Plan


def contention_factor(processes: int, calibration: Calibration) -> float:
    """Wall seconds per CPU second of each of `processes` single-threaded processes on the profiled host
    (see the module docstring); 1 for a GPU calibration (its figures are wall seconds already)."""
    if calibration.kind != "cpu":
        return 1.0
    profiled, factor, cores = (calibration.concurrent_processes, calibration.profile_contention_factor,
                               calibration.host_cores)
    if processes == profiled:
        return factor
    if profiled >= cores:
        return max(1.0, processes * factor / profiled)
    return max(factor, processes / cores)


def priced_for(calibration: Calibration, processes: int) -> Calibration:
    """`calibration` with compute, update and batch figures in wall seconds of one of `processes`
    processes sharing the host (instead of the figures for the profile's own count)."""
    factor = contention_factor(processes, calibration)
    ratio = factor / calibration.contention_factor
    if ratio == 1.0 and processes == calibration.priced_processes:
        return calibration
    compute = {precision: {name: _slower(rates, ratio) for name, rates in classes.items()}
               for precision, classes in calibration.compute.items()}
    models = {key: ModelTiming(m.key, m.path, *(v * ratio for v in (
        m.fwd_s_per_sample, m.fwd_s_per_micro_batch, m.bwd_s_per_sample, m.bwd_s_per_micro_batch,
        m.batch_s_per_sample, m.batch_s_per_call))) for key, m in calibration.models.items()}
    return dataclasses.replace(
        calibration, compute=compute, models=models, contention_factor=factor, priced_processes=processes,
        optimizer_s_per_step=calibration.optimizer_s_per_step * ratio,
        optimizer_s_per_tensor=calibration.optimizer_s_per_tensor * ratio,
        optimizer_bytes_per_s=calibration.optimizer_bytes_per_s / ratio)


def _slower(rates: OpClassRates, ratio: float) -> OpClassRates:
    return OpClassRates(rates.fwd_overhead_s * ratio, rates.bwd_overhead_s * ratio,
                        rates.fwd_work_per_s / ratio, rates.bwd_work_per_s / ratio)


def host_processes(spec: ClusterSpec, calibration: Calibration) -> int:
    """Processes of the spec on one calibrated host: all of a `loopback` cluster's (its nodes are this
    host), else the devices of the largest node of the calibrated type."""
    if spec.inter_node.kind == HOST_LOCAL_NETWORK:
        return sum(g.count * g.per_node for g in spec.nodes)
    return max((g.per_node for g in spec.nodes if calibration.matches(g.device)), default=1)


def for_spec(calibration: Calibration | None, spec: ClusterSpec) -> Calibration | None:
    """`calibration` priced for the spec's processes per host (`host_processes`); None stays None."""
    if calibration is None or calibration.kind != "cpu":
        return calibration
    return priced_for(calibration, host_processes(spec, calibration))


def plan_host_processes(plan: Plan, spec: ClusterSpec, calibration: Calibration) -> int:
    """Processes the plan runs on one calibrated host: all its ranks on a `loopback` cluster, else the
    most ranks it puts on one node of the calibrated type (device labels name the node)."""
    if spec.inter_node.kind == HOST_LOCAL_NETWORK:
        return plan.world_size
    calibrated_types = {g.device.name for g in spec.nodes if calibration.matches(g.device)}
    per_node: dict[str, int] = {}
    for replica in plan.replicas:
        for stage in replica.stages:
            if stage.device_type in calibrated_types:
                node = stage.device_label.rsplit(":", 1)[0]
                per_node[node] = per_node.get(node, 0) + len(stage.ranks)
    return max(per_node.values(), default=1)


def priced_process_notes(plan: Plan, spec: ClusterSpec, calibration: Calibration | None) -> tuple[str, ...]:
    """A warning when the plan runs another number of processes on the host than its CPU compute was
    priced for (the search prices every candidate at the spec's count): by how much, and the fix."""
    if calibration is None or calibration.kind != "cpu":
        return ()
    runs = plan_host_processes(plan, spec, calibration)
    if runs == calibration.priced_processes:
        return ()
    ratio = calibration.contention_factor / contention_factor(runs, calibration)
    if abs(ratio - 1.0) < 1e-9:
        return ()
    return (f"CPU compute was priced for {calibration.priced_processes} processes sharing the host's "
            f"{calibration.host_cores:g} core(s) ({calibration.source}); this plan runs {runs}, so its compute "
            f"estimates are {ratio:.2f}x what its processes will take: plan on a spec of {runs} devices to "
            "price it for that count",)
