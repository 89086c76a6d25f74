"""A recorded fidelity run's plans simulated with the host's cores shared by the ranks computing at each
instant, against that run's measurements and against the estimate (one contention factor per host).

costmodel.host_sharing prices every CPU process of a host as busy all step: a plan of P processes on C
cores computes at max(1, P / C) wall seconds per CPU second throughout. A pipeline's ranks wait in fill
and drain, and a replica with a small share waits for the others, and a waiting rank keeps only ~0.01 of
a core (benchmarks/core_share.py), so the ranks computing beside it should run faster than priced. This
benchmark tests that model before anything is built on it: each configuration of RESULTS (a
`benchmarks/fidelity.py` output) is planned again as fidelity.py plans it, and its schedule is run as an
event simulation in which every rank's forward, backward and optimizer step holds CPU seconds (the plan's
priced seconds over the plan's contention factor) that progress at 1 / factor(n) per wall second while n
ranks of the host compute (costmodel.host_sharing.contention_factor); transfers and gradient all-reduces
hold no core. The optimizer step is the plan's own (ReplicaPlan.optimizer_s, from the calibration).
Nothing is run; prints a table per configuration and per model and writes JSON.

    python benchmarks/sharing_sim.py benchmarks/results/fidelity_held_out.json [--sync-wait-holds-core]

Only 1F1B and GPipe replicas of one stage per device (the fidelity configurations) are simulated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from statistics import mean

import common  # noqa: F401  (benchmarks/: puts the checkout on sys.path)
from fidelity import CLUSTERS, HELD_OUT, plan_configuration

from backends.sim import ReplicaWork, SimInput, from_plan
from costmodel import host_sharing
from costmodel.calibration import load_calibration
from planner.core import schedule as schedules
from planner.core.ir import Plan
from planner.frontend.cluster import load_cluster

Action = tuple  # ("C", replica, kind, stage, micro) | ("S", sync) | ("O", seconds)


def _actions(inp: SimInput) -> tuple[dict[int, list[Action]], dict[int, ReplicaWork]]:
    """Each rank's actions in order (its schedule's, then its gradient groups in plan order, then its
    optimizer step), and each rank's replica."""
    actions: dict[int, list[Action]] = {}
    replica_of: dict[int, ReplicaWork] = {}
    for rep in inp.replicas:
        if rep.chunks != 1:
            raise SystemExit(f"replica {rep.index}: interleaved replicas are not simulated here")
        grid = schedules.make(rep.schedule, len(rep.stages), rep.num_micro, rep.chunks)
        for d, work in enumerate(rep.stages):
            actions[work.rank] = [("C", rep.index, a.kind, a.stage, a.micro) for a in grid[d]]
            replica_of[work.rank] = rep
    for sync in sorted(inp.syncs, key=lambda g: g.group):
        for r in sync.ranks:
            if r in actions:
                actions[r].append(("S", sync))
    for r, rep in replica_of.items():
        actions[r].append(("O", next(w.optimizer_s for w in rep.stages if w.rank == r)))
    return actions, replica_of


def shared_step_s(inp: SimInput, factor: Callable[[int], float], priced_factor: float,
                  sync_wait_holds_core: bool = False) -> float:
    """One step of `inp` with every rank on one host whose n computing ranks each get 1 / factor(n) of a
    CPU second per wall second; compute was priced at `priced_factor`. With `sync_wait_holds_core`, a rank
    waiting at a gradient all-reduce for its peers counts as computing."""
    actions, replica_of = _actions(inp)
    pos = dict.fromkeys(actions, 0)
    cpu_left: dict[int, float] = {}          # rank -> CPU seconds left of the action it computes
    blocked_until: dict[int, float] = {}     # rank -> end of the all-reduce it is in
    arrival: dict[tuple, float] = {}         # (replica, stage, kind, micro) -> its input there
    done: set[tuple] = set()
    link_fwd, link_bwd = dict.fromkeys(actions, 0.0), dict.fromkeys(actions, 0.0)
    in_sync: dict[int, set[int]] = {}
    finished: dict[int, float] = {}
    now = 0.0

    def ready(rank: int, action: Action) -> float | None:
        """CPU seconds of `action` when it can start now, else None."""
        _, ri, kind, s, j = action
        rep = replica_of[rank]
        work = rep.stages[s]
        if kind == "F":
            ok = s == 0 or arrival.get((ri, s, "F", j), float("inf")) <= now
            return work.fwd_s[j] / priced_factor if ok else None
        ok = (ri, s, "F", j) in done and (s == len(rep.stages) - 1 or arrival.get((ri, s, "B", j), float("inf")) <= now)
        return work.bwd_s[j] / priced_factor if ok else None

    while len(finished) < len(actions):
        started = True
        while started:                       # start every action that can start now
            started = False
            for r in actions:
                if r in cpu_left or r in blocked_until or r in finished:
                    continue
                if pos[r] == len(actions[r]):
                    finished[r], started = now, True
                    continue
                action = actions[r][pos[r]]
                if action[0] == "C":
                    cpu = ready(r, action)
                    if cpu is not None:
                        cpu_left[r], started = cpu, True
                elif action[0] == "S":
                    sync = action[1]
                    members = in_sync.setdefault(sync.group, set())
                    members.add(r)
                    if members >= {m for m in sync.ranks if m in actions}:
                        for m in members:
                            blocked_until[m] = now + sync.duration_s
                        started = True
                else:
                    cpu_left[r], started = action[1] / priced_factor, True
        if len(finished) == len(actions):
            break
        waiting = sum(1 for members in in_sync.values() for r in members
                      if r not in blocked_until and r not in finished and actions[r][pos[r]][0] == "S")
        f = factor(len(cpu_left) + (waiting if sync_wait_holds_core else 0)) if cpu_left else 1.0
        events = ([now + left * f for left in cpu_left.values()] + list(blocked_until.values())
                  + [t for t in arrival.values() if t > now])
        step = min(events) - now
        now += step
        for r in list(cpu_left):
            cpu_left[r] -= step / f
            if cpu_left[r] > 1e-15:
                continue
            del cpu_left[r]
            action = actions[r][pos[r]]
            if action[0] == "C":
                _, ri, kind, s, j = action
                rep = replica_of[r]
                done.add((ri, s, kind, j))
                if kind == "F" and s + 1 < len(rep.stages):
                    link_fwd[r] = max(now, link_fwd[r]) + rep.stages[s].send_fwd_s[j]
                    arrival[(ri, s + 1, "F", j)] = link_fwd[r]
                elif kind == "B" and s > 0:
                    link_bwd[r] = max(now, link_bwd[r]) + rep.stages[s].send_bwd_s[j]
                    arrival[(ri, s - 1, "B", j)] = link_bwd[r]
            pos[r] += 1
        for r in [r for r, end in blocked_until.items() if end <= now + 1e-15]:
            del blocked_until[r]
            pos[r] += 1
    return max(finished.values())


