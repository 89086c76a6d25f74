"""The held-out example models (a T5-style encoder-decoder, a ViT, a Mixtral-style MoE: never tuned on)
keep the model-file contract, train on one process, plan on cpu-hetero-4 across pipeline stages, and run."""

from __future__ import annotations

import importlib.util
import math
from types import ModuleType

import pytest
import torch

from planner.api import PlanOptions, RunControls, plan
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli, run_program

HELD_OUT = ("t5_small", "vit_small", "moe_small")
HETERO = CLUSTERS / "cpu-hetero-4.yaml"
TRAIN_STEPS = 30
CPU_STEP_LIMIT_S = 0.5         # one process, one thread, a micro-batch of 16 rows: "well under a second"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"hetplan_held_out_{name}", EXAMPLES / name / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", HELD_OUT)
def test_batches_are_deterministic_per_row(name):
    example = _load(name)
    (small, *_), small_target = example.batch(3, 7)
    (large, *_), large_target = example.batch(5, 7)
    assert torch.equal(small, large[:3]) and torch.equal(small_target, large_target[:3])
    assert not torch.equal(example.batch(3, 8)[1], small_target)


@pytest.mark.parametrize("name", HELD_OUT)
def test_trains_on_one_process_fast_enough(name):
    import time

    example = _load(name)
    torch.manual_seed(0)
    net = example.model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses, cpu_s = [], []
        for step in range(TRAIN_STEPS):
            inputs, target = example.batch(16, step)
            start = time.process_time()
            loss = example.loss_fn(net(*inputs), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            cpu_s.append(time.process_time() - start)
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
    assert sorted(cpu_s)[len(cpu_s) // 2] < CPU_STEP_LIMIT_S


@pytest.mark.parametrize("name", HELD_OUT)
def test_plans_in_two_stages_on_cpu_hetero_4(name):
    options = PlanOptions(global_batch=16, stages=2, micro_batch=4, use_all_devices=True, runners_up=False)
    planned = plan(EXAMPLES / name / "model.py", HETERO, options, RunControls()).plan
    assert planned.world_size == 4 and {len(r.stages) for r in planned.replicas} == {2}
    assert planned.estimates.iteration_s > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", HELD_OUT)
def test_the_emitted_program_runs(name, tmp_path):
    out = tmp_path / name
    proc = run_plan_cli(str(EXAMPLES / name / "model.py"), "--cluster", str(HETERO), "--stages", "2",
                        "--use-all-devices", "--micro-batch", "4", "--global-batch", "16", "--no-runners-up",
                        "-o", str(out), timeout_s=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = run_program(out, 3, timeout_s=240, collective_timeout_s=30, save_final=False)
    assert {m["rank"] for m in metrics} == {0, 1, 2, 3}
    assert all(math.isfinite(m["loss"]) for m in metrics if m.get("loss") is not None)
