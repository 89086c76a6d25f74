"""A plan over two node groups run as two torchrun agents on localhost, as launch.sh starts a cluster.

The cluster (written here) has a node of 1 CPU device and a node of 3, and the slower single device makes
the plan put rank 1 on node 0, so plan ranks are not node-major: torchrun's c10d rendezvous numbers its
agents in an order of its own, and only the program's own mapping (HETPLAN_NODE_RANK, LOCAL_RANK -> plan
rank) makes the run train exactly like one process. Each agent is started by launch.sh with NODE_RANK,
MASTER_ADDR and MASTER_PORT; a wrongly started agent fails with one line and the other does not hang.
The program also runs as `python -m program.train` from the plan directory (a one-device plan, no
torchrun) and as `torchrun program/train.py`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from backends.torchdist.emit import emit_program
from backends.torchdist.program import placement
from backends.torchdist.reference import train_reference
from planner.api import PlanOptions, plan
from planner.core.ir import Plan
from tests.helpers import EXAMPLES, REPO, read_metrics

MLP = EXAMPLES / "mlp" / "model.py"
STEPS = 5
COLLECTIVE_TIMEOUT_S = 30
AGENT_TIMEOUT_S = 240          # a whole agent: start-up, tracing and training on two busy cores
TWO_NODES_SPEC = """\
name: two-nodes
devices:
  cpu-small: {base: CPU, slowdown: 2.0}
  cpu-big: {base: CPU}
nodes:
  - {name: small, count: 1, device: cpu-small, per_node: 1, intra_link: shm}
  - {name: big, count: 1, device: cpu-big, per_node: 3, intra_link: shm}
network:
  inter_node: {kind: loopback, bandwidth_gbit_s: 10, latency_us: 20}
"""
ONE_DEVICE_SPEC = """\
name: one-cpu
nodes:
  - {name: cpu, count: 1, device: CPU, per_node: 1, intra_link: shm}
network:
  inter_node: {kind: loopback, bandwidth_gbit_s: 10, latency_us: 20}
"""


def _plan(tmp_path: Path, spec_text: str, **options) -> tuple[Path, Plan]:
    spec = tmp_path / "spec.yaml"
    spec.write_text(spec_text)
    p = plan(MLP, spec, PlanOptions(runners_up=False, **options)).plan
    out = tmp_path / "out"
    emit_program(p, MLP, out / "program")
    return out, p


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "HETPLAN_NODE_RANK", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "PYTHON": sys.executable, **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _finish(agents: list[subprocess.Popen], timeout_s: float) -> list[int]:
    """Every agent's exit code, killing the process groups of any still running at the deadline."""
    deadline = time.monotonic() + timeout_s
    try:
        return [a.wait(timeout=max(deadline - time.monotonic(), 0.1)) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
            a.wait()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> tuple[Path, Plan]:
    out, p = _plan(tmp_path_factory.mktemp("two-nodes"), TWO_NODES_SPEC, global_batch=16, stages=2,
                   micro_batch=4, use_all_devices=True)
    nodes = placement.planned_nodes(p)
    assert [len(n.ranks) for n in nodes] == [1, 3]
    node_major = [r for n in nodes for r in n.ranks]
    assert node_major != sorted(node_major), ("the spec is meant to give a plan whose ranks are not "
                                              f"node-major (slow single device first): {node_major}")
    return out, p


@pytest.mark.slow
def test_two_agents_started_by_launch_sh_train_exactly_like_one_process(two_nodes, tmp_path):
    out, p = two_nodes
    port = _free_port()
    run = tmp_path / "run"
    args = ["--steps", str(STEPS), "--seed", "3", "--out", str(run), "--save-final",
            "--timeout", str(COLLECTIVE_TIMEOUT_S)]
    agents = [_start([str(out / "program" / "launch.sh"), *args],
                     _env(NODE_RANK=str(k), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)), tmp_path / f"{k}.log")
              for k in (1, 0)]
    codes = _finish(agents, AGENT_TIMEOUT_S)
    logs = "".join((tmp_path / f"{k}.log").read_text()[-3000:] for k in (0, 1))
    assert codes == [0, 0], logs

    ref = train_reference(str(MLP), global_batch=p.global_batch, steps=STEPS, seed=3)
    lines = read_metrics(run / "metrics.jsonl")
    for step in range(STEPS):
        losses = {m["rank"]: m["loss"] for m in lines if m["step"] == step}
        assert sorted(losses) == list(range(p.world_size)), (step, sorted(losses))
        assert list(losses.values()) == pytest.approx([ref.losses[step]] * p.world_size, rel=1e-5), step
    seen = set()
    for rank in range(p.world_size):
        for name, value in torch.load(run / "final" / f"rank{rank}.pt").items():
            rel = float((value - ref.params[name]).norm() / ref.params[name].norm().clamp_min(1e-12))
            assert rel <= 1e-5, f"rank {rank} {name}: relative error {rel:.2e}"
            seen.add(name)
    assert seen == set(ref.params)


