"""Checkpoints and resume in the emitted program, end to end: real plans of the example models on
cpu-hetero-4, emitted programs run by torchrun on gloo (free ports: --standalone; collective timeout
20 s; each run in its own session, under a wall-clock limit).

- a run stopped after 6 steps and resumed (--resume) for 6 more trains bit for bit like 12 steps in
  one go: the same losses, the same final parameters; AdamW, and PowerSGD on 2 replicas (whose error
  feedback and P/Q carry over);
- a rank killed while the checkpoint of step 6 is written leaves step_6 incomplete; the resumed run
  continues from step_3;
- older complete checkpoints are deleted after a new one completes (--keep-checkpoints).

A group restarted by `plan run --max-restarts`, a device lost for good (--elastic) and a checkpoint
loaded into another plan of the model (`plan replan`): tests/test_recovery_e2e.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.torchdist.program import checkpoint, checkpoint_state
from tests.helpers import CLUSTERS, EXAMPLES, REPO, read_metrics, run_plan_cli

MLP = EXAMPLES / "mlp" / "model.py"
CPU4 = CLUSTERS / "cpu-hetero-4.yaml"
COLLECTIVE_TIMEOUT_S = 20
RUN_TIMEOUT_S = 240
SEED = 1

pytestmark = pytest.mark.slow


def plan_program(out: Path, model: Path, *flags: str) -> Path:
    """`plan MODEL --cluster cpu-hetero-4 FLAGS -o OUT`; the emitted program's folder."""
    proc = run_plan_cli(str(model), "--cluster", str(CPU4), "-o", str(out), *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "program"


def train_program(program: Path, out: Path, steps: int, *flags: str, ok: bool = True,
                  max_restarts: int = 0) -> subprocess.CompletedProcess[str]:
    """Run the emitted train.py on as many processes as its plan has ranks, with torchrun (standalone,
    `max_restarts` restarts), `--steps STEPS --out OUT --save-final FLAGS`; asserts it succeeded (`ok`)
    or failed."""
    world = json.loads((program / "plan.json").read_text())["world_size"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("TRITON_INTERPRET", None)     # the kernels' torch references: interpreted Triton is slow
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "--max-restarts", str(max_restarts), str(program / "train.py"), "--steps", str(steps),
           "--seed", str(SEED), "--timeout", str(COLLECTIVE_TIMEOUT_S), "--out", str(out), "--save-final", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=REPO,
                          start_new_session=True)
    assert (proc.returncode == 0) == ok, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def losses_by_step(out: Path, skip_lines: int = 0) -> dict[int, float]:
    """Step -> loss of OUT/metrics.jsonl after its first `skip_lines` lines (every rank logs the same)."""
    return losses_of(read_metrics(out / "metrics.jsonl")[skip_lines:])


def losses_of(records: list[dict]) -> dict[int, float]:
    """Step -> loss of metrics records, each step logged alike by every rank (checked)."""
    by_step: dict[int, set[float]] = {}
    for record in records:
        by_step.setdefault(record["step"], set()).add(record["loss"])
    assert all(len(losses) == 1 for losses in by_step.values()), by_step
    return {step: losses.pop() for step, losses in sorted(by_step.items())}


def _lines(out: Path) -> int:
    return len(read_metrics(out / "metrics.jsonl"))


def _assert_same_final_parameters(out: Path, expected: Path, ranks: int) -> None:
    for rank in range(ranks):
        got = torch.load(out / "final" / f"rank{rank}.pt")
        want = torch.load(expected / "final" / f"rank{rank}.pt")
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), (rank, name)


def _folders(root: Path) -> list[str]:
    return sorted((p.name for p in root.iterdir()), key=lambda name: checkpoint.step_of(Path(name)))


@pytest.fixture(scope="module")
def mlp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The MLP in 2 stages on the two fast devices (2 ranks, AdamW), and its uninterrupted 12-step run."""
    root = tmp_path_factory.mktemp("mlp2")
    program = plan_program(root / "plan", MLP, "--stages", "2")
    train_program(program, root / "full", 12)
    return program, root / "full"


def _resume_matches_uninterrupted(program: Path, full: Path, work: Path, ranks: int) -> Path:
    """6 steps with a checkpoint every 3, stopped; `--resume` to 12: equal to `full`, bit for bit."""
    train_program(program, work, 6, "--checkpoint-every", "3")
    assert _folders(work / "ckpt") == ["step_3", "step_6"]
    first_half = _lines(work)
    proc = train_program(program, work, 12, "--checkpoint-every", "3", "--resume")
    assert "resumed from" in proc.stdout and "step_6 at step 6" in proc.stdout
    resumed, expected = losses_by_step(work, first_half), losses_by_step(full)
    assert sorted(resumed) == list(range(6, 12))
    assert resumed == {step: expected[step] for step in range(6, 12)}      # exact floats
    _assert_same_final_parameters(work, full, ranks)
    return work / "ckpt"


def test_resume_is_bit_exact_under_adamw(mlp2: tuple[Path, Path], tmp_path: Path) -> None:
    program, full = mlp2
    root = _resume_matches_uninterrupted(program, full, tmp_path / "run", ranks=2)
    assert _folders(root) == ["step_6", "step_9", "step_12"]         # --keep-checkpoints 3: step_3 deleted
    marker = checkpoint.read_marker(root / "step_12")
    assert marker is not None and marker["step"] == 12 and marker["world_size"] == 2


def test_resume_is_bit_exact_with_powersgd_on_two_replicas(tmp_path: Path) -> None:
    program = plan_program(tmp_path / "plan", MLP, "--stages", "2", "--use-all-devices", "--compression", "powersgd")
    plan = json.loads((program / "plan.json").read_text())
    compressed = [g["index"] for g in plan["grad_groups"] if g["compressor"] == "powersgd"]
    assert compressed and plan["world_size"] == 4
    full = tmp_path / "full"
    train_program(program, full, 12)
    root = _resume_matches_uninterrupted(program, full, tmp_path / "run", ranks=4)
    names = checkpoint_state.read_metadata(root / "step_6").state_dict_metadata
    group, member = compressed[0], next(g["ranks"][0] for g in plan["grad_groups"] if g["index"] == compressed[0])
    assert f"compressor/{group}/rank{member}/q/0" in names            # the state the resumed run continued with
    assert f"compressor/{group}/rank{member}/error/0" in names


def test_a_crash_during_a_save_leaves_the_previous_checkpoint(mlp2: tuple[Path, Path], tmp_path: Path) -> None:
    program, full = mlp2
    work = tmp_path / "run"
    proc = train_program(program, work, 9, "--checkpoint-every", "3", "--fault", "crash-in-save:fast/0:1@6", ok=False)
    root = work / "ckpt"
    assert checkpoint.is_complete(root / "step_3")
    assert (root / "step_6").is_dir() and not checkpoint.is_complete(root / "step_6"), proc.stderr[-2000:]
    assert checkpoint.latest_complete(root) == root / "step_3"
    before = _lines(work)
    proc = train_program(program, work, 9, "--checkpoint-every", "3", "--resume")
    assert "step_3 at step 3" in proc.stdout
    resumed, expected = losses_by_step(work, before), losses_by_step(full)
    assert resumed == {step: expected[step] for step in range(3, 9)}
    assert checkpoint.is_complete(root / "step_6") and checkpoint.is_complete(root / "step_9")
