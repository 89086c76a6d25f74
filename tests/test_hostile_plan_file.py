"""Plans are checked where they are read (`plan inspect`, `plan run`: plan_files.load_checked_plan): an
edited or stale plan is refused with one line naming the field and what changed, or used only with
--allow-changed; a malformed plan.json is one line, exit 2; `plan inspect` reads no file the plan
names unless it is the recorded one."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from planner.cli import main
from planner.cli.plan_files import load_checked_plan
from planner.core.errors import PlanFileError
from tests.hostile import CPU4, MLP, assert_one_line, run_cli


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    """A plan of the MLP on a copy of cpu-hetero-4 (both inputs in a folder of their own)."""
    folder = tmp_path_factory.mktemp("planned")
    shutil.copyfile(MLP, folder / "model.py")
    shutil.copyfile(CPU4, folder / "spec.yaml")
    assert main([str(folder / "model.py"), "--cluster", str(folder / "spec.yaml"), "-o", str(folder / "out"),
                 "--global-batch", "8"]) == 0
    return folder


@pytest.fixture
def copy(planned: Path, tmp_path: Path) -> Path:
    """A fresh copy of the planned folder (model, spec, out/), its plan's paths pointing into the copy."""
    folder = tmp_path / "p"
    shutil.copytree(planned, folder)
    for plan_json in (folder / "out" / "plan.json", folder / "out" / "program" / "plan.json"):
        data = json.loads(plan_json.read_text())
        data["inputs"]["model_path"] = str(folder / "model.py")
        data["inputs"]["cluster_path"] = str(folder / "spec.yaml")
        plan_json.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return folder


def edit_plan(out: Path, change, *, both: bool = True) -> None:
    """Apply `change(data)` to plan.json (and to program/plan.json, so the two still agree)."""
    for plan_json in (out / "plan.json", out / "program" / "plan.json") if both else (out / "plan.json",):
        data = json.loads(plan_json.read_text())
        change(data)
        plan_json.write_text(json.dumps(data))


def test_an_unchanged_plan_inspects(capfd, copy: Path) -> None:
    code, out, err = run_cli(capfd, ["inspect", copy / "out"])
    assert (code, err) == (0, "") and "simulated step" in out


def test_an_edited_model_file_is_refused_unless_allowed(capfd, copy: Path) -> None:
    with (copy / "model.py").open("a") as f:
        f.write("\n# edited after planning\n")
    code, _, err = run_cli(capfd, ["inspect", copy / "out"])
    assert_one_line(code, err, 2, "inputs.model_digest", "the model file", "changed since planning", "--allow-changed")
    with pytest.raises(PlanFileError, match="model file"):
        load_checked_plan(copy / "out" / "program" / "plan.json")        # where `plan run` reads it
    assert load_checked_plan(copy / "out", allow_changed=True).world_size >= 1
    code, out, err = run_cli(capfd, ["inspect", copy / "out", "--allow-changed"])
    assert code == 0 and "simulated step" in out


def test_an_edited_program_copy_of_the_model_is_refused(capfd, copy: Path) -> None:
    with (copy / "out" / "program" / "model.py").open("a") as f:
        f.write("import os  # slipped in\n")
    code, _, err = run_cli(capfd, ["inspect", copy / "out"])
    assert_one_line(code, err, 2, "inputs.model_digest", "the program's copy of the model file")


def test_an_edited_spec_is_refused_and_not_simulated_when_allowed(capfd, copy: Path) -> None:
    (copy / "spec.yaml").write_text((copy / "spec.yaml").read_text().replace("slowdown: 3.0", "slowdown: 9.0"))
    code, _, err = run_cli(capfd, ["inspect", copy / "out"])
    assert_one_line(code, err, 2, "inputs.cluster_digest", "the cluster spec", "changed since planning")
    code, out, err = run_cli(capfd, ["inspect", copy / "out", "--allow-changed"])
    assert code == 0 and "no simulation" in out and "simulated step" not in out


def test_the_two_copies_of_a_plan_must_agree(capfd, copy: Path) -> None:
    edit_plan(copy / "out", lambda d: d.update(global_batch=d["global_batch"]), both=True)   # reformatted only
    assert run_cli(capfd, ["inspect", copy / "out"])[0] == 0
    edit_plan(copy / "out", lambda d: d["estimates"].update(iteration_s=1e-9), both=False)
    code, _, err = run_cli(capfd, ["inspect", copy / "out"])
    assert_one_line(code, err, 2, "differ", "estimates")
    with pytest.raises(PlanFileError, match="differ"):
        load_checked_plan(copy / "out" / "program" / "plan.json")


