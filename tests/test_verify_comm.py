"""The communication verifier (passes.comm): every rank's ordered communication derived from a plan,
run to completion together, and the program checking at start-up that it runs the verified stream.

- planted faults, each rejected with a message naming the ranks: two sends swapped on one rank, a recv
  with the wrong shape, collectives reordered on one member of a group, a rank missing from a group, a
  1F1B order edited into a wait cycle;
- 48 generated faults over five real plans (GPT, ResNet, HF Llama on cpu-hetero-4 and seed-mixed-32;
  1F1B and GPipe; skip connections; fp16, PowerSGD and 1-bit gradient groups), every one rejected;
- no false alarm on any plan of benchmarks/plan_quality.py (slow: its 85 cases, in process);
- the streams are what the program does: two plans run on gloo with every torch.distributed call
  recorded (tests/comm_tap.py) issue exactly the derived calls, in order (slow);
- the program refuses a plan whose recorded digest was edited, with one line naming the rank, and names
  the first differing event when its split differs from the verified one (tests/test_e2e.py runs plans
  whose streams match).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from backends.torchdist.program import comm_check, p2p, pipeline
from passes import comm
from passes.comm.derive import default_schedules, edge_codecs
from passes.comm.events import COLLECTIVE, RECV, SEND, WAIT, CommEvent
from passes.comm.inputs import SplitView
from planner.api import PlanOptions, plan
from planner.core import schedule as sched
from planner.core.comm_records import CommValue
from planner.core.errors import PassError
from planner.core.ir import Plan
from tests.helpers import CLUSTERS, EXAMPLES, REPO, import_benchmark, run_logs_tail

CASES = {   # name: model, cluster, options; together: 1F1B and GPipe, skips, every kind of gradient group
    "gpt-cpu4-1f1b": ("gpt", "cpu-hetero-4", dict(global_batch=16, stages=2, use_all_devices=True, micro_batch=2,
                                                  schedule="1f1b")),
    "resnet-cpu4-gpipe": ("resnet", "cpu-hetero-4", dict(global_batch=12, stages=2, use_all_devices=True,
                                                         micro_batch=2, schedule="gpipe")),
    "llama-cpu4-fp16": ("hf_llama", "cpu-hetero-4", dict(global_batch=8, stages=2, micro_batch=1,
                                                         compression="fp16")),
    "llama-32-onebit": ("hf_llama", "seed-mixed-32", dict(global_batch=64, stages=4, use_all_devices=True,
                                                          schedule="gpipe", compression="onebit")),
    "gpt-32-powersgd": ("gpt", "seed-mixed-32", dict(global_batch=64, stages=4, use_all_devices=True,
                                                     schedule="1f1b", compression="powersgd")),
}
_planned: dict[str, Plan] = {}


def _case(name: str) -> Plan:
    """The case's plan from `plan()` (which verified it and recorded its inputs), planned once."""
    if name not in _planned:
        model, cluster, options = CASES[name]
        _planned[name] = plan(EXAMPLES / model / "model.py", CLUSTERS / f"{cluster}.yaml",
                              PlanOptions(runners_up=False, **options)).plan
    return _planned[name]


def _inputs(p: Plan) -> comm.StreamInputs:
    assert p.comm is not None
    return comm.from_record(p.comm)


def _streams(p: Plan, variant: comm.Variant | None = None, schedules: comm.Schedules | None = None):
    return comm.streams(p, _inputs(p), variant or comm.variants(p)[0], schedules)


def _rejected(streams) -> str:
    with pytest.raises(PassError) as info:
        comm.check_streams(streams)
    return info.value.message


def _named(head: str) -> set[int]:
    """The ranks a message's first line names: `rank 3`, `ranks 0, 1`, `rank(s) 2 and 5`, `(0 -> 1 -> 0)`."""
    found = set()
    for m in re.finditer(r"\branks?(?:\(s\))? (\d+(?:(?:, | and )\d+)*)|\((\d+(?: -> \d+)+)\)", head):
        found |= {int(x) for x in re.findall(r"\d+", m.group(1) or m.group(2))}
    return found


def _names(message: str, *ranks: int) -> None:
    """The message's first line names every one of `ranks`, and the grid shows a row for each."""
    head = message.splitlines()[0]
    assert set(ranks) <= _named(head), (ranks, head)
    for r in ranks:
        assert re.search(rf"^rank {r} @", message, re.M), (r, message)


def _pipeline_ranks(p: Plan, stages: int, micro: int) -> tuple[int, ...]:
    replica = next(r for r in p.replicas if len(r.stages) >= stages and len(r.micro_batch_sizes) >= micro)
    return replica.ranks


