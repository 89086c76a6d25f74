"""`plan model.onnx`: cost-only planning of an ONNX graph, with the same passes and search as a model file.

The MLP and the ResNet, exported whole with `torch.onnx.export(..., dynamo=True)` (the default export a
user makes, constant folding and all), plan to the same stages as their PyTorch files: the same blocks,
costed alike, so the search makes the same split. The cluster is one where that split is decided by
the blocks' costs (moving the cut by one block changes the slowest stage), not a tie the search breaks
the same way whatever the costs.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from passes.blocks import BLOCKS_KEY
from planner import frontend
from planner.api import PlanOptions, analyse, plan
from planner.cli import main
from planner.cli.plan_cmd import COST_ONLY_NOTE
from planner.core.errors import ModelFileError
from planner.core.ir import Plan
from planner.frontend.onnx_model import load_onnx_model
from tests.helpers import CLUSTERS, EXAMPLES

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

SPEC = str(CLUSTERS / "cpu-hetero-4.yaml")
OPTIONS = ["--cluster", SPEC, "--global-batch", "64", "--stages", "2", "--no-runners-up"]
MODELS = ["mlp", "resnet"]


def export_full_model(name: str, path: Path) -> Path:
    """The example's whole model as ONNX, exported as a user would: model(), a batch from batch()."""
    model_file = frontend.load_model_file(EXAMPLES / name / "model.py")
    torch.manual_seed(0)
    model = model_file.build().eval()
    inputs, _ = model_file.batch(2, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, tuple(inputs), dynamo=True, verbose=False).save(str(path))
    return path


@pytest.fixture(scope="module")
def onnx_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("onnx_models")
    return {name: export_full_model(name, root / f"{name}.onnx") for name in MODELS}


