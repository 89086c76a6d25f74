"""Passes: annotate, blocks, split (before/expected structure, the no-op case), pass manager."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from passes.annotate import COST_KEY, Annotate, MetaShapes
from passes.base import PassManager, PassResult, function_pass
from passes.blocks import BLOCKS_KEY, Blocks, compute_nodes
from passes.split import split_stages
from planner import frontend
from planner.api import trace_model_file
from planner.core.errors import PassError
from tests.helpers import EXAMPLES


def _load(name):
    return frontend.load_model_file(EXAMPLES / name / "model.py")


@pytest.fixture(scope="module")
def gpt():
    mf = _load("gpt")
    gm, blocks, _ = trace_model_file(mf)
    return mf, gm, blocks


def test_trace_allocates_no_storage(gpt):
    _, gm, _ = gpt
    for name, p in gm.named_parameters():
        assert p.is_meta, name


def test_annotate_counts_matmul_flops_from_autograd(gpt):
    _, gm, _ = gpt
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    assert linears
    for n in linears:
        c = n.meta[COST_KEY]
        x, w = n.args[0].meta["val"], n.args[1].meta["val"]
        expected = 2 * x.numel() // x.shape[-1] * w.shape[0] * w.shape[1]
        assert c.fwd_flops == expected
        # backward: grad input and grad weight (each a matmul of the same size)
        assert c.bwd_flops == 2 * expected


def test_blocks_cover_every_node_and_parameter_once(gpt):
    _, gm, blocks = gpt
    nodes = compute_nodes(gm.graph)
    covered = [n.name for n in nodes]
    assert blocks[0].first_node == covered[0] and blocks[-1].last_node == covered[-1]
    for a, b in zip(blocks, blocks[1:]):
        assert covered.index(b.first_node) == covered.index(a.last_node) + 1
    params = {p for b in blocks for p in b.params}
    assert params == {n.target for n in gm.graph.nodes if n.op == "get_attr"
                      and getattr(n.meta["val"], "requires_grad", False) and n.users}


def test_repeated_layers_share_signatures(gpt):
    _, _, blocks = gpt
    by_label = {}
    for b in blocks:
        by_label.setdefault(b.signature, []).append(b.label)
    assert max(len(v) for v in by_label.values()) >= 3   # 4 transformer layers -> repeated blocks


def test_block_label_is_the_most_frequent_module_earliest_on_a_tie(gpt):
    """The label must not depend on set order (string hashing differs per process)."""
    from passes.blocks import BLOCK_INDEX_KEY, _module_path
    _, gm, blocks = gpt
    for b in blocks:
        paths = [_module_path(n)[-1] if _module_path(n) else "" for n in compute_nodes(gm.graph)
                 if n.meta[BLOCK_INDEX_KEY] == b.index]
        assert b.label == max(paths, key=paths.count)   # max keeps the first of equal counts


def test_op_counter_measures_each_signature_once(gpt):
    """Repeated layers hit the counter's cache: one FLOP measurement per distinct op signature."""
    from costmodel.ops import OpCounter, op_class
    _, gm, _ = gpt
    counter = OpCounter()
    Annotate(counter)(gm)
    counted = [n for n in compute_nodes(gm.graph) if op_class(n.target) != "view"]
    assert 0 < counter.measured < len(counted) / 3      # 4 identical layers: most signatures repeat


def test_blocks_cut_between_transformer_layers(gpt):
    _, gm, blocks = gpt
    # each cut leaves a single trainable activation live (the residual stream)
    from passes.blocks import live_after, trainable_dependent
    nodes = compute_nodes(gm.graph)
    counts, _ = live_after(nodes, trainable_dependent(gm.graph))
    names = [n.name for n in nodes]
    for b in blocks[:-1]:
        assert counts[names.index(b.last_node)] == 1


