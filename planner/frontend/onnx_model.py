"""Read an ONNX graph for cost-only planning: the FX graph the analysis passes read, without torch code.

`plan model.onnx --cluster spec.yaml` plans a model from another framework (or a PyTorch model exported
with `torch.onnx.export`) with the same passes and search as a model file; there is no program to emit,
since the plan's stages would have to be ONNX-to-torch code. The file is turned into an FX graph of the
shape torch.export gives, so that passes/annotate counts its costs and passes/blocks coarsens it
unchanged:

- one FX node per operation: the ONNX nodes the torch exporter recorded as one torch op
  (`pkg.torch.onnx.name_scopes`: a `group_norm` exported as Reshape, InstanceNormalization, Reshape,
  Mul, Add) are one node, named as in torch; other files get one node per ONNX node;
- `node.meta["val"]` a meta tensor of the value's static shape (ONNX shape inference; a symbolic batch
  dimension is taken as `trace_batch` rows), `nn_module_stack` from the recorded module scopes;
- FLOPs: each node's target runs its matmuls, convolutions and attention on meta tensors at their ONNX
  shapes, so costmodel.ops counts forward and backward exactly as it counts the torch ops; the other
  ONNX ops count bytes only, as torch's elementwise ops do;
- parameters: initializers as get_attr nodes. Trainable are those torch marks as parameters, and, where
  unmarked, floating initializers of more than one element (a folded weight, or another framework's);
  scalars and the marked buffers are constants. Each operation reading an initializer holds its own copy:
  an ONNX file does not say which equal initializers are one parameter (torch's optimiser merges
  initializers of equal value, and folds a tied weight's transpose into a new one), so none is tied.

Nothing of the file's weights is loaded: shapes come from the tensors' headers (external data stays on
disk), so a large model's graph reads in seconds.
"""

from __future__ import annotations

import ast
import hashlib
import math
import operator
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from planner.core.errors import ModelFileError
from planner.frontend.onnx_ops import DENSE, OnnxOp, dense, torch_dtype

SCOPES_KEY = "pkg.torch.onnx.name_scopes"           # torch's exporter: module path, then the torch op's name
OPS_KEY = "pkg.torch.onnx.class_hierarchy"          # ... module classes, then the aten op (`aten.linear.default`)
KIND_KEY = "pkg.torch.export.graph_signature.InputSpec.kind"   # PARAMETER | BUFFER | CONSTANT_TENSOR
FIX = "export it with torch.onnx.export(model, inputs, dynamo=True), or pass a model file (.py)"
CONTROL_FLOW = {"If", "Loop", "Scan", "SequenceMap"}
# ONNX ops that only re-index their input, named as the torch view op that costmodel.ops files as a view
VIEWS = {"Reshape": "reshape", "Flatten": "flatten", "Squeeze": "squeeze", "Unsqueeze": "unsqueeze",
         "Transpose": "permute", "Identity": "alias", "Expand": "expand", "Slice": "slice", "Split": "split"}
DIGEST_CHUNK_BYTES = 1 << 20


def is_onnx_file(path: str | Path) -> bool:
    """Whether `plan` reads `path` as an ONNX graph (cost-only) rather than as a model file."""
    return Path(path).suffix.lower() == ".onnx"


@dataclass
class OnnxModel:
    """An ONNX file read as an FX graph with shapes (no weights): what planning traces a model file into."""

    path: Path
    digest: str
    graph: fx.GraphModule
    meta_inputs: tuple[torch.Tensor, ...]
    trace_batch: int                  # rows of the graph's batch dimension (costs are per sample)


