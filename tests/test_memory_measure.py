"""A rank's memory, measured exactly, and a rank that runs out of it.

- VmHWM is the process's own peak: a child that allocates 200 MiB reports about that much more, while the
  parent's figure stays where it was (the child's ru_maxrss starts from the parent's instead);
- every metrics line holds the measured peak beside the plan's estimate for the rank, added by the log
  itself; on CUDA the allocator's allocated and reserved peaks;
- RLIMIT_DATA makes a real allocation fail (torch's CPU allocator, Python's MemoryError), recognised and
  sized; lifting it lets the same allocation succeed;
- `plan run --emulate-memory` holds a CPU rank to its device's memory from the spec: a model whose data
  pipeline needs more than the plan counted fails on the small device with one line (rank, device, stage,
  estimate, capacity, peak), and every rank exits non-zero within the process-group timeout, also a peer
  under an agent of its own (launch.sh on two nodes) that only learns of it from gloo.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from backends.torchdist.program import memory, metrics
from backends.torchdist.program.process_group import Context
from planner.core.ir import Plan
from tests.helpers import REPO, run_plan_cli

MIB = 1 << 20
CHILD_BLOCK_BYTES = 200 * MIB
COLLECTIVE_TIMEOUT_S = 20
RUN_TIMEOUT_S = 240           # start-up, tracing and the failure, on two busy cores

# A model whose batch() works in a 512 MiB table: the data pipeline's memory, which the plan does not count.
TRANSIENT_MODEL = '''\
import torch
import torch.nn.functional as F
from torch import nn

TABLE_BYTES = 512 << 20


def model():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def batch(batch_size, step):
    table = torch.ones(TABLE_BYTES // 4)
    x = torch.randn(batch_size, 16, generator=torch.Generator().manual_seed(step + int(table[0])))
    return (x,), x[:, :4].argmax(dim=-1)


def loss_fn(output, target):
    return F.cross_entropy(output, target)
'''
# A roomy device and a small one (0.6 GiB: the plan's 0.4 GiB fits it, the table on top does not).
SMALL_MEMORY_SPEC = """\
name: cpu-small-memory
devices:
  cpu-roomy: {base: CPU, memory_gib: 64}
  cpu-small: {base: CPU, memory_gib: 0.6}
nodes:
  - {name: roomy, count: 1, device: cpu-roomy, per_node: 1}
  - {name: small, count: 1, device: cpu-small, per_node: 1}
network:
  inter_node: {kind: loopback, bandwidth_gbit_s: 10, latency_us: 20}
"""


def _python(code: str, env: dict[str, str] | None = None, timeout_s: float = 120) -> dict:
    """Run `code` in a fresh interpreter with this checkout importable; the JSON it prints last."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- measured