def test_split_stages_equals_whole_model():
    mf = _load("gpt")
    torch.manual_seed(0)
    model = mf.build()
    inputs, _ = mf.batch(3, 0)
    gm = frontend.trace(model, tuple(inputs))
    nodes = compute_nodes(gm.graph)
    cuts = [nodes[len(nodes) // 3].name, nodes[2 * len(nodes) // 3].name, nodes[-1].name]
    split = split_stages(gm, cuts)
    env = dict(zip(split.model_inputs, inputs))
    for st in split.stages:
        outs = st.module(*[env[i] for i in st.inputs])
        env.update(zip(st.model_outputs or st.outputs, outs))
        # every input is a model input or produced by an earlier stage
        for name in st.inputs:
            assert split.values[name].producer < st.index
    torch.testing.assert_close(env[split.stages[-1].model_outputs[0]], model(*inputs))
    # the stages share the model's Parameter objects (an optimizer on the model trains the stages)
    params = dict(model.named_parameters())
    for st in split.stages:
        for name in st.params:
            assert getattr(st.module, name.replace(".", "__")) is params[name]


def test_split_routes_skip_over_a_stage():
    mf = _load("resnet")
    torch.manual_seed(0)
    model = mf.build()
    inputs, _ = mf.batch(2, 0)
    gm = frontend.trace(model, tuple(inputs))
    nodes = compute_nodes(gm.graph)
    stem_out = next(n for n in nodes if "stem" in str(list((n.meta.get("nn_module_stack") or {"": ("",)})
                                                             .values())[-1][0]) and n.name.startswith("relu"))
    cuts = [stem_out.name, nodes[len(nodes) // 2].name, nodes[-1].name]
    split = split_stages(gm, cuts)
    skip = split.values[stem_out.name]
    assert skip.producer == 0 and 2 in skip.consumers      # jumps over stage 1
    assert stem_out.name in split.stages[2].inputs and stem_out.name in split.stages[1].inputs


def test_split_single_stage_is_the_whole_graph():
    mf = _load("mlp")
    torch.manual_seed(0)
    model = mf.build()
    inputs, _ = mf.batch(4, 0)
    gm = frontend.trace(model, tuple(inputs))
    split = split_stages(gm, [compute_nodes(gm.graph)[-1].name])
    (st,) = split.stages
    assert st.inputs == split.model_inputs
    assert len(compute_nodes(st.module.graph)) == len(compute_nodes(gm.graph))
    torch.testing.assert_close(st.module(*inputs)[0], model(*inputs))


def test_split_rejects_unknown_cut():
    mf = _load("mlp")
    gm = frontend.trace(mf.build(), tuple(mf.batch(2, 0)[0]))
    with pytest.raises(PassError, match="not in the traced graph"):
        split_stages(gm, ["no_such_node"])


def test_pass_manager_names_failing_pass_and_history(tmp_path):
    mf = _load("mlp")
    gm = frontend.trace(frontend.build_on_meta(mf), frontend.to_device(mf.batch(2, 0)[0], "meta"))

    def boom(_: fx.GraphModule) -> bool:
        raise RuntimeError("kaput")

    pm = PassManager([MetaShapes(()), Annotate(), function_pass("boom", boom)], dump_dir=tmp_path)
    with pytest.raises(PassError) as err:
        pm.run(gm)
    assert "`boom`" in str(err.value) and "meta_shapes, annotate" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["001_meta_shapes.txt", "002_annotate.txt"]


def test_blocks_requires_annotate():
    mf = _load("mlp")
    gm = frontend.trace(frontend.build_on_meta(mf), frontend.to_device(mf.batch(2, 0)[0], "meta"))
    with pytest.raises(PassError, match="annotate"):
        Blocks()(gm)


def test_meta_shapes_is_a_no_op_on_exported_graphs(gpt):
    _, gm, _ = gpt
    assert MetaShapes(()).call(gm) == PassResult(gm, False)
    assert BLOCKS_KEY in gm.meta
