"""`plan estimate --layout`: a layout the user wrote, built into the search's records, assembled, estimated
and simulated (planner.frontend.layout, planner.search.given, planner.estimate, planner.cli.estimate_cmd).

The central check is the round trip: a plan's own layout, estimated again, is the plan: the same stage
records, devices, memory and gradient groups, the same simulation, and the same estimate (exactly for a
baseline's plan, whose estimate is baselines.evaluate's as the layout's is; within the ILP's integer
clock, one nanosecond, for the planner's, whose gradient sync the solver reports in whole nanoseconds).
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest

from backends.sim import simulate_plan
from planner.api import PlanOptions, plan
from planner.cli import main
from planner.core.errors import HetplanError, OptionError, SpecError
from planner.core.ir import Plan
from planner.estimate import Prepared, estimate_prepared, merge_options, prepare
from planner.frontend.layout import Layout, layout_of_plan, load_layout, parse_layout, parse_shorthand, to_yaml
from planner.search import given
from planner.search.split import equal_bounds
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli

MLP = str(EXAMPLES / "mlp" / "model.py")
GPT = str(EXAMPLES / "gpt" / "model.py")
HETERO = str(CLUSTERS / "cpu-hetero-4.yaml")
CPU4 = str(CLUSTERS / "cpu-4.yaml")
EXAMPLE_LAYOUT = EXAMPLES / "layouts" / "gpt-hetero-4.yaml"
ILP_CLOCK_S = 1e-9           # the solver's integer clock (planner.search.candidates.to_ns)
GIB = float(1 << 30)


def _options(**kw: object) -> PlanOptions:
    return PlanOptions(runners_up=False, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def mlp_hetero() -> Prepared:
    return prepare(MLP, HETERO, merge_options(Layout("x"), _options(), set()))


@pytest.fixture(scope="module")
def gpt_hetero() -> Prepared:
    return prepare(GPT, HETERO, merge_options(Layout("x"), _options(), set()))


def _file(tmp_path: Path, text: str) -> Layout:
    path = tmp_path / "layout.yaml"
    path.write_text(textwrap.dedent(text))
    return load_layout(str(path))


def _one_line(exc: HetplanError, *needles: str) -> str:
    line = exc.one_line()
    assert "\n" not in line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert exc.fix, line
    return line


# ----- the file and the shorthand --------------------------------------------------------------------

def test_example_layout_reads_into_records_and_back():
    layout = load_layout(str(EXAMPLE_LAYOUT))
    first, second = layout.replicas
    assert layout.global_batch == 64
    assert first.devices.names == ("fast",) and [(x.unit, x.first, x.last) for x in first.ranges] == \
        [("layers", 0, 1), ("layers", 2, 3)]
    assert (first.micro_batch, first.share, first.schedule, first.tp) == (8, 48, "1f1b", 1)
    assert second.stages == 2 and second.share is None and second.micro_batch == 4
    again = parse_layout(read_yaml_text(to_yaml(layout)), layout.source)
    assert again == layout


def read_yaml_text(text: str) -> object:
    import yaml

    return yaml.safe_load(text)


def test_layers_are_the_blocks_of_the_repeated_stack(gpt_hetero, mlp_hetero):
    # gpt: embeddings (2 blocks), 4 layers of 2 blocks each (attention, MLP), final norm, head
    assert given.block_layers(gpt_hetero.blocks) == [None, None, 0, 0, 1, 1, 2, 2, 3, 3, None, None]
    # the MLP's blocks are labelled by the activation between its layers: the parameters they read tell
    assert given.block_layers(mlp_hetero.blocks) == [0, 1, 2, 3, 4, None]


def test_mixed_pipeline_gpipe_and_counted_devices(gpt_hetero, tmp_path):
    layout = _file(tmp_path, """\
        replicas:
          - {devices: [fast, slow, slow], micro_batch: 4, schedule: gpipe}
          - {devices: {type: cpu-fast, count: 1}, share: 16}
        """)
    found = estimate_prepared(gpt_hetero, layout, merge_options(layout, _options(), set()))
    mixed, single = found.plan.replicas
    assert [s.device_label for s in mixed.stages] == ["fast/0:0", "slow/1:0", "slow/1:1"]
    assert [(s.first_block, s.last_block) for s in mixed.stages] == [(0, 3), (4, 7), (8, 11)]
    assert mixed.schedule == "gpipe" and mixed.batch_share == 48 and mixed.micro_batch_sizes == (4,) * 12
    assert [s.device_label for s in single.stages] == ["fast/0:1"] and single.micro_batch_sizes == (16,)
    assert found.fits and found.simulation.iteration_s > 0
    assert parse_layout(read_yaml_text(to_yaml(layout)), layout.source) == layout


def test_example_layout_estimates_as_written(gpt_hetero):
    layout = load_layout(str(EXAMPLE_LAYOUT))
    found = estimate_prepared(gpt_hetero, layout, merge_options(layout, _options(), set()))
    p = found.plan
    assert found.fits and p.solver.strategy == "layout"
    fast, slow = p.replicas
    # layers 0-1 with the embeddings before them; layers 2-3 with the norm and head after them
    assert [(s.first_block, s.last_block) for s in fast.stages] == [(0, 5), (6, 11)]
    assert [(s.first_block, s.last_block) for s in slow.stages] == [(0, 5), (6, 11)]   # equal blocks
    assert {s.device_label.split("/")[0] for s in fast.stages} == {"fast"}
    assert {s.device_label.split("/")[0] for s in slow.stages} == {"slow"}
    assert (fast.batch_share, fast.micro_batch_sizes) == (48, (8,) * 6)
    assert (slow.batch_share, slow.micro_batch_sizes) == (16, (4,) * 4)
    assert found.simulation.iteration_s == simulate_plan(p, gpt_hetero.spec).iteration_s
    assert p.estimates.iteration_s == pytest.approx(p.estimates.pipeline_s + p.estimates.sync_s, rel=1e-12)


def test_shorthand_places_fastest_devices_first(mlp_hetero):
    short = parse_shorthand("dp=1, tp=1, pp=2, mb=4")
    assert (short.dp, short.tp, short.pp, short.mb, short.gbs) == (1, 1, 2, 4, None)
    one = estimate_prepared(mlp_hetero, load_layout("dp=1,tp=1,pp=2,mb=4"), _merged("dp=1,tp=1,pp=2,mb=4"))
    (replica,) = one.plan.replicas
    assert [s.device_label for s in replica.stages] == ["fast/0:0", "fast/0:1"]
    assert [(s.first_block, s.last_block) for s in replica.stages] == [(0, 2), (3, 5)]
    assert replica.micro_batch_sizes == (4,) * 16
    two = estimate_prepared(mlp_hetero, load_layout("dp=2,tp=1,pp=2,mb=4"), _merged("dp=2,tp=1,pp=2,mb=4"))
    assert [r.node_group for r in two.plan.replicas] == ["fast", "slow"]
    assert [r.batch_share for r in two.plan.replicas] == [32, 32]      # equal shares, as Megatron's


@pytest.mark.slow
def test_shorthand_tensor_parallel_on_one_node():
    layout = load_layout("dp=2,tp=2,pp=1,mb=8,gbs=32")
    options = merge_options(layout, _options(), set())
    assert options.global_batch == 32 and options.tp == 2
    found = estimate_prepared(prepare(GPT, CPU4, options), layout, options)
    assert [r.tp_degree for r in found.plan.replicas] == [2, 2]
    assert sorted(d for r in found.plan.replicas for s in r.stages for d in s.tp_devices) == [0, 1, 2, 3]
    assert found.layout.replicas[0].tp == 2 and found.layout.shorthand is None   # spelled out: a layout file


def _merged(text: str) -> PlanOptions:
    return merge_options(load_layout(text), _options(), set())


# ----- round trip: a plan's own layout is the plan -----------------------------------------------------

ROUND_TRIPS = {
    "uniform": (MLP, HETERO, {"strategy": "uniform"}),
    "hetero-uneven": (MLP, HETERO, {"use_all_devices": True}),
    "tp2": (GPT, CPU4, {"tp": 2}),
    "interleaved": (GPT, CPU4, {"schedule": "interleaved", "stages": 4}),
    # every device, all in one node: the search charges the sync on the node's link, as the plan runs it
    "all-devices-one-node": (GPT, CPU4, {"use_all_devices": True, "stages": 2}),
}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_a_plans_own_layout_estimates_to_the_plan(case, tmp_path):
    model, cluster, kw = ROUND_TRIPS[case]
    options = _options(**kw)
    planned = plan(model, cluster, options)
    original = planned.plan
    if case == "hetero-uneven":
        shares = sorted(r.batch_share for r in original.replicas)
        assert shares[0] != shares[-1] and len({r.node_group for r in original.replicas}) == 2
    original.save(tmp_path / "plan.json")
    layout = load_layout(str(tmp_path / "plan.json"))
    assert layout == layout_of_plan(original, str(tmp_path / "plan.json"))
    written = tmp_path / "own.yaml"        # a layout written from a plan is a layout file
    written.write_text(to_yaml(layout))
    assert dataclasses.replace(load_layout(str(written)), source=layout.source) == layout
    merged = merge_options(layout, _options(), set())
    prepared = Prepared(planned.cluster, planned.model_file, planned.graph, planned.blocks,  # type: ignore[arg-type]
                        planned.tables, _timer(), {})
    again = estimate_prepared(prepared, layout, merged).plan
    assert again.replicas == original.replicas
    assert again.devices == original.devices and again.grad_groups == original.grad_groups
    assert again.p2p == original.p2p
    assert again.estimates.memory_bytes == original.estimates.memory_bytes
    assert simulate_plan(again, planned.cluster).iteration_s == simulate_plan(original, planned.cluster).iteration_s
    a, b = again.estimates, original.estimates
    assert a.pipeline_s == b.pipeline_s
    if original.solver.strategy == "ilp":      # the solver's sync is on its integer clock
        assert abs(a.sync_s - b.sync_s) <= ILP_CLOCK_S and abs(a.iteration_s - b.iteration_s) <= ILP_CLOCK_S
    else:
        assert a.sync_s == b.sync_s and a.iteration_s == b.iteration_s
    assert abs(a.iteration_s - b.iteration_s) <= 1e-9 * b.iteration_s + ILP_CLOCK_S
    if case == "uniform":       # the estimate's own trace and costing are plan()'s
        assert prepare(model, cluster, merged).tables == planned.tables


def _timer():
    from planner.api import PhaseTimer

    return PhaseTimer()


# ----- what does not fit ------------------------------------------------------------------------------

def _small_slow_spec(tmp_path: Path) -> Path:
    spec = tmp_path / "small.yaml"
    spec.write_text(textwrap.dedent("""\
        name: small-slow
        devices:
          cpu-fast: {base: CPU, slowdown: 1.0}
          cpu-tiny: {base: CPU, slowdown: 3.0, memory_gib: 0.3}
        nodes:
          - {name: fast, count: 1, device: cpu-fast, per_node: 2, intra_link: shm}
          - {name: slow, count: 1, device: cpu-tiny, per_node: 2, intra_link: shm}
        network:
          inter_node: {kind: loopback, bandwidth_gbit_s: 10, latency_us: 20}
        """))
    return spec


NOT_FITTING = """\
    replicas:
      - {devices: fast, stages: 2, micro_batch: 8, share: 48}
      - {devices: slow, micro_batch: 16}
    """


def test_a_layout_that_does_not_fit_says_where_and_by_how_much(tmp_path):
    layout = _file(tmp_path, NOT_FITTING)
    options = merge_options(layout, _options(), set())
    found = estimate_prepared(prepare(MLP, _small_slow_spec(tmp_path), options), layout, options)
    assert not found.fits
    (over,) = found.overs
    e = found.plan.estimates
    assert (over.replica, over.stage, over.device) == (1, 0, "slow/1:0")
    assert over.need_bytes == e.memory_bytes[over.rank]
    assert over.capacity_bytes == e.capacity_bytes[over.rank] * (1 - e.memory_margin)
    assert e.capacity_bytes[over.rank] == pytest.approx(0.3 * GIB, rel=1e-9)
    assert over.over_bytes == pytest.approx(over.need_bytes - over.capacity_bytes, rel=1e-12) and over.over_bytes > 0
    # the rest is estimated and simulated all the same
    assert e.iteration_s > 0 and found.simulation.iteration_s > 0 and found.plan.comm is None


@pytest.mark.slow
def test_cli_not_fitting_exits_5_and_writes_nothing(tmp_path):
    (tmp_path / "mine.yaml").write_text(textwrap.dedent(NOT_FITTING))
    out = tmp_path / "out"
    proc = run_plan_cli("estimate", MLP, "--cluster", str(_small_slow_spec(tmp_path)), "--layout",
                        str(tmp_path / "mine.yaml"), "-o", str(out), timeout_s=120)
    assert proc.returncode == 5, proc.stderr
    assert "estimate:" in proc.stdout and "simulated:" in proc.stdout
    assert "replica 1 stage 0 on slow/1:0" in proc.stdout and "GiB over" in proc.stdout
    assert not out.exists()


@pytest.mark.slow
def test_cli_round_trip_and_output_like_any_plan(tmp_path):
    first, second = tmp_path / "planned", tmp_path / "estimated"
    first.mkdir()
    planned = plan(MLP, HETERO, _options(strategy="uniform")).plan
    planned.save(first / "plan.json")
    proc = run_plan_cli("estimate", MLP, "--cluster", HETERO, "--layout", str(first), "-o", str(second),
                        "--write-layout", str(tmp_path / "own.yaml"), timeout_s=120)
    assert proc.returncode == 0, proc.stderr
    assert "estimate:" in proc.stdout and "simulated:" in proc.stdout
    assert (second / "program" / "train.py").is_file() and (second / "summary.txt").is_file()
    estimated = Plan.load(second)
    assert estimated.estimates == planned.estimates and estimated.replicas == planned.replicas
    assert json.loads((second / "plan.json").read_text())["solver"]["strategy"] == "layout"
    assert load_layout(str(tmp_path / "own.yaml")).replicas == layout_of_plan(planned).replicas


# ----- bad input: one line naming the file, the field and the fix; nothing written ---------------------

@pytest.mark.parametrize("text, field", [
    ("replicas: [{devices: gpu-x}]", "replicas[0].devices"),
    ("replicas: [{devices: fast, stages: [{blocks: 0-2}, {blocks: 4-5}]}]", "replicas[0].stages[0].blocks"),
    ("replicas: [{devices: fast, stages: [{blocks: 0-3}]}]", "replicas[0].stages[0].blocks"),
    ("replicas: [{devices: fast, stages: [{blocks: 0-2}, {blocks: 3-9}]}]", "replicas[0].stages[1].blocks"),
    ("replicas: [{devices: fast, stages: [{layers: 0-1}, {layers: 3-4}]}]", "replicas[0].stages[0].layers"),
    ("replicas: [{devices: fast, stages: 2}, {devices: fast, stages: 2}]", "replicas[1].devices"),
    ("replicas: [{devices: fast, stages: 9}]", "replicas[0].stages"),
    ("replicas: [{devices: fast, share: 40}, {devices: slow, share: 40}]", "replicas[1].share"),
    ("replicas: [{devices: fast, share: 32, micro_batch: 8, micro_batches: 3}, {devices: slow}]",
     "replicas[0].micro_batches"),
    ("replicas: [{devices: fast, tp: 2}, {devices: slow}]", "replicas[0].tp"),
])
def test_layout_the_model_or_cluster_lacks(tmp_path, mlp_hetero, text, field):
    layout = _file(tmp_path, text)
    with pytest.raises(SpecError) as err:
        given.build(layout, mlp_hetero.tables, mlp_hetero.blocks)
    _one_line(err.value, str(tmp_path / "layout.yaml"), field)


@pytest.mark.parametrize("text, field", [
    ("replicas: []", "replicas"),
    ("replicas: [{stages: 2}]", "replicas[0].devices"),
    ("replicas: [{devices: fast, tp: 3}]", "replicas[0].tp"),
    ("replicas: [{devices: fast, stages: [{blocks: 3-1}]}]", "replicas[0].stages[0].blocks"),
    ("replicas: [{devices: fast, stages: [{rows: 0-1}]}]", "replicas[0].stages[0].rows"),
    ("replicas: [{devices: [fast, slow], stages: 3}]", "replicas[0].devices"),
    ("replicas: [{devices: fast, schedule: zigzag}]", "replicas[0].schedule"),
    ("replicas: [{devices: fast, stages: 4, chunks: 2, schedule: 1f1b}]", "replicas[0].chunks"),
    ("replicas: [{devices: fast, stages: 3, chunks: 2}]", "replicas[0].chunks"),
    ("replicas: [{devices: fast, stages: 2, schedule: interleaved}]", "replicas[0].schedule"),
    ("replicas: [{devices: fast, colour: red}]", "replicas[0].colour"),
])
def test_malformed_layout_file(tmp_path, text, field):
    with pytest.raises(SpecError) as err:
        _file(tmp_path, text)
    _one_line(err.value, str(tmp_path / "layout.yaml"), field)


@pytest.mark.parametrize("text, field", [
    ("dp=4;tp=2", "--layout"), ("dp=4,tp=2,pp=2", "--layout mb"), ("dp=0,tp=1,pp=1,mb=1", "--layout dp"),
    ("dp=1,tp=3,pp=1,mb=1", "--layout tp"), ("dp=1,tp=1,pp=1,mb=1,xx=2", "--layout xx"),
    ("dp=1,dp=2,tp=1,pp=1,mb=1", "--layout dp"), ("", "--layout"), ("  ", "--layout"),
])
def test_malformed_shorthand(text, field):
    with pytest.raises(OptionError) as err:
        load_layout(text)
    _one_line(err.value, field)


def test_shorthand_vpp_is_interleaved_1f1b_on_pp_devices():
    """Megatron's vpp: pp devices of pp x vpp stages, stage k on device k mod pp; estimated as the
    simulator runs it."""
    text = "dp=2,tp=1,pp=2,vpp=2,mb=2,gbs=16"
    layout = load_layout(text)
    assert layout.shorthand is not None and layout.shorthand.vpp == 2
    options = merge_options(layout, _options(), set())
    found = estimate_prepared(prepare(GPT, CPU4, options), layout, options)
    for r in found.plan.replicas:
        assert (r.schedule, r.chunks, len(r.stages), len(r.device_stages)) == ("interleaved", 2, 4, 2)
        assert [st.rank for st in r.stages] == [st.rank for st in r.device_stages] * 2
    assert found.plan.estimates.iteration_s == pytest.approx(found.simulation.iteration_s, rel=0.05)


def test_shorthand_larger_than_the_cluster(mlp_hetero):
    with pytest.raises(OptionError) as err:
        given.build(load_layout("dp=3,tp=1,pp=2,mb=1"), mlp_hetero.tables, mlp_hetero.blocks)
    _one_line(err.value, "--layout dp", "dp=3", "6 devices", "holds 2")


def test_flag_and_layout_disagree(tmp_path):
    layout = _file(tmp_path, "global_batch: 32\nreplicas: [{devices: fast}]\n")
    with pytest.raises(OptionError) as err:
        merge_options(layout, _options(global_batch=64), {"global_batch"})
    _one_line(err.value, "--global-batch", "32")
    assert merge_options(layout, _options(global_batch=32), {"global_batch"}).global_batch == 32


def test_cli_bad_shorthand_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["estimate", MLP, "--cluster", HETERO, "--layout", "dp=2,,tp=1", "-o", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("plan: error: --layout")
    assert "fix:" in err and not out.exists()
    proc = run_plan_cli("estimate", MLP, "--cluster", HETERO, "--layout", "dp=2,tp=1,pp=1", "-o", str(out),
                        timeout_s=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--layout mb" in proc.stderr and not out.exists()


def test_equal_split_default(mlp_hetero, tmp_path):
    layout = _file(tmp_path, "replicas: [{devices: fast, stages: 2}, {devices: slow}]\n")
    built = given.build(layout, mlp_hetero.tables, mlp_hetero.blocks)
    configs = {c.config.num_stages: c for c in built.solution.choices}
    assert configs[2].config.split.bounds == equal_bounds(6, 2)
    assert configs[2].share == 32 and configs[1].share == 32
    assert configs[2].config.micro_batch == 16 and configs[1].config.micro_batch == 32   # count = stages
    assert configs[2].config.schedule == "1f1b" and built.solution.status == given.GIVEN_STATUS


def test_cli_unknown_device_is_one_line_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "mine.yaml").write_text("replicas: [{devices: fast, stages: 2}, {devices: a100}]\n")
    out = tmp_path / "out"
    code = main(["estimate", MLP, "--cluster", HETERO, "--layout", str(tmp_path / "mine.yaml"), "-o", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{tmp_path / 'mine.yaml'}: replicas[1].devices: the cluster has no node group or device type 'a100'" in err
    assert "fix: name one of the groups fast, slow" in err and not out.exists()


def test_a_shorthand_lacking_keys_is_shown_completed_and_the_completion_parses():
    with pytest.raises(OptionError) as err:
        load_layout("dp=3, pp=2")
    assert err.value.message == "the shorthand lacks tp, mb"
    assert err.value.fix == "give dp, tp, pp and mb, e.g. 'dp=3, pp=2,tp=1,mb=1'"
    completed = load_layout("dp=3, pp=2,tp=1,mb=1")
    assert completed.shorthand is not None and (completed.shorthand.tp, completed.shorthand.mb) == (1, 1)
