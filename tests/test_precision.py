"""Per-device precision: the planner's choice per device type, and the runtime applying it.

The plan picks bf16 where the device has it (A100, H100), fp16 on tensor-core devices without bf16
(V100, T4) and fp32 on P100 and CPUs (costmodel.compute.best_precision). The emitted program
autocasts CUDA ranks to the plan's precision; CPU ranks stay fp32 unless `--cpu-autocast`, which
the runtime tests here use with plans whose precision is set by hand (a CPU plan is always fp32).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from backends.torchdist.emit import emit_program
from backends.torchdist.program import precision
from backends.torchdist.reference import train_reference
from planner.api import PlanOptions, plan
from planner.core.ir import Plan
from tests.helpers import CLUSTERS, EXAMPLES, REPO, spawn_gloo_workers

GPT = EXAMPLES / "gpt" / "model.py"
STEPS = 3
COLLECTIVE_TIMEOUT_S = 60
RUN_TIMEOUT_S = 240
BF16_LOSS_RTOL = 2e-2      # bf16 keeps 8 bits of mantissa: ~0.4% per rounding, a few roundings deep
FP16_LOSS_RTOL = 1e-2

CPU_SPEC = """\
name: cpus
nodes:
  - {{name: cpu, count: 1, device: CPU, per_node: {n}, intra_link: shm}}
network:
  inter_node: {{kind: loopback, bandwidth_gbit_s: 10, latency_us: 20}}
"""
H100_CPU_SPEC = """\
name: h100-and-cpu
nodes:
  - {name: h100, count: 1, device: H100-80GB, per_node: 2, intra_link: nvlink4}
  - {name: cpu, count: 1, device: CPU, per_node: 2, intra_link: shm}
network:
  inter_node: {kind: roce, bandwidth_gbit_s: 100, latency_us: 5}
