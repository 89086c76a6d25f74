"""A tied parameter (an embedding the LM head reads too) is one tensor: a device holding both of its readers
holds its training state once (costmodel.tables.ClassTable.held_state_bytes), in every place the search
sums a stage's state: the split's costs, the greedy fit, the bottleneck square, the GPipe and interleaved
memory, ZeRO's shards, and the plan's memory figures. It is stepped once by the optimizer too
(`held_optimizer_s`: the pipelines' optimizer time, ZeRO's step and gather), saved once in a checkpoint
(costmodel.checkpoint), and the simulator steps it once.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from costmodel import memory, sharded_state
from planner import frontend
from planner.api import DEFAULT_TRACE_BATCH, trace_model_file
from planner.frontend.cluster import load_cluster
from planner.search import split
from planner.search.bottleneck import _Square
from planner.search.interleave_configs import device_need_bytes
from tests import synthetic as syn
from tests.helpers import CLUSTERS, EXAMPLES

# 6 blocks of 1 GiB state; a 0.5 GiB state read by blocks 0, 2 and 5 (an embedding, its reuse, a head)
TIED = ((0, 2, 0.5 * syn.GIB), (2, 5, 0.5 * syn.GIB))
LINKS = ((100e9, 5e-6),) * 5          # each cut: (bandwidth, latency)


def _table(capacity_gib: float = 40.0):
    return dataclasses.replace(syn.table("x", 1.0, blocks=6, devices=2, per_node=2, capacity_gib=capacity_gib),
                               tied_state=TIED)


def test_a_range_holding_k_readers_counts_the_parameter_once():
    t = _table()
    assert t.held_state_bytes([range(0, 6)]) == pytest.approx(6 * syn.GIB - 2 * 0.5 * syn.GIB)
    assert t.held_state_bytes([range(0, 3)]) == pytest.approx(3 * syn.GIB - 0.5 * syn.GIB)
    assert t.held_state_bytes([range(1, 6)]) == pytest.approx(5 * syn.GIB - 0.5 * syn.GIB)
    assert t.held_state_bytes([range(1, 2), range(3, 5)]) == pytest.approx(3 * syn.GIB)     # no reader held
    assert t.held_state_bytes([range(0, 1), range(5, 6)]) == pytest.approx(2 * syn.GIB)     # readers 0 and 5
    # (readers 0 and 5 without 2, chunks of an interleaved device: priced as two copies, on the safe side)


def test_every_search_sum_agrees_with_held_state_on_every_range():
    t = _table()
    lane = split._lane_arrays(split._Lane(t, 1, LINKS, False, 1.0))
    square = _Square(lane)
    for lo, hi in itertools.combinations(range(7), 2):
        want = t.held_state_bytes([range(lo, hi)])
        assert square.state[lo, hi] == pytest.approx(want), (lo, hi)
        costs = split.costs_per_stage([t], (lo, hi), 1, [], (0.0,) * 6, False)
        assert costs.stage_memory_bytes[0] == pytest.approx(memory.need_bytes(want, 0.0, t.framework_bytes))


def test_a_model_that_fits_one_device_only_once_its_tied_copy_is_counted_once_is_planned_there():
    """State 6 GiB counted per block, 5 GiB held: a 5.5 GiB device takes the whole model in one stage."""
    t = _table(capacity_gib=5.5)
    assert split.fits_greedily(t, 1, 1, False)
    found = split.solve_split(t, 1, 1, [], (0.0,) * 6)
    assert found is not None and found.bounds == (0, 6)
    untied = dataclasses.replace(t, tied_state=())
    assert not split.fits_greedily(untied, 1, 1, False) and split.solve_split(untied, 1, 1, [], (0.0,) * 6) is None


def test_zero_shards_the_tied_parameters_moments_like_every_other():
    t = dataclasses.replace(_table(), precision="bf16", state_bytes=(memory.state_bytes(syn.GIB, "bf16"),) * 6,
                            tied_state=tuple((a, b, memory.state_bytes(0.5 * syn.GIB, "bf16")) for a, b, _ in TIED))
    zeroed = sharded_state.at_group(syn.tables([t], 8), 4).classes[0]
    unique = memory.state_bytes(5 * syn.GIB, "bf16")
    want = unique - sharded_state.moment_bytes(unique, "bf16") * (1 - 1 / 4)
    assert zeroed.held_state_bytes([range(0, 6)]) == pytest.approx(want)


def test_an_interleaved_device_holding_embedding_and_head_counts_them_once():
    t = _table()
    bounds = (0, 1, 3, 5, 6)          # 2 devices x 2 chunks: device 0 holds blocks 0 and 3-4, device 1 1-2 and 5
    need = device_need_bytes(t, bounds, 1, 2, 2)
    assert need[0] == pytest.approx(memory.need_bytes(3 * syn.GIB, 0.0, t.framework_bytes))
    assert need[1] == pytest.approx(memory.need_bytes(3 * syn.GIB - 0.5 * syn.GIB, 0.0, t.framework_bytes))


def test_the_gpt_examples_tables_hold_its_tied_embedding_once():
    """The GPT example's LM head is its token embedding: one stage of the whole model holds the state of
    its distinct parameters; two stages with the embedding on one and the head on the other hold two."""
    from backends.torchdist.program import materialise
    from costmodel.tables import build_tables

    model_file = frontend.load_model_file(EXAMPLES / "gpt" / "model.py", {})
    _, blocks, _ = trace_model_file(model_file, DEFAULT_TRACE_BATCH)
    spec = load_cluster(CLUSTERS / "cpu-4.yaml")
    table = build_tables(blocks, spec, global_batch=16, trace_batch=DEFAULT_TRACE_BATCH).classes[0]
    distinct = sum(p.numel() * 4 for p in materialise.build_meta(model_file, 0).module.parameters())
    n = len(blocks)
    assert table.tied_state and sum(table.state_bytes) > memory.state_bytes(distinct, table.precision) * 1.05
    assert table.held_state_bytes([range(n)]) == pytest.approx(memory.state_bytes(distinct, table.precision))
    halves = table.held_state_bytes([range(n // 2)]) + table.held_state_bytes([range(n // 2, n)])
    assert halves == pytest.approx(sum(table.state_bytes))


# each reader's optimizer time counts the tied parameter's step: 0.2 ms of a block's 1 ms
TIED_STEP = ((0, 2, 2e-4), (2, 5, 2e-4))


def _stepped_table(tied_step=TIED_STEP):
    return dataclasses.replace(_table(), optimizer_s=(1e-3,) * 6, tied_optimizer_s=tied_step)


def test_a_range_holding_k_readers_steps_the_parameter_once():
    t = _stepped_table()
    assert t.held_optimizer_s([range(0, 6)]) == pytest.approx(6e-3 - 2 * 2e-4)
    assert t.held_optimizer_s([range(0, 3)]) == pytest.approx(3e-3 - 2e-4)
    assert t.held_optimizer_s([range(3, 6)]) == pytest.approx(3e-3)
    assert t.held_optimizer_s([range(0, 1), range(2, 3)]) == pytest.approx(2e-3 - 2e-4)    # interleaved chunks


def test_a_pipeline_is_charged_its_slowest_stage_with_each_parameter_stepped_once():
    from planner.search import configs
    from planner.search.split import costs_per_stage

    t = _stepped_table()
    tables = syn.tables([t], 8)
    for bounds, want in (((0, 6), 6e-3 - 4e-4), ((0, 3, 6), 3e-3), ((0, 2, 6), 4e-3 - 2e-4)):
        split = costs_per_stage([t] * (len(bounds) - 1), bounds, 1, LINKS[:len(bounds) - 2], tables.grad_bytes, False)
        assert configs.make_config(tables, 0, split, 1).optimizer_s == pytest.approx(want), bounds
        untied = configs.make_config(syn.tables([_stepped_table(())], 8), 0, split, 1).optimizer_s
        assert untied == pytest.approx(max(1e-3 * (hi - lo) for lo, hi in zip(bounds, bounds[1:])))


def test_zero_steps_and_gathers_a_tied_parameter_once():
    t = _stepped_table()
    tables = dataclasses.replace(syn.tables([t], 8), tied=(((0, 2, 5), 0.125 * syn.GIB),),
                                 param_tensors=(1,) * 6)
    z = 4
    zeroed = sharded_state.at_group(tables, z).classes[0]
    gather = [sharded_state.allgather_s(n, z, tables.inter_bandwidth_bytes_s, 0.0) + tables.inter_latency_s
              for n in tables.grad_bytes]
    tied_gather = sharded_state.allgather_s(0.125 * syn.GIB, z, tables.inter_bandwidth_bytes_s, 0.0) \
        + tables.inter_latency_s
    every_block = sum(1e-3 / z + g for g in gather)
    assert zeroed.held_optimizer_s([range(0, 6)]) == pytest.approx(every_block - 2 * (2e-4 / z + tied_gather))


def _gpt_plan(stages: int):
    from planner.api import PlanOptions, plan

    return plan(EXAMPLES / "gpt" / "model.py", CLUSTERS / "cpu-4.yaml",
                PlanOptions(global_batch=16, stages=stages, runners_up=False)).plan


def test_the_gpt_examples_one_stage_plan_steps_saves_and_simulates_its_embedding_once():
    """One stage of the whole GPT example holds its token embedding and the LM head that reads it: the
    table's optimizer time over the stage is that of its distinct parameters, the checkpoint advice saves
    them once, and the stage records their bytes (which the simulator steps)."""
    from backends.torchdist.program import materialise
    from costmodel import compute
    from costmodel.checkpoint import rank_state_bytes, saved_factor
    from costmodel.tables import build_tables

    model_file = frontend.load_model_file(EXAMPLES / "gpt" / "model.py", {})
    _, blocks, _ = trace_model_file(model_file, DEFAULT_TRACE_BATCH)
    spec = load_cluster(CLUSTERS / "cpu-4.yaml")
    table = build_tables(blocks, spec, global_batch=16, trace_batch=DEFAULT_TRACE_BATCH).classes[0]
    params = list(materialise.build_meta(model_file, 0).module.parameters())
    distinct = sum(p.numel() * 4 for p in params)
    device = spec.nodes[0].device
    assert sum(table.optimizer_s) > compute.optimizer_step_s(distinct, len(params), device) * 1.05
    assert table.held_optimizer_s([range(len(blocks))]) == pytest.approx(
        compute.optimizer_step_s(distinct, len(params), device))

    p = _gpt_plan(1)
    whole = [st for r in p.replicas for st in r.stages]
    assert all(st.first_block == 0 and st.last_block == len(p.blocks) - 1 for st in whole)
    assert all(st.shard_param_bytes == pytest.approx(distinct) for st in whole)
    assert rank_state_bytes(p, "adamw") == pytest.approx([distinct * saved_factor("adamw")] * p.world_size)
    assert sum(b.param_bytes for b in p.blocks) > distinct * 1.05     # what was saved before: a copy too many


def test_two_stages_of_the_gpt_example_each_hold_a_copy_of_the_tied_embedding():
    p = _gpt_plan(2)
    for replica in p.replicas:
        first, last = replica.stages
        per_block = [sum(p.blocks[b].param_bytes for b in range(st.first_block, st.last_block + 1))
                     for st in (first, last)]
        assert [first.shard_param_bytes, last.shard_param_bytes] == pytest.approx(per_block)


def test_a_stage_holding_the_gpt_examples_embedding_and_head_holds_one_compressor_state_for_it():
    """Under gradient compression (PowerSGD's error feedback and P/Q, 1-bit's two buffers), the search's
    bound on a stage's compressor state counts the tied embedding once where the stage holds both of its
    readers: the state of the stage's distinct parameters; two stages each hold theirs."""
    from costmodel.compression import compress_volume, compression_of
    from costmodel.compression_memory import state_table
    from planner.api import PlanOptions, cost_tables

    model_file = frontend.load_model_file(EXAMPLES / "gpt" / "model.py", {})
    gm, blocks, _ = trace_model_file(model_file, DEFAULT_TRACE_BATCH)
    spec = load_cluster(CLUSTERS / "seed-mixed-32.yaml")
    tables = cost_tables(PlanOptions(global_batch=64, compression="auto"), gm, blocks, spec, None)
    states, table = state_table(tables), compression_of(tables)
    assert states is not None and states.tied and {"powersgd", "onebit"} <= set(states.names)
    n = len(blocks)

    def distinct(lo: int, hi: int, name: str) -> float:
        params = [p for b in range(lo, hi) for p in blocks[b].params]
        sizes = dict(pair for b in range(lo, hi) for pair in zip(blocks[b].params, blocks[b].param_sizes))
        return compress_volume(name, table.volume(params, sum(sizes.values()))).state_bytes

    for name in ("powersgd", "onebit"):
        assert states.state_bytes(name, range(n)) == pytest.approx(distinct(0, n, name)), name
        summed = sum(compress_volume(name, table.blocks_volume(range(b, b + 1), tables.grad_bytes)).state_bytes
                     for b in range(n))
        assert summed > distinct(0, n, name) * 1.05, name          # what each reader's count made it
        halves = states.state_bytes(name, range(n // 2)) + states.state_bytes(name, range(n // 2, n))
        assert halves == pytest.approx(distinct(0, n // 2, name) + distinct(n // 2, n, name)), name
