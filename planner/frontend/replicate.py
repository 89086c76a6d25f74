"""Check that a traced stack of layers repeats, and write the graph with all of its layers.

The graph comes from a trace in which a stack (an nn.ModuleList or nn.Sequential of interchangeable
children, see planner/repeated.py) kept only its first few children. Its *periods* (the nodes from the
start of child i to the start of child i+1; the last one as long as the one before) must repeat
exactly after the first: same operators, constant arguments, shapes, module paths (up to the child's
index) and node-name numbering by a fixed step per name; each reads the previous period at the same
offsets and its own child's parameters. Then the last period is copied once per child left out, with
parameters and module paths renamed and node names numbered on, and the nodes after the stack have
their names shifted by the same steps: what torch.export builds and names for the whole model
(tests/test_frontend_repeated.py compares both).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

# torch.fx's node-name grammar (torch/fx/graph.py `_name_regex`): a base and an optional `_<number>`
NAME_REGEX = re.compile(r"^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\d+))?$")


class StackMismatch(Exception):
    """The traced stack does not repeat exactly: the model must be traced in full."""


def _split_name(name: str) -> tuple[str, int | None]:
    """`mul_12` -> ("mul", 12); `mul` -> ("mul", None)."""
    match = NAME_REGEX.match(name)
    if match is None:
        return name, None
    base, num = match.group(1, 2)
    return base, None if num is None else int(num)


def _number(base: str, num: int | None, shift: int) -> str:
    """The name `shift` numbers after `base`_`num`."""
    if not shift:
        return base if num is None else f"{base}_{num}"
    return f"{base}_{(num or 0) + shift}"


def value_key(val: Any) -> Any:
    """What a node's value (node.meta["val"]) is, comparably: shapes, dtypes, strides, requires_grad."""
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), val.dtype, tuple(val.stride()), val.requires_grad)
    if isinstance(val, (tuple, list)):
        return tuple(value_key(v) for v in val)
    return repr(val)


