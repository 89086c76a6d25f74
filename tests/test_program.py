"""The emitted program as code: copied verbatim, placed by plan.devices, launched per node group.

- emit_program copies backends/torchdist/program/ byte for byte; nothing of a spec or a plan is written
  into Python, and launch.sh holds numbers and checked names only (hostile names are left out);
- launch.sh of a 1x4 T4 + 1x8 A100 plan starts 4 processes on node rank 0 and 8 on node rank 1 (run
  with a fake `python` on PATH that prints its arguments);
- placement maps (node rank, local rank) to plan ranks and refuses a wrong launch with one line;
- metrics lines are written whole: a short write (file size limit) is removed again, a full disk is one
  line, and readers skip an incomplete last line;
- lifeline: a child that asked for PR_SET_PDEATHSIG dies with its parent;
- importing the program leaves DCP, ZeRO's optimizer and FSDP's loss scaler to the ranks that use them.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends.torchdist.emit import emit_program, program_units
from backends.torchdist.launch_script import WITHHELD
from backends.torchdist.local_run import keep_previous_run
from backends.torchdist.program import layout, lifeline, metrics, placement
from planner.api import PlanOptions, plan
from planner.core.ir import Plan
from tests.helpers import EXAMPLES, REPO

MLP = EXAMPLES / "mlp" / "model.py"
T4_A100_SPEC = """\
name: t4-and-a100
nodes:
  - {name: t4, count: 1, device: T4, per_node: 4, intra_link: pcie3}
  - {name: a100, count: 1, device: A100-40GB, per_node: 8, intra_link: nvlink3}
network:
  inter_node: {kind: roce, bandwidth_gbit_s: 100, latency_us: 5}
"""
HOSTILE = 'pwn"""\nimport os; os.system("touch INJECTED")  # \\x1b[31m<script>alert(1)</script>'
FAKE_PYTHON = """\
#!/usr/bin/env bash
echo "HETPLAN_NODE_RANK=${HETPLAN_NODE_RANK:-} ARGS=$*"
"""


@pytest.fixture(scope="module")
def mixed_plan(tmp_path_factory) -> Plan:
    """MLP planned on 4 T4 + 8 A100 (two node groups, one node each), every device used."""
    spec = tmp_path_factory.mktemp("spec") / "t4-and-a100.yaml"
    spec.write_text(T4_A100_SPEC)
    p = plan(MLP, spec, PlanOptions(global_batch=96, use_all_devices=True, runners_up=False)).plan
    assert p.world_size == 12
    return p


def _hostile(p: Plan) -> Plan:
    """`p` with a hostile cluster name, node group name and device type name."""
    def stage(s):
        group, node, local = placement.parse_label(s.device_label)
        return dataclasses.replace(s, device_label=f"{HOSTILE}{group}/{node}:{local}", device_type=HOSTILE + "T4")
    replicas = tuple(dataclasses.replace(r, stages=tuple(stage(s) for s in r.stages)) for r in p.replicas)
    devices = tuple(f"{HOSTILE}{label}" for label in p.devices)
    inputs = dataclasses.replace(p.inputs, cluster_name=HOSTILE)
    return dataclasses.replace(p, replicas=replicas, devices=devices, inputs=inputs)


def test_the_program_is_the_package_copied_verbatim(tmp_path, mixed_plan):
    program = tmp_path / "program"
    emit_program(_hostile(mixed_plan), MLP, program)
    units = program_units()
    assert {u.name for u in units} >= {"train.py", "__init__.py", "pipeline.py", "placement.py"}
    for unit in units:
        assert (program / unit.name).read_bytes() == unit.read_bytes(), unit.name
    emitted = {p.name for p in program.iterdir() if p.is_file()}
    assert emitted == {u.name for u in units} | {"plan.json", "model.py", "launch.sh"}
    assert (program / "model.py").read_bytes() == MLP.read_bytes()
    assert Plan.load(program / "plan.json").inputs.cluster_name == HOSTILE   # data stays data
    for unit in units:                      # and no unit mentions a plan's values
        assert "pwn" not in unit.read_text()


# what a rank of a plan that neither saves, resumes, shards its optimizer state nor scales its loss never
# needs (DCP, torch.distributed.optim, FSDP's scaler): the units that use them import them on first use
ON_FIRST_USE = ("torch.distributed.checkpoint", "torch.distributed.optim", "torch.distributed.fsdp")


