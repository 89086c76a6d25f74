"""Run every stage of a plan once, forward and backward, on meta tensors, before the plan is written.

A plan can pass the search, the memory rule and the communication verifier and still crash at start-up
of its program: an in-place op on a received activation, a loss that does not take what the last stage
hands it. `check_stage_runs` runs one stage the way the program does (stages of passes.split, model
inputs from batch(), values of earlier stages as received tensors: leaves that require grad when their
gradient flows back; the loss on the model's output rebuilt like one process; the backward from the loss
or from gradients of the stage's outputs), on meta tensors: shapes and dtypes only, no storage and no
arithmetic. A failure names the model's module it happened in (its qualified name, from the node's
`nn_module_stack`). `check_plan_stages` runs every distinct stage of the plan's splits once (passes.stage_shape:
stages of the same layers at other depths are one).

Two things a stage run cannot see are read from the traced graph:

    check_batch_norm_rows   training-mode BatchNorm needs more than one value per channel; torch checks it
                            in F.batch_norm (so the trace at that size fails), not in the op on meta
    training_notes          what makes a run differ from one process though it runs: BatchNorm statistics
                            per micro-batch, dropout masks per rank (the plan's `warnings`)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from passes.split import StageSplit
from passes.stage_shape import stage_shape
from planner import frontend
from planner.core.errors import ModelFileError, PassError
from planner.core.ir import Plan
from planner.frontend.model_file import describe
from planner.frontend.user_code import user_code

RUN_FIX = ("the whole model runs on one process, so this is a fault of the stage split: report it with this "
           "line; meanwhile plan with another --stages or --micro-batch")
NAMED_AT_MOST = 2          # modules a note names before "and N more"


@dataclass(frozen=True)
class StageRun:
    """What one stage's forward and backward on meta tensors measured, at one micro-batch size."""

    stage: int
    rows: int
    param_count: int       # elements of the parameters the stage reads
    param_bytes: int
    saved_bytes: int       # tensors autograd kept for the backward (activations; the parameters not counted)


def check_stage_runs(split: StageSplit, stage: int, model_file: frontend.ModelFile, inputs: Sequence[Any],
                     target: Any) -> StageRun:
    """Run stage `stage` of `split` forward and backward on meta tensors as the program runs it.

    `inputs`: the model's inputs on meta (in `split.model_inputs` order) at the split's micro-batch size;
    `target`: batch()'s target on meta (the last stage's loss reads it). The stage module's parameters and
    buffers may be real or meta: the run uses meta copies and changes nothing of them. Raises PassError
    naming the module a forward or backward fails in, ModelFileError when the loss fails.
    """
    graph = split.stages[stage]
    rows = _rows(inputs)
    where = f"stage {stage} of {len(split.stages)} at micro-batch size {rows}"
    state = _meta_state(graph.module)
    params = {id(t) for t in state.values() if t.requires_grad}
    runner = _StageRunner(graph.module, state)
    saved = _SavedBytes(params)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        try:
            outs = runner.run(*_stage_args(split, stage, inputs))
        except Exception as exc:
            raise _failure(model_file, where, "forward", runner.node, exc) from exc
        grads: list[torch.Tensor | None]
        if stage == len(split.stages) - 1:
            roots, grads = [_loss(split, model_file, outs, target, where)], [None]
        else:
            pairs = [(t, torch.ones_like(t)) for name, t in zip(graph.outputs, outs)
                     if split.values[name].needs_grad and isinstance(t, torch.Tensor) and t.requires_grad]
            roots, grads = [t for t, _ in pairs], [g for _, g in pairs]
    if roots:
        try:
            torch.autograd.backward(roots, grads)
        except Exception as exc:
            raise _failure(model_file, where, "backward", runner.backward_node, exc) from exc
    read = [t for t in state.values() if t.requires_grad]
    return StageRun(stage, rows, sum(t.numel() for t in read), sum(t.numel() * t.element_size() for t in read),
                    saved.bytes)


def check_plan_stages(splits: Mapping[tuple[int, int], StageSplit], model_file: frontend.ModelFile) -> list[StageRun]:
    """Run every distinct stage of the splits (by (replica, rows), as passes.comm.inputs.trace_splits
    gives them) once; returns what each run measured. A stage is distinct by its micro-batch size and
    what its run depends on (stage_shape): splits that share a stage's cuts (replicas cut alike, or
    pipelines of other depths that agree there), and stages of the same layers elsewhere in a stack
    (layers 10-19 and 20-29 of a transformer), run it once."""
    runs: list[StageRun] = []
    done: set[tuple[Any, ...]] = set()
    seen: set[tuple[int, int]] = set()      # (rows, split) checked already: replicas cut alike share one
    batches: dict[int, tuple[Any, Any]] = {}
    for (_, rows), split in sorted(splits.items(), key=lambda item: item[0]):
        if (rows, id(split)) in seen:
            continue
        seen.add((rows, id(split)))
        for k in range(len(split.stages)):
            key = (rows, stage_shape(split, k))
            if key in done:
                continue
            done.add(key)
            if rows not in batches:
                inputs, target = frontend.example_batch(model_file, rows)
                batches[rows] = (frontend.to_device(inputs, "meta"), frontend.to_device(target, "meta"))
            runs.append(check_stage_runs(split, k, model_file, *batches[rows]))
    return runs


