"""`plan replan`: the cluster less lost devices keeps every label and the real per-node counts; the same
model and options are planned again on it, emitted as `plan` emits, and the program runs it.

The lost-device cluster is checked against hand-counted devices of small specs; the plans are real (trace,
costs, CP-SAT), and the emitted program runs on gloo under torchrun (`plan run --steps 2`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from backends.torchdist.program.placement import resolve
from planner.api import PlanOptions, plan
from planner.core.errors import OptionError, PlanFileError
from planner.core.ir import Lineage, Plan
from planner.frontend.cluster import load_cluster
from planner.replanning import check_device_options, cluster_left, options_from_pairs, with_overrides
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli

MLP = EXAMPLES / "mlp" / "model.py"
HETERO = CLUSTERS / "cpu-hetero-4.yaml"
# two CPU nodes of two devices each, one group: losing fast/0:0 leaves a node of 1 and a node of 2
TWO_NODES = """
name: two-nodes
devices:
  cpu-fast: {base: CPU}
nodes:
  - {name: fast, count: 2, device: cpu-fast, per_node: 2, intra_link: shm}
  - {name: slow, count: 1, device: CPU, per_node: 2, intra_link: shm}
network:
  inter_node: {kind: loopback, bandwidth_gbit_s: 10, latency_us: 20}