def test_inspect_never_prints_a_file_an_edited_plan_names(capfd, copy: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.yaml"
    secret.write_text("password: hunter2-SECRET\nname: x\n")
    edit_plan(copy / "out", lambda d: d["inputs"].update(cluster_path=str(secret)))
    code, _, err = run_cli(capfd, ["inspect", copy / "out"])
    assert_one_line(code, err, 2, "inputs.cluster_digest")
    code, out, err = run_cli(capfd, ["inspect", copy / "out", "--allow-changed"])
    assert code == 0 and "no simulation" in out
    assert "hunter2" not in out + err and "password" not in out + err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_or_a_device_named_in_a_plan_is_not_read(capfd, copy: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        edit_plan(copy / "out", lambda d, p=path: d["inputs"].update(cluster_path=str(p), model_path=str(p)))
        code, _, err = run_cli(capfd, ["inspect", copy / "out"], max_s=20)
        assert_one_line(code, err, 2, "not a readable file")


def _set(path: tuple, value):
    def change(data):
        target = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


MALFORMED = [  # (case, edit of the plan's data, words of the line)
    ("world_size_string", _set(("world_size",), "four"), ["world_size", "expected an integer"]),
    ("world_size_huge", _set(("world_size",), 10**30), ["world_size"]),
    ("world_size_big", _set(("world_size",), 10**9), ["world_size"]),
    ("replicas_not_list", _set(("replicas",), {"a": 1}), ["replicas", "expected a list"]),
    ("stage_missing_rank", lambda d: d["replicas"][0]["stages"][0].pop("rank"), ["replicas[0].stages[0].rank",
                                                                                 "missing"]),
    ("nan_estimate", _set(("estimates", "iteration_s"), math.nan), ["estimates.iteration_s", "finite"]),
    ("inf_memory", _set(("estimates", "memory_bytes", 0), math.inf), ["estimates.memory_bytes[0]"]),
    ("bool_as_int", _set(("global_batch",), True), ["global_batch"]),
    ("rank_out_of_range", _set(("replicas", 0, "stages", 0, "rank"), 999), ["rank 999"]),
    ("negative_block", _set(("replicas", 0, "stages", 0, "first_block"), -5), ["blocks -5..5 out of place"]),
    ("shares_do_not_sum", _set(("global_batch",), 9), ["invariant", "batch shares"]),
    ("memory_over_capacity", _set(("estimates", "memory_bytes", 0), 1e30), ["invariant"]),
    ("unknown_schedule", _set(("replicas", 0, "schedule"), "zigzag"), ["schedule"]),
    ("chunks_without_interleaving", _set(("replicas", 0, "chunks"), 2), ["replicas[0].chunks", "stages per device"]),
    ("interleaved_without_chunks", _set(("replicas", 0, "schedule"), "interleaved"), ["replicas[0].chunks"]),
    ("no_replicas", _set(("replicas",), []), ["no replicas"]),
    ("short_devices", _set(("devices",), []), ["devices"]),
    ("top_level_list", lambda d: d.clear(), ["schema_version"]),
    ("schema_version", _set(("schema_version",), 99), ["schema_version 99"]),
]


@pytest.mark.parametrize(("case", "change", "words"), MALFORMED, ids=[c[0] for c in MALFORMED])
def test_a_malformed_plan_is_one_line_exit_2(capfd, copy: Path, case: str, change, words: list[str]) -> None:
    edit_plan(copy / "out", change)
    code, _, err = run_cli(capfd, ["inspect", copy / "out"], max_s=20)
    assert_one_line(code, err, 2, "plan.json", *words)


@pytest.mark.parametrize("text", ["", "[1, 2]", "{" * 100_000, "1" * 5000, "\x00\xff", "null", '{"schema_version": 1}'])
def test_a_plan_json_that_is_not_a_plan_is_one_line(capfd, copy: Path, text: str) -> None:
    (copy / "out" / "plan.json").write_bytes(text.encode("utf-8", "surrogateescape") if text != "\x00\xff"
                                             else b"\x00\xff")
    code, _, err = run_cli(capfd, ["inspect", copy / "out"], max_s=20)
    assert_one_line(code, err, 2, "plan.json")
