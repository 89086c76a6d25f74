"""The schedule executor: this rank's stage runs the actions of its replica's schedule (1F1B, GPipe or
interleaved 1F1B, planner.core.schedule), forward and backward per micro-batch, with explicit sends and
receives; under interleaved 1F1B the rank runs several stages, and values are relayed stage to stage.

torch.distributed.pipelining is not used because a plan here has replicas with different batch shares
and micro-batch sizes (so different shapes per replica) and skip connections that jump over stages;
both need per-value routing that PipelineStage does not offer. Every value crossing a boundary is sent
from its producer to each consumer stage, and its gradient comes back the same way.

Under zbh1 a backward is two actions: B computes the gradients of the stage's inputs (sent at once to the
stage before) and keeps what the weights' gradients need; W computes those later, where the schedule puts
it (weight_split.py). A stage whose inputs need no gradient (the first), or whose graph the split would
miss a weight of, runs its whole backward at B.

What a step runs is read from the executor's plan, context, graphs and rows at the step's start, so
`replace_plan` may swap them between two steps (rebalance.py: new batch shares, applied without a
restart); the parameters, and with them the optimizer and the gradient sync, stay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint

from passes.comm.derive import edge_pairs
from passes.split import StageSplit, relayed
from planner import frontend
from planner.core import schedule as sched
from planner.core.ir import Plan

from . import precision
from .activations import NO_CODEC, Codec
from .data import ReplicaData
from .p2p import P2P, tag
from .process_group import Context
from .rows import MicroBatch
from .slowdown import Slowdown, no_drift
from .stages import StageGraphs


def edge_codecs(plan: Plan, replica: int) -> dict[tuple[int, int], Codec]:
    """(producer stage, consumer stage) -> activation codec, for every pair of a replica.

    The plan names the compressor (and its settings) of each adjacent edge; a value skipping stages
    travels with the codec of the edge leaving its producer (passes.comm's edge_pairs, the pairing the
    verifier derived the messages from). Sender and receiver look up the same pair.
    """
    return {pair: NO_CODEC if e is None else Codec.of(e) for pair, e in edge_pairs(plan, replica).items()}


class StageExecutor:
    """This rank's stage: its parameters (`params`, by the plan's names), its graphs (one per micro-batch
    size), its rows (`data`: what this stage reads of each step) and its schedule.

    `cpu_autocast`: apply the plan's bf16/fp16 precision on CPU ranks too (see precision.py). `drift(step)`:
    the factor on the planned emulated slowdown at each step (slowdown.py; an injected `slow` fault).
    """

    def __init__(self, plan: Plan, ctx: Context, model_file: frontend.ModelFile, graphs: StageGraphs,
                 params: dict[str, nn.Parameter], data: ReplicaData, *, cpu_autocast: bool = False,
                 drift: Callable[[int], float] = no_drift) -> None:
        self.plan, self.ctx, self.model_file, self.data = plan, ctx, model_file, data
        self.graphs = graphs          # this rank's stage installed (stages.StageGraphs.install)
        self.params = params
        self.p2p = P2P()
        self.slowdown = Slowdown(ctx.stage.slowdown, ctx.device, self.p2p, drift)
        self.compute_dtype = precision.stage_compute_dtype(ctx.stage, cpu_autocast)
        self.scaler = (precision.LossScaler(ctx.device)
                       if precision.needs_loss_scaling(plan, cpu_autocast) else None)
        self.edges = edge_codecs(plan, ctx.replica.index)
        self._clean: dict[tuple[int, int], bool] = {}     # (stage, rows) -> its backward splits (zbh1)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.params.values())

    def replace_plan(self, plan: Plan, ctx: Context, graphs: StageGraphs, data: ReplicaData) -> None:
        """Run the next steps by `plan` (the same stages, devices and schedules; other batch shares and
        micro-batches): `ctx` its view of this rank, `graphs` this stage at its micro-batch sizes with
        this executor's parameters installed, `data` its rows. The old rows' readers are stopped."""
        if ctx.stage != self.ctx.stage or ctx.replica.stages != self.ctx.replica.stages:
            raise ValueError(f"rank {ctx.rank}: a replaced plan keeps every stage as it is")
        old = self.data
        self.plan, self.ctx, self.graphs, self.data = plan, ctx, graphs, data
        self.edges = edge_codecs(plan, ctx.replica.index)
        if old is not data:
            old.close()

    def train_step(self, step: int) -> float:
        """Forward and backward of this rank's stages for every micro-batch of step `step`; returns the
        loss contribution of this rank (last stages: share-weighted mean over their rows)."""
        ctx = self.ctx
        self.slowdown.begin_step(step)
        micro = self.data.micro_batches(step)
        actions = sched.make(ctx.replica.schedule, ctx.num_stages, len(micro), ctx.replica.chunks)[ctx.stage.index]
        saved: dict[tuple[int, int], dict[str, Any]] = {}
        loss_sum = 0.0
        for action in actions:
            with self.slowdown.padded():
                if action.kind == "F":
                    loss_sum += self._forward(action.stage, action.micro, micro[action.micro], saved)
                elif action.kind == "W":
                    self._weights(action.stage, action.micro, saved)
                else:
                    self._backward(action.stage, action.micro, saved)
        self.p2p.wait_sends()
        return loss_sum

    def _routes(self, split: StageSplit, k: int, order: dict[str, int],
                ) -> tuple[list[tuple[str, int]], list[tuple[str, list[int]]]]:
        """Stage k's values in: (name, the stage it comes from), and out: (name, the stages it goes to), each
        in value order (`order`: each value's index). Values go from their producer to each stage reading them;
        under interleaved 1F1B they are relayed stage to stage (passes.split.relayed), so a rank's stages talk
        to their neighbours only."""
        if self.ctx.replica.chunks > 1:
            into, out = relayed(split.values, k, self.ctx.num_stages)
            return [(n, k - 1) for n in into], [(n, [k + 1]) for n in out]
        stage = split.stages[k]
        incoming = [(n, split.values[n].producer) for n in sorted(stage.inputs, key=order.__getitem__)
                    if split.values[n].producer != -1]
        outgoing = [] if k == self.ctx.num_stages - 1 else \
            [(n, [c for c in split.values[n].consumers if c < self.ctx.num_stages])
             for n in sorted(stage.outputs, key=order.__getitem__)]
        return incoming, outgoing

    def _forward(self, k: int, j: int, mb: MicroBatch, saved: dict[tuple[int, int], dict[str, Any]]) -> float:
        ctx = self.ctx
        last = k == ctx.num_stages - 1
        split = self.graphs.split_at(mb.rows)
        stage = split.stages[k]
        local = dict(zip(split.model_inputs, mb.inputs))
        value_index = {name: i for i, name in enumerate(sorted(split.values))}
        incoming, outgoing = self._routes(split, k, value_index)
        received = []
        # values travel in value order both ways (sends, receives, their gradients): NCCL matches the
        # messages of two ranks in the order they are issued, not by tag (passes.comm verifies the order)
        for name, source in incoming:
            info = split.values[name]
            t = self.p2p.recv(info.shape, info.dtype, ctx.rank_of_stage(source),
                              tag(j, value_index[name], False, len(value_index)), ctx.device,
                              codec=self.edges[source, k])
            if info.needs_grad:
                t.requires_grad_(True)
            received.append((name, t, source))
        arrived = {name: t for name, t, _ in received}
        args = [arrived[name] if name in arrived else local[name] for name in stage.inputs]
        with precision.autocast(self.compute_dtype, ctx.device):
            if ctx.replica.stages[k].recompute:   # keep only the stage inputs; rerun the forward during backward
                outs = torch.utils.checkpoint.checkpoint(stage.module, *args, use_reentrant=False)
            else:
                outs = stage.module(*args)
            if last:
                output = split.model_output(outs)    # the structure the model returns on one process
                loss = self.model_file.loss_fn(output, mb.target) * (mb.rows / self.plan.global_batch)
        record: dict[str, Any] = {"received": received, "sent": [], "split": split, "rows": mb.rows}
        contribution = 0.0
        if last:
            record["loss"] = self.scaler.scale_loss(loss) if self.scaler else loss
            contribution = float(loss.detach())
        else:
            made = dict(zip(stage.outputs, outs))
            for name, targets in outgoing:
                info = split.values[name]
                t = made[name] if name in made else arrived[name]       # relayed: handed on as it came
                for consumer in targets:
                    self.p2p.send(t, ctx.rank_of_stage(consumer),
                                  tag(j, value_index[name], False, len(value_index)),
                                  dtype=info.dtype, codec=self.edges[k, consumer])
                record["sent"].append((name, t, targets))
        saved[(k, j)] = record
        return contribution

    def _backward(self, k: int, j: int, saved: dict[tuple[int, int], dict[str, Any]]) -> None:
        ctx = self.ctx
        weights_later = sched.weight_split(ctx.replica.schedule)
        record = saved[(k, j)] if weights_later else saved.pop((k, j))
        split: StageSplit = record["split"]
        value_index = {name: i for i, name in enumerate(sorted(split.values))}
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] | None = None
        if k == ctx.num_stages - 1:
            tensors = [record["loss"]]
        else:
            grads = []
            for name, t, targets in record["sent"]:
                info = split.values[name]
                if not info.needs_grad:
                    continue
                total = None
                for consumer in targets:
                    g = self.p2p.recv(info.shape, info.dtype, ctx.rank_of_stage(consumer),
                                      tag(j, value_index[name], True, len(value_index)), ctx.device,
                                      codec=self.edges[k, consumer])
                    total = g if total is None else total + g
                if total is not None and t.requires_grad:
                    tensors.append(t)
                    grads.append(total.to(t.dtype))   # t may be half under autocast
        inputs = [t for name, t, _ in record["received"] if split.values[name].needs_grad and t.requires_grad]
        if weights_later and inputs and tensors and self._splits_cleanly(k, record["rows"], tensors, inputs):
            from . import weight_split
            record["weights"] = weight_split.input_gradients(tensors, grads, inputs, self.params.values())
        elif tensors:
            torch.autograd.backward(tensors, grads)
        for name, t, source in record["received"]:
            if not split.values[name].needs_grad:   # context (masks, positions): no gradient flows
                continue
            grad = t.grad if t.grad is not None else torch.zeros_like(t)
            self.p2p.send(grad, ctx.rank_of_stage(source), tag(j, value_index[name], True, len(value_index)),
                          dtype=split.values[name].dtype, codec=self.edges[source, k])

    def _weights(self, k: int, j: int, saved: dict[tuple[int, int], dict[str, Any]]) -> None:
        """zbh1's W: the weight gradients of stage k's backward of micro-batch j, from what its B kept."""
        record = saved.pop((k, j))
        if "weights" in record:
            from . import weight_split
            weight_split.weight_gradients(self.params.values(), record["weights"])

    def _splits_cleanly(self, k: int, rows: int, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
        """Whether stage k's backward at micro-batches of `rows` splits into B and W (weight_split), found on
        its first one: every micro-batch of a size runs the same graph."""
        if (k, rows) not in self._clean:
            from . import weight_split
            self._clean[k, rows] = weight_split.splits_cleanly(outputs, inputs, self.params.values())
        return self._clean[k, rows]

