"""A planning step in a forked child (planner.core.forked): its value or its error comes back, and the
child never outlives the block, whatever the parent's own step does."""

from __future__ import annotations

import os
import time

import pytest

from planner.core import forked as forked_module
from planner.core.errors import PlanningError
from planner.core.forked import can_fork, forked, forked_until

needs_fork = pytest.mark.skipif(not can_fork(), reason="fork, or a second core, is missing here")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@needs_fork
def test_the_value_is_made_in_another_process_from_the_state_at_the_fork():
    table = {"rows": list(range(1000))}          # the child's copy of this process's state: nothing sent

    def work() -> tuple[int, int]:
        return os.getpid(), sum(table["rows"])

    with forked(work) as child:
        table["rows"] = []                       # the parent's later changes are not the child's
        pid, total = child.result()
    assert pid != os.getpid() and total == sum(range(1000))


@needs_fork
def test_an_error_in_the_child_is_raised_in_the_parent_with_its_fields():
    def fails() -> None:
        raise PlanningError("no baseline fits", file="spec.yaml", field="nodes", fix="add a device")

    with forked(fails) as child, pytest.raises(PlanningError) as caught:
        child.result()
    assert (caught.value.message, caught.value.file, caught.value.field, caught.value.fix) == (
        "no baseline fits", "spec.yaml", "nodes", "add a device")


@needs_fork
def test_an_error_that_does_not_pickle_still_comes_back():
    class Local(Exception):                      # a class defined here: pickling it fails
        pass

    def fails() -> None:
        raise Local("unpicklable")

    with forked(fails) as child, pytest.raises(RuntimeError, match="Local: unpicklable"):
        child.result()


@needs_fork
def test_a_child_that_dies_without_a_result_is_an_error_not_a_hang():
    with forked(lambda: os._exit(9)) as child, pytest.raises(RuntimeError, match="died without a result"):
        child.result()


@needs_fork
def test_leaving_the_block_kills_and_reaps_a_child_still_working():
    seen: list[int] = []

    def slow() -> None:
        time.sleep(60)

    start = time.monotonic()
    with pytest.raises(ValueError, match="the parent's own step failed"):
        with forked(slow) as child:
            seen.append(child._pid or 0)
            raise ValueError("the parent's own step failed")
    assert time.monotonic() - start < 10
    assert seen[0] > 0 and _gone(seen[0])
    with pytest.raises(ChildProcessError):      # reaped: no zombie left to wait for
        os.waitpid(seen[0], os.WNOHANG)


def test_without_a_second_core_the_step_runs_here_when_asked(monkeypatch):
    monkeypatch.setattr(forked_module.os, "cpu_count", lambda: 1)
    calls: list[int] = []

    def work() -> int:
        calls.append(os.getpid())
        return 7

    with forked(work) as child:
        assert calls == []                       # nothing ran yet: the value is made on `result()`
        assert child.result() == 7
    assert calls == [os.getpid()]


@needs_fork
def test_a_child_stuck_past_the_wait_is_killed_and_the_step_runs_here():
    parent = os.getpid()

    def stuck_in_the_child() -> int:
        if os.getpid() != parent:
            time.sleep(60)                       # as a child blocked on a lock the fork left held
        return os.getpid()

    start = time.monotonic()
    with forked(stuck_in_the_child) as child:
        pid = child._pid
        assert child.result(timeout_s=0.5) == parent
    assert time.monotonic() - start < 10 and pid is not None and _gone(pid)


def test_a_caller_that_must_not_fork_keeps_the_step_here():
    with forked(os.getpid, enabled=False) as child:
        assert child._pid is None and child.result() == os.getpid()


@needs_fork
def test_a_plan_is_the_same_whether_its_steps_ran_forked_or_here(monkeypatch):
    from planner.api import PlanOptions, RunControls, plan
    from tests.helpers import CLUSTERS, EXAMPLES

    forks: list[bool] = []
    real_fork = forked_module.os.fork

    def counted_fork() -> int:
        forks.append(True)
        return real_fork()

    monkeypatch.setattr(forked_module.os, "fork", counted_fork)

    def made(controls: RunControls) -> object:
        return plan(EXAMPLES / "gpt" / "model.py", CLUSTERS / "cpu-hetero-4.yaml",
                    PlanOptions(global_batch=32, stages=2), controls).plan

    forked_plan = made(RunControls())
    assert len(forks) == 3                      # the search's later builds, the runners-up and the verifier
    here = made(RunControls(fork_steps=False))
    assert len(forks) == 3                      # none more
    assert forked_plan == here
    assert here.solver.runners_up and here.comm is not None and here.comm.digests    # both steps ran


# ----- a child that prepares at once and finishes on a message (forked_until) ---------------------------

@needs_fork
def test_the_child_prepares_before_the_message_and_finishes_with_it():
    parent = os.getpid()
    state = {"rows": [1, 2, 3]}

    def prepare() -> tuple[int, int]:
        return os.getpid(), sum(state["rows"])

    def finish(prepared: tuple[int, int], message: int) -> tuple[int, int, int]:
        pid, total = prepared
        return pid, os.getpid(), total * message

    with forked_until(prepare, finish) as child:
        state["rows"] = []                       # after the fork: not the child's
        child.send(10)
        prepared_in, finished_in, value = child.result(10)
    assert prepared_in == finished_in != parent and value == 60


@needs_fork
def test_an_error_while_preparing_is_raised_only_when_a_message_asks():
    def prepare() -> None:
        raise PlanningError("cannot trace at one row", file="model.py", field="model", fix="x")

    with forked_until(prepare, lambda prepared, message: message) as child:
        pid = child._pid
    assert pid is not None and _gone(pid)       # left without asking: nothing raised, the child reaped
    with forked_until(prepare, lambda prepared, message: message) as child, \
            pytest.raises(PlanningError, match="cannot trace at one row"):
        child.send("plan")
        child.result()


@needs_fork
def test_the_message_arrives_while_a_later_child_holds_the_pipe_open():
    """A child forked after this one inherits the parent's end of the message pipe: the message is read by
    its length, so the answer does not wait for that later child to end."""
    with forked_until(lambda: 2, lambda prepared, message: prepared * message) as child:
        with forked(lambda: time.sleep(30)):       # holds a copy of the message pipe's write end
            start = time.monotonic()
            child.send(21)
            assert child.result(timeout_s=20) == 42
            assert time.monotonic() - start < 10


@needs_fork
def test_the_child_prints_nothing(capfd):
    def prepare() -> int:
        print("a warning the parent printed already")
        os.write(2, b"and one on stderr\n")
        return 1

    with forked_until(prepare, lambda prepared, message: prepared + message) as child:
        child.send(1)
        assert child.result(10) == 2
    out, err = capfd.readouterr()
    assert "warning" not in out and "stderr" not in err


def test_without_a_fork_both_steps_run_here_on_the_message(monkeypatch):
    monkeypatch.setattr(forked_module.os, "cpu_count", lambda: 1)
    calls: list[str] = []

    def prepare() -> int:
        calls.append("prepare")
        return 5

    with forked_until(prepare, lambda prepared, message: (os.getpid(), prepared + message)) as child:
        child.send(1)
        assert calls == []                       # made on `result()`
        assert child.result() == (os.getpid(), 6)
    assert calls == ["prepare"]
