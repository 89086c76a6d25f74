"""Blocks and single ops of a real model, timed alone on one device: what the cost model's per-block and
per-op figures are compared with (`benchmarks/single_device.py`).

The model is built with its real weights on the device and traced at the micro-batch size (as the emitted
program does, `backends.torchdist.program.stages`), then split into one stage per planner block with the lowering
pass (`passes.split.split_stages` at the blocks' last nodes). Each stage runs alone on the values the
stages before it produced (received activations require grad, as in a pipeline stage): forward, then
backward from a gradient of ones on every output that has one. The model's loss is not part of any block
(the planner's blocks hold the traced forward only).

Ops are the distinct aten calls of the same traced graph, with the real values they received, timed
`CHAIN_OPS` times per repetition as `microbench.measure_case` times its cases: a chain (each call's first
input is the previous call's output; the other inputs its own copies) where the output has the first
input's shape, else independent copies on their own leaf inputs (a backward over several roots costs
more per op on CPU: measured here, ~10 us for a small transpose). Floating inputs require grad, as
`costmodel.ops.OpCounter` assumes when it counts backward work. In blocks and ops alike, parameters
accumulate their gradients from one repetition to the next (as over a step's micro-batches, and as the
weights of `microbench.measure_case` do), while an activation's gradient is taken anew each time.

Timing follows `planner.profiling.microbench` (`fwd_bwd_times_s`: `disturb()` before every repetition, medians,
CPU seconds of this process on a CPU device, wall seconds with a device synchronise on CUDA).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map

from costmodel.ops import OpCounter, op_name
from passes.split import StageSplit, split_stages
from planner import frontend
from planner.core.blocks import OpCount
from planner.profiling.microbench import CHAIN_OPS, fwd_bwd_times_s


@dataclass(frozen=True)
class OpCall:
    """One distinct aten call of a traced model, with the real values it received on the device."""

    label: str                 # op name and input shapes, e.g. "linear 32x128, 128x128, 128"
    target: Any                # the aten overload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    count: OpCount             # the planner's work count of this very call
    nodes: int                 # graph nodes making this call (same op, shapes and constants)
    chains: bool               # timed as a chain: the output has the first input's shape and dtype


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds of one forward and of one backward (medians over repetitions)."""

    fwd_s: float
    bwd_s: float


@dataclass(frozen=True)
class ModelRun:
    """A model timed at one micro-batch size: every block alone, and the whole traced graph at once."""

    micro_batch: int
    blocks: tuple[PhaseTimes, ...]
    whole: PhaseTimes


