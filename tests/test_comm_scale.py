"""What lets the comm phase plan a 1024-GPU cluster in seconds, held to the slow way it replaces:

- the shared derivation (passes.comm.derive.Derivation) gives every rank of a real plan the digest of its
  whole streams hashed event by event, and verify_comm records exactly those;
- the simulator settles the set-up collectives every rank opens with at once, and still refuses a
  set-up that differs on one rank (left out, reordered, another group size), naming it;
- the stage check runs stages of the same shape once (layers 1-4 of a stack), but a stage that differs
  only in a constant on its own, and the run it skips measures what the one it made measured;
- a plan of 256 ranks (64 copies of a 4-rank plan side by side) records each rank's whole-stream digest,
  and a set-up left out on its last rank is refused naming it.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
import torch

from passes import comm
from passes.blocks import compute_nodes
from passes.comm.events import WAIT
from passes.split import split_stages
from passes.stage_check import check_plan_stages, check_stage_runs
from passes.stage_shape import stage_shape
from planner import frontend
from planner.api import PlanOptions, plan
from planner.core.errors import PassError
from planner.core.ir import Plan
from tests.helpers import CLUSTERS, EXAMPLES

ROWS = '''
def batch(batch_size, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 8, generator=g)[:batch_size]
    return (x,), x[:, :4].contiguous()
'''

# a stack of six alike layers between an input and an output layer
STACK = '''
import torch
import torch.nn as nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(h)

def model():
    return Net()
''' + ROWS

# stages [inp], [fc, leaky 0.1], [fc, leaky 0.2], [fc, leaky 0.1], [out]: the middle one differs in its slope
SLOPES = '''
import torch
import torch.nn as nn

def model():
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.LeakyReLU(0.1), nn.Linear(16, 16),
                         nn.LeakyReLU(0.2), nn.Linear(16, 16), nn.LeakyReLU(0.1), nn.Linear(16, 4))
''' + ROWS

_planned: dict[str, Plan] = {}


def _onebit_plan() -> Plan:
    """GPT on 32 mixed devices in 4-stage pipelines with 1-bit groups (every run variant), planned once."""
    if "onebit" not in _planned:
        _planned["onebit"] = plan(EXAMPLES / "gpt" / "model.py", CLUSTERS / "seed-mixed-32.yaml",
                                  PlanOptions(runners_up=False, global_batch=64, stages=4, use_all_devices=True,
                                              schedule="1f1b", compression="onebit")).plan
    return _planned["onebit"]


def _inputs(p: Plan) -> comm.StreamInputs:
    assert p.comm is not None
    return comm.from_record(p.comm)


# ----- the shared derivation equals the rank-by-rank one ------------------------------------------------

@pytest.mark.slow
def test_every_ranks_digest_is_the_digest_of_its_whole_streams():
    p = _onebit_plan()
    inputs, runs = _inputs(p), comm.variants(p)
    assert any(v.onebit == "momentum" for v in runs) and any(v.skipped for v in runs)
    for rank in range(p.world_size):
        whole = {v: comm.rank_stream(p, rank, inputs, v) for v in runs}
        cut = next(i for i, e in enumerate(whole[runs[0]]) if e.kind == WAIT) + 1     # the pipeline's end
        common = whole[runs[0]][:cut]
        tails = {v: whole[v][cut:] for v in runs}
        assert all(whole[v][:len(common)] == common for v in runs)
        expected = comm.stream_digest(common, tails, runs)
        assert p.comm.digests[rank] == expected == comm.rank_digest(p, rank, inputs)[0], rank
    assert comm.verify_comm(p, inputs) == p.comm


# ----- the opening settled at once is still checked -----------------------------------------------------

def _gpt4() -> Plan:
    if "gpt4" not in _planned:
        _planned["gpt4"] = plan(EXAMPLES / "gpt" / "model.py", CLUSTERS / "cpu-hetero-4.yaml",
                                PlanOptions(runners_up=False, global_batch=16, stages=2, use_all_devices=True,
                                            micro_batch=2, schedule="1f1b")).plan
    return _planned["gpt4"]


def _rejected_naming(streams, rank: int) -> str:
    with pytest.raises(PassError) as info:
        comm.check_streams(streams)
    head = info.value.message.splitlines()[0]
    assert f"rank {rank}" in head or f"rank(s) {rank}" in head or f" {rank}," in head or f"{rank} and" in head, head
    return head


def test_a_set_up_left_out_on_one_rank_is_refused_naming_it():
    p = _gpt4()
    streams = comm.streams(p, _inputs(p), comm.variants(p)[0])
    comm.check_streams(streams)                       # as derived: it runs
    last = p.world_size - 1
    setups = [i for i, e in enumerate(streams[last]) if e.label == "setup"]
    assert len(setups) >= 2
    del streams[last][setups[0]]
    _rejected_naming(streams, last)


def test_a_set_up_reordered_or_resized_on_one_rank_is_refused():
    p = _gpt4()
    for edit in ("swap", "resize"):
        streams = comm.streams(p, _inputs(p), comm.variants(p)[0])
        s = streams[1]
        if edit == "swap":
            s[0], s[1] = s[1], s[0]
        else:
            s[0] = s[0]._replace(shape=(s[0].shape[0] + 1,))
        with pytest.raises(PassError) as info:
            comm.check_streams(streams)
        assert info.value.message.startswith("collective mismatch"), (edit, info.value.message)
        assert "rank 1" in info.value.message.splitlines()[0]


# ----- stages of one shape run once ---------------------------------------------------------------------

def _traced(tmp_path: Path, source: str, rows: int = 2):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(source))
    model_file = frontend.load_model_file(path)
    gm, _ = frontend.trace_model(model_file, rows)
    return model_file, gm


def _meta_batch(model_file: frontend.ModelFile, rows: int):
    inputs, target = frontend.example_batch(model_file, rows)
    return frontend.to_device(inputs, "meta"), frontend.to_device(target, "meta")


def test_stages_of_the_same_layers_run_once_and_measure_alike(tmp_path):
    model_file, gm = _traced(tmp_path, STACK)
    tanhs = [n.name for n in compute_nodes(gm.graph) if "tanh" in n.name]
    assert len(tanhs) == 6
    cuts = tanhs[:5] + [compute_nodes(gm.graph)[-1].name]      # [inp, l0] [l1] [l2] [l3] [l4] [l5, out]
    split = split_stages(gm, cuts)
    shapes = [stage_shape(split, k) for k in range(6)]
    assert shapes[1] == shapes[2] == shapes[3] == shapes[4]
    assert len(set(shapes)) == 3
    runs = check_plan_stages({(0, 2): split, (1, 2): split}, model_file)     # two replicas cut alike
    assert [r.stage for r in runs] == [0, 1, 5]
    inputs, target = _meta_batch(model_file, 2)
    skipped = [check_stage_runs(split, k, model_file, inputs, target) for k in (2, 3, 4)]
    assert all(dataclasses.replace(s, stage=1) == runs[1] for s in skipped)


def test_a_stage_that_differs_in_a_constant_runs_on_its_own(tmp_path):
    model_file, gm = _traced(tmp_path, SLOPES)
    nodes = compute_nodes(gm.graph)
    slopes = [n.name for n in nodes if "leaky_relu" in n.name]
    assert len(slopes) == 3
    first_linear = next(n.name for n in nodes if n.op == "call_function" and "linear" in str(n.target))
    split = split_stages(gm, [first_linear, *slopes, nodes[-1].name])
    shapes = [stage_shape(split, k) for k in range(5)]
    assert shapes[1] == shapes[3] and shapes[2] != shapes[1]
    assert [r.stage for r in check_plan_stages({(0, 2): split}, model_file)] == [0, 1, 2, 4]
    # at another micro-batch size, the same stage is another run
    _, gm3 = _traced(tmp_path, SLOPES, rows=3)
    split3 = split_stages(gm3, [first_linear, *slopes, compute_nodes(gm3.graph)[-1].name])
    runs = check_plan_stages({(0, 2): split, (1, 3): split3}, model_file)
    assert [(r.rows, r.stage) for r in runs] == [(2, 0), (2, 1), (2, 2), (2, 4), (3, 0), (3, 1), (3, 2), (3, 4)]


def test_a_failing_stage_fails_though_one_of_its_shape_ran_before(tmp_path):
    model_file, gm = _traced(tmp_path, STACK)
    tanhs = [n.name for n in compute_nodes(gm.graph) if "tanh" in n.name]
    split = split_stages(gm, tanhs[:5] + [compute_nodes(gm.graph)[-1].name])
    broken = split.stages[3].module
    for n in broken.graph.nodes:                   # stage 3 alone gets an op that fails on its input
        if n.op == "call_function" and "tanh" in n.name:
            n.target = torch.ops.aten.mm.default
            n.args = (n.args[0], n.args[0])                 # (2, 16) @ (2, 16)
    broken.recompile()
    assert stage_shape(split, 3) != stage_shape(split, 1)
    with pytest.raises(PassError, match="stage 3 of 6"):
        check_plan_stages({(0, 2): split}, model_file)


# ----- many ranks: 64 copies of a plan side by side ----------------------------------------------------

def test_a_256_rank_plan_records_the_digests_of_its_ranks_whole_streams():
    p = _gpt4()
    inputs = _inputs(p)
    copies, size = 64, p.world_size          # every copy's ranks renumbered, its groups and edges copied
    replicas, groups, edges = [], [], []
    for c in range(copies):
        shift = c * size
        for r in p.replicas:
            stages = tuple(dataclasses.replace(s, rank=s.rank + shift, tp_ranks=tuple(x + shift for x in s.tp_ranks))
                           for s in r.stages)
            replicas.append(dataclasses.replace(r, index=len(replicas), stages=stages))
        for g in p.grad_groups:
            groups.append(dataclasses.replace(g, index=len(groups), ranks=tuple(x + shift for x in g.ranks)))
        for e in p.p2p:
            edges.append(dataclasses.replace(e, replica=e.replica + c * len(p.replicas), src_rank=e.src_rank + shift,
                                             dst_rank=e.dst_rank + shift))
    big = dataclasses.replace(p, replicas=tuple(replicas), grad_groups=tuple(groups), p2p=tuple(edges),
                              world_size=size * copies, devices=p.devices * copies, comm=None)
    splits = {(i * len(p.replicas) + r, rows): view for i in range(copies) for (r, rows), view in inputs.splits.items()}
    big_inputs = comm.StreamInputs(splits, inputs.params)
    record = comm.verify_comm(big, big_inputs)
    runs = comm.variants(big)
    for rank in (0, 1, size + 1, big.world_size // 2, big.world_size - 1):
        whole = {v: comm.rank_stream(big, rank, big_inputs, v) for v in runs}
        cut = next(i for i, e in enumerate(whole[runs[0]]) if e.kind == WAIT) + 1
        assert sum(e.label == "setup" for e in whole[runs[0]]) == len(groups)
        assert record.digests[rank] == comm.stream_digest(whole[runs[0]][:cut], {v: whole[v][cut:] for v in runs},
                                                          runs), rank
    edited = comm.streams(big, big_inputs, runs[0])           # one set-up of the last copy's last rank left out
    del edited[-1][len(groups) - 1]
    _rejected_naming(edited, big.world_size - 1)