# ----------------------------------------------------------------------------- no-op: real plans pass

@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_variant_of_a_real_plan_runs_to_completion(name):
    p = _case(name)
    assert len(p.comm.digests) == p.world_size
    again = comm.verify_comm(p, _inputs(p))                  # the record alone reproduces the verification
    assert again == p.comm
    for variant in comm.variants(p):
        comm.check_streams(_streams(p, variant), variant.name)


def test_the_record_holds_what_the_trace_gives_and_round_trips():
    p = _case("resnet-cpu4-gpipe")
    traced = comm.trace_inputs(p, *_model_and_graph("resnet"))
    assert comm.from_record(p.comm) == comm.StreamInputs(traced.splits, traced.params)
    assert Plan.from_json(p.to_json()) == p
    skips = [v for s in p.comm.splits for v in s.values if v.producer == 0 and len(v.consumers) > 1]
    assert skips or any(len(s.stage_inputs[1]) > 1 for s in p.comm.splits)   # the long skip crosses too


def _model_and_graph(model: str):
    from planner import frontend
    from planner.api import trace_model_file

    model_file = frontend.load_model_file(EXAMPLES / model / "model.py", {})
    gm, _, _ = trace_model_file(model_file)
    return model_file, gm, 2


def test_the_derivation_uses_the_programs_tags_and_edge_codecs():
    for micro in (0, 1, 5, 2047, 2048, 4100):
        for index in range(4):
            for backward in (False, True):
                assert comm.message_tag(micro, index, backward, 4) == p2p.tag(micro, index, backward, 4)
    p = _case("gpt-cpu4-1f1b")
    edited = tuple(dataclasses.replace(e, compressor="int8", block_elems=64) if e.replica == 0 else e for e in p.p2p)
    q = dataclasses.replace(p, p2p=edited)
    for r in q.replicas:
        ours = edge_codecs(q, r.index)
        theirs = pipeline.edge_codecs(q, r.index)
        assert ours == {k: c.compressor if c.compressor != "int8" else f"int8/{c.block_elems}"
                        for k, c in theirs.items()}


# ----------------------------------------------------------------------------- planted faults

def test_two_sends_swapped_on_one_rank():
    p = _case("gpt-cpu4-1f1b")
    first, second = _pipeline_ranks(p, 2, 2)[:2]
    streams = _streams(p)
    sends = [i for i, e in enumerate(streams[first]) if e.kind == SEND and e.peer == second]
    a, b = sends[0], sends[1]
    streams[first][a], streams[first][b] = streams[first][b], streams[first][a]
    message = _rejected(streams)
    assert message.startswith("message mismatch")
    _names(message, first, second)


def test_a_recv_with_the_wrong_shape():
    p = _case("resnet-cpu4-gpipe")
    first, second = _pipeline_ranks(p, 2, 2)[:2]
    streams = _streams(p)
    i = next(i for i, e in enumerate(streams[second]) if e.kind == RECV)
    e = streams[second][i]
    streams[second][i] = e._replace(shape=(e.shape[0] + 1, *e.shape[1:]))
    message = _rejected(streams)
    assert message.startswith("message mismatch") and "receives" in message
    _names(message, first, second)


def test_collectives_reordered_on_one_member_of_a_group():
    p = _case("gpt-cpu4-1f1b")
    tied = next(g for g in p.grad_groups if len(g.ranks) == p.world_size)     # the embedding and LM head
    member = tied.ranks[0]
    streams = _streams(p)
    syncs = [i for i, e in enumerate(streams[member]) if e.kind == COLLECTIVE and e.label == "sync"]
    a, b = syncs[0], syncs[1]       # the tied group's sync and the stage group's, swapped
    other = next(r for r in streams[member][b].members if r != member)
    streams[member][a], streams[member][b] = streams[member][b], streams[member][a]
    message = _rejected(streams)
    assert message.startswith("communication deadlock") and "wait for each other in a cycle" in message
    _names(message, member, other)


def test_a_rank_missing_from_a_group():
    p = _case("gpt-32-powersgd")
    group = max(p.grad_groups, key=lambda g: len(g.ranks))
    missing = group.ranks[-1]
    streams = _streams(p)
    for r, stream in enumerate(streams):         # every other member believes the group lacks `missing`
        if r != missing:
            stream[:] = [e._replace(members=tuple(m for m in e.members if m != missing))
                         if e.group == f"grad{group.index}" else e for e in stream]
    message = _rejected(streams)
    _names(message, missing)


