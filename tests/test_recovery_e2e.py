"""Training that survives failures, end to end through `plan run` (real torchrun, gloo, files on disk):

- a worker killed mid-run under `MAX_RESTARTS=1 ./launch.sh` (checkpoints every 3 steps): torchrun
  restarts the group, the program resumes from its last complete checkpoint, and the per-step losses
  and final parameters equal an uninterrupted run bit for bit;
- a device lost for good under --elastic: the supervisor re-plans without it and the run ends with the
  requested steps on the devices left, its losses those of one process, its log naming the device and
  the plan that replaced it;
- `plan replan --without` by hand: a 4-device plan trains 6 steps, the 3-device plan (its stages cut
  elsewhere) resumes from the checkpoint and trains 6 more, the 12 losses those of one process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from backends.torchdist.reference import train_reference
from planner.core.ir import Plan
from tests.helpers import CLUSTERS, EXAMPLES, REPO, read_metrics, run_logs_tail, run_plan_cli, run_program

MODEL = EXAMPLES / "mlp" / "model.py"
SEED, LR = 3, 1e-3


@pytest.fixture(scope="module")
def four_device_plan(tmp_path_factory):
    """examples/mlp as 2 replicas x 2 stages on cpu-hetero-4 (every device used)."""
    out = tmp_path_factory.mktemp("recovery") / "out"
    proc = run_plan_cli(str(MODEL), "--cluster", str(CLUSTERS / "cpu-hetero-4.yaml"), "--global-batch", "8",
                        "--stages", "2", "--use-all-devices", "--micro-batch", "2", "--no-runners-up", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(out)
    assert plan.world_size == 4
    return out, plan


def _plan_run(out, *args: str, timeout_s: float = 400) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "planner.cli", "run", str(out), "--seed", str(SEED), "--lr", str(LR),
           "--optimizer", "adamw", "--timeout", "20", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO,
                          start_new_session=True)


def _losses(metrics: list[dict]) -> dict[int, float]:
    """step -> loss, the newest record of each step (a step run again after a restart counts once)."""
    return {m["step"]: m["loss"] for m in metrics}


def _finals(run_dir, world_size: int) -> dict[str, torch.Tensor]:
    out = {}
    for rank in range(world_size):
        out.update(torch.load(run_dir / "final" / f"rank{rank}.pt"))
    return out


def _reference(plan: Plan, steps: int):
    return train_reference(str(MODEL), global_batch=plan.global_batch, steps=steps, seed=SEED, lr=LR,
                           optimizer="adamw", accumulate=[m for r in plan.replicas for m in r.micro_batch_sizes])


@pytest.mark.slow
def test_a_device_that_stays_dead_is_planned_around_and_the_run_finishes(four_device_plan, tmp_path):
    source, plan = four_device_plan
    out = tmp_path / "out"
    subprocess.run(["cp", "-r", str(source), str(out)], check=True)
    steps, lost = 8, plan.devices[3]
    proc = _plan_run(out, "--steps", str(steps), "--checkpoint-every", "3", "--max-restarts", "1", "--elastic",
                     f"--fault=kill-always:{lost}@4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:] + run_logs_tail(out)
    records = [json.loads(line) for line in (out / "run" / "elastic.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records] == ["device_lost", "replanned"], records
    assert records[0]["device"] == lost and records[1]["step"] == 3
    new_dir = out / "elastic" / "1"
    assert records[1]["plan"] == str(new_dir)
    assert f"{lost} failed again after a restart" in proc.stdout and str(new_dir) in proc.stdout
    new_plan = Plan.load(new_dir)
    assert lost not in new_plan.devices and new_plan.global_batch == plan.global_batch
    ref = _reference(plan, steps)
    before = _losses(read_metrics(out / "run" / "metrics.jsonl"))
    after = _losses(read_metrics(new_dir / "run" / "metrics.jsonl"))
    assert sorted(after) == list(range(3, steps))               # resumed at 3, ended with the steps asked for
    for step, loss in {**{s: v for s, v in before.items() if s < 3}, **after}.items():
        assert loss == pytest.approx(ref.losses[step], rel=1e-5), (step, loss, ref.losses[step])


@pytest.mark.slow
def test_replan_without_a_device_resumes_on_moved_stages_as_one_process(four_device_plan, tmp_path):
    source, plan = four_device_plan
    out = tmp_path / "out"
    subprocess.run(["cp", "-r", str(source), str(out)], check=True)
    proc = _plan_run(out, "--steps", "6", "--checkpoint-every", "3")
    assert proc.returncode == 0, proc.stderr[-2000:] + run_logs_tail(out)
    dropped = "fast/0:0"                                        # fast/0:1 then runs as itself, not renumbered
    assert dropped in plan.devices
    out2 = tmp_path / "out2"
    # 3 devices left, all used (the plan's --use-all-devices kept), the pipeline depth the search's choice
    proc = subprocess.run([sys.executable, "-m", "planner.cli", "replan", str(out), "--without", dropped,
                           "--stages", "0", "-o", str(out2)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    new_plan = Plan.load(out2)
    assert sorted(new_plan.devices) == ["fast/0:1", "slow/1:0", "slow/1:1"]
    cuts = {tuple(s.last_node for s in r.stages) for r in plan.replicas}
    assert {tuple(s.last_node for s in r.stages) for r in new_plan.replicas} != cuts   # the stages moved
    proc = _plan_run(out2, "--steps", "12", "--resume-from", str(out / "run" / "ckpt"))
    assert proc.returncode == 0, proc.stderr[-2000:] + run_logs_tail(out2)
    ref = _reference(plan, 12)
    losses = {**_losses(read_metrics(out / "run" / "metrics.jsonl")),
              **_losses(read_metrics(out2 / "run" / "metrics.jsonl"))}
    assert sorted(losses) == list(range(12))
    for step, loss in losses.items():
        assert loss == pytest.approx(ref.losses[step], rel=1e-5), (step, loss, ref.losses[step])



@pytest.mark.slow
def test_a_killed_worker_restarts_and_resumes_bit_for_bit(four_device_plan, tmp_path):
    """`MAX_RESTARTS=1 ./launch.sh` (torchrun's own store, which outlives the restart: the new group forms
    under its attempt's keys), checkpoints every 3 steps, a worker killed as step 5 begins: the restarted
    group resumes from step_3 and ends with the losses and final parameters of a run never stopped.
    (`plan run --max-restarts` restarts the same way: the elastic test's first launch does.)"""
    out, plan = four_device_plan
    steps = 9
    run_program(out, steps, seed=SEED, lr=LR)                   # uninterrupted
    clean_losses = _losses(read_metrics(out / "run" / "metrics.jsonl"))
    clean_params = _finals(out / "run", plan.world_size)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "MAX_RESTARTS": "1"}
    run_dir = tmp_path / "run"
    proc = subprocess.run([str(out / "program" / "launch.sh"), "--steps", str(steps), "--seed", str(SEED),
                           "--lr", str(LR), "--optimizer", "adamw", "--save-final", "--checkpoint-every", "3",
                           f"--fault=kill:{plan.devices[1]}@5", "--timeout", "20", "--out", str(run_dir)],
                          capture_output=True, text=True, timeout=300, env=env, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"resumed from {run_dir / 'ckpt' / 'step_3'} at step 3" in proc.stdout   # it died, and came back
    assert _losses(read_metrics(run_dir / "metrics.jsonl")) == clean_losses
    resumed = _finals(run_dir, plan.world_size)
    assert resumed.keys() == clean_params.keys()
    for name, value in resumed.items():
        assert torch.equal(value, clean_params[name]), name


def test_resume_without_a_checkpoint_is_one_line_before_any_rank_starts(four_device_plan, tmp_path):
    source, _ = four_device_plan
    out = tmp_path / "out"
    subprocess.run(["cp", "-r", str(source), str(out)], check=True)
    shutil.rmtree(out / "run", ignore_errors=True)                 # another test of the module may have run it
    proc = _plan_run(out, "--steps", "2", "--resume", timeout_s=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("plan: error: --resume: no complete checkpoint in ") and "--checkpoint-every" in lines[0]
    assert not (out / "run").exists()                               # nothing was launched
