"""Trace a deep stack of identical layers through a few of them; replicate the rest in the graph.

Tracing time grows with the number of operators, and a transformer is mostly one layer repeated: the 80
layers of Llama-70B take about fifteen times as long to export as 5 of them. A *stack* is an `nn.ModuleList`
or `nn.Sequential` of at least MIN_STACK interchangeable children: same classes, parameter and buffer shapes
and dtypes, equal attributes (containers element by element, a module held in a plain attribute alike and
stateless), no hooks, no parameter shared with another module. Only a position-like integer attribute
(`layer_idx = i`) may differ, and the trace must not read it: its values are watched while tracing. The
stack is shortened in place to its first HEAD children, traced, and restored; planner/replicate.py then
checks that the traced layers repeat exactly and writes the graph of the whole model, the graph torch.export
gives for it (tests/test_frontend_repeated.py compares both). When a check fails the caller traces the model
in full. What no check sees: control flow in the parent's loop that singles out middle layers by their loop
index (`if i >= 40: ...`); the shortened trace never reaches such a layer. The emitted program does not
depend on this graph: it traces its stages in full itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from planner.frontend.replicate import StackMismatch, replicate_stack

REPLICATED_KEY = "hetplan.replicated"
HEAD = 4                    # children traced: child 0 may differ; 1..3 show the period twice
MIN_STACK = HEAD + 1        # shorter stacks gain nothing
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
STATE_ATTRS = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks", "_is_full_backward_hook", *HOOK_DICTS}
ATTRIBUTE_DEPTH = 4         # containers and stateless modules compared inside a child's attributes


@dataclass(frozen=True)
class Stack:
    """A container whose `length` children are interchangeable; `kept` are the ones traced. `varying`:
    the integer attributes (submodule path in the child, name) whose values differ between children."""

    path: str
    container: nn.Module
    length: int
    varying: tuple[tuple[str, str], ...] = ()

    @property
    def kept(self) -> tuple[int, ...]:
        return tuple(range(HEAD))


@dataclass(frozen=True)
class Replicated:
    """What `gm.meta[REPLICATED_KEY]` records per stack: its path, children, and how many were traced."""

    path: str
    length: int
    traced: int


# ----- finding stacks --------------------------------------------------------------------------------

def _same(a: Any, b: Any, depth: int = 0) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False            # a plain tensor attribute: only the very same tensor is the same
    if type(a) is not type(b) or depth > ATTRIBUTE_DEPTH:
        return False
    if isinstance(a, nn.Module):
        return _same_stateless_module(a, b, depth + 1)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k], depth + 1) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, depth + 1) for x, y in zip(a, b))
    try:
        equal = a == b
    except Exception:           # objects that cannot compare are different
        return False
    return equal if isinstance(equal, bool) else False


def _same_stateless_module(a: nn.Module, b: nn.Module, depth: int) -> bool:
    """Two modules held in a plain attribute (not registered: transformers 5 keeps a per-layer module of
    kernel functions in a dict): the same when neither holds parameters or buffers and they are alike in
    structure and attributes. One with state is only ever the very same module."""
    da, db = _describe(a), _describe(b)
    if da is None or db is None or da[0] != db[0] or [k for k, _ in da[1]] != [k for k, _ in db[1]]:
        return False
    if any(True for _ in a.parameters()) or any(True for _ in a.buffers()):
        return False
    return all(_same(x, y, depth) for (_, x), (_, y) in zip(da[1], db[1]))


def _describe(child: nn.Module) -> tuple[tuple[Any, ...], list[tuple[tuple[str, str], Any]]] | None:
    """(structure, attributes) of a child: module tree, parameter and buffer metadata; None if hooked."""
    structure: list[Any] = []
    attributes: list[tuple[tuple[str, str], Any]] = []
    for name, m in child.named_modules(remove_duplicate=False):
        if any(getattr(m, hooks, None) for hooks in HOOK_DICTS):
            return None
        structure.append((name, type(m)))
        for pname, p in m._parameters.items():
            structure.append((name, pname, None if p is None else
                              (type(p), tuple(p.shape), p.dtype, p.requires_grad)))
        for bname, b in m._buffers.items():
            structure.append((name, bname, None if b is None else (tuple(b.shape), b.dtype),
                              bname in m._non_persistent_buffers_set))
        attributes.extend(((name, k), v) for k, v in vars(m).items() if k not in STATE_ATTRS)
    return tuple(structure), attributes


def _varying(children: list[nn.Module]) -> tuple[tuple[str, str], ...] | None:
    """The attributes in which interchangeable `children` differ (position-like integers only), or None
    when the children are not interchangeable."""
    described = [_describe(c) for c in children]
    if any(d is None for d in described):
        return None
    first_structure, first_attributes = described[0]  # type: ignore[misc]
    keys = [k for k, _ in first_attributes]
    for structure, attributes in described[1:]:  # type: ignore[misc]
        if structure != first_structure or [k for k, _ in attributes] != keys:
            return None
    varying = []
    for j, key in enumerate(keys):
        values = [d[1][j][1] for d in described]  # type: ignore[index]
        if all(_same(values[0], v) for v in values[1:]):
            continue
        # a position-like integer (layer_idx = i, layer_number = i + 1) is the only difference allowed
        if not all(type(v) is int for v in values) or len({v - i for i, v in enumerate(values)}) != 1:
            return None
        varying.append(key)
    return tuple(varying)


def find_stacks(module: nn.Module) -> list[Stack]:
    """The outermost containers of at least MIN_STACK interchangeable children that own their parameters."""
    registrations: dict[int, int] = {}
    for _, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        registrations[id(t)] = registrations.get(id(t), 0) + 1
    stacks: list[Stack] = []
    for path, m in module.named_modules():
        if any(path.startswith(s.path + ".") for s in stacks) or not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(m._modules.values())
        if (len(children) < MIN_STACK or list(m._modules) != [str(i) for i in range(len(children))]
                or any(c is None for c in children) or len({id(c) for c in children}) != len(children)):
            continue
        owned = [t for c in children for _, t in [*c.named_parameters(remove_duplicate=False),
                                                   *c.named_buffers(remove_duplicate=False)]]
        varying = None if any(registrations[id(t)] != 1 for t in owned) else _varying(children)
        if varying is not None:
            stacks.append(Stack(path, m, len(children), varying))
    return stacks


class _Watched:
    """Stands in, during the trace, for an integer attribute that differs between a stack's children.

    Such a value may only be carried, never read: a comparison, arithmetic, indexing, hashing or
    formatting of it is logged, and the caller then traces the model in full. (It is not an int
    subclass: CPython reads an int subclass in C without calling its methods, e.g. as a list index.)
    """

    def __init__(self, value: int, reads: list[str], name: str) -> None:
        self._value, self._reads, self._name = value, reads, name

    def _read(self) -> int:
        self._reads.append(self._name)
        return self._value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._read(), name)


def _read_through(name: str) -> Callable[..., Any]:
    def method(self: _Watched, *args: Any) -> Any:
        return getattr(self._read(), name)(*args)
    return method


for _dunder in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__", "__index__",
                "__int__", "__float__", "__complex__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__",
                "__rmul__", "__floordiv__", "__rfloordiv__", "__truediv__", "__rtruediv__", "__mod__", "__rmod__",
                "__divmod__", "__rdivmod__", "__pow__", "__rpow__", "__neg__", "__pos__", "__abs__", "__invert__",
                "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__", "__rlshift__",
                "__rshift__", "__rrshift__", "__round__", "__trunc__", "__floor__", "__ceil__", "__format__",
                "__str__", "__repr__"):
    setattr(_Watched, _dunder, _read_through(_dunder))


@contextlib.contextmanager
def keep_only_traced(stacks: list[Stack], reads: list[str]) -> Iterator[None]:
    """Shorten each stack in place to its `kept` children (renumbered 0..K-1), their varying attributes
    watched (a read is appended to `reads`); restore everything after."""
    saved_modules = [s.container._modules for s in stacks]
    saved_values: list[tuple[nn.Module, str, Any]] = []
    try:
        for s in stacks:
            children = list(s.container.children())      # distinct, none missing: see find_stacks
            kept = [children[i] for i in s.kept]
            for child, (sub, attr) in ((c, v) for c in kept for v in s.varying):
                owner = child.get_submodule(sub)
                saved_values.append((owner, attr, owner.__dict__[attr]))
                name = ".".join(p for p in (s.path, "*", sub, attr) if p)
                owner.__dict__[attr] = _Watched(owner.__dict__[attr], reads, name)
            s.container._modules = {str(r): c for r, c in enumerate(kept)}
        yield
    finally:
        for owner, attr, value in saved_values:
            owner.__dict__[attr] = value
        for s, modules in zip(stacks, saved_modules):
            s.container._modules = modules


def _fetch(root: Any, target: str) -> Any:
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def replicate(traced: fx.GraphModule, module: nn.Module, stacks: list[Stack]) -> fx.GraphModule | None:
    """The graph of the whole `module` from `traced` (a trace with each stack shortened to its kept
    children), or None when a stack's period does not repeat exactly in `traced`."""
    graph = traced.graph
    try:
        for s in stacks:
            graph = replicate_stack(graph, s.path, s.length, len(s.kept))
    except StackMismatch:
        return None
    graph.lint()
    in_stack = tuple(s.path + "." for s in stacks)
    attributes = {str(n.target): _fetch(module if str(n.target).startswith(in_stack) else traced, str(n.target))
                  for n in graph.nodes if n.op == "get_attr"}
    # lazy: the planner reads the graph and never runs it, so Python code for 5,000 nodes is not generated
    gm = _LazyGraphModule(attributes, graph, class_name=type(traced).__name__)
    gm.meta.update(traced.meta)
    gm.meta[REPLICATED_KEY] = tuple(Replicated(s.path, s.length, len(s.kept)) for s in stacks)
    return gm


def trace_replicated(module: nn.Module, inputs: tuple[Any, ...],
                     export: Callable[[nn.Module, tuple[Any, ...]], fx.GraphModule]) -> fx.GraphModule | None:
    """`export(module, inputs)` with every stack traced through its kept children and replicated;
    None when the model has no stack, the shortened model does not trace, or a period does not repeat."""
    stacks = find_stacks(module)
    if not stacks:
        return None
    reads: list[str] = []
    try:
        with keep_only_traced(stacks, reads):
            traced = export(module, inputs)
    except Exception:  # the shortened model is not traceable (e.g. forward indexes a late layer)
        return None
    if reads:           # forward reads a layer's position: the layers are not interchangeable
        return None
    return replicate(traced, module, stacks)