class _StackGraph:
    """One stack in a traced graph: its periods and what the replicated graph needs to know."""

    def __init__(self, graph: fx.Graph, path: str, length: int, traced: int) -> None:
        self.path, self.length = path, length
        self.child_pattern = re.compile(rf"^{re.escape(path)}\.(\d+)(?=\.|$)")
        nodes = list(graph.nodes)
        starts: dict[int, int] = {}
        owner: list[int | None] = []
        for pos, n in enumerate(nodes):
            child = self.child_of_node(n)
            owner.append(child)
            if child is not None:
                starts.setdefault(child, pos)
        order = [starts.get(r, -1) for r in range(traced)]
        if -1 in order or order != sorted(order) or traced < 3:
            raise StackMismatch(f"children of {path} not traced once each, in order")
        order.append(order[-1] + order[-1] - order[-2])   # the last period is as long as the one before
        self.prefix = nodes[:order[0]]
        self.periods = [nodes[order[r]:order[r + 1]] for r in range(traced)]
        self.tail = nodes[order[-1]:]                  # what follows the stack
        for r, period in enumerate(self.periods):
            if any(owner[order[r] + i] not in (None, r) for i in range(len(period))):
                raise StackMismatch(f"children of {path} interleave")
        if any(child is not None for child in owner[order[-1]:]):
            raise StackMismatch(f"the last traced child of {path} is longer than a period")
        if any(n.op in ("placeholder", "get_attr") for n in [*sum(self.periods, []), *self.tail]):
            raise StackMismatch("inputs or attributes after the first layer")
        self.where = {n: (r, i) for r, period in enumerate(self.periods) for i, n in enumerate(period)}

    # paths and names
    def child_of_path(self, path: str) -> int | None:
        match = self.child_pattern.match(path)
        return None if match is None else int(match.group(1))

    def child_of_node(self, node: fx.Node) -> int | None:
        stack = node.meta.get("nn_module_stack") or {}
        for path, _ in stack.values():
            child = self.child_of_path(str(path))
            if child is not None:
                return child
        return None

    def in_child(self, path: str) -> str:
        """`path` relative to its child of the stack (`.self_attn.q_proj.weight`)."""
        return self.child_pattern.sub("", path, count=1)

    def rename_path(self, path: str, child: int) -> str:
        return self.child_pattern.sub(f"{self.path}.{child}", path, count=1)

    def rename_stack(self, meta_stack: dict[str, Any] | None, child: int) -> dict[str, Any] | None:
        if not meta_stack:
            return meta_stack
        renamed = {}
        for key, (path, kind) in meta_stack.items():
            new_path = self.rename_path(str(path), child)
            renamed[str(key).replace(str(path), new_path, 1)] = (new_path, kind)
        return renamed

    def rename_meta(self, meta: dict[str, Any], child: int) -> dict[str, Any]:
        renamed = dict(meta)
        if "nn_module_stack" in meta:
            renamed["nn_module_stack"] = self.rename_stack(meta["nn_module_stack"], child)
        return renamed

    # the period check
    def token(self, ref: fx.Node, period: int, offsets: bool) -> Any:
        """How a node of `period` refers to `ref`, in terms that mean the same in every period."""
        location = self.where.get(ref)
        if location is not None:
            r, i = location
            if r == period:
                return ("own", i)
            if r == period - 1:
                return ("previous", i if offsets else None)
        if ref.op == "get_attr" and self.child_of_path(str(ref.target)) == period:
            return ("parameter", self.in_child(str(ref.target)))
        return ("node", ref)

    def signature(self, node: fx.Node, period: int, offsets: bool) -> tuple[Any, ...]:
        def leaf(v: Any) -> Any:
            if isinstance(v, fx.Node):
                return self.token(v, period, offsets)
            return ("constant", type(v).__name__, repr(v))

        base, _ = _split_name(node.name)
        return (node.op, node.target, base, value_key(node.meta.get("val")),
                self.rename_stack(node.meta.get("nn_module_stack"), 0),
                map_aggregate(node.args, leaf), map_aggregate(node.kwargs, leaf))

    def check(self) -> dict[str, int]:
        """Raise StackMismatch unless periods 1..K-2 repeat; returns the name numbers one period uses, per base."""
        last = len(self.periods) - 1
        first = self.periods[1]
        if any(len(p) != len(first) for p in self.periods[1:]):
            raise StackMismatch(f"periods of {self.path} differ in length")
        for r in range(2, last + 1):  # period 1 reads period 0, which may differ: no offsets there
            offsets = r - 1 > 1
            for a, b in zip(self.periods[r - 1], self.periods[r]):
                if self.signature(a, r - 1, offsets) != self.signature(b, r, offsets):
                    raise StackMismatch(f"{a.name} and {b.name} differ")
        step: dict[str, int] = {}
        for r in range(2, last + 1):
            for a, b in zip(self.periods[r - 1], self.periods[r]):
                base, num_a = _split_name(a.name)
                _, num_b = _split_name(b.name)
                if num_a is None or num_b is None or step.setdefault(base, num_b - num_a) != num_b - num_a:
                    raise StackMismatch(f"names {a.name}, {b.name} are not numbered by period")
        for n in self.tail:
            for ref in n.all_input_nodes:
                r = self.where.get(ref, (0, 0))[0]
                if 0 < r < last:
                    raise StackMismatch(f"{n.name} reads {ref.name}, inside the stack")
        for n in self.prefix:      # a child's parameters serve that child's period only (not `layers[-1].w`)
            child = self.child_of_path(str(n.target)) if n.op == "get_attr" else None
            if child is not None and any(self.where.get(u, (None, 0))[0] != child for u in n.users):
                raise StackMismatch(f"{n.target} is read outside its layer")
        return step


def _numbers_ascend(graph: fx.Graph) -> bool:
    """Node-name numbers grow along the graph, per base (so shifting later names keeps them unique)."""
    seen: dict[str, int] = {}
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        base, num = _split_name(n.name)
        if (num or 0) <= seen.get(base, -1):
            return False
        seen[base] = num or 0
    return True


def replicate_stack(graph: fx.Graph, path: str, length: int, traced: int) -> fx.Graph:
    """`graph` with all `length` children of the stack at `path`; it was traced with the first `traced`
    of them. Raises StackMismatch unless the traced periods repeat."""
    view = _StackGraph(graph, path, length, traced)
    step = view.check()
    if not _numbers_ascend(graph):
        raise StackMismatch("node names are not numbered in graph order")
    return _Builder(view, step).build()