def test_a_1f1b_order_edited_into_a_wait_cycle():
    p = _case("gpt-cpu4-1f1b")
    replica = next(r for r in p.replicas if r.schedule == "1f1b" and len(r.micro_batch_sizes) >= 2)
    base = sched.make("1f1b", 2, len(replica.micro_batch_sizes))
    # the stages trade orders: stage 0 alternates without warming up, stage 1 warms up with two forwards
    edited = [[sched.Action(0, a.kind, a.micro) for a in base[1]], [sched.Action(1, a.kind, a.micro) for a in base[0]]]
    with pytest.raises(PassError):
        sched.check(edited, len(replica.micro_batch_sizes))          # the schedule checker agrees
    schedules = default_schedules(p)

    def edited_schedules(r: int):
        return edited if r == replica.index else schedules(r)

    with pytest.raises(PassError) as info:
        comm.verify_comm(p, _inputs(p), edited_schedules)
    message = info.value.message
    assert message.startswith("communication deadlock")
    assert "0B0 for a message from rank" in message and "1F1 for a message from rank" in message
    _names(message, *replica.ranks)


# ----------------------------------------------------------------------------- generated faults

def _swap_same_peer(p, streams, rng):
    """Two messages of one rank to (or from) the same peer, in the other order."""
    r = rng.randrange(len(streams))
    pairs = [(i, j) for i, a in enumerate(streams[r]) for j, b in enumerate(streams[r]) if i < j
             and a.kind in (SEND, RECV) and a.kind == b.kind and a.peer == b.peer and a.signature() != b.signature()]
    if not pairs:
        return None
    i, j = rng.choice(pairs)
    s = streams[r]
    peer = s[i].peer
    s[i], s[j] = s[j], s[i]
    return {r, peer}


def _drop(p, streams, rng):
    """One send, recv or collective of a rank left out (a wait is no communication of its own)."""
    r = rng.randrange(len(streams))
    picks = [i for i, e in enumerate(streams[r]) if e.kind != WAIT]
    i = rng.choice(picks)
    e = streams[r].pop(i)
    return {r} | ({e.peer} if e.peer >= 0 else set())


def _mutate(p, streams, rng):
    """A message's shape, dtype, tag or peer, or a collective's payload, changed on one rank."""
    r = rng.randrange(len(streams))
    i = rng.randrange(len(streams[r]))
    e = streams[r][i]
    if e.kind == WAIT:
        return None
    what = rng.choice(["shape", "dtype", "tag", "peer"] if e.kind != COLLECTIVE else ["shape", "dtype"])
    if what == "shape":
        changed = e._replace(shape=(*e.shape, 2))
    elif what == "dtype":
        changed = e._replace(dtype="float16" if e.dtype != "float16" else "float32")
    elif what == "tag":
        changed = e._replace(tag=e.tag + 2)
    else:
        others = [q for q in range(len(streams)) if q not in (r, e.peer)]
        if not others:
            return None
        changed = e._replace(peer=rng.choice(others))
    streams[r][i] = changed
    return {r} | ({e.peer, changed.peer} if e.peer >= 0 else set())


def _reorder_collectives(p, streams, rng):
    """Two collectives of one member in the other order, where another rank issues both in order."""
    r = rng.randrange(len(streams))
    s = streams[r]
    options = []
    for i, a in enumerate(s):
        for j in range(i + 1, len(s)):
            b = s[j]
            if a.kind != COLLECTIVE or b.kind != COLLECTIVE or a.signature() == b.signature():
                continue
            shared = (set(a.members) & set(b.members)) - {r}
            if a.group == b.group or shared:
                options.append((i, j, sorted(shared)))
    if not options:
        return None
    i, j, shared = rng.choice(options)
    s[i], s[j] = s[j], s[i]
    return {r, *shared}


def _remove_member(p, streams, rng):
    """A rank left out of a group in the other members' streams, while it still takes part."""
    groups = sorted({(e.group, e.members) for s in streams for e in s if e.kind == COLLECTIVE and len(e.members) > 1})
    group, members = rng.choice(groups)
    missing = rng.choice(members)
    for r, s in enumerate(streams):
        if r != missing:
            s[:] = [e._replace(members=tuple(m for m in e.members if m != missing)) if e.group == group else e
                    for e in s]
    return {missing}