def test_vmhwm_is_this_process_own_peak_not_the_parent_s():
    parent_before = memory.own_peak_resident_bytes()
    child = _python(f"""
import json, resource
from backends.torchdist.program import memory
before = memory.own_peak_resident_bytes()
inherited = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
block = b"\\x01" * {CHILD_BLOCK_BYTES}
print(json.dumps({{"before": before, "after": memory.own_peak_resident_bytes(), "ru_maxrss": inherited}}))
""")
    parent_after = memory.own_peak_resident_bytes()
    grew = child["after"] - child["before"]
    assert 0.95 * CHILD_BLOCK_BYTES <= grew <= CHILD_BLOCK_BYTES + 40 * MIB, grew / MIB
    assert abs(parent_after - parent_before) < 40 * MIB, (parent_before / MIB, parent_after / MIB)
    if parent_before > child["before"] + 100 * MIB:       # then ru_maxrss shows the parent's, VmHWM does not
        assert child["ru_maxrss"] >= parent_before - 10 * MIB > child["before"]


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory) -> tuple[Path, Plan]:
    """The transient-table model planned on the roomy + small cluster (one pipeline of two stages)."""
    folder = tmp_path_factory.mktemp("small-memory")
    (folder / "model.py").write_text(TRANSIENT_MODEL)
    (folder / "spec.yaml").write_text(SMALL_MEMORY_SPEC)
    out = folder / "out"
    proc = run_plan_cli(str(folder / "model.py"), "--cluster", str(folder / "spec.yaml"), "--global-batch", "8",
                        "--use-all-devices", "--no-runners-up", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    p = Plan.load(out)
    assert [p.stage_of_rank(r)[1].device_type for r in range(p.world_size)] == ["cpu-roomy", "cpu-small"]
    assert p.estimates.memory_bytes[1] <= 0.9 * p.estimates.capacity_bytes[1] < p.estimates.memory_bytes[1] + 512 * MIB
    return out, p


def test_each_metrics_line_holds_the_measured_peak_beside_the_plan_s_estimate(small_plan, tmp_path):
    _, p = small_plan
    replica, stage = p.stage_of_rank(1)
    log = metrics.MetricsLog(tmp_path, Context(1, p.world_size, replica, stage, torch.device("cpu"), {}))
    before = memory.own_peak_resident_bytes()
    log.log(step=0, loss=1.0)
    after = memory.own_peak_resident_bytes()
    log.close()
    [line] = metrics.read_metrics(tmp_path / metrics.METRICS_FILE)
    assert before <= line["peak_memory_bytes"] <= after
    assert line["peak_reserved_bytes"] is None
    assert line["estimated_memory_bytes"] == stage.memory_bytes == p.estimates.memory_bytes[1]
    assert line["step"] == 0 and line["rank"] == 1 and line["device"] == stage.device_label


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_allocator_s_allocated_and_reserved_peaks():
    device = torch.device("cuda", 0)
    block = torch.ones(64 * MIB // 4, device=device)
    fields = memory.peak_memory_fields(device)
    assert fields["peak_memory_bytes"] is not None and fields["peak_reserved_bytes"] is not None
    assert fields["peak_memory_bytes"] >= block.numel() * 4
    assert fields["peak_reserved_bytes"] >= fields["peak_memory_bytes"]
    assert memory.measured_peak_bytes(device) == fields["peak_reserved_bytes"]


# ----------------------------------------------------------------------------- running out


def test_a_data_limit_makes_real_allocations_fail_and_lifting_it_lets_them_through():
    seen = _python("""
import json, re
import torch
from backends.torchdist.program import memory
data_bytes = int(re.search(r"VmData:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
limit = memory.limit_data_bytes(data_bytes + (64 << 20))
out = {}
try:
    torch.ones(256 << 18)
except RuntimeError as exc:
    out["torch"] = [memory.is_out_of_memory(exc), memory.failed_allocation_bytes(exc)]
try:
    bytearray(256 << 20)
except MemoryError as exc:
    out["python"] = memory.is_out_of_memory(exc)
limit.lift()
out["after_lift"] = int(torch.ones(256 << 18).numel())
out["not_memory"] = memory.is_out_of_memory(RuntimeError("gloo: connection closed"))
print(json.dumps(out))
""")
    assert seen["torch"] == [True, 256 * MIB]
    assert seen["python"] is True
    assert seen["after_lift"] == 256 << 18
    assert seen["not_memory"] is False


def test_an_allocation_failure_under_a_model_file_error_is_still_found():
    from planner.core.errors import ModelFileError
    try:
        try:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1024 bytes.")
        except RuntimeError as inner:
            raise ModelFileError("batch() failed", file="model.py") from inner
    except ModelFileError as outer:
        failed = memory.allocation_failure(outer)
    assert isinstance(failed, RuntimeError) and memory.failed_allocation_bytes(failed) == 1024
    assert memory.allocation_failure(ModelFileError("no batch()")) is None


def _oom_line_fields(text: str) -> None:
    assert "rank 1 (replica 0 stage 1 on small/1:0, cpu-small, cpu) ran out of memory allocating 512 MiB" in text
    estimate, capacity, peak = (int(v.replace(",", "")) for v in re.search(
        r"the plan estimates ([\d,]+) MiB of the device's ([\d,]+) MiB, the rank had reached a peak of "
        r"([\d,]+) MiB", text).groups())
    assert capacity == round(0.6 * 1024) and 0 < estimate < capacity and 0 < peak < capacity


@pytest.mark.slow
def test_a_rank_out_of_its_emulated_memory_says_so_and_every_rank_exits_within_the_timeout(small_plan):
    out, p = small_plan
    path = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "planner.cli", "run", str(out), "--steps", "3", "--emulate-memory",
                           "--timeout", str(COLLECTIVE_TIMEOUT_S)], capture_output=True, text=True, cwd=REPO,
                          timeout=RUN_TIMEOUT_S, env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
                          start_new_session=True)
    ended = time.time()
    assert time.monotonic() - start < RUN_TIMEOUT_S
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("plan run: rank 1 (replica 0 stage 1 on small/1:0, cpu-small) exited with code 1 "
                               "before its first step: train.py: plan.json: estimates.memory_bytes[1]: "), lines
    _oom_line_fields(lines[0])
    log = Path(lines[0].rsplit("(logs: ", 1)[1].rstrip(")"))
    assert log.parts[-2] == "1" and "ran out of memory" in log.read_text()     # that rank's full log, on disk
    assert ended - log.stat().st_mtime < COLLECTIVE_TIMEOUT_S                 # the others stopped within it
    launcher = (out / "run" / "logs" / "launcher.log").read_text()
    report = launcher[launcher.rindex("Failures:"):]            # torchrun's failure report: every rank's end
    codes = {int(r): int(c) for r, c in re.findall(r"^\s*rank\s*:\s*(\d+).*?^\s*exitcode\s*:\s*(-?\d+)",
                                                   report, re.S | re.M)}
    assert set(codes) == {0, 1} and codes[1] == 1 and codes[0] != 0, codes
    assert "plan run: no step completed; metrics: " in proc.stdout


