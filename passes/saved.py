"""Saved: the bytes autograd keeps for the backward, per node, as the program's autograd keeps them.

A micro-batch in flight holds, until its backward, exactly the tensors its ops saved for the backward
(`torch.autograd.graph.saved_tensors_hooks` sees them): a linear keeps its input, a multiply the other
factor, a norm its input and statistics, attention its query, key, value, output and log-sum-exp; a
residual add or a reshape keeps nothing. Every op's output is not kept (the outputs of every op were this
project's first, upper estimate: 1.5-1.8x what a Llama layer keeps at a sequence of 1024).

Each node's op runs once on fresh meta tensors under saved-tensor hooks, its inputs requiring grad where
they depend on a trainable parameter (`trainable_dependent`), and what it saved is matched to
its inputs and outputs by storage: an input kept is the value of the node that made it, counted once for
the whole graph at the first node that keeps it (a view is its base's storage); a new tensor it keeps
(an output, or an internal one such as a norm's statistics) is its own. Ops of one signature (target,
tensor shapes, strides and dtypes, which inputs need grad, constant arguments) are run once.

Attention runs as the fused kernels the program's devices run (flash or memory-efficient attention on
CUDA and ROCm, the flash kernel on CPU): they keep query, key, value, output and the row log-sum-exp,
and a boolean mask as an additive one of the query's dtype. On meta, `scaled_dot_product_attention`
would take the math path and keep the sequence x sequence probabilities, which these kernels do not; torch
takes that path for real only where a mask needs a gradient of its own (a trainable position bias).

Records `node.meta[KEPT_KEY]` (`Kept`): what this node adds to what a micro-batch keeps, at the trace's
batch and dtypes: the graph values first kept here (by the node that made them: tensor parallelism splits
a value its pairs make, passes.shardings) and the op's own kept tensors; passes.blocks sums them per block.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from passes.base import Pass, PassResult
from planner.core.errors import PassError

LSE_DTYPE = torch.float32            # the fused kernels' log-sum-exp, one per query row and head

KEPT_KEY = "hetplan.kept_bytes"
Root = tuple[fx.Node, int]           # (node, position among its tensor outputs): a storage of the graph


@dataclass(frozen=True)
class Kept:
    """What one node adds to what a micro-batch keeps for its backward."""

    values: tuple[tuple[str, float], ...]   # graph values first kept here: (the node that made it, bytes)
    internal_bytes: float                   # tensors the op makes and keeps that are no value of the graph

    @property
    def bytes(self) -> float:
        return self.internal_bytes + sum(b for _, b in self.values)


NOTHING_KEPT = Kept((), 0.0)


@dataclass(frozen=True)
class OpKeeps:
    """What one op keeps for its backward, the same for every node of its signature."""

    inputs: tuple[int, ...]          # positions among its tensor inputs of the ones it keeps
    outputs: tuple[int, ...]         # positions among its tensor outputs of the ones it keeps
    views: tuple[int | None, ...]    # per tensor output: the input position whose storage it shares
    other_bytes: float               # tensors it makes and keeps that are neither input nor output


class SavedActivations(Pass):
    """Write `node.meta[KEPT_KEY]` on every compute node (see the module docstring)."""

    name = "saved"

    def __init__(self) -> None:
        self._cache: dict[Any, OpKeeps] = {}

    def requires(self, gm: fx.GraphModule) -> None:
        missing = [n.name for n in gm.graph.nodes if n.op not in ("output",) and "val" not in n.meta]
        if missing:
            raise PassError(f"saved needs node.meta['val'] (missing on {missing[:3]})", fix="run MetaShapes first")

    def call(self, gm: fx.GraphModule) -> PassResult:
        needs_grad = trainable_dependent(gm.graph)
        roots: dict[Root, Root] = {}          # a node's output -> the storage it lives in
        counted: set[Root] = set()
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                roots[(node, 0)] = (node, 0)
                continue
            if node.op == "output":
                continue
            if node.op == "call_function" and node.target is operator.getitem:
                producer, index = node.args[0], node.args[1]
                if isinstance(producer, fx.Node) and isinstance(index, int):
                    position = _tensor_position(producer, index)
                    roots[(node, 0)] = roots.get((producer, position), (node, 0)) if position is not None \
                        else (node, 0)
                node.meta[KEPT_KEY] = NOTHING_KEPT
                continue
            inputs = _tensor_inputs(node)
            keeps = self._keeps(gm, node, inputs, needs_grad)
            for position, view_of in enumerate(keeps.views):
                roots[(node, position)] = ((roots.get((inputs[view_of], 0), (inputs[view_of], 0)))
                                           if view_of is not None else (node, position))
            values = []
            for root in [roots.get((inputs[i], 0), (inputs[i], 0)) for i in keeps.inputs] + \
                        [roots[(node, i)] for i in keeps.outputs]:
                if root not in counted and root[0].op != "get_attr":
                    counted.add(root)
                    values.append((root[0].name, _root_bytes(root)))
            node.meta[KEPT_KEY] = Kept(tuple(values), keeps.other_bytes)
        return PassResult(gm, True)

    def ensures(self, gm: fx.GraphModule) -> None:
        for node in gm.graph.nodes:
            if node.op.startswith("call") and not isinstance(node.meta.get(KEPT_KEY), Kept):
                raise PassError(f"node {node.name} left without its kept bytes", fix="report this")

    def _keeps(self, gm: fx.GraphModule, node: fx.Node, inputs: list[fx.Node], needs_grad: set[fx.Node]) -> OpKeeps:
        grads = tuple(n in needs_grad and _is_float(n) for n in inputs)
        first = tuple(inputs.index(n) for n in inputs)       # the same node twice is one tensor
        target = gm.get_submodule(str(node.target)) if node.op == "call_module" else node.target
        key = (node.op, _target_key(target), tuple(_value_key(n.meta["val"]) for n in inputs), grads, first,
               _constants_key(node))
        if key not in self._cache:
            self._cache[key] = _run_op(node, target, inputs, grads)
        return self._cache[key]


def _run_op(node: fx.Node, target: Any, inputs: list[fx.Node], grads: tuple[bool, ...]) -> OpKeeps:
    """Run the op once on fresh meta tensors under saved-tensor hooks and match what it saved."""
    fresh: dict[fx.Node, torch.Tensor] = {}
    for n, grad in zip(inputs, grads):
        if n not in fresh:
            v = n.meta["val"]
            fresh[n] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta").requires_grad_(grad)
    def value(a: Any) -> Any:
        return fresh.get(a, a.meta.get("val")) if isinstance(a, fx.Node) else a

    args: Any = fx.node.map_aggregate(node.args, value)
    kwargs: Any = fx.node.map_aggregate(node.kwargs, value)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FusedAttention():
            if node.op == "call_method":
                out = getattr(args[0], str(node.target))(*args[1:], **kwargs)
            elif node.target is torch.ops.aten.scaled_dot_product_attention.default:
                out = fused_attention(*args, **kwargs)
            else:
                out = target(*args, **kwargs)
    except Exception:           # an op meta cannot run: keep its outputs if it has a backward at all
        outputs = [v for v in tree_flatten(node.meta["val"])[0] if isinstance(v, torch.Tensor)]
        keep = tuple(range(len(outputs))) if any(grads) else ()
        return OpKeeps((), keep, tuple(None for _ in outputs), 0.0)
    by_storage = {_storage(fresh[n]): i for i, n in reversed(list(enumerate(inputs)))}
    state = ({_storage(t) for t in [*target.parameters(), *target.buffers()]}
             if isinstance(target, torch.nn.Module) else set())   # a module's own weights are not activations
    outputs = [v for v in tree_flatten(out)[0] if isinstance(v, torch.Tensor)]
    out_storage = {_storage(t): i for i, t in reversed(list(enumerate(outputs)))}
    kept_in, kept_out, other = set(), set(), {}
    for t in saved:
        s = _storage(t)
        if s in by_storage:
            kept_in.add(by_storage[s])
        elif s in out_storage:
            kept_out.add(out_storage[s])
        elif s not in state:
            other[s] = t.untyped_storage().nbytes()
    views = tuple(by_storage.get(_storage(t)) for t in outputs)
    return OpKeeps(tuple(sorted(kept_in)), tuple(sorted(kept_out)), views, float(sum(other.values())))


class _FusedAttentionFunction(torch.autograd.Function):
    """Attention's forward, keeping what the fused kernels keep (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                kwargs: dict[str, Any]) -> torch.Tensor:
        with torch.no_grad():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
        lse = torch.empty(q.shape[:-1], dtype=LSE_DTYPE, device=q.device)
        kept = [q, k, v, out, lse]
        if mask is not None:
            kept.append(mask.to(q.dtype) if mask.dtype == torch.bool else mask)
        ctx.save_for_backward(*kept)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:     # never run: the pass only counts what is kept
        raise NotImplementedError("fused attention is a model of what is kept, not a kernel")


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False) -> torch.Tensor:
    """`scaled_dot_product_attention` keeping what the fused kernels keep; with a mask that needs a gradient of
    its own (a trainable position bias, as T5's), which they cannot give, the math path as torch runs it."""
    if attn_mask is not None and attn_mask.requires_grad:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    return _FusedAttentionFunction.apply(q, k, v, attn_mask, {"dropout_p": dropout_p, "is_causal": is_causal,
                                                              "scale": scale, "enable_gqa": enable_gqa})


