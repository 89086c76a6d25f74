"""`plan diff`: the differences of two real plans, side by side, and the estimate's change explained."""

from __future__ import annotations

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
