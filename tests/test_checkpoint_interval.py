"""The planned checkpoint: its cost under a plan and the Young/Daly interval, from `mtbf_hours` and
`storage.write_gbyte_s` in the spec.

Expected figures are worked out from the spec's numbers by hand (GB/s x 1e9, hours x 3600, AdamW: fp32
weights and two moments = 3 x the parameter bytes, a CPU memcpy reads and writes), on a real plan.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from backends.report.terminal import summary
from costmodel.checkpoint import checkpoint_advice, default_storage, rank_state_bytes
from planner.api import PlanOptions, plan
from planner.core.errors import SpecError
from planner.core.ir import Plan
from planner.frontend.cluster import load_cluster
from tests.helpers import CLUSTERS, EXAMPLES

MLP = EXAMPLES / "mlp" / "model.py"
SPEC = """
name: ckpt
devices:
  cpu-a: {base: CPU, memory_bandwidth_gbyte_s: 20, mtbf_hours: MTBF_A}
  cpu-b: {base: CPU, memory_bandwidth_gbyte_s: 10}
nodes:
  - {name: a, count: 1, device: cpu-a, per_node: 2, intra_link: shm}
  - {name: b, count: 1, device: cpu-b, per_node: 2, intra_link: shm}
network:
  inter_node: {kind: loopback, bandwidth_gbit_s: 10, latency_us: 20}