@pytest.mark.slow
def test_a_peer_under_its_own_agent_fails_on_the_out_of_memory_rank_s_death(small_plan, tmp_path):
    """Two nodes, two torchrun agents (launch.sh NODE_RANK=k): nothing but gloo tells node 0's rank. The
    rendezvous store lives here, so neither agent's end takes the other's store along."""
    import datetime

    import torch.distributed as dist

    out, p = small_plan
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=RUN_TIMEOUT_S))
    port = str(store.port)
    path = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x)
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "HETPLAN_NODE_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=path, OMP_NUM_THREADS="1", PYTHON=sys.executable, MASTER_ADDR="127.0.0.1",
               MASTER_PORT=port, **{memory.EMULATE_ENV: "1"})
    args = [str(out / "program" / "launch.sh"), "--steps", "3", "--out", str(tmp_path / "run"),
            "--timeout", str(COLLECTIVE_TIMEOUT_S)]
    agents = []
    for k in (0, 1):
        with open(tmp_path / f"{k}.log", "wb") as f:
            agents.append(subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env={**env, "NODE_RANK": str(k)},
                                           start_new_session=True))
    ended_s: dict[int, float] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while len(ended_s) < len(agents) and time.monotonic() < deadline:
            for k, agent in enumerate(agents):
                if k not in ended_s and agent.poll() is not None:
                    ended_s[k] = time.monotonic()
            time.sleep(0.1)
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
            a.wait()
    codes = [a.returncode for a in agents]
    logs = {k: (tmp_path / f"{k}.log").read_text(errors="replace") for k in (0, 1)}
    assert codes[0] != 0 and codes[1] != 0, logs
    oom = [ln for ln in logs[1].splitlines() if "ran out of memory" in ln]
    assert len(oom) == 1, logs[1][-3000:]
    _oom_line_fields(oom[0])
    said = [ln for ln in logs[0].splitlines() if "train.py: rank 0" in ln]
    assert said and 'train.py", line' not in logs[0], logs[0][-3000:]     # one line, not the program's traceback
    assert len(ended_s) == 2 and ended_s[0] - ended_s[1] < COLLECTIVE_TIMEOUT_S + 5, ended_s   # within the timeout
