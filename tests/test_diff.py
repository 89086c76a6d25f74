"""`plan diff`: the differences of two real plans, side by side, and the estimate's change explained."""

from __future__ import annotations

import dataclasses

import pytest

from backends.report.diff import diff_text, explain
from planner.cli.main import main
from planner.core.ir import Plan
from tests.helpers import EXAMPLES

GPT = EXAMPLES / "gpt" / "model.py"
CLUSTER = EXAMPLES / "clusters" / "seed-mixed-32.yaml"


@pytest.fixture(scope="module")
def two_plans(tmp_path_factory):
    out = tmp_path_factory.mktemp("diff")
    one, spread = out / "one", out / "spread"
    assert main([str(GPT), "--cluster", str(CLUSTER), "--global-batch", "64", "-o", str(one),
                 "--no-runners-up"]) == 0
    assert main([str(GPT), "--cluster", str(CLUSTER), "--global-batch", "64", "-o", str(spread),
                 "--use-all-devices", "--no-runners-up"]) == 0
    return one, spread


def test_diff_shows_what_changed_and_why_it_costs(two_plans, capsys):
    one, spread = two_plans
    assert main(["diff", str(one), str(spread)]) == 0
    text = capsys.readouterr().out
    a, b = Plan.load(one), Plan.load(spread)
    assert a.world_size != b.world_size
    devices = next(line.split() for line in text.splitlines() if line.startswith("devices used"))
    assert devices == ["devices", "used", str(a.world_size), str(b.world_size)]
    assert "what it costs: " in text
    ratio = b.estimates.iteration_s / a.estimates.iteration_s
    expected = f"{ratio:.2f}x the step time" if ratio >= 1 else f"{1 / ratio:.2f}x faster"
    assert expected in text
    assert f"{a.world_size} -> {b.world_size} devices" in explain(a, b)


def test_a_plan_against_itself_is_the_same_plan(two_plans):
    a = Plan.load(two_plans[0])
    text = diff_text(a, a)
    assert "the same plan" in text and "what it costs" not in text


def test_diff_of_a_missing_plan_is_one_line(two_plans, tmp_path, capsys):
    assert main(["diff", str(two_plans[0]), str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "nothing: no plan here" in err


def test_a_plan_moved_to_other_devices_is_not_the_same_plan(two_plans, capsys):
    # the same layout re-planned without one of its devices lands on the next node: only `devices` differs
    one = two_plans[0]
    moved = one.parent / "moved"
    a = Plan.load(one)
    assert a.devices == ("a100/0:0", "a100/0:1", "a100/0:2", "a100/0:3")
    assert main(["replan", str(one), "--without", "a100/0:1", "-o", str(moved)]) == 0
    capsys.readouterr()
    b = Plan.load(moved)
    assert b.devices == ("a100/1:0", "a100/1:1", "a100/1:2", "a100/1:3")
    text = diff_text(a, b)
    assert "the same plan" not in text
    row = next(cells for cells in map(str.split, text.splitlines()) if cells[:1] == ["devices"] and cells[1] != "used")
    assert row == ["devices", "a100/0:0-3", "a100/1:0-3"]


def test_devices_alike_on_nodes_in_a_row_read_as_one(two_plans):
    from backends.report.diff import _device_set

    a = Plan.load(two_plans[1])                       # every device of seed-mixed-32
    assert _device_set(a) == _device_set(dataclasses.replace(a, devices=tuple(sorted(a.devices, reverse=True))))
    labels = [f"a100/{n}:{k}" for n in range(4) for k in range(8)] + ["v100/4:0", "v100/4:2", "v100/5:0", "v100/5:2"]
    assert _device_set(dataclasses.replace(a, devices=tuple(labels))) == "a100/0-3:0-7, v100/4-5:0,2"