def test_the_program_imports_checkpoints_zero_and_loss_scaling_on_first_use(tmp_path, mixed_plan):
    emit_program(mixed_plan, MLP, tmp_path / "program")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    probe = f"import sys, program.train; print(sorted(m for m in {ON_FIRST_USE!r} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_launch_script_holds_only_checked_names(tmp_path, mixed_plan):
    program = tmp_path / "program"
    emit_program(_hostile(mixed_plan), MLP, program)
    text = (program / "launch.sh").read_text()
    assert "pwn" not in text and "INJECTED" not in text and "\x1b" not in text and WITHHELD in text
    assert subprocess.run(["bash", "-n", str(program / "launch.sh")]).returncode == 0
    assert (program / "launch.sh").stat().st_mode & stat.S_IXUSR


def _fake_launch(program: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    full = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "PYTHON", "MASTER_ADDR")}
    full.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env)
    return subprocess.run([str(program / "launch.sh"), "--steps", "3"], capture_output=True, text=True,
                          env=full, timeout=30)


def test_launch_sh_starts_4_and_8_processes_on_the_two_nodes(tmp_path, mixed_plan):
    program = tmp_path / "program"
    emit_program(mixed_plan, MLP, program)
    nodes = placement.planned_nodes(mixed_plan)
    assert [(n.group, len(n.ranks)) for n in nodes] == [("t4", 4), ("a100", 8)]
    for node_rank, count in ((0, 4), (1, 8)):
        proc = _fake_launch(program, tmp_path, NODE_RANK=str(node_rank), MASTER_ADDR="10.0.0.1")
        assert proc.returncode == 0, proc.stderr
        assert f"HETPLAN_NODE_RANK={node_rank} " in proc.stdout
        assert f"--nnodes 2 --nproc-per-node {count} " in proc.stdout
        assert "--rdzv-endpoint 10.0.0.1:29500" in proc.stdout and proc.stdout.rstrip().endswith("--steps 3")
    alone = _fake_launch(program, tmp_path)                          # one machine: every process here
    assert "--standalone --nproc-per-node 12 --max-restarts 0 train.py --steps 3" in alone.stdout
    assert "HETPLAN_NODE_RANK= " in alone.stdout
    wrong = _fake_launch(program, tmp_path, NODE_RANK="2", MASTER_ADDR="10.0.0.1")
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr.strip() == "launch.sh: NODE_RANK=2 is not a node rank of this plan (0..1)"
    no_master = _fake_launch(program, tmp_path, NODE_RANK="0")
    assert no_master.returncode != 0 and "MASTER_ADDR" in no_master.stderr


# ----------------------------------------------------------------------------- placement

def _env(**values: int) -> dict[str, str]:
    names = {"node": "HETPLAN_NODE_RANK", "local": "LOCAL_RANK", "local_world": "LOCAL_WORLD_SIZE",
             "world": "WORLD_SIZE", "rank": "RANK"}
    return {names[k]: str(v) for k, v in values.items()}


def test_plan_rank_comes_from_node_rank_and_local_rank_not_torchruns_rank(mixed_plan):
    nodes = placement.planned_nodes(mixed_plan)
    for node in nodes:
        for local, expected in enumerate(node.ranks):
            # torchrun's RANK is deliberately wrong: its rendezvous may order the agents either way
            got = placement.resolve(mixed_plan, _env(node=node.node_rank, local=local, rank=99,
                                                     local_world=len(node.ranks), world=12))
            assert (got.rank, got.device_index, got.node) == (expected, node.local_devices[local], node)
    alone = placement.resolve(mixed_plan, _env(local=5, rank=7, world=12))   # no node rank: one machine
    assert (alone.rank, alone.node, alone.device_index) == (7, None, 5)


@pytest.mark.parametrize("env, expected", [
    (dict(node=0, local=0, local_world=3, world=12),
     "launch.sh: NODE_RANK: node rank 0 is node 0 of group t4 (T4): the plan runs 4 processes there, this "
     "agent started 3 (LOCAL_WORLD_SIZE) (fix: start this node with `NODE_RANK=0 ./launch.sh`)"),
    (dict(node=0, local=0, local_world=8, world=12),
     "the plan runs 8 on node rank 1"),
    (dict(node=1, local=0, local_world=8, world=16),
     "launch.sh: WORLD_SIZE: the plan runs 12 processes, torchrun started 16 (WORLD_SIZE) (fix: start each "
     "of the plan's nodes with `NODE_RANK=k ./launch.sh`, k in node ranks 0..1)"),
    (dict(node=2, local=0, local_world=4, world=12), "node rank 2 is not one of the plan's 2 nodes"),
    (dict(local=0, world=4, rank=0), "the plan runs 12 processes, torchrun started 4"),
])
def test_a_wrong_launch_is_one_line_with_the_fix(mixed_plan, env, expected):
    with pytest.raises(placement.LaunchError) as info:
        placement.resolve(mixed_plan, _env(**env))
    line = info.value.one_line()
    assert expected in line and "\n" not in line