storage: {write_gbyte_s: 0.5}
"""
BANDWIDTH_BYTES_S = {"a": 20e9, "b": 10e9}
STORAGE_BYTES_S = 0.5e9


def _write(folder: Path, text: str, name: str = "spec.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Plan, Path]:
    folder = tmp_path_factory.mktemp("ckpt")
    spec = _write(folder, SPEC.replace("MTBF_A", "1000"))
    result = plan(MLP, spec, PlanOptions(global_batch=12, stages=2, use_all_devices=True, runners_up=False))
    return result.plan, folder


def _saved_bytes(p: Plan, rank: int) -> float:
    st = p.stage_of_rank(rank)[1]
    return 3.0 * sum(p.blocks[b].param_bytes for b in range(st.first_block, st.last_block + 1))


def test_cost_and_interval_follow_the_spec(planned: tuple[Plan, Path]) -> None:
    p, _ = planned
    advice = p.checkpoint
    assert advice is not None
    saved = [_saved_bytes(p, r) for r in range(p.world_size)]
    assert advice.state_bytes == pytest.approx(max(saved)) and saved[advice.state_rank] == max(saved)
    group = [label.split("/")[0] for label in p.devices]
    node = [label.split(":")[0] for label in p.devices]
    assert advice.blocking_s == pytest.approx(max(2 * saved[r] / BANDWIDTH_BYTES_S[group[r]]
                                                  for r in range(p.world_size)))
    per_node = {n: sum(saved[r] for r in range(p.world_size) if node[r] == n) for n in set(node)}
    assert advice.write_s == pytest.approx(max(per_node.values()) / STORAGE_BYTES_S)
    assert advice.storage_write_bytes_s == STORAGE_BYTES_S and "storage.write_gbyte_s" in advice.storage_source
    assert advice.devices_with_mtbf == group.count("a") == 2     # group b's devices give none: not counted
    assert advice.job_mtbf_s == pytest.approx(1000 * 3600 / 2)
    young = math.sqrt(2 * advice.blocking_s * 1000 * 3600 / 2)
    assert young > advice.write_s and advice.interval_s == pytest.approx(young)
    assert advice.interval_steps == max(1, round(young / p.estimates.iteration_s))
    text = summary(p, width=None)
    assert f"checkpoint every {advice.interval_steps} step(s)" in text and "2 device(s) without mtbf_hours" in text


def test_the_interval_is_never_shorter_than_the_write(planned: tuple[Plan, Path]) -> None:
    """A save cannot start before the previous one is written: a tiny MTBF gives the write time."""
    p, folder = planned
    fragile = load_cluster(_write(folder / "fragile", SPEC.replace("MTBF_A", "1e-6")))
    advice = checkpoint_advice(p, fragile)
    assert advice.interval_s == advice.write_s and advice.interval_steps == max(1, round(
        advice.write_s / p.estimates.iteration_s))


def test_sgd_saves_weights_and_momentum(planned: tuple[Plan, Path]) -> None:
    p, folder = planned
    options = tuple(("optimizer", "sgd") if k == "optimizer" else (k, v) for k, v in p.inputs.options)
    sgd = dataclasses.replace(p, inputs=dataclasses.replace(p.inputs, options=options))
    spec = load_cluster(folder / "spec.yaml")
    assert checkpoint_advice(sgd, spec).state_bytes == pytest.approx(p.checkpoint.state_bytes * 2 / 3)  # type: ignore[union-attr]


def test_no_mtbf_gives_the_cost_but_no_interval() -> None:
    p = plan(MLP, CLUSTERS / "cpu-hetero-4.yaml", PlanOptions(global_batch=8, runners_up=False)).plan
    advice = p.checkpoint
    assert advice is not None and advice.interval_s is None and advice.job_mtbf_s is None
    assert advice.interval_steps is None and advice.devices_with_mtbf == 0
    assert advice.storage_write_bytes_s == default_storage()[0] == 1e9 and "placeholder" in advice.storage_source
    assert "no checkpoint interval" in summary(p, width=None)


# ---- the spec's fields ------------------------------------------------------------------------

def test_mtbf_on_a_node_group_and_a_device_type(tmp_path: Path) -> None:
    spec = load_cluster(_write(tmp_path, SPEC.replace("MTBF_A", "1000").replace(
        "device: cpu-b, per_node: 2,", "device: cpu-b, per_node: 2, mtbf_hours: 250,")))
    assert [g.device.mtbf_hours for g in spec.nodes] == [1000.0, 250.0]
    assert spec.storage_write_bytes_s == 0.5e9
    assert load_cluster(CLUSTERS / "cpu-hetero-4.yaml").storage_write_bytes_s is None


@pytest.mark.parametrize(("old", "new", "field"), [
    ("mtbf_hours: MTBF_A", "mtbf_hours: -5", "devices.cpu-a.mtbf_hours"),
    ("mtbf_hours: MTBF_A", "mtbf_hours: often", "devices.cpu-a.mtbf_hours"),
    ("per_node: 2, intra_link: shm}\n  - {name: b", "per_node: 2, intra_link: shm, mtbf_hours: 0}\n  - {name: b",
     "nodes[0].mtbf_hours"),
    ("write_gbyte_s: 0.5", "write_gbyte_s: 0", "storage.write_gbyte_s"),
    ("write_gbyte_s: 0.5", "speed: 1", "storage"),
])
def test_a_bad_figure_is_one_line_naming_it(tmp_path: Path, old: str, new: str, field: str) -> None:
    text = SPEC.replace("MTBF_A", "1000") if old != "mtbf_hours: MTBF_A" else SPEC
    with pytest.raises(SpecError) as err:
        load_cluster(_write(tmp_path, text.replace(old, new)))
    assert (err.value.field or "").startswith(field) and "\n" not in err.value.one_line()


def test_the_seed_cluster_gives_every_device_an_mtbf() -> None:
    spec = load_cluster(Path(__file__).resolve().parents[1] / "examples" / "clusters" / "seed-mixed-32.yaml")
    assert all(d.type.mtbf_hours == 50000 for d in spec.devices())


LLAMA = EXAMPLES / "hf_llama" / "model.py"


def test_a_zero_rank_saves_its_share_of_the_optimizer_state():
    """TP 2 x ZeRO over 2 replicas: each rank saves one shard's fp32 weights and half its two moments."""
    p = plan(LLAMA, CLUSTERS / "cpu-4.yaml", PlanOptions(global_batch=16, tp=2, zero="on", runners_up=False)).plan
    assert p.grad_groups and all(g.zero and len(g.ranks) == 2 for g in p.grad_groups)
    saved = rank_state_bytes(p, "adamw")
    for rank in range(p.world_size):
        shard = p.stage_of_rank(rank)[1].shard_param_bytes
        in_groups = sum(g.nbytes for g in p.grad_groups if rank in g.ranks)
        assert in_groups == pytest.approx(shard)
        assert saved[rank] == pytest.approx(shard * (1 + 2 / 2))


def test_an_interleaved_rank_saves_every_stage_it_runs():
    p = plan(LLAMA, CLUSTERS / "cpu-4.yaml", PlanOptions(global_batch=16, stages=4, schedule="interleaved",
                                                         zero="off", runners_up=False)).plan
    assert all(r.chunks == 2 for r in p.replicas)
    saved = rank_state_bytes(p, "adamw")
    for rank in range(p.world_size):
        replica, stage = p.stage_of_rank(rank)
        held = sum(p.blocks[b].param_bytes for s in replica.stages_with(stage)
                   for b in range(s.first_block, s.last_block + 1))
        assert saved[rank] == pytest.approx(3.0 * held)