class FusedAttention(TorchFunctionMode):
    """Routes `F.scaled_dot_product_attention` called inside a module or function (a `call_module` node of a
    symbolically traced graph, an ONNX operator) to `fused_attention`."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:     # the mode is off inside its own handler
            return fused_attention(*args, **kwargs)
        return func(*args, **kwargs)


def trainable_dependent(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value depends on a trainable parameter (the activations proper).

    Values computed from the inputs alone (masks, rotary tables, positions) are context that every
    later layer reads; they do not make a point a worse place to cut, so cut search ignores them.
    """
    dependent: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "get_attr":
            val = n.meta.get("val")
            if getattr(val, "requires_grad", False):
                dependent.add(n)
        elif n.op != "placeholder" and any(a in dependent for a in n.all_input_nodes):
            dependent.add(n)
    return dependent


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's inputs whose values are tensors, in argument order (a node used twice appears twice)."""
    found: list[fx.Node] = []
    fx.node.map_aggregate((node.args, node.kwargs), lambda a: found.append(a)
                          if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) else None)
    return found


def _tensor_position(node: fx.Node, index: int) -> int | None:
    """The position among `node`'s tensor outputs of element `index` of its (tuple) value."""
    value = node.meta.get("val")
    if not isinstance(value, (tuple, list)) or not 0 <= index < len(value) or \
            not isinstance(value[index], torch.Tensor):
        return None
    return sum(1 for v in value[:index] for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor))


def _root_bytes(root: Root) -> float:
    node, position = root
    tensors = [v for v in tree_flatten(node.meta.get("val"))[0] if isinstance(v, torch.Tensor)]
    if position >= len(tensors):
        return 0.0
    t = tensors[position]
    return float(t.numel() * t.element_size())


def _is_float(node: fx.Node) -> bool:
    v = node.meta.get("val")
    return isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.dtype.is_complex)


def _value_key(v: torch.Tensor) -> tuple[Any, ...]:
    return tuple(v.shape), tuple(v.stride()), v.dtype


def _target_key(target: Any) -> Any:
    if isinstance(target, torch.nn.Module):
        return type(target), repr(target)
    return target


def _constants_key(node: fx.Node) -> str:
    return repr(fx.node.map_aggregate((node.args, node.kwargs), lambda a: "<t>" if isinstance(a, fx.Node) else a))
