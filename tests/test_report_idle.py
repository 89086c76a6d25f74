"""The bubble's causes: they add up to the plan's bubble, and each is the part of idle time it names."""

from __future__ import annotations

import pytest

from backends.report.idle import idle_causes, idle_parts
from planner.api import PlanOptions, plan
from planner.frontend.cluster import load_cluster
from tests.helpers import EXAMPLES

GPT = EXAMPLES / "gpt" / "model.py"
LLAMA = EXAMPLES / "hf_llama" / "model.py"
HETERO = EXAMPLES / "clusters" / "cpu-hetero-4.yaml"
HOMOG = EXAMPLES / "clusters" / "cpu-4.yaml"


@pytest.mark.parametrize("model, cluster, options", [
    (GPT, HETERO, {"stages": 2}),
    (LLAMA, HOMOG, {"tp": 2, "zero": "on"}),
    (LLAMA, HOMOG, {"stages": 4, "schedule": "interleaved"}),
])
def test_the_causes_add_up_to_the_bubble(model, cluster, options):
    planned = plan(model, load_cluster(cluster), PlanOptions(global_batch=16, runners_up=False, **options)).plan
    parts = idle_parts(planned)
    assert min(parts.fill_drain, parts.uneven_stages, parts.uneven_replicas, parts.gradient_sync,
               parts.optimizer_step) >= 0
    assert parts.total == pytest.approx(planned.estimates.bubble_fraction, abs=1e-12)
    assert parts.total > 0


def test_one_stage_replicas_idle_only_in_the_sync_the_optimizer_and_for_each_other():
    planned = plan(GPT, load_cluster(HETERO), PlanOptions(global_batch=16, stages=1, tp=1, use_all_devices=True,
                                                          runners_up=False)).plan
    assert len(planned.replicas) == planned.world_size == 4
    e = planned.estimates
    parts = idle_parts(planned)
    assert parts.fill_drain == pytest.approx(0, abs=1e-12) and parts.uneven_stages == pytest.approx(0, abs=1e-12)
    assert parts.gradient_sync == pytest.approx(e.sync_s / e.iteration_s)
    assert parts.optimizer_step == pytest.approx(sum(r.optimizer_s for r in planned.replicas)
                                                 / (e.iteration_s * planned.world_size)) and parts.optimizer_step > 0
    waits = sum(e.pipeline_s - r.estimated_s for r in planned.replicas)      # one rank per replica
    assert parts.uneven_replicas == pytest.approx(waits / (e.iteration_s * planned.world_size))


def test_a_pipeline_s_fill_and_its_uneven_stages_are_told_apart():
    planned = plan(GPT, load_cluster(HOMOG), PlanOptions(global_batch=16, stages=4, micro_batch=4,
                                                         schedule="1f1b", runners_up=False)).plan
    (replica,) = planned.replicas
    e = planned.estimates
    busy = [e.busy_s[r] for r in replica.ranks]
    device_s = e.iteration_s * planned.world_size
    parts = idle_parts(planned)
    # four micro-batches through four stages: the fill and drain is the makespan beyond the busiest stage
    assert parts.fill_drain == pytest.approx(4 * (replica.estimated_s - replica.optimizer_s - max(busy)) / device_s)
    assert parts.uneven_stages == pytest.approx(sum(max(busy) - b for b in busy) / device_s)
    assert parts.fill_drain > parts.uneven_stages
    assert idle_causes(planned).startswith("fill and drain ")