"""
EXPECTED = {"A100-40GB": "bf16", "H100-80GB": "bf16", "V100-32GB": "fp16", "T4": "fp16",
            "P100-16GB": "fp32", "CPU": "fp32"}


# ----------------------------------------------------------------------------- planner

def _precisions(result_plan: Plan) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for r in result_plan.replicas:
        for s in r.stages:
            found.setdefault(s.device_type, set()).add(s.precision)
    return found


@pytest.mark.parametrize("cluster", ["seed-mixed-32", "edge-t4", "h100-and-cpu"])
def test_plan_picks_precision_per_device_type(tmp_path, cluster):
    if cluster == "h100-and-cpu":
        spec = tmp_path / "h100-and-cpu.yaml"
        spec.write_text(H100_CPU_SPEC)
    else:
        spec = CLUSTERS / f"{cluster}.yaml"
    result = plan(GPT, spec, PlanOptions(global_batch=64, use_all_devices=True))
    found = _precisions(result.plan)
    checked = {t: p for t, p in found.items() if t in EXPECTED}
    assert checked, found
    for device_type, precisions in checked.items():
        assert precisions == {EXPECTED[device_type]}, (device_type, precisions)


def test_compute_dtype_follows_plan_on_cuda_and_cpu_only_with_the_flag():
    assert precision.compute_dtype("bf16", "cuda") == torch.bfloat16
    assert precision.compute_dtype("fp16", "cuda") == torch.float16
    assert precision.compute_dtype("fp32", "cuda") == torch.float32
    assert precision.compute_dtype("bf16", "cpu") == torch.float32            # CPU: fp32 by default
    assert precision.compute_dtype("bf16", "cpu", cpu_autocast=True) == torch.bfloat16
    assert precision.compute_dtype("fp32", "cpu", cpu_autocast=True) == torch.float32


# ----------------------------------------------------------------------------- runtime

def _with_precision(p: Plan, value: str) -> Plan:
    replicas = tuple(dataclasses.replace(r, stages=tuple(dataclasses.replace(s, precision=value)
                                                         for s in r.stages)) for r in p.replicas)
    return dataclasses.replace(p, replicas=replicas)


def _program(tmp_path: Path, devices: int, value: str, **options) -> tuple[Path, Plan]:
    spec = tmp_path / "cpus.yaml"
    spec.write_text(CPU_SPEC.format(n=devices))
    result = plan(GPT, spec, PlanOptions(global_batch=8, **options))
    assert {s.precision for r in result.plan.replicas for s in r.stages} == {"fp32"}   # CPU plans are fp32
    forced = _with_precision(result.plan, value)
    program = tmp_path / value / "program"
    emit_program(forced, GPT, program)
    return program, forced


def _torchrun(program: Path, nproc: int, *flags: str) -> list[dict]:
    """Run the emitted train.py with torchrun (flags `plan run` does not pass, like --cpu-autocast)."""
    out = program.parent / "run"
    env = {**os.environ, "HETPLAN_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(program / "train.py"), "--steps", str(STEPS), "--seed", "2", "--out", str(out), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=REPO,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (out / "metrics.jsonl").unlink()
    return lines


@pytest.mark.slow
def test_one_process_program_autocasts_to_bf16_only_with_the_cpu_flag(tmp_path):
    program, p = _program(tmp_path, 1, "bf16")
    ref = train_reference(str(GPT), global_batch=p.global_batch, steps=STEPS, seed=2)

    plain = _torchrun(program, 1)                       # plan says bf16, but CPU ranks stay fp32
    assert {m["compute_dtype"] for m in plain} == {"float32"}
    assert [m["loss"] for m in plain] == pytest.approx(ref.losses, rel=1e-5)

    cast = _torchrun(program, 1, "--cpu-autocast")
    assert {m["compute_dtype"] for m in cast} == {"bfloat16"}
    assert {m["loss_scale"] for m in cast} == {None}   # bf16 needs no loss scaling
    losses = [m["loss"] for m in cast]
    assert losses == pytest.approx(ref.losses, rel=BF16_LOSS_RTOL)
    assert losses != pytest.approx(ref.losses, rel=1e-6)   # bf16 arithmetic really ran


@pytest.mark.slow
def test_two_stage_fp16_program_scales_the_loss_on_every_rank(tmp_path):
    program, p = _program(tmp_path, 2, "fp16", stages=2, micro_batch=2)
    assert p.world_size == 2 and len(p.replicas[0].stages) == 2
    ref = train_reference(str(GPT), global_batch=p.global_batch, steps=STEPS, seed=2)
    metrics = _torchrun(program, 2, "--cpu-autocast")
    assert {m["compute_dtype"] for m in metrics} == {"float16"}
    assert {m["loss_scale"] for m in metrics} == {2.0 ** 16}          # the same scale on both stages
    assert not any(m["skipped_step"] for m in metrics)
    for step in range(STEPS):
        losses = {m["loss"] for m in metrics if m["step"] == step}
        assert len(losses) == 1 and losses.pop() == pytest.approx(ref.losses[step], rel=FP16_LOSS_RTOL)


# ----------------------------------------------------------------------------- loss scaler on gloo

def _overflow_worker(rank: int, port: int, world_size: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        layer = torch.nn.Linear(3, 2)
        before = [p.detach().clone() for p in layer.parameters()]
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        scaler = precision.LossScaler(torch.device("cpu"))
        scaler.scale_loss(layer(torch.ones(1, 3)).sum()).backward()
        if rank == 1:                                   # one rank overflows ...
            layer.weight.grad[0, 0] = float("inf")
        assert scaler.unscale_(optimizer)               # ... every rank sees it
        scaler.step(optimizer)
        assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters(), strict=True))  # skipped
        assert scaler.scale == 2.0 ** 15                # backed off everywhere
    finally:
        dist.destroy_process_group()


def test_loss_scaler_overflow_on_one_rank_skips_the_step_on_all():
    spawn_gloo_workers(_overflow_worker, (2,), 2, deadline_s=RUN_TIMEOUT_S)


@pytest.mark.slow
def test_pipeline_across_device_types_mixes_precisions_per_stage(tmp_path):
    # a pipeline spanning A100, V100 and P100 stages (planner.search.hetero): bf16, fp16, fp32 stages
    # exchange activations in the traced dtype and share one loss scale
    program, p = _program(tmp_path, 3, "fp32", stages=3, micro_batch=2)
    [replica] = p.replicas
    mixed = dataclasses.replace(replica, stages=tuple(dataclasses.replace(s, precision=value)
                                                      for s, value in zip(replica.stages, ("bf16", "fp16", "fp32"))))
    mixed_plan = dataclasses.replace(p, replicas=(mixed,))
    emit_program(mixed_plan, GPT, program)
    ref = train_reference(str(GPT), global_batch=p.global_batch, steps=STEPS, seed=2)
    metrics = _torchrun(program, 3, "--cpu-autocast")
    assert {m["rank"]: m["compute_dtype"] for m in metrics} == {0: "bfloat16", 1: "float16", 2: "float32"}
    assert {m["loss_scale"] for m in metrics} == {2.0 ** 16}          # one fp16 stage: the plan scales the loss
    for step in range(STEPS):
        losses = {m["loss"] for m in metrics if m["step"] == step}
        assert len(losses) == 1 and losses.pop() == pytest.approx(ref.losses[step], rel=FP16_LOSS_RTOL)
