"""A plan that passes never crashes at start-up: `plan` runs every stage forward and backward on meta
(passes.stage_check) and either fixes what would crash or refuses with one line naming the module; and it
warns where a run will differ from one process (BatchNorm, dropout)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from backends.torchdist.reference import train_reference
from costmodel.placeholders import NOTE_PREFIX
from passes.blocks import compute_nodes
from passes.split import clone_written_inputs, split_stages
from passes.stage_check import check_stage_runs, group_modules
from planner import frontend
from planner.core.errors import PassError
from planner.core.ir import Plan
from tests.helpers import CLUSTERS, run_plan_cli, run_program

STEPS = 3
CLUSTER = str(CLUSTERS / "cpu-hetero-4.yaml")

ROWS = '''
def batch(batch_size, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 8, generator=g)[:batch_size]
    return (x,), x[:, :4].contiguous()
'''

# three blocks: [a], [act, b], [act2, c]: every cut is right before an in-place ReLU
INPLACE = '''
import torch
import torch.nn as nn

def model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True),
                         nn.Linear(16, 4))
''' + ROWS

# the parameter-free tail outweighs the layers: two stages cut before it
NO_PARAMS_LAST = '''
import torch
import torch.nn as nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        wide = h.unsqueeze(-1).expand(-1, -1, 8192)
        return (torch.tanh(wide) * torch.sigmoid(wide) + wide.cos()).mean(-1)

def model():
    return Net()
''' + ROWS

BATCH_NORM_HEAD = '''
import torch
import torch.nn as nn

class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, h):
        return self.out(torch.relu(self.bn(self.fc(h))))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(8, 16), Head()

    def forward(self, x):
        return self.head(torch.tanh(self.a(x)))

def model():
    return Net()
''' + ROWS

# a tiny GPT-2 whose forward returns a CausalLMOutputWithCrossAttentions; the loss reads `.logits`
HF_MODEL_OUTPUT = '''
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

SEQ, VOCAB = 8, 64

def model():
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
                        tie_word_embeddings=False)
    return GPT2LMHeadModel(config)

def batch(batch_size, step):
    rows = [torch.randint(VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(1000 * step + r))
            for r in range(batch_size)]
    tokens = torch.stack(rows)
    return (tokens[:, :-1],), tokens[:, 1:]

def loss_fn(output, target):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
'''

# four BatchNorm2d (named two at a time), a dropout that draws masks and one with p=0 that does not
NOISY = '''
import torch
import torch.nn as nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(Block(), nn.Conv2d(4, 4, 1), Block(), Block(), nn.Conv2d(4, 4, 1), Block())
        self.drop, self.still = nn.Dropout(0.1), nn.Dropout(0.0)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.still(self.drop(self.body(x).flatten(1))))

def model():
    return Net()

def batch(batch_size, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 4, 4, 4, generator=g)[:batch_size]
    return (x,), x[:, 0, 0, :4].contiguous()
'''


def _model_file(tmp_path: Path, source: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def _plan(model: Path, out: Path, *options: str):
    return run_plan_cli(str(model), "--cluster", CLUSTER, "--no-runners-up", *options, "-o", str(out))


def _trains_like_one_process(out: Path, model: Path, plan: Plan, optimizer: str = "adamw", lr: float = 1e-3) -> None:
    """`plan run` equals single-process training: every rank's loss and every parameter at 1e-5."""
    metrics = run_program(out, STEPS, seed=2, optimizer=optimizer, lr=lr)
    ref = train_reference(str(model), global_batch=plan.global_batch, steps=STEPS, seed=2, optimizer=optimizer, lr=lr)
    assert len(metrics) == STEPS * plan.world_size
    for m in metrics:
        assert m["loss"] == pytest.approx(ref.losses[m["step"]], rel=1e-5), m
    for rank in range(plan.world_size):
        for name, value in torch.load(out / "run" / "final" / f"rank{rank}.pt").items():
            rel = float((value - ref.params[name]).norm() / ref.params[name].norm().clamp_min(1e-12))
            assert rel <= 1e-5, f"rank {rank} {name}: relative error {rel:.2e}"


