"""Split a traced graph into pipeline stages at the plan's cut nodes (lowering).

Stage k holds the compute nodes after stage k-1's last node up to its own `last_node`. Each
stage becomes a GraphModule whose inputs are the values it reads from outside (model inputs,
which every rank computes locally, and values of earlier stages, which arrive by p2p) and whose
outputs are the values later stages (or the model's output) read. Skip connections across several
stages are ordinary values with a far consumer. Parameters enter as get_attr on the stage's own
root module, which holds the very same Parameter objects as the model.

A stage input that an in-place op writes to (`nn.ReLU(inplace=True)` right after a cut) is cloned first
inside the stage: a received activation is a leaf that requires grad, which autograd refuses to modify in
place, and a model input must stay as it was for a recompute. Other inputs are used as they are. The last
stage's outputs are the model's output flattened; `StageSplit.model_output` rebuilds its structure (a
tuple, a dict, a Hugging Face `ModelOutput`) from the traced graph's output tree, so the loss receives
what the model returns on one process.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_unflatten

from passes.blocks import compute_nodes
from planner.core.errors import PassError
from planner.frontend.trace import export_output_spec


@dataclass(frozen=True)
class ValueInfo:
    """A value crossing a stage boundary."""

    name: str
    producer: int                 # stage index; -1 for model inputs (available on every rank)
    consumers: tuple[int, ...]    # stage indices; `num_stages` stands for the model output
    shape: tuple[int, ...]
    dtype: torch.dtype
    needs_grad: bool              # floating and depends on a parameter: its gradient flows back


@dataclass
class StageGraph:
    index: int
    module: fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    params: list[str]
    model_outputs: list[str] = field(default_factory=list)   # last stage: the model's outputs


@dataclass
class StageSplit:
    stages: list[StageGraph]
    values: dict[str, ValueInfo]          # every value that crosses a boundary or is a model input
    model_inputs: list[str]
    output_structure: str                 # "tensor" | "tuple"
    output_spec: TreeSpec | None = None   # the model's output tree over the last stage's outputs

    def model_output(self, flat_outputs: Sequence[Any]) -> Any:
        """What the model's forward returns on one process, from the last stage's outputs (in
        `model_outputs` order): a tensor, a tuple, a dict or a `ModelOutput`, as traced."""
        if self.output_spec is None:      # a split made without its model's output tree
            return flat_outputs[0] if self.output_structure == "tensor" else tuple(flat_outputs)
        return tree_unflatten(list(flat_outputs), self.output_spec)


class Crossing(Protocol):
    """A value crossing stage boundaries, as ValueInfo and passes.comm's view of it record it."""

    @property
    def producer(self) -> int: ...
    @property
    def consumers(self) -> tuple[int, ...]: ...


def relayed(values: Mapping[str, Crossing], stage: int, num_stages: int) -> tuple[list[str], list[str]]:
    """The values stage `stage` receives from the stage before and hands to the stage after when values
    are relayed stage to stage (interleaved 1F1B: each stage talks to its neighbours only, so the messages
    between two devices run in the order both run their stages): those made before it and read at or after
    it, and those made at or before it and read after it, by name. Model inputs are read where needed."""
    def last_reader(v: Crossing) -> int:
        return max((c for c in v.consumers if c < num_stages), default=-1)

    into = sorted(n for n, v in values.items() if 0 <= v.producer < stage <= last_reader(v))
    out = sorted(n for n, v in values.items() if 0 <= v.producer <= stage < last_reader(v))
    return into, out


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def attr_name(target: str) -> str:
    return target.replace(".", "__")


