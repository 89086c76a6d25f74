"""The plan's stage and communication checks made in a child that traced the model at one row beside the
first trace (planner.checks_ahead): the same record and errors as made here, and only where it pays."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from planner import checks_ahead, frontend
from planner.api import PlanOptions, RunControls, plan
from planner.core import forked as forked_module
from planner.core.forked import can_fork
from planner.frontend.cluster import load_cluster
from tests.helpers import CLUSTERS, EXAMPLES

needs_fork = pytest.mark.skipif(not can_fork(), reason="fork, or a second core, is missing here")
GPT = EXAMPLES / "gpt" / "model.py"


def test_only_a_model_whose_training_state_outgrows_every_device_is_traced_ahead(tmp_path: Path):
    gpt = frontend.load_model_file(GPT)
    assert not checks_ahead.worth_tracing_ahead(gpt, load_cluster(CLUSTERS / "cpu-hetero-4.yaml"))
    small = tmp_path / "small.yaml"       # devices of 1 MiB: the example's 0.2 M parameters (3.5 MB) outgrow them
    small.write_text("name: small\ndevices:\n  tiny: {base: CPU, memory_gib: 0.001}\n"
                     "nodes:\n  - {name: n, count: 1, device: tiny, per_node: 2, intra_link: shm}\n"
                     "network:\n  inter_node: {kind: loopback, bandwidth_gbit_s: 10, latency_us: 20}\n")
    assert checks_ahead.worth_tracing_ahead(gpt, load_cluster(small))


def _plans(monkeypatch, micro_batch: int) -> tuple[object, object, list[int]]:
    """The plan made with the checks ahead (the model taken as large) and made all here; the forks of the first."""
    monkeypatch.setattr(checks_ahead, "worth_tracing_ahead", lambda model_file, spec: True)
    forks: list[int] = []
    real_fork = forked_module.os.fork

    def counted_fork() -> int:
        pid = real_fork()
        if pid:
            forks.append(pid)
        return pid

    monkeypatch.setattr(forked_module.os, "fork", counted_fork)
    options = PlanOptions(global_batch=16, stages=2, micro_batch=micro_batch)
    ahead = plan(GPT, CLUSTERS / "cpu-hetero-4.yaml", options, RunControls()).plan
    made_forks = list(forks)
    here = plan(GPT, CLUSTERS / "cpu-hetero-4.yaml", options, RunControls(fork_steps=False)).plan
    assert forks == made_forks                   # a caller that must not fork: no child at all
    return ahead, here, made_forks


@needs_fork
def test_a_plan_of_one_row_micro_batches_is_checked_by_the_child_as_it_is_here(monkeypatch):
    ahead, here, forks = _plans(monkeypatch, micro_batch=1)
    assert {m for r in ahead.replicas for m in r.micro_batch_sizes} == {1}
    assert ahead == here and ahead.comm is not None and ahead.comm.digests
    assert len(forks) == 3                       # the checks ahead, the search's later builds, the runners-up
    for pid in forks:                            # every child reaped
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


@needs_fork
def test_a_plan_of_larger_micro_batches_stops_the_child_and_is_checked_here(monkeypatch):
    ahead, here, forks = _plans(monkeypatch, micro_batch=2)
    assert 1 not in {m for r in ahead.replicas for m in r.micro_batch_sizes}
    assert ahead == here
    assert len(forks) == 4                       # the verifier too, forked here once the child was stopped


@needs_fork
def test_an_error_of_the_checks_in_the_child_is_the_error_made_here(monkeypatch, tmp_path: Path):
    """A model whose stages fail at one row (a view with the batch size written in): the child's check
    raises the model file's error, as the same check here does."""
    source = GPT.read_text()
    broken = tmp_path / "model.py"
    broken.write_text(source + "\n\n_make = model\n\n\ndef model():\n    return _Rows2(_make())\n\n\n"
                      "class _Rows2(nn.Module):\n    def __init__(self, inner):\n        super().__init__()\n"
                      "        self.inner = inner\n\n    def forward(self, x):\n"
                      "        if x.shape[0] == 1:\n            raise ValueError('one row is not supported')\n"
                      "        return self.inner(x)\n")
    monkeypatch.setattr(checks_ahead, "worth_tracing_ahead", lambda model_file, spec: True)
    options = PlanOptions(global_batch=16, stages=2, micro_batch=1)
    errors = []
    for controls in (RunControls(), RunControls(fork_steps=False)):
        with pytest.raises(Exception) as caught:
            plan(broken, CLUSTERS / "cpu-hetero-4.yaml", options, controls)
        errors.append((type(caught.value).__name__, str(caught.value)))
    assert errors[0] == errors[1] and "one row is not supported" in errors[0][1]
