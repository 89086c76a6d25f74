"""The runners-up a user would try first: the best single-device plan and the best pure data-parallel
plan are always among them (planned and simulated like every runner-up), shown in the chosen row when
the chosen plan is one of them, and saying why when the model fits on no single device."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from backends.report.terminal import runners_up_section
from backends.report.text import NO_PLAN_DEVICES, SAME_AS_CHOSEN, runners_up_rows
from planner import runners_up
from planner.api import PlanOptions, plan
from planner.cli.main import main
from planner.core.errors import PlanningError
from planner.core.ir import Plan
from planner.search import baselines, ilp, strategies
from planner.search.configs import build_configs
from planner.search.options import SearchOptions
from tests import synthetic
from tests.helpers import CLUSTERS, EXAMPLES

# ResNet-18's widths and depth (2 basic blocks per width) on the example's 32x32 images
RESNET18 = f"""
import importlib.util

_spec = importlib.util.spec_from_file_location("resnet_example", {str(EXAMPLES / "resnet" / "model.py")!r})
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)
batch, loss_fn = _example.batch, _example.loss_fn


def model():
    return _example.ResNet(stage_widths=(64, 128, 256, 512), blocks_per_stage=2, groups=8)
"""
# one node of four A100s on NVLink: at one sample per step a 4-stage pipeline wins narrowly (it splits
# the optimizer step), with a bubble of ~78%: the plan of issue 15, which showed no one-device row
A100_NODE = """
name: a100-node
nodes:
  - {name: a100, count: 1, device: A100-80GB, per_node: 4, intra_link: nvlink3}
network:
  inter_node: {kind: roce, bandwidth_gbit_s: 100, latency_us: 5}
"""
# ~580 MiB of training state beside the framework's 1 GiB on devices of 1.5 GiB: pipelines only
WIDE_MLP = """
import torch
from torch import nn


def model():
    return nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.ReLU()) for _ in range(8)], nn.Linear(2048, 10))


def batch(batch_size, step):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(batch_size, 2048, generator=g),), torch.randint(10, (batch_size,), generator=g)
"""
SMALL_DEVICES = """
name: small-4
devices:
  small-gpu: {base: A100-80GB, memory_gib: 1.5}
nodes:
  - {name: small, count: 1, device: small-gpu, per_node: 4, intra_link: nvlink3}
network:
  inter_node: {kind: roce, bandwidth_gbit_s: 100, latency_us: 5}