def load_onnx_model(path: str | Path, trace_batch: int) -> OnnxModel:
    """Read `path` into an OnnxModel; a symbolic batch dimension becomes `trace_batch` rows. Raises
    ModelFileError (one line) when the file is not a valid ONNX model or its shapes are not static."""
    p, file = Path(path), str(path)
    if not p.is_file():
        raise ModelFileError("ONNX file not found", file=file, fix="pass the path of an .onnx file")
    try:
        import onnx  # the `onnx` extra: needed only when an .onnx file is planned
    except ImportError as exc:
        raise ModelFileError("planning an ONNX graph needs the onnx package", file=file,
                             fix="pip install 'hetplan[onnx]'") from exc
    try:
        model = onnx.load(file, load_external_data=False)
        onnx.checker.check_model(model)
    except Exception as exc:   # protobuf's decode errors, the checker's ValidationError: all mean "not valid"
        raise ModelFileError(f"not a valid ONNX model: {type(exc).__name__}: {_first_line(exc)}", file=file,
                             fix=FIX) from exc
    model, rows = _static_shapes(model, trace_batch, file)
    graph = _Reader(model, file).graph_module()
    meta_inputs = tuple(n.meta["val"] for n in graph.graph.nodes if n.op == "placeholder")
    return OnnxModel(p, _digest(p), graph, meta_inputs, rows)


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(DIGEST_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _static_shapes(model: Any, trace_batch: int, file: str) -> tuple[Any, int]:
    """The model with every value's shape inferred; a symbolic first dimension of an input is `trace_batch`.
    Returns it and the batch rows (the first input's first dimension)."""
    import onnx

    initializers = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    if not inputs or not model.graph.node:
        raise ModelFileError("the ONNX graph has no inputs or no nodes", file=file, fix=FIX)
    changed = False
    for value in inputs:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_value") and dim.dim_value > 0:
                continue
            if axis != 0:
                raise ModelFileError(f"input {value.name} has a symbolic dimension {axis} ({dim.dim_param or '?'})",
                                     file=file, field=value.name,
                                     fix="export with static shapes; only the batch dimension may be symbolic")
            dim.Clear()
            dim.dim_value = trace_batch
            changed = True
    if changed:   # the recorded shapes say the symbol: infer them again from the inputs
        del model.graph.value_info[:]
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except Exception as exc:
        raise ModelFileError(f"ONNX shape inference failed: {_first_line(exc)}", file=file, fix=FIX) from exc
    first = inputs[0].type.tensor_type.shape.dim
    return model, (first[0].dim_value if first else 1)


@dataclass
class _Group:
    """ONNX nodes that become one FX node: a torch op the exporter recorded, or a single ONNX node."""

    nodes: list[Any]
    scopes: list[str]       # module path then op name (torch's exporter), or [] for another file
    aten: str               # the aten op recorded (`aten.linear.default`), or ""


class _Reader:
    """Builds the FX graph of one ONNX model (see the module docstring)."""

    def __init__(self, model: Any, file: str) -> None:
        self.model, self.file = model, file
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.env: dict[str, fx.Node] = {}
        g = model.graph
        self.types: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for value in [*g.input, *g.value_info, *g.output]:
            known = self._type_of(value)
            if known is not None:
                self.types.setdefault(value.name, known)
        self.kinds = {v.name: p.value for v in [*g.input, *g.value_info] for p in v.metadata_props
                      if p.key == KIND_KEY}
        self.initializers = {t.name for t in g.initializer}
        for t in g.initializer:
            self.types[t.name] = (torch_dtype(t.data_type, file, t.name), tuple(int(d) for d in t.dims))
        self.constants = {out: n for n in g.node if n.op_type == "Constant" for out in n.output}
        self.uses = Counter(name for n in g.node for name in n.input)
        self.graph_outputs = {o.name for o in g.output}
        self.copies: Counter[str] = Counter()

    def graph_module(self) -> fx.GraphModule:
        g = self.model.graph
        for value in g.input:
            if value.name not in self.initializers:
                node = self.graph.placeholder(_identifier(value.name))
                node.meta["val"] = self._meta(value.name)
                self.env[value.name] = node
        for group in _groups([n for n in g.node if n.op_type != "Constant"]):
            self._add(group)
        outputs = [self._value(o.name) for o in g.output]
        self.graph.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
        self.graph.lint()
        return fx.GraphModule(self.root, self.graph, class_name="OnnxGraph")

    def _add(self, group: _Group) -> None:
        """One FX node for `group`: it reads the values its nodes read from outside it, and gives the values
        read after it (several: a tuple and getitem nodes, as torch.export writes them)."""
        produced = {out for n in group.nodes for out in n.output if out}
        reads: list[str] = []
        for n in group.nodes:
            if n.op_type in CONTROL_FLOW:
                raise ModelFileError(f"node {n.name or n.output[0]} is control flow ({n.op_type}), which cost-only "
                                     "planning cannot unroll", file=self.file, fix="export the model without it")
            reads += [name for name in n.input if name and name not in produced and name not in reads]
        inside = Counter(name for n in group.nodes for name in n.input)
        outputs = [out for n in group.nodes for out in n.output
                   if out and (self.uses[out] > inside[out] or out in self.graph_outputs)]
        if not outputs:
            return   # dead code: nothing reads what these nodes compute
        target = OnnxOp(_torch_name(group), tuple(p for n in group.nodes if (p := self._probe(n)) is not None))
        key = group.scopes[-1] if group.scopes else (group.nodes[0].name or outputs[0])   # torch's op name
        node = self.graph.create_node("call_function", target, tuple(self._value(name) for name in reads),
                                      name=_identifier(key))
        node.meta["nn_module_stack"] = {f"scope{i}": (path, "") for i, path in enumerate(group.scopes[1:-1])}
        if len(outputs) == 1:
            node.meta["val"] = self._meta(outputs[0])
            self.env[outputs[0]] = node
            return
        node.meta["val"] = tuple(self._meta(out) for out in outputs)
        for i, out in enumerate(outputs):
            item = self.graph.call_function(operator.getitem, (node, i))
            item.meta.update(val=node.meta["val"][i], nn_module_stack=node.meta["nn_module_stack"])
            self.env[out] = item

    def _value(self, name: str) -> fx.Node:
        """The FX node of value `name` for its next reader: computed, an input, or an initializer or a
        constant (a copy per reading operation, see the module docstring)."""
        if name in self.env:
            return self.env[name]
        if name not in self.initializers and name not in self.constants:
            raise ModelFileError(f"value {name} is read before any node computes it", file=self.file, fix=FIX)
        dtype, shape = self._type(name)
        trainable = name in self.initializers and self._trainable(name, dtype, shape)
        self.copies[name] += 1
        target, value = _attribute(self.root, name, self.copies[name], torch.empty(shape, dtype=dtype, device="meta"),
                                   trainable)
        node = self.graph.get_attr(target)
        node.meta["val"] = value
        return node

    def _trainable(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
        if name in self.kinds:
            return self.kinds[name] == "PARAMETER"
        return dtype.is_floating_point and math.prod(shape) > 1

    def _constant_type(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """A Constant node's type, from its attribute (shape inference may leave it out)."""
        import onnx

        for attr in self.constants[name].attribute:
            value = onnx.helper.get_attribute_value(attr)
            if attr.name == "value":
                return torch_dtype(value.data_type, self.file, name), tuple(int(d) for d in value.dims)
            if attr.name in ("value_float", "value_int"):
                return (torch.float32 if attr.name == "value_float" else torch.int64), ()
            if attr.name in ("value_floats", "value_ints"):
                return (torch.float32 if attr.name == "value_floats" else torch.int64), (len(value),)
        raise ModelFileError(f"constant {name} has no tensor value", file=self.file, field=name, fix=FIX)

    def _type(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        if name in self.types:
            return self.types[name]
        if name in self.constants:
            return self._constant_type(name)
        raise ModelFileError(f"no static shape for value {name}", file=self.file, field=name,
                             fix="export with static shapes (ONNX shape inference could not give one)")

    def _meta(self, name: str) -> torch.Tensor:
        dtype, shape = self._type(name)
        return torch.empty(shape, dtype=dtype, device="meta")

    def _type_of(self, value: Any) -> tuple[torch.dtype, tuple[int, ...]] | None:
        if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
            return None
        tensor = value.type.tensor_type
        if not all(d.HasField("dim_value") for d in tensor.shape.dim):
            return None
        return torch_dtype(tensor.elem_type, self.file, value.name), tuple(int(d.dim_value) for d in tensor.shape.dim)

    def _probe(self, node: Any) -> tuple[str, Callable[[], Any]] | None:
        """(description, run) for a dense ONNX op: torch's op on meta tensors of its shapes; None otherwise."""
        if node.op_type not in DENSE:
            return None
        shapes = [self._type(name)[1] for name in node.input if name]
        if len(shapes) < 2:
            return None
        attrs = {a.name: _attribute_value(a) for a in node.attribute}
        run = dense(node.op_type, shapes, self._type(node.output[0])[1], attrs)
        return f"{node.op_type}{[list(s) for s in shapes]}{sorted(attrs.items())}", run


def _groups(nodes: list[Any]) -> list[_Group]:
    """Consecutive nodes with the same recorded torch op (scopes) are one group; unrecorded nodes alone."""
    out: list[_Group] = []
    for n in nodes:
        props = {p.key: p.value for p in n.metadata_props}
        scopes = _literal_list(props.get(SCOPES_KEY))
        ops = _literal_list(props.get(OPS_KEY))
        if scopes and out and out[-1].scopes == scopes:
            out[-1].nodes.append(n)
        else:
            out.append(_Group([n], scopes, ops[-1] if ops and ops[-1].startswith("aten.") else ""))
    return out


def _torch_name(group: _Group) -> str:
    """The torch op's name (`linear`): recorded by torch's exporter, else the op a lone ONNX node is."""
    if group.aten:
        return group.aten.split(".")[1]
    names = [DENSE.get(n.op_type) for n in group.nodes if n.op_type in DENSE]
    if names:
        return str(names[0])
    if all(n.op_type in VIEWS for n in group.nodes):
        return VIEWS[group.nodes[0].op_type]
    return group.nodes[0].op_type.lower()


def _attribute(root: nn.Module, name: str, copy: int, value: torch.Tensor,
               trainable: bool) -> tuple[str, torch.Tensor]:
    """Register an initializer's copy on `root` (a parameter if trainable, else a buffer); returns its
    get_attr target, the dotted name itself where it is a module path (`blocks.0.conv1.weight`), and the
    tensor registered."""
    parts = name.split(".")
    if copy > 1:
        parts[-1] = f"{parts[-1]}_{copy}"
    if not all(re.fullmatch(r"\w+", part) for part in parts):
        parts = [_identifier(".".join(parts))]
    owner = root
    for part in parts[:-1]:
        child = owner._modules.get(part)
        if child is None:
            if hasattr(owner, part):   # a tensor of that name already: keep this one flat
                return _attribute(root, _identifier(name), copy, value, trainable)
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    leaf = parts[-1]
    while hasattr(owner, leaf):
        leaf += "_"
    registered = value
    if trainable:
        registered = nn.Parameter(value)
        owner.register_parameter(leaf, registered)
    else:
        owner.register_buffer(leaf, value)
    return ".".join([*parts[:-1], leaf]), registered


def _attribute_value(attr: Any) -> Any:
    import onnx

    value = onnx.helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return list(value) if isinstance(value, (list, tuple)) else value


def _literal_list(text: str | None) -> list[str]:
    if not text:
        return []
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


def _identifier(name: str) -> str:
    text = re.sub(r"\W", "_", name).strip("_") or "value"
    return text if not text[0].isdigit() else f"v_{text}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
