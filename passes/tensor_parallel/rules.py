"""Shard propagation: how one aten op carries a tensor sharded on one dimension (correctness first).

A value inside a tensor-parallel region is `Shard(dim, interleave)`: each rank holds a 1/degree slice of
`dim` (of each of `interleave` blocks). `propagate(node, states)` gives the state of `node`'s output from
its inputs' states (a value absent from `states` is replicated), the sharded sizes the degree must divide,
and the concrete sizes in its arguments that become local sizes in the shard. An op without a rule here,
or one that needs the whole sharded dimension (a reduction over it, a layer norm over it, a softmax over
it, a broadcast of a replicated value along it), raises `Unshardable`: the region stays replicated.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .layout import SizeRewrite


@dataclass(frozen=True)
class Shard:
    dim: int
    interleave: int = 1


State = Shard | tuple[Shard, ...]


class Unshardable(Exception):
    """`node` cannot carry its sharded input: the region it is in stays replicated."""


@dataclass
class Step:
    state: State
    sizes: list[int] = field(default_factory=list)
    rewrites: list[SizeRewrite] = field(default_factory=list)


ELEMENTWISE = frozenset({
    "add", "sub", "rsub", "mul", "div", "neg", "gelu", "silu", "relu", "tanh", "sigmoid", "exp", "log",
    "rsqrt", "sqrt", "pow", "erf", "abs", "clamp", "square", "reciprocal", "sin", "cos", "leaky_relu",
    "hardtanh", "softplus", "mish", "dropout", "clone", "contiguous", "alias", "detach", "to", "_to_copy",
    "type_as", "masked_fill", "where", "lift_fresh_copy",
})
VIEWS = frozenset({"view", "reshape", "_unsafe_view"})
SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax"})
SPLITS = frozenset({"split", "chunk"})
OTHER = frozenset({"transpose", "permute", "unsqueeze", "squeeze", "expand", "slice", "cat",
                   "scaled_dot_product_attention", "matmul", "bmm"})
SUPPORTED = ELEMENTWISE | VIEWS | SOFTMAX | SPLITS | OTHER


def op_name(node: fx.Node) -> str | None:
    """The aten op's name without overload (`view` for aten.view.default); "getitem"; None otherwise."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        return "getitem"
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target.overloadpacket.__name__
    return None


def can_carry(node: fx.Node) -> bool:
    """Whether some rule exists for `node` (the flood's cheap first check, before the shapes)."""
    name = op_name(node)
    return name == "getitem" or name in SUPPORTED


def shape(node: fx.Node) -> tuple[int, ...]:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise Unshardable(f"{node.name}: no tensor shape recorded")
    return tuple(int(s) for s in value.shape)


def arg_node(node: fx.Node, i: int) -> fx.Node:
    """Argument `i` of `node`, which must be a node (a tensor input)."""
    value = node.args[i] if i < len(node.args) else None
    if not isinstance(value, fx.Node):
        raise Unshardable(f"{node.name}: argument {i} is not a tensor")
    return value


def arg_int(node: fx.Node, i: int, name: str = "", default: int | None = None) -> int:
    """Integer argument `i` (or keyword `name`) of `node`."""
    value = node.args[i] if i < len(node.args) else node.kwargs.get(name, default)
    if not isinstance(value, int):
        raise Unshardable(f"{node.name}: argument {i} is not a concrete int")
    return value


def arg_ints(node: fx.Node, i: int) -> list[int]:
    """List-of-ints argument `i` of `node` (a shape, a permutation)."""
    value = node.args[i] if i < len(node.args) else None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) for v in value):
        raise Unshardable(f"{node.name}: argument {i} is not a list of concrete ints")
    return [int(v) for v in value]