def trace_on_device(model_file: frontend.ModelFile, micro_batch: int, device: torch.device,
                    dtype: torch.dtype) -> tuple[fx.GraphModule, tuple[Any, ...]]:
    """The model with real weights (`torch.manual_seed(0)`) in `dtype` on `device`, traced on `micro_batch`
    rows of its `batch()`; returns the graph and those inputs (floating ones in `dtype`)."""
    torch.manual_seed(0)
    module = model_file.build().to(device=device, dtype=dtype)
    inputs, _ = frontend.example_batch(model_file, micro_batch)
    inputs = tuple(_cast(v, dtype) for v in frontend.to_device(inputs, device))
    return frontend.trace(module, inputs, file=str(model_file.path)), inputs


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _grad_outputs(value: Any) -> list[torch.Tensor]:
    """The tensors of an op's or a stage's output that backward starts from."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]


def _timed(forward: Callable[[], Any], device: torch.device, repeats: int,
           received: list[torch.Tensor]) -> PhaseTimes:
    """Forward and backward (from gradients of ones, made once) of `forward`'s output. Parameters keep
    accumulating their gradients (as over a step's micro-batches); the `received` leaves get theirs
    anew each time (a pipeline stage receives a fresh activation per micro-batch)."""
    grads = [torch.ones_like(t) for t in _grad_outputs(forward())]

    def backward(out: Any) -> None:
        outs = _grad_outputs(out)
        if outs:
            torch.autograd.backward(outs, grads)
        for t in received:
            t.grad = None

    fwd_s, bwd_s = fwd_bwd_times_s(forward, backward, repeats, device)
    return PhaseTimes(fwd_s, bwd_s)


# ---- blocks ------------------------------------------------------------------------------------------
def _stage_inputs(split: StageSplit, inputs: tuple[Any, ...]) -> list[list[Any]]:
    """Each stage's input values, from one forward through all stages (detached; a value whose gradient
    flows back to an earlier stage becomes a leaf that requires grad, as a received activation does)."""
    env: dict[str, Any] = dict(zip(split.model_inputs, inputs, strict=True))
    per_stage = []
    with torch.no_grad():
        for stage in split.stages:
            per_stage.append([_received(env[name], split.values[name].needs_grad) for name in stage.inputs])
            outs = stage.module(*(env[name] for name in stage.inputs))
            env.update(zip(stage.outputs or stage.model_outputs, outs, strict=True))
    return per_stage


def _received(value: Any, needs_grad: bool) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().clone().requires_grad_(needs_grad and value.is_floating_point())


def measure_blocks(gm: fx.GraphModule, inputs: tuple[Any, ...], last_nodes: list[str], micro_batch: int,
                   device: torch.device, repeats: int) -> ModelRun:
    """Forward and backward of every block alone (`last_nodes`: each block's last node, in order) and of
    the whole graph, traced on `micro_batch` rows (`trace_on_device`)."""
    split = split_stages(gm, last_nodes)
    blocks = []
    for stage, args in zip(split.stages, _stage_inputs(split, inputs), strict=True):
        received = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        blocks.append(_timed(functools.partial(stage.module, *args), device, repeats, received))
    whole = _timed(lambda: gm(*inputs), device, repeats, [])
    return ModelRun(micro_batch, tuple(blocks), whole)


# ---- ops ---------------------------------------------------------------------------------------------
class _CallRecorder(fx.Interpreter):
    """Runs the graph, recording every aten call with its real argument values and output."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        out = super().call_function(target, args, kwargs)
        if isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable:
            self.calls.append((target, args, kwargs, out))
        return out


def _shape_key(value: Any) -> Any:
    return ("T", tuple(value.shape), str(value.dtype)) if isinstance(value, torch.Tensor) else value


def _label(target: Any, args: tuple[Any, ...]) -> str:
    shapes = ["x".join(map(str, t.shape)) or "scalar" for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    return f"{op_name(target.overloadpacket)} {', '.join(shapes)}".strip()


def distinct_calls(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> list[OpCall]:
    """The graph's aten calls (in-place ones left out), one per distinct (op, input shapes and dtypes,
    constant arguments), in first-use order, with the values of their first use (parameters as such)."""
    recorder = _CallRecorder(gm)
    with torch.no_grad():
        recorder.run(*inputs)
    counter = OpCounter()
    seen: dict[str, int] = {}
    calls: list[OpCall] = []
    for target, args, kwargs, out in recorder.calls:
        key = repr((str(target), tree_map(_shape_key, (args, kwargs))))
        if key in seen:
            calls[seen[key]] = replace(calls[seen[key]], nodes=calls[seen[key]].nodes + 1)
            continue
        seen[key] = len(calls)
        calls.append(OpCall(_label(target, args), target, args, kwargs,
                            counter.count(target, args, kwargs, out), 1, _chains(args, out)))
    return calls


def _chains(args: tuple[Any, ...], out: Any) -> bool:
    first = args[0] if args else None
    return (isinstance(first, torch.Tensor) and not isinstance(first, nn.Parameter) and first.is_floating_point()
            and isinstance(out, torch.Tensor) and out.shape == first.shape and out.dtype == first.dtype)


def _leaf_copy(value: Any) -> Any:
    """A parameter stays a parameter (its gradient accumulates); another floating tensor becomes a leaf
    that requires grad (an activation: its gradient is what the op's backward computes)."""
    if isinstance(value, nn.Parameter):
        return nn.Parameter(value.detach().clone())
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.is_floating_point())
    return value


def measure_call(call: OpCall, device: torch.device, repeats: int) -> PhaseTimes:
    """Seconds per op of `call`, forward and backward, over `CHAIN_OPS` calls: chained if `call.chains`,
    else independent copies (see the module docstring)."""
    if call.chains:
        first = _leaf_copy(call.args[0])
        rests = [tree_map(_leaf_copy, (call.args[1:], call.kwargs)) for _ in range(CHAIN_OPS)]

        def forward() -> Any:
            y = first
            for rest, kwargs in rests:
                y = call.target(y, *rest, **kwargs)
            return y
        leaves: Any = (first, rests)
    else:
        copies = [tree_map(_leaf_copy, (call.args, call.kwargs)) for _ in range(CHAIN_OPS)]

        def forward() -> Any:
            return [call.target(*a, **k) for a, k in copies]
        leaves = copies
    received = [t for t in tree_leaves(leaves)
                if isinstance(t, torch.Tensor) and t.requires_grad and not isinstance(t, nn.Parameter)]
    times = _timed(forward, device, repeats, received)
    return PhaseTimes(times.fwd_s / CHAIN_OPS, times.bwd_s / CHAIN_OPS)