def _meta_split(model: Path, rows: int, cuts: list[str] | None = None):
    """The model traced on meta at `rows` rows and split after `cuts` (default: after every third of it),
    with its meta inputs and target."""
    model_file = frontend.load_model_file(model)
    inputs, target = frontend.example_batch(model_file, rows)
    inputs, target = frontend.to_device(inputs, "meta"), frontend.to_device(target, "meta")
    gm = frontend.trace(frontend.build_on_meta(model_file), inputs)
    nodes = compute_nodes(gm.graph)
    split = split_stages(gm, cuts or [nodes[len(nodes) // 3].name, nodes[-1].name])
    return model_file, gm, split, inputs, target


# ----- 1. an in-place op right after a cut ----------------------------------------------------------------

def test_only_inputs_written_in_place_are_cloned(tmp_path):
    model_file, gm, split, inputs, target = _meta_split(_model_file(tmp_path, INPLACE), 2, ["linear", "linear_2"])
    first = [n for n in split.stages[1].module.graph.nodes if n.op == "call_function"][:2]
    assert [str(n.target) for n in first] == ["aten.clone.default", "aten.relu_.default"]
    assert first[0].args[0].name == "linear" and first[1].args[0] is first[0]
    # the model input of stage 0 and the graph of an ordinary model get no copy
    assert not any("clone" in str(n.target) for n in split.stages[0].module.graph.nodes)
    plain = _meta_split(_model_file(tmp_path, NO_PARAMS_LAST, "plain.py"), 2)[2]
    assert not any("clone" in str(n.target) for st in plain.stages for n in st.module.graph.nodes)
    # a write through a view of an input counts too
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    view = graph.call_function(torch.ops.aten.view.default, (x, [-1]))
    graph.output(graph.call_function(torch.ops.aten.relu_.default, (view,)))
    assert clone_written_inputs(graph) == ["x"]
    for run in [check_stage_runs(split, k, model_file, inputs, target) for k in range(2)]:
        assert run.rows == 2 and run.saved_bytes > 0
    assert check_stage_runs(split, 0, model_file, inputs, target).param_count == 8 * 16 + 16


def test_a_stage_that_fails_is_named_by_its_module(tmp_path):
    model_file, gm, split, inputs, target = _meta_split(_model_file(tmp_path, INPLACE), 2, ["linear", "linear_2"])
    graph = split.stages[1].module.graph        # undo the clone: the in-place ReLU on the received leaf
    clone = next(n for n in graph.nodes if n.target == torch.ops.aten.clone.default)
    clone.replace_all_uses_with(clone.args[0])
    graph.erase_node(clone)
    split.stages[1].module.recompile()
    with pytest.raises(PassError) as failed:
        check_stage_runs(split, 1, model_file, inputs, target)
    line = failed.value.one_line()
    assert "stage 1 of 2 at micro-batch size 2 fails its forward in module 1 (ReLU)" in line, line
    assert "in-place" in line and failed.value.exit_code == 4


@pytest.mark.slow
def test_in_place_relu_right_after_a_cut_trains_like_one_process(tmp_path):
    model, out = _model_file(tmp_path, INPLACE), tmp_path / "out"
    proc = _plan(model, out, "--global-batch", "8", "--stages", "2", "--micro-batch", "2")
    assert proc.returncode == 0, proc.stderr
    # no BatchNorm, no dropout: nothing to warn about but the catalog's placeholder CPU figures
    assert not [ln for ln in proc.stderr.splitlines() if "warning" in ln and NOTE_PREFIX not in ln], proc.stderr
    plan = Plan.load(out)
    assert all(w.startswith(NOTE_PREFIX) for w in json.loads((out / "plan.json").read_text()).get("warnings", ()))
    gm, _ = frontend.trace_model(frontend.load_model_file(model), 2)
    names = [n.name for n in compute_nodes(gm.graph)]
    for replica in plan.replicas:                 # the second stage starts with an in-place ReLU
        assert len(replica.stages) == 2
        assert names[names.index(replica.stages[0].last_node) + 1].startswith("relu_")
    _trains_like_one_process(out, model, plan)


# ----- 2. a stage without parameters -----------------------------------------------------------------------

@pytest.mark.slow
def test_parameter_free_last_stage_trains_like_one_process(tmp_path):
    model, out = _model_file(tmp_path, NO_PARAMS_LAST), tmp_path / "out"
    proc = _plan(model, out, "--global-batch", "8", "--stages", "2", "--use-all-devices", "--micro-batch", "2")
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(out)
    assert [len(r.stages) for r in plan.replicas] == [2, 2]
    assert all(r.stages[-1].params == () for r in plan.replicas)
    assert plan.grad_groups and all(len(g.ranks) == 2 for g in plan.grad_groups)   # the first stages' sync
    _trains_like_one_process(out, model, plan)


# ----- 3. BatchNorm at a 1-row micro-batch -----------------------------------------------------------------

def test_batch_norm_at_a_one_row_micro_batch_is_refused_naming_the_module(tmp_path):
    # an odd global batch over two replicas gives one of them an odd share: under --micro-batch 2 its last
    # micro-batch has 1 row
    model, out = _model_file(tmp_path, BATCH_NORM_HEAD), tmp_path / "out"
    proc = _plan(model, out, "--global-batch", "7", "--stages", "2", "--use-all-devices", "--micro-batch", "2")
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert str(model) in line and "module head.bn (BatchNorm1d)" in line and "micro-batch of 1 row" in line, line
    assert "--micro-batch 2" in line and "GroupNorm" in line, line
    assert not out.exists()


# ----- 4. a Hugging Face ModelOutput --------------------------------------------------------------------------

@pytest.mark.slow
def test_hf_model_output_reaches_the_loss_as_on_one_process(tmp_path):
    model, out = _model_file(tmp_path, HF_MODEL_OUTPUT), tmp_path / "out"
    proc = _plan(model, out, "--global-batch", "4", "--stages", "2", "--micro-batch", "2")
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(out)
    assert [len(r.stages) for r in plan.replicas] == [2]
    # SGD: the attention's key bias has a gradient of float noise only (softmax ignores a shift), which
    # AdamW's division by sqrt(v) turns into full-size updates that differ between summation orders
    _trains_like_one_process(out, model, plan, optimizer="sgd", lr=0.05)


def test_the_last_stage_rebuilds_the_model_output(tmp_path):
    model_file, gm, split, inputs, target = _meta_split(_model_file(tmp_path, HF_MODEL_OUTPUT), 2)
    output = split.model_output([torch.empty(2, 8, 64, device="meta")])
    assert type(output).__name__ == "CausalLMOutputWithCrossAttentions" and output.logits.shape == (2, 8, 64)
    run = check_stage_runs(split, 1, model_file, inputs, target)        # the loss reads `.logits`
    assert run.param_count > 0


# ----- warnings -------------------------------------------------------------------------------------------------

def test_batch_norm_and_dropout_are_warned_about_by_module(tmp_path):
    model, out = _model_file(tmp_path, NOISY), tmp_path / "out"
    proc = _plan(model, out, "--global-batch", "8", "--micro-batch", "2", "--stages", "1")
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines()
              if line.startswith("plan: warning: ") and NOTE_PREFIX not in line]     # not the placeholder note
    assert len(warned) == 2, proc.stderr
    assert "BatchNorm2d in body.0.bn, body.2.bn and 2 more" in warned[0] and "2 rows" in warned[0], warned
    assert "Dropout in drop;" in warned[1] and "still" not in warned[1], warned     # p=0 draws no mask
    plan = Plan.load(out)
    assert [f"plan: warning: {w}" for w in plan.warnings if not w.startswith(NOTE_PREFIX)] == warned
    summary = (out / "summary.txt").read_text()
    assert all(w in summary for w in plan.warnings)
    assert "warnings:" not in proc.stdout         # the terminal shows them once, on stderr
    # a plan file from before the field loads without warnings
    data = json.loads((out / "plan.json").read_text())
    del data["warnings"]
    assert Plan.from_json(json.dumps(data)).warnings == ()


def test_modules_are_grouped_by_class(tmp_path):
    _, gm, *_ = _meta_split(_model_file(tmp_path, NOISY), 2)
    norms = [n for n in gm.graph.nodes if "batch_norm" in str(n.target)]
    assert group_modules(norms[:1]) == "BatchNorm2d in body.0.bn"
    assert group_modules(norms[:2]) == "BatchNorm2d in body.0.bn and body.2.bn"
    assert group_modules(norms) == "BatchNorm2d in body.0.bn, body.2.bn and 2 more"