def _schedule_cycle(p, streams, rng):
    """A pipeline's schedule edited so two neighbouring stages wait for each other."""
    shapes = [r for r in p.replicas if len(r.stages) >= 2 and len(r.micro_batch_sizes) >= 2]
    if not shapes:
        return None
    replica = rng.choice(shapes)
    stages, micro = len(replica.stages), len(replica.micro_batch_sizes)
    s = rng.randrange(stages - 1)
    edited = sched.make(replica.schedule, stages, micro)
    edited[s] = [sched.Action(s, kind, i) for i in range(micro) for kind in "FB"]                  # no warm-up
    edited[s + 1] = [sched.Action(s + 1, kind, i) for kind in "FB" for i in range(micro)]          # all forwards first
    default = default_schedules(p)
    variant = rng.choice(comm.variants(p))
    streams[:] = comm.streams(p, _inputs(p), variant, lambda r: edited if r == replica.index else default(r))
    return {replica.stages[s].rank, replica.stages[s + 1].rank}


FAULTS = [_swap_same_peer, _drop, _mutate, _reorder_collectives, _remove_member, _schedule_cycle]
GENERATED = 48


@pytest.mark.slow
def test_every_generated_fault_is_rejected_naming_its_ranks():
    rng = random.Random(15)
    made: list[tuple[str, str]] = []
    while len(made) < GENERATED:
        fault = FAULTS[len(made) % len(FAULTS)]
        name = rng.choice(sorted(CASES))
        p = _case(name)
        streams = _streams(p, rng.choice(comm.variants(p)))
        involved = fault(p, streams, rng)
        if involved is None:          # no such fault in this plan: draw another plan
            continue
        with pytest.raises(PassError) as info:
            comm.check_streams(streams)
        head = info.value.message.splitlines()[0]
        assert involved & _named(head), (fault.__name__, name, involved, head)
        made.append((fault.__name__, name))
    assert {f for f, _ in made} == {f.__name__ for f in FAULTS}
    assert {n for _, n in made} == set(CASES)


# ----------------------------------------------------------------------------- plan_quality: no false alarm

@pytest.mark.slow
@pytest.mark.parametrize("name", import_benchmark("plan_quality").MODELS)
def test_no_false_alarm_on_any_plan_of_plan_quality(monkeypatch, name):
    monkeypatch.setenv("HETPLAN_SEQ_LEN", "1024")          # as plan_quality.py traces llama7b
    common = import_benchmark("common")
    plan_quality = import_benchmark("plan_quality")

    from passes.comm.inputs import graph_params, split_inputs
    from planner import frontend
    from planner.api import DEFAULT_TRACE_BATCH, trace_model_file
    from planner.core.errors import PlanningError
    from planner.frontend.cluster import load_cluster

    model_file = frontend.load_model_file(EXAMPLES / name / "model.py", {})
    gm, blocks, _ = trace_model_file(model_file, DEFAULT_TRACE_BATCH)
    model = common.TracedModel(name, model_file.path, blocks,
                               tuple(n.name for n in gm.graph.nodes if n.op == "placeholder"),
                               model_file.digest, 0.0)
    graphs = {DEFAULT_TRACE_BATCH: gm}

    def graph_at(rows: int):
        if rows not in graphs:
            graphs[rows] = frontend.trace_model(model_file, rows)[0]
        return graphs[rows]

    params = graph_params(gm)
    checked = 0
    for path in common.cluster_files():
        spec = load_cluster(path)
        batch = max(plan_quality.GLOBAL_BATCH, spec.num_devices * plan_quality.SAMPLES_PER_DEVICE)
        for strategy in plan_quality.STRATEGIES:
            try:
                p, _ = common.plan_with(model, spec, PlanOptions(global_batch=batch, strategy=strategy))
            except PlanningError:
                continue
            comm.verify_comm(p, split_inputs(p, graph_at, params))      # raises on a false alarm
            checked += 1
    assert checked >= 24        # 30, 25 and 30 plans of gpt, llama7b and resnet when this was written


# ----------------------------------------------------------------------------- the program