"""


def _spec(tmp_path: Path, text: str = TWO_NODES) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


# ---- the cluster less lost devices ------------------------------------------------------------

def test_without_keeps_labels_and_real_node_sizes(tmp_path: Path) -> None:
    spec = load_cluster(_spec(tmp_path))
    left = spec.without(["fast/0:0"])
    assert [d.label for d in left.devices()] == ["fast/0:1", "fast/1:0", "fast/1:1", "slow/2:0", "slow/2:1"]
    assert [d.index for d in left.devices()] == [0, 1, 2, 3, 4]     # positions among the devices left
    assert [(g.name, g.count, g.per_node, g.nodes, g.locals) for g in left.nodes] == [
        ("fast", 1, 1, (0,), (1,)), ("fast", 1, 2, (1,), (0, 1)), ("slow", 1, 2, (2,), (0, 1))]
    assert left.num_devices == 5 and left.lost == ("fast/0:0",)
    again = left.without(["slow/2:1", "fast/0:1"])                  # a node left with none has none
    assert [d.label for d in again.devices()] == ["fast/1:0", "fast/1:1", "slow/2:0"]
    assert again.lost == ("fast/0:0", "fast/0:1", "slow/2:1")
    assert spec.without([]) is spec


def test_without_an_unknown_or_every_label_is_one_line(tmp_path: Path) -> None:
    spec = load_cluster(_spec(tmp_path))
    with pytest.raises(OptionError, match=r"no device 'fast/9:0'") as unknown:
        spec.without(["fast/9:0"])
    assert unknown.value.field == "--without" and "one of: fast/0:0, fast/0:1" in unknown.value.one_line()
    with pytest.raises(OptionError, match="lost already"):
        spec.without(["fast/0:0"]).without(["fast/0:0"])
    with pytest.raises(OptionError, match=r"every device of the cluster \(6\)") as everything:
        spec.without([d.label for d in spec.devices()])
    assert "\n" not in everything.value.one_line()


def test_a_plan_without_a_device_places_ranks_on_the_others_by_their_labels(tmp_path: Path) -> None:
    spec = load_cluster(_spec(tmp_path)).without(["fast/0:0"])
    result = plan(MLP, spec, PlanOptions(global_batch=10, use_all_devices=True, runners_up=False))
    p = result.plan
    assert sorted(p.devices) == ["fast/0:1", "fast/1:0", "fast/1:1", "slow/2:0", "slow/2:1"]
    assert p.inputs.lost_devices == ("fast/0:0",)
    by_index = {d.index: d.label for d in spec.devices()}
    assert all(by_index[st.device] == st.device_label for r in p.replicas for st in r.stages)


# ---- options read back ------------------------------------------------------------------------

def test_options_read_back_equal_the_ones_recorded() -> None:
    options = PlanOptions(global_batch=24, strategy="exact", precision="fp32", stages=2, use_all_devices=True,
                          micro_batch=3, memory_margin=0.25, schedule="gpipe", compression="auto",
                          time_limit_s=2.5, calibration=None, runners_up=False, objective="time", optimizer="sgd",
                          names={"model": "build", "loss_fn": "my_loss"})
    assert options_from_pairs(options.as_pairs()) == options
    assert options_from_pairs(PlanOptions().as_pairs()) == PlanOptions()
    with pytest.raises(PlanFileError, match="option stages is 'two'") as err:
        options_from_pairs((("stages", "two"),))
    assert err.value.field == "inputs.options"
    with pytest.raises(PlanFileError, match="unknown option 'warp'"):
        options_from_pairs((("warp", "9"),))


def test_device_counting_options_that_no_longer_fit_name_the_option(tmp_path: Path) -> None:
    spec = load_cluster(_spec(tmp_path)).without(["fast/0:0", "fast/0:1", "fast/1:0", "fast/1:1"])
    with pytest.raises(OptionError, match=r"--stages 4; the cluster less fast/0:0.* has 2 devices") as err:
        check_device_options(PlanOptions(stages=4), spec, spec.lost)
    assert err.value.field == "--stages"
    check_device_options(PlanOptions(stages=2, use_all_devices=True), spec, spec.lost)
    three = load_cluster(_spec(tmp_path)).without(["fast/0:0", "fast/0:1", "fast/1:0"])
    recorded = PlanOptions(stages=2, use_all_devices=True)
    with pytest.raises(OptionError, match="the 3 devices of the cluster less .* pipelines of 2") as err:
        check_device_options(recorded, three, three.lost)
    assert err.value.field == "--use-all-devices" and "--no-use-all-devices" in (err.value.fix or "")
    check_device_options(with_overrides(recorded, {"use_all_devices": False}), three, three.lost)
    check_device_options(with_overrides(recorded, {"stages": None}), three, three.lost)
    with pytest.raises(OptionError, match="no option 'stage'"):
        with_overrides(recorded, {"stage": 1})


def test_a_one_node_plan_runs_each_rank_on_the_gpu_its_label_names(tmp_path: Path) -> None:
    """Without NODE_RANK (plan run, launch.sh on one machine), a one-node plan without GPU 0 uses GPU 1."""
    one_node = "nodes: [{name: n, count: 1, device: CPU, per_node: 2, intra_link: shm}]"
    spec = load_cluster(_spec(tmp_path, one_node)).without(["n/0:0"])
    p = plan(MLP, spec, PlanOptions(global_batch=4, runners_up=False)).plan
    assert p.devices == ("n/0:1",)
    place = resolve(p, {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"})
    assert (place.rank, place.device_index) == (0, 1)


def test_lineage_does_not_change_plan_equality(tmp_path: Path) -> None:
    p = plan(MLP, HETERO, PlanOptions(global_batch=8, runners_up=False)).plan
    marked = dataclasses.replace(p, lineage=Lineage("/old", "ab" * 32, ("fast/0:0",), str(HETERO)))
    assert marked == p
    again = Plan.from_json(marked.to_json())
    assert again.lineage == marked.lineage and again.checkpoint == p.checkpoint
    older = json.loads(p.to_json())                        # a plan written before these fields existed
    for key in ("lineage", "checkpoint"):
        older.pop(key, None)
    assert Plan.from_json(json.dumps(older)) == p and "lost_devices" not in older["inputs"]


# ---- the command, end to end --------------------------------------------------------------------

@pytest.mark.slow
def test_replan_without_a_device_writes_a_plan_dir_that_says_what_it_replaced(tmp_path: Path) -> None:
    """plan -> replan --without fast/0:0; the new plan keeps the labels, the options and the program
    defaults, and inspect says what it replaced."""
    out, new = tmp_path / "out", tmp_path / "out2"
    first = run_plan_cli(str(MLP), "--cluster", str(HETERO), "--global-batch", "12", "--stages", "1",
                         "--use-all-devices", "--no-runners-up", "-o", str(out), timeout_s=120)
    assert first.returncode == 0, first.stderr
    assert "fast/0:0" in Plan.load(out).devices

    same = run_plan_cli("replan", str(out), "--without", "fast/0:0", "-o", str(out), timeout_s=60)
    assert same.returncode == 2 and "holds the input" in same.stderr      # OUT holds the model planned

    proc = run_plan_cli("replan", str(out), "--without", "fast/0:0", "-o", str(new), timeout_s=120)
    assert proc.returncode == 0, proc.stderr
    replanned = Plan.load(new)
    assert sorted(replanned.devices) == ["fast/0:1", "slow/1:0", "slow/1:1"]     # label kept, not renumbered
    assert replanned.global_batch == 12 and replanned.inputs.options == Plan.load(out).inputs.options
    assert replanned.program == Plan.load(out).program
    lineage = replanned.lineage
    assert lineage is not None and lineage.without == ("fast/0:0",) and lineage.plan_dir == str(out.resolve())
    assert f"re-planned from {out.resolve()} without fast/0:0" in (new / "summary.txt").read_text()
    assert json.loads((new / "program" / "plan.json").read_text()) == json.loads((new / "plan.json").read_text())

    shown = run_plan_cli("inspect", str(new), timeout_s=60)
    assert shown.returncode == 0, shown.stderr
    assert "re-planned from" in shown.stdout and "simulated" in shown.stdout.lower()

    # the program of a re-plan runs and resumes: tests/test_recovery_e2e.py


def test_replan_needs_a_lost_device_or_a_new_spec(tmp_path: Path) -> None:
    proc = run_plan_cli("replan", str(tmp_path), "-o", str(tmp_path / "x"), timeout_s=60)
    assert proc.returncode == 2 and "--without" in proc.stderr


def test_the_plans_spec_gone_asks_for_cluster(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    p = plan(MLP, spec, PlanOptions(global_batch=8, runners_up=False)).plan
    spec.unlink()
    with pytest.raises(PlanFileError, match="not there") as err:
        cluster_left(p, ["fast/0:0"])
    assert "--cluster" in (err.value.fix or "")
    (tmp_path / "elsewhere").mkdir()
    moved = _spec(tmp_path / "elsewhere")
    assert [d.label for d in cluster_left(p, ["fast/0:0"], moved).devices()][0] == "fast/0:1"
