"""`--objective cost`: the cheapest plan per sample when the spec prices its devices."""

from __future__ import annotations

from planner.api import PlanOptions, plan
from tests.helpers import CLUSTERS, EXAMPLES

GPT = EXAMPLES / "gpt" / "model.py"


def _priced(tmp_path, a100: float, v100: float, p100: float):
    text = (CLUSTERS / "seed-mixed-32.yaml").read_text()
    for device, price in (("A100-40GB", a100), ("V100-32GB", v100), ("P100-16GB", p100)):
        text = text.replace(f"device: {device},", f"device: {device}, price_per_hour: {price},")
    path = tmp_path / "priced.yaml"
    path.write_text(text)
    return path


def test_cost_objective_trades_time_for_cheaper_devices(tmp_path):
    cluster = _priced(tmp_path, a100=3.0, v100=0.9, p100=0.3)
    fast = plan(GPT, cluster, PlanOptions(global_batch=256, runners_up=False)).plan
    cheap = plan(GPT, cluster, PlanOptions(global_batch=256, objective="cost", runners_up=False)).plan
    assert cheap.estimates.cost_per_sample < fast.estimates.cost_per_sample
    assert cheap.estimates.iteration_s >= fast.estimates.iteration_s
    # the a100s are 10x the p100s' price and nowhere near 10x their speed on this small model
    assert {st.device_type for r in cheap.replicas for st in r.stages} != {"A100-40GB"}


def test_cost_objective_keeps_the_fast_plan_when_fast_devices_are_cheap(tmp_path):
    cluster = _priced(tmp_path, a100=0.3, v100=0.9, p100=3.0)
    fast = plan(GPT, cluster, PlanOptions(global_batch=256, runners_up=False)).plan
    cheap = plan(GPT, cluster, PlanOptions(global_batch=256, objective="cost", runners_up=False)).plan
    assert cheap.estimates.cost_per_sample <= fast.estimates.cost_per_sample
    assert {st.device_type for r in cheap.replicas for st in r.stages} == {"A100-40GB"}