def _stage_layout(p: Plan) -> list[tuple[str, int, tuple[int, ...], tuple[tuple[int, int, str], ...]]]:
    return [(r.node_group, r.batch_share, r.micro_batch_sizes,
             tuple((s.first_block, s.last_block, s.last_node) for s in r.stages)) for r in p.replicas]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_the_onnx_graph_plans_to_the_pytorch_files_stage_split(onnx_files, name, tmp_path, capsys):
    assert main([str(EXAMPLES / name / "model.py"), *OPTIONS, "-o", str(tmp_path / "py")]) == 0
    capsys.readouterr()
    assert main([str(onnx_files[name]), *OPTIONS, "-o", str(tmp_path / "onnx")]) == 0
    printed = capsys.readouterr().out
    assert COST_ONLY_NOTE in printed
    out = tmp_path / "onnx"
    assert (out / "plan.json").is_file() and (out / "summary.txt").is_file() and not (out / "program").exists()
    assert COST_ONLY_NOTE in (out / "summary.txt").read_text()

    from_py, from_onnx = Plan.load(tmp_path / "py"), Plan.load(out)
    assert len(from_onnx.blocks) == len(from_py.blocks)
    assert _stage_layout(from_onnx) == _stage_layout(from_py)       # same blocks per stage, same node names
    assert all(len(r.stages) == 2 for r in from_onnx.replicas)
    assert from_onnx.estimates.iteration_s == pytest.approx(from_py.estimates.iteration_s, rel=0.01)
    for a, b in zip(from_onnx.blocks, from_py.blocks):
        assert (a.first_node, a.last_node, a.label) == (b.first_node, b.last_node, b.label)
        assert a.fwd_flops == pytest.approx(b.fwd_flops) and a.bwd_flops == pytest.approx(b.bwd_flops)
        assert a.boundary_bytes == b.boundary_bytes
    assert sum(b.param_bytes for b in from_onnx.blocks) == pytest.approx(sum(b.param_bytes for b in from_py.blocks),
                                                                         rel=0.01)
    assert from_onnx.inputs.model_path.endswith(".onnx") and from_onnx.program is None

    # the plan directory reads like any other; there is nothing of it to export
    assert main(["inspect", str(out)]) == 0
    capsys.readouterr()
    assert main(["export", str(out), "--onnx", str(tmp_path / "stages")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cost-only plan of an ONNX graph" in err


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_the_split_is_decided_by_costs_the_onnx_reader_gets_right(onnx_files, name):
    options = PlanOptions(global_batch=64, stages=2, runners_up=False)
    from_py = plan(EXAMPLES / name / "model.py", SPEC, options)
    from_onnx = plan(onnx_files[name], SPEC, options)
    for py_class, onnx_class in zip(from_py.tables.classes, from_onnx.tables.classes):
        assert onnx_class.fwd_s == pytest.approx(py_class.fwd_s, rel=0.02)
        assert onnx_class.bwd_s == pytest.approx(py_class.bwd_s, rel=0.02)
        assert onnx_class.boundary_bytes == pytest.approx(py_class.boundary_bytes)
    # no tie: moving the chosen cut one block either way changes the slowest stage by more than 5%
    cut = from_py.plan.replicas[0].stages[0].last_block
    per_block = [f + b for f, b in zip(from_py.tables.classes[0].fwd_s, from_py.tables.classes[0].bwd_s)]

    def slowest(c: int) -> float:
        return max(sum(per_block[:c + 1]), sum(per_block[c + 1:]))

    for other in (cut - 1, cut + 1):
        if 0 <= other < len(per_block) - 1:
            assert abs(slowest(other) - slowest(cut)) > 0.05 * slowest(cut)


def test_a_malformed_onnx_file_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"\x08\x07garbage, not a protobuf ModelProto\xff\xff")
    code = main([str(bad), "--cluster", SPEC, "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("plan: error: ") and str(bad) in err and "not a valid ONNX model" in err
    assert not (tmp_path / "out").exists()


def _foreign_graph(batch_dim: str | int, seq_dim: str | int = 32) -> onnx.ModelProto:
    """A graph another framework could have written: no torch metadata, one ONNX node per op."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch_dim, seq_dim])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch_dim, 10])
    weights = [helper.make_tensor("w1", TensorProto.FLOAT, [32, 64], [0.0] * 32 * 64),
               helper.make_tensor("b1", TensorProto.FLOAT, [64], [0.0] * 64),
               helper.make_tensor("w2", TensorProto.FLOAT, [10, 64], [0.0] * 640),
               helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
             helper.make_node("Relu", ["hb"], ["r"], name="act"),
             helper.make_node("Mul", ["r", "half"], ["rs"], name="scale"),
             helper.make_node("Gemm", ["rs", "w2"], ["y"], name="fc2", transB=1)]
    graph = helper.make_graph(nodes, "foreign", [x], [y], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_foreign_graph_reads_with_torchs_flop_counts_and_a_symbolic_batch(tmp_path):
    path = tmp_path / "foreign.onnx"
    onnx.save(_foreign_graph("N"), str(path))
    model = load_onnx_model(path, trace_batch=2)
    assert model.trace_batch == 2 and tuple(model.meta_inputs[0].shape) == (2, 32)
    analyse(model.graph, model.meta_inputs)
    blocks = model.graph.meta[BLOCKS_KEY]
    fwd = sum(b.fwd_flops for b in blocks)
    assert fwd == 2 * 2 * 32 * 64 + 2 * 2 * 64 * 10       # the two matmuls, as torch's counter counts them
    assert sum(b.bwd_flops for b in blocks) == 2 * fwd     # gradients of both operands
    params = {p for b in blocks for p in b.params}
    assert params == {"w1", "b1", "w2"}                    # the scalar is a constant, not a weight
    assert sum(b.param_bytes for b in blocks) == 4 * (32 * 64 + 64 + 640)


def test_a_symbolic_dimension_other_than_the_batch_is_one_line(tmp_path):
    path = tmp_path / "foreign.onnx"
    onnx.save(_foreign_graph(4, "seq"), str(path))
    with pytest.raises(ModelFileError) as caught:
        load_onnx_model(path, trace_batch=2)
    line = caught.value.one_line()
    assert "input x has a symbolic dimension 1 (seq)" in line and str(path) in line
