"""The report's memory parts add up to what the plan records for each rank, compressor state included."""

from __future__ import annotations

import re

import pytest

from backends.report.html import render_html
from backends.report.memory_parts import memory_parts
from backends.report.svg import replica_groups
from planner.api import PlanOptions, plan
from planner.frontend.cluster import load_cluster
from tests.helpers import EXAMPLES

GPT = EXAMPLES / "gpt" / "model.py"
CPU4 = EXAMPLES / "clusters" / "cpu-hetero-4.yaml"


@pytest.mark.parametrize("compression", ["none", "onebit"])
def test_parts_sum_to_the_recorded_memory(compression):
    spec = load_cluster(CPU4)
    planned = plan(GPT, spec, PlanOptions(global_batch=16, compression=compression, stages=2,
                                          runners_up=False)).plan
    compressed = {r for g in planned.grad_groups if g.compressor != "none" for r in g.ranks}
    assert (compression != "none") == bool(compressed)
    for rank in range(planned.world_size):
        weights, grads, optimizer, activations, compressor, framework = memory_parts(planned, rank, spec)
        assert sum((weights, grads, optimizer, activations, compressor, framework)) == pytest.approx(
            planned.estimates.memory_bytes[rank], rel=1e-9)
        assert optimizer == pytest.approx(2 * grads) and weights == pytest.approx(grads)   # fp32 on CPU
        assert activations > 0 and framework > 0
        assert (compressor > 0) == (rank in compressed)


LLAMA = EXAMPLES / "hf_llama" / "model.py"
CPU_HOMOG = EXAMPLES / "clusters" / "cpu-4.yaml"


def _check_sums(planned, spec):
    for rank in range(planned.world_size):
        parts = memory_parts(planned, rank, spec)
        assert sum(parts) == pytest.approx(planned.estimates.memory_bytes[rank], rel=1e-9)
        assert min(parts) >= 0.0


def test_parts_of_tensor_parallel_shards_with_sharded_optimizer_state():
    """Weights and gradients are one shard's, AdamW's moments 1/2 of that across the ZeRO group of two."""
    spec = load_cluster(CPU_HOMOG)
    planned = plan(LLAMA, spec, PlanOptions(global_batch=16, tp=2, zero="on", runners_up=False)).plan
    assert planned.tp_degree == 2 and all(g.zero and len(g.ranks) == 2 for g in planned.grad_groups)
    _check_sums(planned, spec)
    for rank in range(planned.world_size):
        _, stage = planned.stage_of_rank(rank)
        weights, grads, optimizer, activations, _, framework = memory_parts(planned, rank, spec)
        assert 0 < stage.shard_param_bytes < sum(b.param_bytes for b in planned.blocks)
        assert grads == pytest.approx(stage.shard_param_bytes, rel=1e-9)
        assert weights == pytest.approx(grads) and optimizer == pytest.approx(2 * grads / 2)   # fp32 on CPU
        assert activations > 0 and framework > 0


def test_parts_of_an_interleaved_device_hold_all_its_stages():
    spec = load_cluster(CPU_HOMOG)
    planned = plan(LLAMA, spec, PlanOptions(global_batch=16, stages=4, schedule="interleaved",
                                            runners_up=False)).plan
    assert all(r.chunks == 2 for r in planned.replicas)
    _check_sums(planned, spec)
    for rank in range(planned.world_size):
        replica, stage = planned.stage_of_rank(rank)
        held = sum(b.param_bytes for s in replica.stages_with(stage)
                   for b in planned.blocks[s.first_block: s.last_block + 1])
        _, grads, optimizer, _, _, _ = memory_parts(planned, rank, spec)
        assert grads == pytest.approx(held, rel=1e-9) and optimizer == pytest.approx(2 * held)
    page = render_html(planned, spec, None)           # a bar per device, not one per stage it runs
    devices = sum(len(group.first.device_stages) for group in replica_groups(planned))
    assert devices < sum(len(group.first.stages) for group in replica_groups(planned))
    assert len(re.findall(r"GiB \(\d+%\)</text>", page)) == devices