@pytest.mark.slow
def test_an_agent_started_on_the_wrong_node_fails_in_one_line_and_the_other_does_not_hang(two_nodes, tmp_path):
    out, p = two_nodes
    port = _free_port()
    args = ["--steps", "2", "--out", str(tmp_path / "run"), "--timeout", "15"]
    rdzv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "wrong-node"]
    # node rank 0 runs 1 process in the plan; this agent starts 3 (node rank 1's count) there
    wrong = _start([sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc-per-node", "3",
                    str(out / "program" / "train.py"), *args], _env(HETPLAN_NODE_RANK="0"), tmp_path / "0.log")
    right = _start([str(out / "program" / "launch.sh"), *args],
                   _env(NODE_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_ID="wrong-node"),
                   tmp_path / "1.log")
    start = time.monotonic()
    codes = _finish([wrong, right], 120)
    assert all(code != 0 for code in codes) and time.monotonic() - start < 120
    said = [ln for ln in (tmp_path / "0.log").read_text().splitlines() if ln.startswith("train.py:")]
    assert said == ["train.py: launch.sh: NODE_RANK: node rank 0 is node 0 of group small (cpu-small): the plan "
                    "runs 1 process there, this agent started 3 (LOCAL_WORLD_SIZE) (fix: start this node with "
                    "`NODE_RANK=0 ./launch.sh`; the plan runs 3 on node rank 1)"], said
    # the right node's processes see a world of 6, not the plan's 4: they stop at once, in one line too
    other = [ln for ln in (tmp_path / "1.log").read_text().splitlines() if ln.startswith("train.py:")]
    assert len(other) == 1 and "the plan runs 4 processes, torchrun started 6" in other[0], other
    for k in (0, 1):                       # no traceback of the program's own
        assert 'program/train.py", line' not in (tmp_path / f"{k}.log").read_text()


@pytest.mark.slow
def test_the_program_runs_as_a_module_and_as_a_torchrun_script(tmp_path):
    out, p = _plan(tmp_path, ONE_DEVICE_SPEC, global_batch=8)
    assert p.world_size == 1
    env = {k: v for k, v in _env().items() if k not in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    module = subprocess.run([sys.executable, "-m", "program.train", "--steps", "2", "--out", str(tmp_path / "a")],
                            cwd=out, env=env, capture_output=True, text=True, timeout=AGENT_TIMEOUT_S)
    assert module.returncode == 0, module.stderr[-3000:]
    assert "hetplan plan: 1 ranks on 1 node(s)" in module.stdout
    script = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                             str(out / "program" / "train.py"), "--steps", "2", "--out", str(tmp_path / "b")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=AGENT_TIMEOUT_S)
    assert script.returncode == 0, script.stderr[-3000:]
    a, b = (read_metrics(tmp_path / d / "metrics.jsonl") for d in "ab")
    assert [m["loss"] for m in a] == [m["loss"] for m in b] and len(a) == 2