def _needs_grad(nodes: list[fx.Node], gm: fx.GraphModule) -> dict[fx.Node, bool]:
    """Which values depend on a trainable parameter (so their gradients are needed)."""
    flag: dict[fx.Node, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            value = _attr(gm, n.target)
            flag[n] = isinstance(value, torch.Tensor) and value.requires_grad
        elif n.op == "placeholder":
            flag[n] = False
        else:
            val = n.meta.get("val")
            # containers (a split's tuple) pass the flag on to their getitem elements
            floating = not isinstance(val, torch.Tensor) or val.is_floating_point()
            flag[n] = floating and any(flag.get(a, False) for a in n.all_input_nodes)
    return flag


class _StageBuilder:
    """Copies nodes into one stage's graph; outside values become placeholders or get_attrs."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.env: dict[fx.Node, fx.Node] = {}
        self.inputs: list[str] = []
        self.params: list[str] = []

    def lookup(self, a: fx.Node) -> fx.Node:
        if a in self.env:
            return self.env[a]
        if a.op == "get_attr":
            target = str(a.target)            # a get_attr's target is the attribute's dotted path
            value = _attr(self.gm, target)
            name = attr_name(target)
            if isinstance(value, nn.Parameter):
                self.root.register_parameter(name, value)
                self.params.append(target)
            elif isinstance(value, torch.Tensor):
                self.root.register_buffer(name, value)
            else:
                setattr(self.root, name, value)
            self.env[a] = self.graph.get_attr(name)
        else:
            self.env[a] = self.graph.placeholder(a.name)
            self.env[a].meta = dict(a.meta)
            self.inputs.append(a.name)
        return self.env[a]

    def copy(self, n: fx.Node) -> None:
        for a in n.all_input_nodes:
            self.lookup(a)
        self.env[n] = self.graph.node_copy(n, self.lookup)

    def finish(self, results: list[fx.Node]) -> None:
        self.graph.output(tuple(results))
        clone_written_inputs(self.graph)
        self.graph.lint()


def _bound_args(node: fx.Node) -> list[tuple[Any, Any]]:
    """(schema argument, value) of an aten op's call; empty for anything else (Python functions)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    out = []
    for i, arg in enumerate(target._schema.arguments):
        if i < len(node.args):
            out.append((arg, node.args[i]))
        elif arg.name in node.kwargs:
            out.append((arg, node.kwargs[arg.name]))
    return out


def _returns_view_of(user: fx.Node, value: fx.Node) -> bool:
    """Whether `user`'s result shares `value`'s storage: an aten op that returns an alias of the argument
    `value` is bound to (`view`, `t`, `split`, an in-place op), or an element of such a list."""
    if user.op == "call_function" and user.target is operator.getitem:
        return True
    target = user.target
    if not isinstance(target, torch._ops.OpOverload) or not any(r.alias_info for r in target._schema.returns):
        return False
    return any(arg.alias_info is not None and any(v is value for v in tree_leaves(bound))
               for arg, bound in _bound_args(user))


def _views_of(node: fx.Node) -> set[fx.Node]:
    """`node` and every value of the graph that shares its storage, transitively."""
    found, todo = {node}, [node]
    while todo:
        value = todo.pop()
        for user in value.users:
            if user not in found and _returns_view_of(user, value):
                found.add(user)
                todo.append(user)
    return found


def written_in_place(node: fx.Node) -> bool:
    """Whether an in-place op (schema `Tensor(a!)`) writes to `node`'s value or to a view of it."""
    views = _views_of(node)
    return any(arg.alias_info is not None and arg.alias_info.is_write and
               any(v in views for v in tree_leaves(bound) if isinstance(v, fx.Node))
               for user in {u for v in views for u in v.users} for arg, bound in _bound_args(user))


def clone_written_inputs(graph: fx.Graph) -> list[str]:
    """Give each placeholder of `graph` that an in-place op writes to a clone, read by all its users
    instead; returns their names. Autograd refuses an in-place op on a leaf that requires grad (a
    received activation), and a model input must stay unchanged for a recompute; copying every input
    would cost a copy of each activation for nothing."""
    cloned = []
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        if not written_in_place(node):
            continue
        last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last_placeholder):
            copy = graph.call_function(torch.ops.aten.clone.default, (node,))
        copy.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")}
        node.replace_all_uses_with(copy, delete_user_cb=lambda user, copy=copy: user is not copy)
        cloned.append(node.name)
    return cloned