def _plan_dir(tmp_path: Path, model: str, *options: str) -> Path:
    out = tmp_path / model
    proc = subprocess.run([sys.executable, "-m", "planner.cli", str(EXAMPLES / model / "model.py"), "--cluster",
                           str(CLUSTERS / "cpu-hetero-4.yaml"), "--no-runners-up", "-o", str(out), *options],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return out


def _torchrun(program: Path, nproc: int, *args: str, tap: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HETPLAN_TIMEOUT_S": "60", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    script = [str(REPO / "tests" / "comm_tap.py"), str(tap)] if tap else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           *script, str(program / "train.py"), "--out", str(program.parent / "run"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
                          start_new_session=True)


def _expected_calls(p: Plan, rank: int) -> list[list]:
    """The derived stream of one step (the default variant) as the tap records calls."""
    out = []
    for e in comm.rank_stream(p, rank, _inputs(p), comm.variants(p)[0]):
        if e.kind in (SEND, RECV):
            out.append([e.kind, e.peer, e.tag, list(e.shape), e.dtype])
        elif e.kind == COLLECTIVE and e.op.startswith("new_group"):
            out.append(["new_group", list(p.grad_groups[int(e.op.removeprefix("new_group grad"))].ranks), -1, [], ""])
        elif e.kind == COLLECTIVE:
            out.append([e.op, list(e.members), -1, list(e.shape), e.dtype])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("model, options", [
    ("gpt", ("--global-batch", "16", "--stages", "2", "--use-all-devices", "--micro-batch", "2")),
    ("resnet", ("--global-batch", "12", "--stages", "2", "--use-all-devices", "--micro-batch", "2",
                "--schedule", "gpipe")),
], ids=["gpt-tied", "resnet-skip"])
def test_the_program_issues_exactly_the_derived_calls(tmp_path, model, options):
    out = _plan_dir(tmp_path, model, *options)
    p = Plan.load(out)
    tap = tmp_path / "tap"
    proc = _torchrun(out / "program", p.world_size, "--steps", "1", tap=tap)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(p.world_size):
        calls = json.loads((tap / f"rank{rank}.json").read_text())
        assert calls == _expected_calls(p, rank), rank


@pytest.mark.slow
def test_the_program_refuses_an_edited_digest_with_one_line(tmp_path):
    out = _plan_dir(tmp_path, "mlp", "--global-batch", "8", "--stages", "2", "--micro-batch", "2")
    p = Plan.load(out)
    assert p.world_size >= 2 and p.comm is not None
    for copy in (out / "plan.json", out / "program" / "plan.json"):      # `plan run` wants both alike
        data = json.loads(copy.read_text())
        digest = data["comm"]["digests"][1]
        data["comm"]["digests"][1] = ("0" if digest[0] != "0" else "1") + digest[1:]
        copy.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-m", "planner.cli", "run", str(out), "--steps", "2", "--timeout", "60"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO, start_new_session=True)
    assert proc.returncode != 0
    line = proc.stderr.strip().splitlines()[-1]
    assert "rank 1" in line and "comm" in line and "before its first step" in line, line + run_logs_tail(out)
    assert not (out / "run" / "metrics.jsonl").exists() or not (out / "run" / "metrics.jsonl").read_text()
    logs = run_logs_tail(out)
    assert "not their recorded digest" in logs and "not starting" in logs     # rank 1 says why, rank 0 who


def test_the_program_names_the_first_event_that_differs():
    p = _case("gpt-cpu4-1f1b")
    first, second = _pipeline_ranks(p, 2, 2)[:2]
    recorded = _inputs(p)
    assert comm_check.mismatch(p, second, recorded) is None
    # this rank's own split gives the boundary value another width than the planner's trace did
    replica = p.stage_of_rank(second)[0].index
    rows = p.replicas[replica].micro_batch_sizes[0]
    view = recorded.split(replica, rows)
    name = next(n for n in sorted(view.values) if view.values[n].producer == 0 and 1 in view.values[n].consumers)
    v = view.values[name]
    wider = CommValue(v.name, v.producer, v.consumers, (*v.shape[:-1], v.shape[-1] + 1), v.dtype, v.needs_grad)
    changed = SplitView({**view.values, name: wider}, view.stage_inputs, view.stage_outputs)
    mine = comm.StreamInputs({**recorded.splits, (replica, rows): changed}, recorded.params)
    why = comm_check.mismatch(p, second, mine)
    assert why is not None and why.startswith(f"rank {second}: its communication differs from the verified one")
    here, verified = (f"float32[{','.join(map(str, shape))}]" for shape in (wider.shape, v.shape))
    assert re.search(rf"`[^`]*recv <{first} [^`]*{re.escape(here)}[^`]*` here, `[^`]*{re.escape(verified)}[^`]*`"
                     " verified", why), why
    assert "\n" not in why
    assert "records no verified communication" in comm_check.mismatch(dataclasses.replace(p, comm=None), 0, recorded)


def test_the_grid_shows_where_each_rank_stopped():
    p = _case("gpt-cpu4-1f1b")
    streams = _streams(p)
    grid = comm.format_grid(streams, [(0, 5), (1, len(streams[1]))])
    rows = grid.splitlines()
    assert rows[0].startswith("rank 0 @5/") and f"[{streams[0][5].cell()}]" in rows[0]
    assert rows[1].startswith("rank 1 @") and rows[1].rstrip().endswith("[done]")
    assert isinstance(streams[0][0], CommEvent)
