"""Verify a plan before anything is emitted: coverage, ranks, shares, memory, schedules, groups."""

from __future__ import annotations

from costmodel import memory
from planner.core import schedule as sched
from planner.core.cluster import ClusterSpec
from planner.core.errors import PassError, PlanningError
from planner.core.ir import Plan


def verify_plan(plan: Plan, spec: ClusterSpec | None = None) -> None:
    """Raise PassError (or PlanningError for memory) when the plan breaks an invariant."""
    nblocks = len(plan.blocks)
    ranks = sorted(rank for r in plan.replicas for st in r.device_stages for rank in st.ranks)
    if ranks != list(range(plan.world_size)):
        raise PassError(f"ranks {ranks} are not 0..{plan.world_size - 1}", fix="report this plan")
    devices = [d for r in plan.replicas for st in r.device_stages for _, d, _ in st.rank_devices()]
    if len(set(devices)) != len(devices):
        raise PassError("a device serves two stages", fix="report this plan")
    if sum(r.batch_share for r in plan.replicas) != plan.global_batch:
        raise PassError(f"batch shares {[r.batch_share for r in plan.replicas]} do not sum to "
                        f"{plan.global_batch}", fix="report this plan")
    holders: dict[tuple[str, int], set[int]] = {}     # (parameter, tensor-parallel lane) -> ranks
    schedules_checked: set[tuple[str, int, int, int]] = set()
    for r in plan.replicas:
        if sum(r.micro_batch_sizes) != r.batch_share or min(r.micro_batch_sizes) < 1:
            raise PassError(f"replica {r.index}: micro-batches {r.micro_batch_sizes} do not cover its share",
                            fix="report this plan")
        if len({st.tp_degree for st in r.stages}) != 1 or r.tp_degree != plan.tp_degree:
            raise PassError(f"replica {r.index}: stages of tensor-parallel degrees "
                            f"{sorted({st.tp_degree for st in r.stages})}, the plan's is {plan.tp_degree}",
                            fix="report this plan")
        if (r.chunks > 1) != (r.schedule == "interleaved") or r.chunks < 1 or len(r.stages) % r.chunks:
            raise PassError(f"replica {r.index}: {len(r.stages)} stages in {r.chunks} per device under "
                            f"{r.schedule}", fix="report this plan")
        expected = 0
        for st in r.stages:
            home = r.device_stages[st.index % len(r.device_stages)]
            if (st.ranks, st.device) != (home.ranks, home.device):
                raise PassError(f"replica {r.index} stage {st.index} runs on ranks {list(st.ranks)}, its device's "
                                f"stages on {list(home.ranks)}", fix="report this plan")
            if st.first_block != expected or st.last_block < st.first_block:
                raise PassError(f"replica {r.index} stage {st.index} covers blocks "
                                f"{st.first_block}..{st.last_block}, expected to start at {expected}")
            expected = st.last_block + 1
            if plan.blocks[st.last_block].last_node != st.last_node:
                raise PassError(f"stage {st.index} of replica {r.index} ends at {st.last_node}, "
                                f"block {st.last_block} ends at {plan.blocks[st.last_block].last_node}")
            for lane, rank in enumerate(st.ranks):
                for p in st.params:
                    holders.setdefault((p, lane), set()).add(rank)
        if expected != nblocks:
            raise PassError(f"replica {r.index} covers {expected} of {nblocks} blocks", fix="report this plan")
        shape = (r.schedule, len(r.stages), len(r.micro_batch_sizes), r.chunks)
        if shape not in schedules_checked:     # the schedule depends on these alone
            sched.check(sched.make(*shape), shape[2], shape[3])
            schedules_checked.add(shape)
    lane_of = {rank: lane for r in plan.replicas for st in r.device_stages for lane, rank in enumerate(st.ranks)}
    grouped: dict[tuple[str, int], set[int]] = {}
    for g in plan.grad_groups:
        for p in g.params:
            key = (p, lane_of.get(g.ranks[0], 0))
            if key in grouped:
                raise PassError(f"parameter {p} is in two gradient groups", fix="report this plan")
            grouped[key] = set(g.ranks)
    for (p, lane), hs in holders.items():
        if len(hs) > 1 and grouped.get((p, lane)) != hs:
            raise PassError(f"parameter {p} is held by ranks {sorted(hs)} but synchronised over "
                            f"{sorted(grouped.get((p, lane), set()))}", fix="report this plan")
    # the one memory rule the search planned with: need <= device memory x (1 - margin)
    margin = plan.estimates.memory_margin
    for rank, (mem, device_bytes) in enumerate(zip(plan.estimates.memory_bytes, plan.estimates.capacity_bytes)):
        capacity = memory.capacity_bytes(device_bytes, margin)
        if not memory.fits(mem, capacity):
            raise PlanningError(f"rank {rank} ({plan.devices[rank]}) needs {mem / 2**30:.2f} GiB of the "
                                f"{capacity / 2**30:.2f} GiB its device offers with a {margin:.0%} margin",
                                fix="use more pipeline stages or devices, or a smaller --memory-margin")
