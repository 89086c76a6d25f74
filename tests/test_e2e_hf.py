"""End to end with a Hugging Face model: rotary tables and the causal mask cross the stage cut as
context values (no gradient), the hidden state as an activation."""

from __future__ import annotations

import pytest

from backends.torchdist.reference import train_reference
from planner.core.ir import Plan
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli, run_program

STEPS = 3


@pytest.mark.slow
def test_hf_llama_two_stages_two_replicas_matches_single_process(tmp_path):
    model = EXAMPLES / "hf_llama" / "model.py"
    out = tmp_path / "out"
    proc = run_plan_cli(str(model), "--cluster", str(CLUSTERS / "cpu-hetero-4.yaml"), "--global-batch", "8",
                        "--stages", "2", "--use-all-devices", "--micro-batch", "2", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(out)
    assert [len(r.stages) for r in plan.replicas] == [2, 2]
    metrics = run_program(out, STEPS, seed=1, save_final=False)
    ref = train_reference(str(model), global_batch=8, steps=STEPS, seed=1)
    for m in metrics:
        assert m["loss"] == pytest.approx(ref.losses[m["step"]], rel=1e-5)
    assert len(metrics) == STEPS * plan.world_size