"""


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def _names(p: Plan) -> list[str]:
    return [u.name for u in p.solver.runners_up]


def _row(p: Plan, name: str) -> list[str]:
    return next(r for r in runners_up_rows(p) if r[0] == name or r[0].startswith(name + " ="))


@pytest.fixture(scope="module")
def resnet_pipeline(tmp_path_factory) -> Plan:
    folder = tmp_path_factory.mktemp("resnet18")
    # 1F1B forced: interleaving the four devices is within 3% of it (its estimate the lower, the
    # simulation the other way round: the estimate adds the slowest stage's optimizer step after the drain)
    return plan(_write(folder, "model.py", RESNET18), _write(folder, "a100.yaml", A100_NODE),
                PlanOptions(global_batch=1, schedule="1f1b")).plan


@pytest.fixture(scope="module")
def gpt_mixed() -> Plan:
    return plan(EXAMPLES / "gpt" / "model.py", CLUSTERS / "seed-mixed-32.yaml", PlanOptions(global_batch=64)).plan


def test_a_narrow_pipeline_win_shows_the_one_device_row(resnet_pipeline):
    p = resnet_pipeline
    assert p.solver.strategy == "ilp" and len(p.replicas) == 1 and len(p.replicas[0].stages) == 4
    assert p.estimates.bubble_fraction > 0.7
    # at one sample the best data-parallel plan is one device too: one row under both names
    one = next(u for u in p.solver.runners_up if u.name.startswith("single device"))
    assert one.name == "single device = data parallel"
    assert one.devices_used == 1 and one.layout == "a100:1st x1"
    assert one.simulated_iteration_s > p.solver.simulated_iteration_s     # the pipeline does win, narrowly
    assert one.why_slower.startswith(f"{one.simulated_iteration_s / p.solver.simulated_iteration_s:.2f}x slower")
    assert one.estimated_iteration_s < 1.1 * p.estimates.iteration_s
    assert _row(p, "single device")[3] == "1"
    assert "single device" in runners_up_section(p, width=None)


def test_gpt_shows_both_and_the_chosen_plan_once(gpt_mixed):
    p = gpt_mixed
    names = _names(p)
    assert any(n.startswith("single device") for n in names) and any("data parallel" in n for n in names)
    rows = runners_up_rows(p)
    shown = [r[0] for r in rows]
    assert any("single device" in n for n in shown) and any("data parallel" in n for n in shown)
    # the chosen plan is pure data parallel here: it says so in its row rather than a copy of itself
    assert all(len(r.stages) == 1 for r in p.replicas) and len(p.replicas) > 1
    assert shown[0] == "ilp (chosen) = data parallel"
    same = [u for u in p.solver.runners_up if u.why_slower == SAME_AS_CHOSEN]
    assert [u.name for u in same] == ["data parallel"] and "data parallel" not in shown[1:]
    single = _row(p, "single device")
    assert single[3] == "1" and single[5].endswith("1 device vs 4") and "x slower" in single[5]
    # the existing runners-up stay, ranked by simulated time
    assert {"uniform", "fastest", "megatron", "metis"} <= set(names)
    times = [u.simulated_iteration_s for u in p.solver.runners_up]
    assert times == sorted(times)


def test_a_model_on_no_single_device_says_why(tmp_path):
    model, spec = _write(tmp_path, "model.py", WIDE_MLP), _write(tmp_path, "small.yaml", SMALL_DEVICES)
    first = plan(model, spec, PlanOptions(global_batch=8)).plan
    # spread over several devices: pipeline stages, or tensor-parallel shards of a stage
    assert first.world_size > 1 and (len(first.replicas[0].stages) > 1 or first.tp_degree > 1)
    for name in runners_up.FIRST_TRY_ROWS.values():
        entry = next(u for u in first.solver.runners_up if u.name == name)
        assert entry.devices_used == NO_PLAN_DEVICES
        assert entry.why_slower.startswith("fits on no single device: needs 1.6 GiB at the least")
        assert "the largest offers 1.4 GiB (small-gpu" in entry.why_slower
        assert _row(first, name)[1:5] == ["-", "-", "-", "-"]
    # after the plans, and the whole plan is reproducible with them
    assert first.solver.runners_up[-1].devices_used == NO_PLAN_DEVICES
    assert plan(model, spec, PlanOptions(global_batch=8)).plan.to_json() == first.to_json()
    with pytest.raises(PlanningError, match="fits on no single device"):
        plan(model, spec, PlanOptions(global_batch=8, strategy="single", runners_up=False))


def test_single_and_dp_are_strategies_of_their_own(tmp_path):
    spec = CLUSTERS / "cpu-hetero-4.yaml"
    assert {"single", "dp"} <= set(strategies.STRATEGIES)
    assert set(baselines.SOLVERS) == {"uniform", "fastest", "megatron", "metis"}   # plan_quality's set
    one = plan(EXAMPLES / "mlp" / "model.py", spec, PlanOptions(global_batch=16, strategy="single")).plan
    assert one.world_size == 1 and one.solver.strategy == "single" and one.solver.status == "OPTIMAL"
    assert one.replicas[0].node_group == "fast"          # the faster of the two device types
    assert one.solver.runners_up == ()                   # a baseline's plan has no runners-up
    dp = plan(EXAMPLES / "mlp" / "model.py", spec, PlanOptions(global_batch=16, strategy="dp")).plan
    assert dp.solver.strategy == "dp" and all(len(r.stages) == 1 for r in dp.replicas)
    assert dp.estimates.iteration_s <= one.estimates.iteration_s * (1 + 1e-9)
    for strategy in ("single", "dp"):
        with pytest.raises(PlanningError) as caught:
            plan(EXAMPLES / "mlp" / "model.py", spec, PlanOptions(global_batch=16, strategy=strategy, stages=2))
        assert caught.value.field == "--stages"


def test_the_first_tries_are_free_of_the_chosen_plans_depth(tmp_path):
    # held to 2 stages, the plan is compared with the data-parallel plan it was kept from, which says so
    p = plan(_write(tmp_path, "model.py", RESNET18), _write(tmp_path, "a100.yaml", A100_NODE),
             PlanOptions(global_batch=64, stages=2)).plan
    assert all(len(r.stages) == 2 for r in p.replicas)
    single = next(u for u in p.solver.runners_up if u.name == "single device")
    dp = next(u for u in p.solver.runners_up if u.name == "data parallel")
    assert (single.devices_used, single.layout, dp.layout) == (1, "a100:1st x1", "a100:1st x4")
    assert dp.simulated_iteration_s < p.solver.simulated_iteration_s
    ratio = p.solver.simulated_iteration_s / dp.simulated_iteration_s
    assert dp.why_slower.startswith(f"{ratio:.2f}x faster (") and dp.why_slower.endswith("held to --stages 2")
    assert "held to" not in single.why_slower       # slower: what it was free of does not matter


def test_single_is_the_best_one_device_plan_and_dp_the_ilp_over_one_stage():
    fast = synthetic.table("fast", 2.0, blocks=6, devices=4, per_node=4, capacity_gib=40.0)
    small = synthetic.table("small", 4.0, blocks=6, devices=4, per_node=4, capacity_gib=4.0)   # faster, too small
    tables = synthetic.tables([fast, small], global_batch=16)
    options = SearchOptions()
    single = baselines.single_solution(tables, options)
    assert [(c.config.cls, c.config.num_stages, c.replicas) for c in single.choices] == [(0, 1, 1)]
    assert single.bound_s == single.objective_s and single.status == "OPTIMAL"
    best = min(baselines.evaluate(tables, [(c, 16)]).objective_s
               for m in (1, 2, 4, 8, 16) if (c := baselines.make_config(tables, 0, 1, m, balanced=True)))
    assert single.objective_s == pytest.approx(best)
    dp = baselines.dp_solution(tables, options)
    assert all(c.config.num_stages == 1 and c.config.cls == 0 for c in dp.choices)
    configs = build_configs(tables, 1, mixed_pipelines=False)
    assert dp.objective_s == pytest.approx(ilp.solve(tables, configs).objective_s)
    assert dp.objective_s <= single.objective_s
    tiny = synthetic.tables([small], global_batch=16)
    with pytest.raises(PlanningError, match=r"fits on no single device: needs 6\.0 GiB"):
        baselines.single_solution(tiny, options)


def test_inspect_shows_the_one_device_row(tmp_path, capsys):
    model, spec = _write(tmp_path, "model.py", RESNET18), _write(tmp_path, "a100.yaml", A100_NODE)
    out = tmp_path / "out"
    assert main([str(model), "--cluster", str(spec), "--global-batch", "1", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    why = shown[shown.index("why this plan:"):].split("\n\n")[0]
    assert "ilp (chosen)" in why and "single device = data parallel" in why and "a100:1st x1" in why