def _norm(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _single(states: dict[fx.Node, State], node: fx.Node) -> Shard | None:
    state = states.get(node)
    if isinstance(state, tuple):
        raise Unshardable(f"{node.name}: a list of shards used as one tensor")
    return state


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _broadcast(node: fx.Node, states: dict[fx.Node, State], inputs: list[fx.Node], batch_only: bool) -> Step:
    """Elementwise with broadcasting (and matmul's batch dims): every sharded input on one output dim,
    every replicated input of size 1 there (or without that dim)."""
    out = shape(node)
    dims: set[tuple[int, int]] = set()
    for a in inputs:
        st = _single(states, a)
        if st is not None:
            rank = len(shape(a))
            if batch_only and st.dim >= rank - 2:
                raise Unshardable(f"{node.name}: sharded on a matrix dim of {a.name}")
            aligned = st.dim + len(out) - rank
            if shape(a)[st.dim] != out[aligned]:
                raise Unshardable(f"{node.name}: {a.name} broadcast along its sharded dim")
            dims.add((aligned, st.interleave))
    if len(dims) != 1:
        raise Unshardable(f"{node.name}: inputs sharded on different dims {sorted(dims)}")
    aligned, interleave = dims.pop()
    for a in inputs:
        if a not in states:
            a_shape = shape(a)
            at = aligned - (len(out) - len(a_shape))
            if at >= 0 and a_shape[at] != 1:
                raise Unshardable(f"{node.name}: replicated {a.name} spans the sharded dim")
    return Step(Shard(aligned, interleave), [out[aligned] // interleave])


def _view(node: fx.Node, st: Shard) -> Step:
    """Split or merge view: the sharded dim d of S_in maps to the output dim e with
    prod(S_out[:e]) == prod(S_in[:d]) (the shard is the outermost part of a merged or split dim)."""
    if st.interleave != 1:
        raise Unshardable(f"{node.name}: a view of an interleaved shard")
    s_in, s_out = shape(arg_node(node, 0)), shape(node)
    prefix = math.prod(s_in[:st.dim])
    for e in range(len(s_out)):
        if math.prod(s_out[:e]) == prefix and s_out[e] > 1:
            args = arg_ints(node, 1)
            rewrites = []
            if len(args) == len(s_out) and args[e] != -1:
                rewrites.append(SizeRewrite(node.name, 1, e, s_out[e]))
            return Step(Shard(e), [s_in[st.dim], s_out[e]], rewrites)
    raise Unshardable(f"{node.name}: view {s_in} -> {s_out} does not keep sharded dim {st.dim} separable")


def _split(node: fx.Node, st: Shard) -> Step:
    rank = len(shape(arg_node(node, 0)))
    dim = _norm(arg_int(node, 2, "dim", 0), rank)
    pieces = node.meta.get("val")
    if not isinstance(pieces, (list, tuple)):
        raise Unshardable(f"{node.name}: no pieces recorded")
    if dim != st.dim:
        return Step(tuple(st for _ in pieces))
    sizes = {int(p.shape[dim]) for p in pieces}
    if len(pieces) != st.interleave or len(sizes) != 1:
        raise Unshardable(f"{node.name}: splits its sharded dim into {len(pieces)} parts, "
                          f"not its {st.interleave} interleaved blocks")
    rewrites = [SizeRewrite(node.name, 1, None, sizes.pop())] if op_name(node) == "split" else []
    return Step(tuple(Shard(dim) for _ in pieces), [int(pieces[0].shape[dim])], rewrites)


def _other_dim(node: fx.Node, st: Shard, dim: int, rank: int) -> Step:
    if _norm(dim, rank) == st.dim:
        raise Unshardable(f"{node.name}: works along the sharded dim {st.dim}")
    return Step(st)


def _sdpa(node: fx.Node, states: dict[fx.Node, State]) -> Step:
    q, k, v = (arg_node(node, i) for i in range(3))
    if node.kwargs.get("enable_gqa"):
        raise Unshardable(f"{node.name}: scaled_dot_product_attention with enable_gqa")
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    inputs = [a for a in (q, k, v, mask) if isinstance(a, fx.Node)]
    if any(states.get(a) is None for a in (q, k, v)):
        raise Unshardable(f"{node.name}: query, key and value must all be sharded")
    return _broadcast(node, states, inputs, batch_only=True)


def propagate(node: fx.Node, states: dict[fx.Node, State]) -> Step:
    """The state of `node`'s output, given its inputs' (`states`; absent: replicated)."""
    name = op_name(node)
    if name == "getitem":
        listed = states.get(arg_node(node, 0))
        if not isinstance(listed, tuple):
            raise Unshardable(f"{node.name}: getitem of a value that is not a list of shards")
        return Step(listed[arg_int(node, 1)])
    if name in ELEMENTWISE:
        return _broadcast(node, states, _tensor_args(node), batch_only=False)
    if name in ("matmul", "bmm"):
        return _broadcast(node, states, _tensor_args(node), batch_only=True)
    if name == "scaled_dot_product_attention":
        return _sdpa(node, states)
    if name == "cat":
        listed_args = node.args[0] if isinstance(node.args[0], (list, tuple)) else ()
        tensors = [t for t in listed_args if isinstance(t, fx.Node)]
        if not tensors or len(tensors) != len(listed_args):
            raise Unshardable(f"{node.name}: cat of something other than tensors")
        found = {states.get(t) for t in tensors}
        first = found.pop() if len(found) == 1 else None
        if not isinstance(first, Shard):
            raise Unshardable(f"{node.name}: cat of differently sharded or replicated tensors")
        return _other_dim(node, first, arg_int(node, 1, "dim", 0), len(shape(node)))
    src = arg_node(node, 0)
    st = _single(states, src)
    if st is None:
        raise Unshardable(f"{node.name}: its sharded input is not its first argument")
    rank = len(shape(src))
    if name in VIEWS:
        return _view(node, st)
    if name in SPLITS:
        return _split(node, st)
    if name in SOFTMAX:
        return _other_dim(node, st, arg_int(node, 1, "dim"), rank)
    if name == "slice":
        return _other_dim(node, st, arg_int(node, 1, "dim", 0), rank)
    if name == "transpose":
        a, b = _norm(arg_int(node, 1), rank), _norm(arg_int(node, 2), rank)
        return Step(Shard(b if st.dim == a else a if st.dim == b else st.dim, st.interleave))
    if name == "permute":
        order = [_norm(x, rank) for x in arg_ints(node, 1)]
        return Step(Shard(order.index(st.dim), st.interleave))
    if name == "unsqueeze":
        at = _norm(arg_int(node, 1), rank + 1)
        return Step(Shard(st.dim + (1 if at <= st.dim else 0), st.interleave))
    if name == "squeeze" and len(node.args) == 2 and isinstance(node.args[1], int):
        at = _norm(node.args[1], rank)
        if at == st.dim:
            raise Unshardable(f"{node.name}: squeezes the sharded dim")
        return Step(Shard(st.dim - (1 if at < st.dim else 0), st.interleave))
    if name == "expand":
        sizes = arg_ints(node, 1)
        e = st.dim + len(sizes) - rank
        rewrites = [] if sizes[e] == -1 else [SizeRewrite(node.name, 1, e, sizes[e])]
        return Step(Shard(e, st.interleave), [shape(node)[e] // st.interleave], rewrites)
    raise Unshardable(f"{node.name}: no shard rule for {node.target}")
