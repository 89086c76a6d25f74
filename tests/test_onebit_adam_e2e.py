"""1-bit Adam in the emitted program: a `onebit` gradient group under AdamW warms up with exact
gradients, then exchanges 1-bit momentum instead; under SGD it keeps 1-bit gradients.

The example GPT planned with `--compression onebit`, run on gloo for a few steps by torchrun
(`train.py` flags that `plan run` does not pass: --onebit-freeze-step, --cpu-autocast); the metrics
lines and the final weights are checked. The optimizer's numerics are checked against a reference
in tests/test_onebit_adam.py; here it is the wiring: which steps send what, replicas in sync, the
loss close to single-process training, fp16 loss scaling around the exchange.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.torchdist.emit import emit_program
from backends.torchdist.program.gradsync import group_payload_bytes
from backends.torchdist.reference import train_reference
from planner import frontend
from planner.api import PlanOptions, plan
from planner.core.ir import Plan
from tests.helpers import CLUSTERS, EXAMPLES, REPO, run_plan_cli, run_program

GPT = EXAMPLES / "gpt" / "model.py"
CPU4 = CLUSTERS / "cpu-hetero-4.yaml"
STEPS, FREEZE_STEP = 5, 2
EXACT_LOSS_RTOL = 1e-5        # warm-up: exact all-reduce, as tests/test_e2e.py
LOSS_RTOL = 2e-2              # a few compressed steps stay close to exact training
FP16_LOSS_RTOL = 2e-2         # fp16 compute (tests/test_precision.py: 1e-2) and a few compressed steps
COLLECTIVE_TIMEOUT_S = 60
RUN_TIMEOUT_S = 300
CPU2_SPEC = """\
name: cpus
nodes:
  - {name: cpu, count: 1, device: CPU, per_node: 2, intra_link: shm}
network:
  inter_node: {kind: loopback, bandwidth_gbit_s: 10, latency_us: 20}
"""


def _torchrun(program: Path, nproc: int, *flags: str) -> list[dict]:
    """Run the emitted train.py with torchrun (collective timeout 60 s, own session); metrics lines."""
    out = program.parent / "run"
    env = {**os.environ, "HETPLAN_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)      # kernels' torch references: interpreted Triton is slow here
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(program / "train.py"), "--steps", str(STEPS), "--seed", "1", "--out", str(out),
           "--save-final", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=REPO,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _shapes() -> dict[str, tuple[int, ...]]:
    module = frontend.build_on_meta(frontend.load_model_file(GPT))
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def _check_bytes(plan_: Plan, metrics: list[dict], exact_steps: int) -> None:
    """Exact fp32 payload while warming up, then the cost model's 1-bit payload, per group and rank."""
    shapes = _shapes()
    for m in metrics:
        for g in (g for g in plan_.grad_groups if m["rank"] in g.ranks):
            expected = g.nbytes if m["step"] < exact_steps else group_payload_bytes(g, shapes)
            assert m["grad_wire_bytes_by_group"][str(g.index)] == expected, (m["rank"], m["step"], g.index)
        if m["step"] >= exact_steps:           # the momentum travels 1-bit: ~32x fewer bytes
            assert m["grad_bytes"] >= 30 * m["grad_wire_bytes"]


def _check_losses_and_replicas(out: Path, plan_: Plan, metrics: list[dict], exact_steps: int, rtol: float) -> None:
    ref = train_reference(str(GPT), global_batch=plan_.global_batch, steps=STEPS, seed=1)
    for step in range(STEPS):
        losses = {m["loss"] for m in metrics if m["step"] == step}
        assert len(losses) == 1, (step, losses)
        # the loss of step k reflects the updates of steps < k
        tolerance = EXACT_LOSS_RTOL if step <= exact_steps else rtol
        assert losses.pop() == pytest.approx(ref.losses[step], rel=tolerance), step
    finals = [torch.load(out / "run" / "final" / f"rank{r}.pt") for r in range(plan_.world_size)]
    for g in plan_.grad_groups:                # the decoded momentum is the same on every rank
        for name in g.params:
            assert all(torch.equal(finals[r][name], finals[g.ranks[0]][name]) for r in g.ranks[1:]), name


def _plan_gpt(tmp_path: Path, *extra: str) -> tuple[Path, Plan]:
    out = tmp_path / "out"
    proc = run_plan_cli(str(GPT), "--cluster", str(CPU4), "--global-batch", "16", "--use-all-devices",
                        "--compression", "onebit", "-o", str(out), *extra)
    assert proc.returncode == 0, proc.stderr
    plan_ = Plan.load(out)
    assert {g.compressor for g in plan_.grad_groups} == {"onebit"}
    return out, plan_


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--stages", "1"), ("--stages", "2", "--micro-batch", "2")],
                         ids=["1x4", "2x2"])
def test_adamw_warms_up_exact_then_exchanges_1bit_momentum(tmp_path, layout):
    out, plan_ = _plan_gpt(tmp_path, *layout)
    if layout[1] == "2":       # stage groups and the tied embedding's group: several exchanges per rank
        assert len(plan_.grad_groups) == 3
    metrics = _torchrun(out / "program", plan_.world_size, "--onebit-freeze-step", str(FREEZE_STEP))
    _check_bytes(plan_, metrics, exact_steps=FREEZE_STEP)
    _check_losses_and_replicas(out, plan_, metrics, FREEZE_STEP, LOSS_RTOL)


@pytest.mark.slow
def test_sgd_keeps_1bit_gradients_from_the_first_step(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out, plan_ = _plan_gpt(tmp_path, "--stages", "1")
    metrics = run_program(out, 3, seed=1, optimizer="sgd", lr=0.1)
    _check_bytes(plan_, metrics, exact_steps=0)


@pytest.mark.slow
def test_fp16_loss_scaling_unscales_before_the_momentum_exchange(tmp_path):
    spec = tmp_path / "cpus.yaml"
    spec.write_text(CPU2_SPEC)
    result = plan(GPT, spec, PlanOptions(global_batch=8, stages=1, use_all_devices=True, compression="onebit"))
    assert result.plan.world_size == 2 and {g.compressor for g in result.plan.grad_groups} == {"onebit"}
    replicas = tuple(dataclasses.replace(r, stages=tuple(dataclasses.replace(s, precision="fp16")
                                                         for s in r.stages)) for r in result.plan.replicas)
    forced = dataclasses.replace(result.plan, replicas=replicas)
    out = tmp_path / "fp16"
    emit_program(forced, GPT, out / "program")
    metrics = _torchrun(out / "program", 2, "--cpu-autocast", "--onebit-freeze-step", str(FREEZE_STEP))
    assert {m["compute_dtype"] for m in metrics} == {"float16"}
    assert {m["loss_scale"] for m in metrics} == {2.0 ** 16} and not any(m["skipped_step"] for m in metrics)
    _check_bytes(forced, metrics, exact_steps=FREEZE_STEP)
    # fp16 forward and backward: every step within fp16 rounding of single-process fp32 training
    _check_losses_and_replicas(out, forced, metrics, exact_steps=-1, rtol=FP16_LOSS_RTOL)