def with_plan_optimizer(inp: SimInput, plan: Plan) -> SimInput:
    """`inp` with each rank's optimizer step the plan's (the calibrated one) in place of the simulator's."""
    step = {st.rank: r.optimizer_s or 0.0 for r in plan.replicas for st in r.stages}
    replicas = tuple(dataclasses.replace(rep, stages=tuple(dataclasses.replace(w, optimizer_s=step[w.rank])
                                                           for w in rep.stages)) for rep in inp.replicas)
    return dataclasses.replace(inp, replicas=replicas)


def rows_of(recorded: dict, calibration_path: Path, work: Path, sync_wait_holds_core: bool) -> list[dict]:
    calibration = load_calibration(calibration_path)
    rows = []
    for c in recorded["configurations"]:
        config = plan_configuration(c["model"], c["cluster"], c["stages"], c["micro_batch"], c["global_batch"],
                                    calibration_path, work, c.get("strategy", "ilp"))
        plan = Plan.load(config.out)
        inp = with_plan_optimizer(from_plan(plan, load_cluster(CLUSTERS[c["cluster"]])), plan)
        shared_s = shared_step_s(inp, lambda n: host_sharing.contention_factor(n, calibration),
                                 host_sharing.contention_factor(plan.world_size, calibration), sync_wait_holds_core)
        measured = c["measured_step_s"]
        rows.append({"name": c["name"], "model": c["model"], "held_out": c["model"] in HELD_OUT,
                     "processes": plan.world_size, "measured_step_s": measured,
                     "estimate_s": plan.estimates.iteration_s, "shared_s": shared_s,
                     "estimate_error": plan.estimates.iteration_s / measured - 1.0,
                     "shared_error": shared_s / measured - 1.0})
    return rows


def report(rows: list[dict]) -> str:
    lines = [common.table(
        ["configuration", "processes", "measured ms", "estimate ms", "error", "shared cores ms", "error"],
        [[r["name"], str(r["processes"]), f"{r['measured_step_s'] * 1e3:.1f}", f"{r['estimate_s'] * 1e3:.1f}",
          f"{r['estimate_error']:+.1%}", f"{r['shared_s'] * 1e3:.1f}", f"{r['shared_error']:+.1%}"] for r in rows]), ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        lines.append(f"{model:10s} {'held out' if mine[0]['held_out'] else 'tuned':8s} step time mean |error|: "
                     f"one factor per host {mean(abs(r['estimate_error']) for r in mine):.1%}, cores shared by "
                     f"the ranks computing {mean(abs(r['shared_error']) for r in mine):.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="a benchmarks/fidelity.py output")
    p.add_argument("--calibration", type=Path, default=None, help="default: the one RESULTS names")
    p.add_argument("--sync-wait-holds-core", action="store_true",
                   help="a rank waiting at a gradient all-reduce for its peers keeps its core (counts as computing)")
    p.add_argument("--out", type=Path, default=None,
                   help="default: benchmarks/results/sharing_sim.json (sharing_sim_sync_wait.json with the flag)")
    args = p.parse_args(argv)
    recorded = json.loads(args.results.read_text())
    calibration = args.calibration or Path(recorded["calibration"])
    with tempfile.TemporaryDirectory(prefix="hetplan-sharing-") as tmp:
        rows = rows_of(recorded, calibration, Path(tmp), args.sync_wait_holds_core)
    print(report(rows))
    out = args.out or common.RESULTS / f"sharing_sim{'_sync_wait' if args.sync_wait_holds_core else ''}.json"
    common.write_json_to(out, {"results": str(args.results), "calibration": str(calibration),
                               "sync_wait_holds_core": args.sync_wait_holds_core, "configurations": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
