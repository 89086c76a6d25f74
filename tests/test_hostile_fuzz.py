"""Fuzzed specs, options and plan-file edits (hypothesis): never a traceback, never a hang, and only the
documented exit codes: 0 planned, 2 bad input, 3 no feasible plan; any refusal is one line.

Bounded: a few dozen examples per property, each CLI call in this process under a time limit (and a
watchdog that ends the run, with every thread's stack, should one hang)."""

from __future__ import annotations

import copy
import faulthandler
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import main
from planner.core.errors import SpecError
from planner.frontend.cluster import load_cluster
from tests.hostile import CPU4, MLP, run_cli

WATCHDOG_S = 600          # no example comes near: a call that does has hung
CALL_S = 90               # one CLI call (a plan of the MLP takes seconds)
FUZZ = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FEW = settings(FUZZ, max_examples=20)

SPEC_WORDS = ["name", "devices", "nodes", "network", "count", "per_node", "device", "intra_link",
              "price_per_hour", "kind", "bandwidth_gbit_s", "bandwidth_gbyte_s", "latency_us", "inter_node",
              "base", "slowdown", "vendor", "peak_tflops", "fp32", "bf16", "memory_gib",
              "memory_bandwidth_gbyte_s", "tensor_cores", "source", "<<"]
SPEC_NAMES = ["CPU", "T4", "A100-80GB", "cpu-fast", "shm", "nvlink3", "none", "loopback", "tcp", "1e-9", "a/b",
              "x\x1b[31m", "", " ", "\n", "é", "a" * 70]
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(-3, 9)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | st.sampled_from(SPEC_NAMES))
documents = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                         | st.dictionaries(st.sampled_from(SPEC_WORDS) | st.text(max_size=6), inner, max_size=5),
                         max_leaves=25)


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _one_line(code: int, err: str) -> None:
    assert code in (0, 2, 3), (code, err)
    assert "Traceback" not in err
    if code:
        assert len(err.strip().splitlines()) == 1 and err.startswith("plan: error: "), err


# ---- specs -------------------------------------------------------------------------------------

def _text_of(document: Any) -> str:
    try:
        return yaml.safe_dump(document, allow_unicode=True)
    except (yaml.YAMLError, ValueError):
        return repr(document)


@FUZZ
@given(document=documents | st.text(max_size=200))
def test_any_yaml_document_is_a_spec_or_one_spec_error(tmp_path_factory, document: Any) -> None:
    path = tmp_path_factory.mktemp("spec") / "spec.yaml"
    path.write_text(document if isinstance(document, str) else _text_of(document), encoding="utf-8")
    try:
        load_cluster(path)
    except SpecError as exc:
        line = exc.one_line()
        assert "\n" not in line and len(line) <= 2000 and "\x1b" not in line


BASE_SPEC = yaml.safe_load(CPU4.read_text())


def _leaves(value: Any, at: tuple = ()) -> list[tuple]:
    if isinstance(value, dict):
        return [at] + [p for k, v in value.items() for p in _leaves(v, (*at, k))]
    if isinstance(value, list):
        return [at] + [p for i, v in enumerate(value) for p in _leaves(v, (*at, i))]
    return [at]


def _mutated(base: dict, data: st.DataObject, values: st.SearchStrategy) -> dict:
    """`base` with one to three values (at paths drawn from it) replaced by drawn ones."""
    out = copy.deepcopy(base)
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(_leaves(out)[1:]))
        parent = out
        for step in where[:-1]:
            parent = parent[step]
        parent[where[-1]] = data.draw(values)
    return out


@FEW
@given(data=st.data())
def test_a_mutated_spec_through_the_cli(capfd, tmp_path_factory, data: st.DataObject) -> None:
    folder = tmp_path_factory.mktemp("cli")
    spec = folder / "spec.yaml"
    spec.write_text(_text_of(_mutated(BASE_SPEC, data, documents)), encoding="utf-8")
    code, _, err = run_cli(capfd, [MLP, "--cluster", spec, "-o", folder / "out", "--global-batch", "8",
                                   "--no-runners-up"], max_s=CALL_S)
    _one_line(code, err)


# ---- options -----------------------------------------------------------------------------------

NUMBERS = st.sampled_from(["0", "-1", "1", "2", "3", "7", "64", "nan", "inf", "-inf", "1e-300", "1e300", "0.5",
                           "0.999999", str(2**64), "", "x", "1_000"])
FLAGS = {
    "--global-batch": NUMBERS, "--micro-batch": NUMBERS, "--stages": NUMBERS, "--memory-margin": NUMBERS,
    "--time-limit": NUMBERS, "--lr": NUMBERS, "--trace-timeout": NUMBERS,
    "--strategy": st.sampled_from(["ilp", "exact", "uniform", "fastest", "megatron", "metis", "ILP", ""]),
    "--precision": st.sampled_from(["auto", "fp32", "bf16", "fp16", "int4"]),
    "--schedule": st.sampled_from(["auto", "1f1b", "gpipe", "zb"]),
    "--compression": st.sampled_from(["none", "auto", "fp16", "powersgd", "onebit", "zip"]),
    "--model-fn": st.sampled_from(["model", "batch", "nope", "os.system", "1x"]),
    "--loss-fn": st.sampled_from(["loss_fn", "model", "missing"]),
}


@FEW
@given(chosen=st.dictionaries(st.sampled_from(sorted(FLAGS)), st.just(None), min_size=1, max_size=3),
       data=st.data())
def test_fuzzed_options_through_the_cli(capfd, tmp_path_factory, chosen: dict, data: st.DataObject) -> None:
    folder = tmp_path_factory.mktemp("opt")
    flags = [part for flag in chosen for part in (flag, data.draw(FLAGS[flag], label=flag))]
    code, _, err = run_cli(capfd, [MLP, "--cluster", CPU4, "-o", folder / "out", "--no-runners-up",
                                   "--time-limit", "2", *flags], max_s=CALL_S)
    _one_line(code, err)


# ---- plan files --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzzplan") / "out"
    assert main([str(MLP), "--cluster", str(CPU4), "-o", str(out), "--global-batch", "8"]) == 0
    return out


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.integers(-2, 8)
                           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
                           | st.sampled_from(["1f1b", "gpipe", "none", "fp32", "\x1b[2J", "../../etc/passwd"]),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                       max_size=3),
                           max_leaves=8)


@FUZZ
@given(data=st.data())
def test_an_edited_plan_file_inspects_or_is_one_line(capfd, plan_dir: Path, tmp_path_factory,
                                                     data: st.DataObject) -> None:
    out = tmp_path_factory.mktemp("edit") / "out"
    shutil.copytree(plan_dir, out)
    edited = _mutated(json.loads((plan_dir / "plan.json").read_text()), data, JSON_VALUES)
    text = json.dumps(edited, allow_nan=True)
    for plan_json in (out / "plan.json", out / "program" / "plan.json"):   # both: past the copies' check
        plan_json.write_text(text)
    code, printed, err = run_cli(capfd, ["inspect", out], max_s=CALL_S)
    assert code in (0, 2), (code, err)
    _one_line(code, err)
    assert "\x1b" not in printed + err