class _Builder:
    """Writes the whole graph: prefix (with every child's attributes), traced periods, copies, tail."""

    def __init__(self, view: _StackGraph, step: dict[str, int]) -> None:
        self.view, self.step = view, step
        self.template_child = len(view.periods) - 1        # the last traced period is the one copied
        self.copied = range(len(view.periods), view.length)
        self.out = fx.Graph()
        self.out._codegen = view.periods[0][0].graph._codegen
        self.env: dict[fx.Node, fx.Node] = {}
        self.parameters: dict[tuple[int, str], fx.Node] = {}  # (child, path in child) -> get_attr

    def build(self) -> fx.Graph:
        self.copy_prefix()
        for period in self.view.periods:
            for n in period:
                self.env[n] = self.add(n, self.env.__getitem__, n.name, n.meta)
        last_period = self.copy_periods()
        self.copy_tail(last_period)
        return self.out

    def add(self, node: fx.Node, ref: Callable[[fx.Node], fx.Node], name: str, meta: dict[str, Any]) -> fx.Node:
        new = self.out.create_node(node.op, node.target, fx.map_arg(node.args, ref), fx.map_arg(node.kwargs, ref),
                                   name=name, type_expr=node.type)
        if new.name != name:
            raise StackMismatch(f"node name {name} taken")
        new.meta = meta
        return new

    def attribute(self, node: fx.Node, target: str) -> fx.Node:
        new = self.out.get_attr(target, type_expr=node.type)    # named from the target, as export names it
        new.meta = dict(node.meta)
        return new

    def copy_prefix(self) -> None:
        """Inputs, attributes, what precedes the stack. The attributes of the copied children follow the
        template child's (the order named_parameters gives)."""
        view, prefix = self.view, self.view.prefix
        for pos, n in enumerate(prefix):
            child = view.child_of_path(str(n.target)) if n.op == "get_attr" else None
            if child is None:
                self.env[n] = self.add(n, self.env.__getitem__, n.name, n.meta)
                continue
            self.env[n] = self.attribute(n, str(n.target))
            if self.env[n].name != n.name:
                raise StackMismatch(f"attribute {n.target} named {self.env[n].name}, not {n.name}")
            nxt = prefix[pos + 1] if pos + 1 < len(prefix) else None
            if child != self.template_child or (nxt is not None and nxt.op == "get_attr"
                                                and view.child_of_path(str(nxt.target)) == child):
                continue
            run: list[fx.Node] = []       # the template child's attributes that end here
            for m in reversed(prefix[:pos + 1]):
                if m.op != "get_attr" or view.child_of_path(str(m.target)) != child:
                    break
                run.insert(0, m)
            for c in self.copied:
                for m in run:
                    self.parameters[c, view.in_child(str(m.target))] = \
                        self.attribute(m, view.rename_path(str(m.target), c))

    def copy_periods(self) -> list[fx.Node]:
        """The template period once per child not traced; returns the last period written."""
        view, template = self.view, self.view.periods[-1]
        previous = [self.env[n] for n in template]
        for c in self.copied:
            own: list[fx.Node] = []

            def ref(v: fx.Node, c: int = c, own: list[fx.Node] = own, previous: list[fx.Node] = previous) -> fx.Node:
                kind, where = view.token(v, self.template_child, True)
                if kind == "own":
                    return own[where]
                if kind == "previous":
                    return previous[where]
                if kind == "parameter":
                    return self.parameters[c, where]
                return self.env[where]

            shift = c - self.template_child
            for n in template:
                base, num = _split_name(n.name)
                own.append(self.add(n, ref, _number(base, num, shift * self.step.get(base, 0)),
                                    view.rename_meta(n.meta, c)))
            previous = own
        return previous

    def copy_tail(self, last_period: list[fx.Node]) -> None:
        """What follows the stack; reads of the template period now read the last copy."""
        view, added = self.view, len(self.copied)

        def ref(v: fx.Node) -> fx.Node:
            r, i = view.where.get(v, (-1, 0))
            return last_period[i] if r == self.template_child else self.env[v]

        for n in view.tail:
            if n.op == "output":
                self.env[n] = self.out.output(fx.map_arg(n.args[0], ref), type_expr=n.type)
                self.env[n].meta = dict(n.meta)
                continue
            base, num = _split_name(n.name)
            self.env[n] = self.add(n, ref, _number(base, num, added * self.step.get(base, 0)), n.meta)
