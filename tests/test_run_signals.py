"""`plan run` under signals and deaths: nothing orphaned, one line per death, loopback only, runs kept.

Each test runs a 4-rank plan (the MLP on cpu-hetero-4, 2 stages x 2 replicas) with a marker in the
environment of `plan run`, which torchrun and every worker inherit: the test lists the run's processes
by it (/proc/<pid>/environ), and kills whatever is left at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from planner.core.ir import Plan
from tests.helpers import CLUSTERS, EXAMPLES, REPO, read_metrics, run_plan_cli, sigint_handled_by

MLP = EXAMPLES / "mlp" / "model.py"
SURVIVE_S = 10.0              # no process of the run may outlive its launcher by more
START_TIMEOUT_S = 180         # until every rank has logged a step, on two busy cores
LONG_RUN_STEPS = 100_000      # runs the tests end themselves
MARKER = "HETPLAN_TEST_RUN_MARKER"


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> tuple[Path, Plan]:
    out = tmp_path_factory.mktemp("signals") / "out"
    proc = run_plan_cli(str(MLP), "--cluster", str(CLUSTERS / "cpu-hetero-4.yaml"), "--global-batch", "16",
                        "--stages", "2", "--micro-batch", "4", "--use-all-devices", "--no-runners-up", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    return out, Plan.load(out)


@dataclass
class Run:
    proc: subprocess.Popen
    out: Path
    marker: str

    def processes(self) -> dict[int, dict[str, str]]:
        """pid -> environment of every live process of this run (plan run, torchrun, workers)."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                raw = (entry / "environ").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
            if env.get(MARKER) == self.marker and state != "Z":
                found[int(entry.name)] = env
        return found

    def worker(self, rank: int) -> int:
        return next(pid for pid, env in self.processes().items() if env.get("RANK") == str(rank)
                    and "TORCHELASTIC_RUN_ID" in env)

    def agent(self) -> int:
        return next(pid for pid in self.processes()
                    if b"torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes())

    def wait_until_training(self, world: int) -> None:
        """Until every rank has logged its first step."""
        deadline = time.monotonic() + START_TIMEOUT_S
        path = self.out / "run" / "metrics.jsonl"
        while time.monotonic() < deadline:
            if path.exists() and len({m["rank"] for m in read_metrics(path)}) == world:
                return
            assert self.proc.poll() is None, self.proc.communicate()[1]
            time.sleep(0.2)
        raise TimeoutError("the run did not start training")

    def gone_within(self, seconds: float) -> dict[int, dict[str, str]]:
        """The run's processes still alive after `seconds` (none, hopefully)."""
        deadline = time.monotonic() + seconds
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.processes()


@pytest.fixture
def start_run(planned, tmp_path) -> Iterator:
    runs: list[Run] = []

    def start(*args: str, steps: int = LONG_RUN_STEPS, out: Path | None = None,
              sigint: signal.Handlers = signal.SIG_DFL) -> Run:
        """`plan run` of a copy of the plan, started with SIGINT's disposition `sigint` (not the suite's own:
        a suite started in the background of a shell without job control has SIGINT ignored)."""
        if out is None:
            out = tmp_path / "out"
            shutil.copytree(planned[0], out)
        marker = uuid.uuid4().hex
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, MARKER: marker, "PYTHONPATH": path}
        with sigint_handled_by(sigint):
            proc = subprocess.Popen([sys.executable, "-m", "planner.cli", "run", str(out), "--steps", str(steps),
                                     *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                    cwd=REPO, start_new_session=True)
        runs.append(Run(proc, out, marker))
        return runs[-1]

    yield start
    for run in runs:                        # leftovers of a failed test: killed, every child reaped
        for pid in run.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if run.proc.poll() is None:
            run.proc.kill()
        run.proc.communicate()


def _stderr_lines(run: Run, timeout_s: float = 60) -> list[str]:
    _, err = run.proc.communicate(timeout=timeout_s)
    return [ln for ln in err.splitlines() if ln.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_sigterm_or_sigint_to_plan_run_stops_torchrun_and_every_worker(start_run, planned, sig):
    # started with SIGINT ignored, SIGTERM's run keeps ignoring it, as a background job of a shell does
    run = start_run(sigint=signal.SIG_IGN if sig == signal.SIGTERM else signal.SIG_DFL)
    world = planned[1].world_size
    run.wait_until_training(world)
    assert len(run.processes()) == world + 2          # plan run, torchrun, the workers
    if sig == signal.SIGTERM:
        run.proc.send_signal(signal.SIGINT)
        logged = len(read_metrics(run.out / "run" / "metrics.jsonl"))
        deadline = time.monotonic() + START_TIMEOUT_S      # two more steps of every rank after the SIGINT
        while len(read_metrics(run.out / "run" / "metrics.jsonl")) < logged + 2 * world:
            assert run.proc.poll() is None and time.monotonic() < deadline, "the ignored SIGINT stopped the run"
            time.sleep(0.2)
        assert len(run.processes()) == world + 2
    run.proc.send_signal(sig)
    assert run.gone_within(SURVIVE_S) == {}
    lines = _stderr_lines(run)
    assert run.proc.returncode == 128 + sig
    assert len(lines) == 1 and lines[0].startswith(f"plan run: stopped by {sig.name}"), lines


@pytest.mark.slow
def test_sigkill_to_plan_run_leaves_no_process_behind(start_run, planned):
    run = start_run()
    run.wait_until_training(planned[1].world_size)
    run.proc.kill()
    assert run.gone_within(SURVIVE_S) == {}


@pytest.mark.slow
def test_sigkill_to_the_torchrun_agent_takes_its_workers_along(start_run, planned):
    run = start_run()
    run.wait_until_training(planned[1].world_size)
    os.kill(run.agent(), signal.SIGKILL)
    assert run.gone_within(SURVIVE_S) == {}
    lines = _stderr_lines(run)
    assert run.proc.returncode == 1
    assert lines == [f"plan run: the torchrun agent was killed by SIGKILL; its workers stopped with it "
                     f"(logs: {run.out / 'run' / 'logs'})"], lines


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_in_one_line_naming_it(start_run, planned):
    plan_ = planned[1]
    run = start_run()
    run.wait_until_training(plan_.world_size)
    victim = 2
    os.kill(run.worker(victim), signal.SIGKILL)
    assert run.gone_within(60) == {}                                    # every other rank stops too
    lines = _stderr_lines(run)
    assert run.proc.returncode == 1 and len(lines) == 1, lines
    _, stage = plan_.stage_of_rank(victim)
    assert lines[0].startswith(f"plan run: rank {victim} (replica 1 stage {stage.index} on {stage.device_label}, "
                               f"{stage.device_type}) was killed by SIGKILL after step "), lines
    log = Path(lines[0].rsplit("(logs: ", 1)[1].rstrip(")"))
    assert log.is_file() and log.parts[-2] == str(victim)               # that rank's full log, on disk


@pytest.mark.slow
def test_a_hung_rank_is_detected_within_the_timeout(start_run, planned):
    plan_ = planned[1]
    run = start_run("--timeout", "10")
    run.wait_until_training(plan_.world_size)
    hung = run.worker(1)
    os.kill(hung, signal.SIGSTOP)                                       # alive, but answers nobody
    start = time.monotonic()
    lines = _stderr_lines(run, timeout_s=120)
    assert time.monotonic() - start < 60
    assert run.proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("plan run: rank "), lines
    assert run.gone_within(SURVIVE_S) == {}
    logs = {log.parts[-2]: log.read_text(errors="replace")
            for log in (run.out / "run" / "logs").glob("*/attempt_*/*/stderr.log")}
    assert len(logs) == plan_.world_size
    for rank, text in logs.items():     # each rank that waited in vain says so in one line, not a traceback
        if rank != "1":
            assert "Traceback" not in text and "train.py: rank " in text, (rank, text[-2000:])


def _listening(pids: list[int]) -> list[tuple[str, int]]:
    """(local address in /proc/net hex, pid) of every listening TCP socket the processes hold."""
    inodes = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:               # state LISTEN
                found.append((fields[1].rsplit(":", 1)[0], inodes[fields[9]]))
    return found


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


@pytest.mark.slow
def test_a_single_machine_run_listens_on_loopback_only(start_run, planned):
    run = start_run()
    run.wait_until_training(planned[1].world_size)
    pids = list(run.processes())
    sockets = _listening(pids)
    assert {pid for _, pid in sockets} >= {run.proc.pid}                # the store, in plan run itself
    assert len({pid for _, pid in sockets}) == planned[1].world_size + 1    # and gloo in every worker
    assert {address for address, _ in sockets} <= LOOPBACK, sockets
    run.proc.send_signal(signal.SIGTERM)
    assert run.gone_within(SURVIVE_S) == {}


@pytest.mark.slow
def test_a_second_run_keeps_the_first_runs_metrics_and_logs(start_run, planned):
    first = start_run(steps=2)
    assert first.proc.wait(timeout=START_TIMEOUT_S) == 0, first.proc.communicate()[1]
    first_metrics = (first.out / "run" / "metrics.jsonl").read_bytes()
    assert len(read_metrics(first.out / "run" / "metrics.jsonl")) == 2 * planned[1].world_size
    second = start_run(steps=1, out=first.out)
    assert second.proc.wait(timeout=START_TIMEOUT_S) == 0, second.proc.communicate()[1]
    kept = first.out / "runs" / "1"
    assert (kept / "metrics.jsonl").read_bytes() == first_metrics
    assert (kept / "logs" / "launcher.log").is_file()
    assert len(read_metrics(first.out / "run" / "metrics.jsonl")) == planned[1].world_size
