"""Interleaved 1F1B end to end: plan with `--schedule interleaved` -> emit -> run on gloo processes -> equal
to single-process training. Each rank runs several stages; values are relayed stage to stage, so a skip
connection and the tied embedding / LM head cross ranks too."""

from __future__ import annotations

import pytest

from planner.core.ir import Plan
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli
from tests.test_e2e import _check_against_reference
from tests.test_tp_e2e import check_llama_tp2_on_cpu4


def _plan(tmp_path, model: str, *flags: str, cluster: str = "cpu-hetero-4.yaml") -> tuple:
    out = tmp_path / "out"
    proc = run_plan_cli(str(EXAMPLES / model / "model.py"), "--cluster", str(CLUSTERS / cluster),
                        "--schedule", "interleaved", "--use-all-devices", *flags, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(out)
    for r in plan.replicas:
        assert r.schedule == "interleaved" and r.chunks > 1
        assert len(r.stages) == r.chunks * len(r.device_stages)
        for st in r.stages:                       # stage k on the ranks of stage k mod devices
            assert st.ranks == r.device_stages[st.index % len(r.device_stages)].ranks
    return out, plan


@pytest.mark.slow
def test_gpt_interleaved_on_two_devices_per_replica_matches_single_process(tmp_path):
    out, plan = _plan(tmp_path, "gpt", "--global-batch", "16", "--stages", "4", "--micro-batch", "2")
    assert plan.world_size == 4 and len(plan.replicas) == 2
    # the tied embedding (first stage, device 0) and LM head (last stage, device 1) share one group
    tied = [g for g in plan.grad_groups if "token_embedding.weight" in g.params]
    assert tied and len(tied[0].ranks) == 4
    _check_against_reference(out, plan, "gpt")


@pytest.mark.slow
def test_resnet_interleaved_relays_its_skip_connections(tmp_path):
    out, plan = _plan(tmp_path, "resnet", "--global-batch", "12", "--stages", "4", "--micro-batch", "2")
    # SGD: see tests/test_e2e.py's resnet test on convolution backward and AdamW. The reference accumulates
    # the plan's micro-batches: against one whole batch of 12, the stem's summation order moved its weight by
    # 1.7e-5 after four steps on an AVX2 host (within 1e-5 on the hosts before)
    _check_against_reference(out, plan, "resnet", optimizer="sgd", lr=0.05)


@pytest.mark.slow
def test_hf_llama_interleaved_with_tensor_parallelism_matches_single_process(tmp_path):
    check_llama_tp2_on_cpu4(_plan, tmp_path, stages=4)


def test_rebalance_on_an_interleaved_plan_is_one_line_before_any_rank_starts(tmp_path):
    # (every rank started, traced its stages, then refused it alike)
    out, _ = _plan(tmp_path, "gpt", "--global-batch", "16", "--stages", "4", "--micro-batch", "2",
                   "--no-runners-up")
    proc = run_plan_cli("run", str(out), "--rebalance", "--steps", "2")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("plan: error: --rebalance: ") and "interleaved 1F1B" in lines[0]
    assert "--schedule 1f1b" in lines[0] and proc.stdout == ""
    assert not (out / "run").exists()