@pytest.mark.parametrize("planned, found, found_gib, needed_gib, ok", [
    ("A100-40GB", "NVIDIA A100-SXM4-40GB", 39.4, 36.0, True),
    ("A100-40GB", "NVIDIA A10", 22.0, 36.0, False),          # A10 is not A100, and too small
    ("A10", "NVIDIA A100-SXM4-80GB", 79.0, 20.0, False),     # nor A100 an A10
    ("H200", "NVIDIA H200", 139.8, 126.0, True),
    ("T4", "Tesla T4", 14.6, 13.5, True),
    ("T4", "NVIDIA L4", 22.0, 13.5, False),
    ("my-gpu", "NVIDIA H100 80GB HBM3", 79.1, 70.0, True),   # a spec's own type: memory alone
    ("my-gpu", "NVIDIA H100 80GB HBM3", 79.1, 100.0, False),
])
def test_a_gpu_is_the_planned_type_by_name_and_memory(planned, found, found_gib, needed_gib, ok):
    why = placement.gpu_mismatch(planned, needed_gib * 2**30, found, int(found_gib * 2**30))
    assert (why is None) == ok, why


def test_layout_table_escapes_names_for_the_terminal(mixed_plan):
    text = layout.table(_hostile(mixed_plan))
    assert "\x1b" not in text and "\\x1b" in text
    assert len(text.splitlines()) == 2 + mixed_plan.world_size   # title, header, one line per rank
    assert "node rank" in text.splitlines()[1]


# ----------------------------------------------------------------------------- metrics

def test_readers_skip_an_incomplete_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 0, "rank": 0}\n{"step": 1, "rank": 0}\n{"step": 2, "ra')
    assert metrics.read_metrics(path) == [{"step": 0, "rank": 0}, {"step": 1, "rank": 0}]


FULL_DISK_SCRIPT = """\
import os, resource, sys
from backends.torchdist.program import metrics
from planner.core.errors import HetplanError
path = sys.argv[1]
fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))   # the disk is full after 100 bytes
line = ('{"step": %d, "pad": "' + 'x' * 20 + '"}\\n')
try:
    for step in range(10):
        metrics.append_line(fd, (line % step).encode(), path)
except HetplanError as exc:
    print(exc.one_line())
"""


def test_a_short_write_is_removed_again_and_reported_in_one_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    proc = subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, str(path)], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and "removed again" in proc.stdout and "fix: free disk space" in proc.stdout
    data = path.read_bytes()
    assert data.endswith(b"\n") and len(data) <= 100             # whole lines only: the torn one is gone
    assert [r["step"] for r in metrics.read_metrics(path)] == list(range(data.count(b"\n")))


def test_a_full_disk_is_one_line(tmp_path):
    fd = os.open("/dev/full", os.O_WRONLY | os.O_APPEND)
    try:
        with pytest.raises(metrics.MetricsWriteError) as info:
            metrics.append_line(fd, b'{"step": 0}\n', "/dev/full")
    finally:
        os.close(fd)
    assert "No space left on device" in info.value.one_line()


# ----------------------------------------------------------------------------- lifeline, runs kept

ORPHAN_SCRIPT = """\
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import signal, time
from backends.torchdist.program import lifeline
assert lifeline.die_with_parent(signal.SIGKILL)
print("armed", flush=True)
time.sleep(120)
'''])
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_child_with_a_lifeline_dies_with_its_parent():
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        time.sleep(3.0)                       # the child has imported and armed its lifeline
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        os.killpg(parent.pid, signal.SIGKILL) if _alive(parent.pid) else None
        parent.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_lifeline_requested_too_late_is_seen():
    assert lifeline.die_with_parent(0, expected_parent_pid=os.getppid()) is True
    assert lifeline.die_with_parent(0, expected_parent_pid=1 if os.getppid() != 1 else 2) is False


def test_an_earlier_run_is_moved_aside_never_deleted(tmp_path):
    run = tmp_path / "run"
    assert keep_previous_run(run) is None
    for expected in ("1", "2"):
        run.mkdir()
        (run / "metrics.jsonl").write_text(f"run {expected}\n")
        kept = keep_previous_run(run)
        assert kept == tmp_path / "runs" / expected and not run.exists()
        assert (kept / "metrics.jsonl").read_text() == f"run {expected}\n"

