"""`plan export OUT --onnx DIR`: every stage of a 2-stage plan as ONNX, checked in onnxruntime.

The command checks each file against its torch stage; these tests check the files once more from the
outside: the stages' ONNX files, chained in onnxruntime, give what the whole torch model gives on the same
batch (the split, the boundary names and the export are all in that chain), and the weights travel as
initializers (a file's only inputs are the values crossing its stage's boundaries).
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.torchdist.program import materialise
from planner import frontend
from planner.cli import main
from planner.core.ir import Plan
from tests.helpers import CLUSTERS, EXAMPLES

pytest.importorskip("onnxruntime")
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

SPEC = str(CLUSTERS / "cpu-hetero-4.yaml")
TOLERANCE = 1e-4
ROWS = 2


def _plan_two_stages(model: Path, out: Path) -> None:
    code = main([str(model), "--cluster", SPEC, "--global-batch", "8", "--stages", "2", "--micro-batch", str(ROWS),
                 "--no-runners-up", "-o", str(out)])
    assert code == 0


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("onnx_plans")
    out = {}
    for name in ("gpt", "resnet", "hf_llama"):
        _plan_two_stages(EXAMPLES / name / "model.py", root / name)
        out[name] = root / name
    return out


def _onnx_forward(files: list[Path], model_input: np.ndarray) -> dict[str, np.ndarray]:
    """Run the stage files in order, each fed by name from the model input and the earlier stages."""
    values: dict[str, np.ndarray] = {}
    for path in files:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feeds = {i.name: values.get(i.name, model_input) for i in session.get_inputs()}
        names = [o.name for o in session.get_outputs()]
        values.update(zip(names, session.run(names, feeds)))
    return values


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "resnet", "hf_llama"])
def test_every_stage_exports_and_matches_torch(plans, name, tmp_path, capsys):
    stages_dir = tmp_path / "stages"
    code = main(["export", str(plans[name]), "--onnx", str(stages_dir)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    plan = Plan.load(plans[name])
    replica = plan.replicas[0]
    assert len(replica.stages) == 2
    files = [stages_dir / f"stage{k}_replica0.onnx" for k in range(2)]
    assert all(f.is_file() for f in files)
    # the table: one row per file, each with its max abs difference within the tolerance
    rows = {line.split()[0]: line for line in printed.out.splitlines() if line.startswith("stage")}
    for f in files:
        diff = float(re.findall(r"\d\.\d\de[-+]\d\d", rows[f.name])[0])
        assert diff <= TOLERANCE

    # weights are initializers: a stage file's inputs are only values crossing its boundaries
    first, second = (onnx.load(str(f)) for f in files)
    model_inputs = set(plan.inputs.model_input_names)
    assert {i.name for i in first.graph.input} <= model_inputs
    crossing = {o.name for o in first.graph.output}
    assert {i.name for i in second.graph.input} <= crossing | model_inputs
    assert replica.stages[0].last_node in crossing
    assert len(first.graph.initializer) > 0 and len(second.graph.initializer) > 0

    # chained in onnxruntime, the stages compute the whole torch model's forward
    model_file = frontend.load_model_file(plans[name] / "program" / "model.py")
    model = materialise.full_model(model_file, 0)      # the program's initial values for seed 0
    (x,), _ = model_file.batch(ROWS, 0)
    with torch.no_grad():
        expected = model(x).numpy()
    values = _onnx_forward(files, x.numpy())
    got = values[second.graph.output[0].name]
    assert got.shape == expected.shape
    assert float(np.abs(got - expected).max()) <= TOLERANCE


@pytest.mark.slow
def test_a_cut_at_a_node_the_model_does_not_have_is_one_line(plans, tmp_path, capsys):
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "program").mkdir()
    (edited / "program" / "model.py").write_bytes((plans["resnet"] / "program" / "model.py").read_bytes())
    data = json.loads((plans["resnet"] / "plan.json").read_text())
    cut = data["replicas"][0]["stages"][0]["last_block"]
    data["replicas"][0]["stages"][0]["last_node"] = "no_such_node"
    data["blocks"][cut]["last_node"] = "no_such_node"   # the verifier checks that the two agree
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    (edited / "plan.json").write_text(text)
    (edited / "program" / "plan.json").write_text(text)
    code = main(["export", str(edited), "--onnx", str(tmp_path / "stages"), "--allow-changed"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert "no_such_node" in err and "last_node" in err and str(edited / "plan.json") in err
    assert not (tmp_path / "stages").exists()


@pytest.mark.slow
def test_an_operator_onnx_lacks_is_one_line_naming_stage_and_op(tmp_path, capsys):
    model = tmp_path / "spectral.py"
    model.write_text(textwrap.dedent('''
        import torch
        from torch import nn


        class Spectral(nn.Module):
            def __init__(self):
                super().__init__()
                self.inp = nn.Linear(8, 8)
                self.out = nn.Linear(8, 4)

            def forward(self, x):
                h = self.inp(x)
                return self.out(torch.linalg.eigvalsh(h.unsqueeze(-1) * h.unsqueeze(-2)))


        def model():
            return Spectral()


        def batch(batch_size, step):
            g = torch.Generator().manual_seed(step)
            return (torch.randn(batch_size, 8, generator=g),), torch.randn(batch_size, 4, generator=g)
    '''))
    _plan_two_stages(model, tmp_path / "out")
    capsys.readouterr()
    code = main(["export", str(tmp_path / "out"), "--onnx", str(tmp_path / "stages")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert "stage 1" in err and "aten._linalg_eigh" in err
    assert not (tmp_path / "stages").exists()


@pytest.mark.slow
def test_a_stage_outside_the_tolerance_fails_and_writes_nothing(plans, tmp_path, capsys):
    stages_dir = tmp_path / "stages"
    code = main(["export", str(plans["resnet"]), "--onnx", str(stages_dir), "--tolerance", "1e-12"])
    printed = capsys.readouterr()
    assert code == 4
    assert len(printed.err.strip().splitlines()) == 1 and "differs from torch" in printed.err
    assert "stage0_replica0.onnx" in printed.out      # the table of every stage is still shown
    assert not stages_dir.exists()
