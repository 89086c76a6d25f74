"""ZB-H1 end to end: plan with `--schedule zbh1` -> emit -> run on gloo processes -> equal to single-process
training. Each backward runs as B (the inputs' gradients, sent on at once) and W (the weights', later), so a
gradient that W never accumulated, or accumulated twice, moves the weights away from the reference."""

from __future__ import annotations

import pytest

from planner.core import schedule as sched
from planner.core.ir import Plan
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli
from tests.test_e2e import _check_against_reference
from tests.test_tp_e2e import check_llama_tp2_on_cpu4


def _plan(tmp_path, model: str, *flags: str, cluster: str = "cpu-hetero-4.yaml") -> tuple:
    out = tmp_path / "out"
    proc = run_plan_cli(str(EXAMPLES / model / "model.py"), "--cluster", str(CLUSTERS / cluster),
                        "--schedule", "zbh1", *flags, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(out)
    for r in plan.replicas:
        assert r.schedule == "zbh1" and len(r.stages) > 1
        # the weight gradients' part is priced on every stage with weights
        assert all(0 < st.wgrad_s_per_sample < st.bwd_s_per_sample for st in r.stages)
    return out, plan


@pytest.mark.slow
def test_gpt_zero_bubble_on_three_stages_matches_single_process(tmp_path):
    # three stages: the middle one receives and sends, so its W runs on gradients B kept; the tied embedding
    # (first stage) and LM head (last) sum their gradients across ranks
    out, plan = _plan(tmp_path, "gpt", "--global-batch", "16", "--stages", "3", "--micro-batch", "2",
                      cluster="cpu-4.yaml")
    assert any(len(r.stages) == 3 for r in plan.replicas)
    held_back = sched.make("zbh1", 3, len(plan.replicas[0].micro_batch_sizes))[2]
    assert [str(a) for a in held_back][:4] == ["2F0", "2B0", "2F1", "2B1"]   # the last stage holds back W
    _check_against_reference(out, plan, "gpt")


@pytest.mark.slow
def test_hf_llama_zero_bubble_with_tensor_parallelism_matches_single_process(tmp_path):
    check_llama_tp2_on_cpu4(_plan, tmp_path, stages=2)


@pytest.mark.slow
def test_t5_zero_bubble_with_a_bias_shared_by_every_layer_matches_single_process(tmp_path):
    # T5's relative position bias is read by every attention layer of a stack: its weight gradient runs
    # along several paths of one stage, which W walks one after another over the same saved tensors
    out, plan = _plan(tmp_path, "t5_small", "--global-batch", "8", "--stages", "2", "--micro-batch", "2",
                      cluster="cpu-4.yaml")
    _check_against_reference(out, plan, "t5_small")