# ----- one stage's run ---------------------------------------------------------------------------------

def _rows(inputs: Sequence[Any]) -> int:
    tensors = [t for t in tree_leaves(list(inputs)) if isinstance(t, torch.Tensor) and t.dim() > 0]
    return int(tensors[0].shape[0]) if tensors else 0


def _meta_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A meta copy of every parameter and buffer of a stage module, by attribute name; a tensor the
    module holds under two names (a tied weight) has one copy."""
    copies: dict[int, torch.Tensor] = {}
    state = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if id(tensor) not in copies:
            copies[id(tensor)] = torch.empty_like(tensor, device="meta").requires_grad_(tensor.requires_grad)
        state[name] = copies[id(tensor)]
    return state


def _stage_args(split: StageSplit, stage: int, inputs: Sequence[Any]) -> list[Any]:
    """The stage's arguments as the program passes them: model inputs as given, each value of an earlier
    stage as a received tensor (a fresh leaf; requiring grad when its gradient is sent back)."""
    local = dict(zip(split.model_inputs, inputs))
    args = []
    for name in split.stages[stage].inputs:
        if name in local:
            args.append(local[name])
            continue
        info = split.values[name]
        args.append(torch.empty(info.shape, dtype=info.dtype, device="meta").requires_grad_(info.needs_grad))
    return args


class _StageRunner(fx.Interpreter):
    """Runs a stage graph node by node on `state` (its tensors by attribute name), remembering the node
    running now and, through a hook on each result's autograd node, the node whose backward ran last."""

    def __init__(self, module: fx.GraphModule, state: Mapping[str, torch.Tensor]) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.state = state
        self.node: fx.Node | None = None
        self.backward_node: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.node = n
        result = super().run_node(n)
        for value in tree_leaves(result):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                value.grad_fn.register_prehook(lambda grads, node=n: self._entered(node))
        return result

    def _entered(self, node: fx.Node) -> None:
        self.backward_node = node

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.state[target] if target in self.state else super().get_attr(target, args, kwargs)


class _SavedBytes:
    """Bytes of the tensors autograd saves for the backward (saved-tensor hooks), each tensor once; the
    stage's parameters (and views of them) are not activations and are left out."""

    def __init__(self, params: set[int]) -> None:
        self.params = params
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(tensor) not in self.seen and id(base) not in self.params:
            self.seen.add(id(tensor))
            self.bytes += tensor.numel() * tensor.element_size()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _loss(split: StageSplit, model_file: frontend.ModelFile, outs: Sequence[Any], target: Any,
          where: str) -> torch.Tensor:
    """The loss on the model's output, as the program's last stage computes it (a scalar tensor)."""
    name = getattr(model_file.loss_fn, "__name__", "loss_fn")
    output = split.model_output(outs)
    try:
        with user_code(str(model_file.path), f"{name}(output, target)", model_file.time_limit_s, field=name):
            loss = model_file.loss_fn(output, target)
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(f"{name}(output, target) fails on the output of {where}, "
                             f"{describe(output)} ({type(output).__name__}): "
                             f"{type(exc).__name__}: {_first_line(exc)}", file=str(model_file.path), field=name,
                             fix="take what the model's forward returns and batch()'s target") from exc
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        raise ModelFileError(f"{name}(output, target) returns {type(loss).__name__}, not a scalar tensor, on the "
                             f"output of {where}", file=str(model_file.path), field=name,
                             fix="return the mean loss over the batch's rows, as a tensor")
    return loss


def _failure(model_file: frontend.ModelFile, where: str, phase: str, node: fx.Node | None,
             exc: Exception) -> PassError:
    at = f" in {module_name(node)} (node {node.name})" if node is not None else ""
    return PassError(f"{where} fails its {phase}{at}: {type(exc).__name__}: {_first_line(exc)}",
                     file=str(model_file.path), field="model", fix=RUN_FIX)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


# ----- read from the graph -----------------------------------------------------------------------------

def module_of(node: fx.Node) -> tuple[str, str]:
    """(qualified name, class name) of the innermost module of the model whose forward made `node`; the
    model itself is `("", its class)`, a graph without module records `("", "")`."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, kind = list(stack.values())[-1]
    kind_name = kind if isinstance(kind, str) else getattr(kind, "__qualname__", str(kind))
    return str(path), kind_name.rsplit(".", 1)[-1]


def module_name(node: fx.Node) -> str:
    """`module head.bn (BatchNorm1d)`: the module a node belongs to, as a message names it."""
    path, kind = module_of(node)
    return f"module {path} ({kind})" if path else f"the model's own forward ({kind})" if kind else \
        "the model's forward"


def _schema_arg(node: fx.Node, name: str) -> Any:
    """The value node `node` passes for its aten op's argument `name` (None when it has none)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return None
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name, arg.default_value)
    return None


