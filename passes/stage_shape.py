"""The shape of a pipeline stage: what a run of it on meta tensors depends on, without names.

passes.stage_check runs every distinct stage of a plan forward and backward on meta once. A plan of a
transformer has many stages of the same layers at other depths (layers 10-19 and 20-29, or one layer a
stage in a 64-stage pipeline), whose graphs differ in their node, value and parameter names only; on
meta tensors nothing else of them is read, so stages of one shape at one micro-batch size run alike
(the same success or failure, the same parameter and activation bytes) and one run stands for all.
Measured on Llama-70B at 1024 GPUs (16 pipelines of 64 stages), 5 runs instead of 64.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from passes.split import StageSplit


def stage_shape(split: StageSplit, stage: int) -> tuple[Any, ...]:
    """What a run of one stage on meta (check_stage_runs) depends on, without the names of its nodes,
    values and parameters: its nodes in order (op, target, arguments with nodes by position), what each
    input is (which model input; a received value's shape, dtype and whether its gradient is sent back),
    each parameter's and buffer's shape, dtype and requires_grad (a tensor held twice, once), which
    outputs send a gradient back, and whether the loss follows (the model's output tree). Two stages of
    equal shape at one micro-batch size run alike: on meta tensors nothing but these is read. An
    argument of a kind not listed here is equal only to itself (the same object), so stages that might
    differ are run each."""
    graph = split.stages[stage]
    module = graph.module
    tensors: dict[int, int] = {}
    state: dict[str, tuple[Any, ...]] = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        state[name] = (tensors.setdefault(id(t), len(tensors)), tuple(t.shape), t.dtype, t.requires_grad,
                       isinstance(t, torch.nn.Parameter))
    model_inputs = {name: i for i, name in enumerate(split.model_inputs)}
    inputs = tuple(("input", model_inputs[name]) if name in model_inputs else
                   ("received", split.values[name].shape, split.values[name].dtype, split.values[name].needs_grad)
                   for name in graph.inputs)
    position: dict[fx.Node, int] = {}
    nodes: list[tuple[Any, ...]] = []
    for n in module.graph.nodes:
        position[n] = len(position)
        if n.op == "placeholder":
            nodes.append(("placeholder",))
        elif n.op == "get_attr":
            target = str(n.target)
            nodes.append(("get_attr", state[target]) if target in state else
                         ("get_attr", "object", id(_attribute(module, target))))
        elif n.op in ("call_function", "call_method"):
            nodes.append((n.op, n.target, _shape_of(n.args, position), _shape_of(n.kwargs, position)))
        else:                       # call_module, output: the module is named (equal only to itself)
            nodes.append((n.op, str(n.target), _shape_of(n.args, position), _shape_of(n.kwargs, position)))
    last = stage == len(split.stages) - 1
    sends_grad = tuple(split.values[name].needs_grad for name in graph.outputs)
    return (last, str(split.output_spec) if last else "", inputs, sends_grad, tuple(state.values()), tuple(nodes))


_PLAIN = (bool, int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _shape_of(arg: Any, position: Mapping[fx.Node, int]) -> Any:
    """An argument with nodes by position; floats by repr (-0.0 and nan are themselves); anything else
    not plain by identity."""
    if isinstance(arg, fx.Node):
        return ("node", position[arg])
    if isinstance(arg, (tuple, list)):
        return (type(arg).__name__, tuple(_shape_of(a, position) for a in arg))
    if isinstance(arg, dict):
        return ("dict", tuple((k, _shape_of(v, position)) for k, v in arg.items()))
    if isinstance(arg, slice):
        return ("slice", _shape_of(arg.start, position), _shape_of(arg.stop, position), _shape_of(arg.step, position))
    if isinstance(arg, float):
        return ("float", repr(arg))
    if isinstance(arg, _PLAIN):
        return (type(arg).__name__, arg)
    return ("object", id(arg))


def _attribute(module: torch.nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
