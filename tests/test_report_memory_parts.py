"""The report's memory parts add up to what the plan records for each rank, compressor state included."""

from __future__ import annotations

import pytest

from backends.report.memory_parts import memory_parts
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