def batch_norm_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's batch normalisations in training mode (which normalise by the batch's statistics)."""
    out = []
    for n in gm.graph.nodes:
        target = n.target
        if n.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        name = target._schema.name.removeprefix("aten::")
        training = True if name == "_batch_norm_with_update" else _schema_arg(n, "training")
        if "batch_norm" in name and training is True:
            out.append(n)
    return out


def dropout_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's random dropouts: dropout ops in training with p > 0, attention with dropout_p > 0."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        name = n.target._schema.name.removeprefix("aten::")
        if "dropout" in name and "attention" not in name:
            p, train = _schema_arg(n, "p"), _schema_arg(n, "train")
            if isinstance(p, (int, float)) and p > 0 and train is not False:
                out.append(n)
        elif "attention" in name:
            p = _schema_arg(n, "dropout_p")
            if isinstance(p, (int, float)) and p > 0:
                out.append(n)
    return out


def values_per_channel(node: fx.Node, rows: int, trace_batch: int) -> int | None:
    """Values per channel a batch norm normalises over at micro-batch size `rows`: rows x the spatial size
    of its input as traced at `trace_batch` rows (None when its first dimension is not the batch's)."""
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or int(val.shape[0]) != trace_batch:
        return None
    return rows * math.prod(int(d) for d in val.shape[2:])


def check_batch_norm_rows(plan: Plan, gm: fx.GraphModule, trace_batch: int, file: str) -> None:
    """Refuse a plan whose micro-batches leave a training-mode BatchNorm one value per channel (a 1-row
    micro-batch into BatchNorm1d): torch raises at that size, in the program's trace of it. `gm` is the
    model traced at `trace_batch` rows. Raises ModelFileError naming the module and the micro-batch."""
    nodes = batch_norm_nodes(gm)
    for replica in plan.replicas:
        for rows in sorted(set(replica.micro_batch_sizes)):
            for node in nodes:
                if values_per_channel(node, rows, trace_batch) == 1:
                    sizes = list(replica.micro_batch_sizes)
                    raise ModelFileError(
                        f"{module_name(node)} would normalise a micro-batch of {rows} row: replica {replica.index} "
                        f"trains its {replica.batch_share} rows as {sizes}, and training-mode BatchNorm needs more "
                        "than one value per channel", file=file, field="model",
                        fix="give every micro-batch at least 2 rows: --micro-batch 2 or more, with a --global-batch "
                            "that leaves no replica an odd share (its last micro-batch would have 1 row; try "
                            "another one, or fewer replicas), or normalise per sample (GroupNorm, LayerNorm)")


def training_notes(plan: Plan, gm: fx.GraphModule) -> tuple[str, ...]:
    """Why a run of `plan` will not equal training on one process though it runs: BatchNorm normalises
    each micro-batch by its own statistics, dropout draws its masks per rank and micro-batch. One line per
    cause, naming the modules (grouped); none for a plan that trains the whole batch at once on one rank."""
    micro_batches = sum(len(r.micro_batch_sizes) for r in plan.replicas)
    sizes = sorted({m for r in plan.replicas for m in r.micro_batch_sizes})
    notes = []
    norms = batch_norm_nodes(gm)
    if norms and micro_batches > 1:
        rows = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        notes.append(f"BatchNorm statistics are per micro-batch ({rows} rows here, not the global batch of "
                     f"{plan.global_batch}): {group_modules(norms)}; the run will differ from one process "
                     "(per-sample GroupNorm or LayerNorm would not)")
    drops = dropout_nodes(gm)
    if drops and (micro_batches > 1 or plan.world_size > 1):
        notes.append(f"dropout masks are drawn per rank and micro-batch: {group_modules(drops)}; the run will "
                     "differ from one process (p=0 would not)")
    return tuple(notes)


def group_modules(nodes: Sequence[fx.Node]) -> str:
    """`BatchNorm2d in layer1.0.bn1, layer1.0.bn2 and 18 more`: the modules of `nodes` by class, each
    module once, in graph order."""
    by_kind: dict[str, list[str]] = {}
    for node in nodes:
        path, kind = module_of(node)
        names = by_kind.setdefault(kind or "the model", [])
        name = path or "the model's own forward"
        if name not in names:
            names.append(name)
    parts = []
    for kind, names in by_kind.items():
        shown = ", ".join(names[:NAMED_AT_MOST])
        rest = len(names) - NAMED_AT_MOST
        if rest > 0:
            shown += f" and {rest} more"
        elif len(names) > 1:
            shown = ", ".join(names[:-1]) + " and " + names[-1]
        parts.append(f"{kind} in {shown}")
    return "; ".join(parts)