def _output_nodes(out_args: fx.node.Argument) -> list[fx.Node]:
    """The graph's outputs, flattened; each must be a value the graph computes (a stage sends it on)."""
    nodes = []
    for value in tree_leaves(out_args):
        if not isinstance(value, fx.Node):
            raise PassError(f"the model's forward returns {type(value).__name__}, not a computed tensor",
                            fix="return tensors computed from the inputs only")
        nodes.append(value)
    return nodes


def split_stages(gm: fx.GraphModule, last_nodes: list[str]) -> StageSplit:
    """Cut `gm` after each of `last_nodes` (one per stage, in order; the last ends the graph)."""
    nodes = compute_nodes(gm.graph)
    names = [n.name for n in nodes]
    S = len(last_nodes)
    stage_of: dict[fx.Node, int] = {}
    cut_positions = []
    for name in last_nodes:
        if name not in names:
            raise PassError(f"cut node `{name}` is not in the traced graph", field="stages.last_node",
                            fix="re-plan: the model file changed since the plan was made")
        cut_positions.append(names.index(name))
    if cut_positions != sorted(cut_positions) or cut_positions[-1] != len(nodes) - 1:
        raise PassError(f"cut nodes {last_nodes} are out of order or do not end the graph",
                        fix="re-plan with this model file")
    s = 0
    for i, n in enumerate(nodes):
        stage_of[n] = s
        if i == cut_positions[s] and s < S - 1:
            s += 1
    grads = _needs_grad(nodes, gm)
    output_node = gm.graph.output_node()
    out_args = output_node.args[0]
    out_values = _output_nodes(out_args)
    model_inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

    values: dict[str, ValueInfo] = {}
    for n in gm.graph.nodes:
        if n.op not in ("placeholder",) and n not in stage_of:
            continue
        producer = -1 if n.op == "placeholder" else stage_of[n]
        consumers = sorted({stage_of[u] for u in n.users if u in stage_of and stage_of[u] != producer}
                           | ({S} if n in out_values and producer != S - 1 else set()))
        if consumers or n.op == "placeholder":
            val = n.meta.get("val")
            values[n.name] = ValueInfo(n.name, producer, tuple(consumers),
                                       tuple(getattr(val, "shape", ())),
                                       getattr(val, "dtype", torch.float32), grads.get(n, False))

    stages = []
    for k in range(S):
        builder = _StageBuilder(gm)
        members = [n for n in nodes if stage_of[n] == k]
        for n in members:
            builder.copy(n)
        if k == S - 1:
            model_outputs = [v.name for v in out_values]
            builder.finish([builder.lookup(v) for v in out_values])
            outputs: list[str] = []
        else:
            model_outputs = []
            outputs = [n.name for n in members if n.name in values and values[n.name].consumers]
            builder.finish([builder.env[n] for n in members if n.name in outputs])
        stage_gm = fx.GraphModule(builder.root, builder.graph, class_name=f"Stage{k}")
        stages.append(StageGraph(k, stage_gm, builder.inputs, outputs, builder.params, model_outputs))
    structure = "tuple" if isinstance(out_args, (tuple, list)) and len(out_values) > 1 else "tensor"
    return StageSplit(stages, values, model_inputs, structure, output_spec(gm))


def output_spec(gm: fx.GraphModule) -> TreeSpec:
    """The tree the model's output is built from the graph's flat outputs with: torch.export's output
    spec (kept by the GraphModule's pytree code generation), or the output node's own structure."""
    spec = export_output_spec(gm)
    return spec if spec is not None else tree_flatten(gm.graph.output_node().args[0])[1]
