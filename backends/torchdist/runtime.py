"""The small runtime the emitted program calls: stage construction per micro-batch size,
the pipeline schedule with explicit p2p, gradient synchronisation, metrics.

torch.distributed.pipelining is not used because a plan here has replicas with different batch
shares and micro-batch sizes (so different shapes per replica) and skip connections that jump
over stages; both need per-value routing that PipelineStage does not offer.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint

from backends.compression import OneBitAdamW
from backends.torchdist import precision
from backends.torchdist.comm import P2P, Context, tag
from backends.torchdist.gradsync import GradientSync
from passes.split import StageSplit, split_stages
from planner import frontend
from planner.core import schedule as sched
from planner.core.ir import Plan


def build_model(model_file: frontend.ModelFile, seed: int) -> nn.Module:
    """The full model with exactly the values of `torch.manual_seed(seed); model()` on one process."""
    torch.manual_seed(seed)
    return model_file.build()


def make_optimizer(name: str, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The program's optimizers: AdamW (torch defaults but the learning rate), or SGD, momentum 0.9."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr)


def make_stage_optimizer(name: str, params: list[nn.Parameter], grad_sync: GradientSync, lr: float, *,
                         onebit_freeze_step: int) -> torch.optim.Optimizer:
    """One rank's optimizer over `params`.

    `make_optimizer(name, params, lr)`, except that under AdamW the parameters of `grad_sync`'s
    `onebit` groups train with 1-bit Adam (OneBitAdamW: exact AdamW for `onebit_freeze_step` steps,
    then frozen variance and 1-bit compressed momentum in place of the group's gradient sync; see
    backends.compression.onebit_adam). 1-bit compression on the gradients themselves only suits SGD.
    One optimizer for all of the rank's parameters, so that fp16 loss scaling unscales them and skips
    the step together.
    """
    if name != "adamw":
        return make_optimizer(name, params, lr)
    handed = grad_sync.momentum_exchanges()     # the exchanges stay listed in grad_sync.exchanges
    if not handed:
        return make_optimizer(name, params, lr)
    in_groups = {id(p) for group_params, _ in handed for p in group_params}
    rest = [p for p in params if id(p) not in in_groups]
    groups = [{"params": group_params} for group_params, _ in handed] + ([{"params": rest}] if rest else [])
    return OneBitAdamW(groups, exchanges=[exchange for _, exchange in handed], lr=lr,
                       freeze_step=onebit_freeze_step)


def sync_step_gradients(grad_sync: GradientSync, params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None,
                        scaler: precision.LossScaler | None) -> bool:
    """Sum each gradient group's gradients over its ranks (replicas, and stages sharing a weight), with
    the group's compressor; returns whether the step is skipped.

    Groups whose momentum the optimizer exchanges in its coming step (1-bit Adam after warm-up) keep
    their local gradients. Under fp16 loss scaling (`scaler`; needs `optimizer`) gradients are unscaled
    first, and on an overflow anywhere no rank syncs: the step is skipped everywhere (True).
    """
    if grad_sync.exchanges and not isinstance(optimizer, OneBitAdamW):
        raise ValueError("1-bit Adam groups sync through their optimizer (make_stage_optimizer); pass it")
    if scaler is not None:
        if optimizer is None:
            raise ValueError("fp16 loss scaling needs the optimizer to unscale gradients")
        for p in params:                    # every rank takes part in the inf check
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if scaler.unscale_(optimizer):
            return True
    skip = {e.key for e in optimizer.exchanging()} if isinstance(optimizer, OneBitAdamW) else set()
    grad_sync.sync(skip=skip)
    return False


def rows_of_replica(plan: Plan, replica_index: int) -> tuple[int, int]:
    """[start, stop) rows of the global batch this replica trains on: shares in plan order."""
    start = sum(r.batch_share for r in plan.replicas[:replica_index])
    return start, start + plan.replicas[replica_index].batch_share


def _slice_rows(value: Any, start: int, stop: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[start:stop]
    if isinstance(value, (tuple, list)):
        return type(value)(_slice_rows(v, start, stop) for v in value)
    return value


def edge_compressors(plan: Plan, replica: int) -> dict[tuple[int, int], str]:
    """(producer stage, consumer stage) -> activation compressor, for every pair of a replica.

    The plan names the compressor of each adjacent edge; a value skipping stages travels with the
    compressor of the edge leaving its producer. Sender and receiver look up the same pair.
    """
    edges = {(e.src_stage, e.dst_stage): e.compressor for e in plan.p2p if e.replica == replica}
    stages = len(plan.replicas[replica].stages)
    return {(a, b): edges.get((a, b), edges.get((a, a + 1), "none"))
            for a in range(stages) for b in range(a + 1, stages)}


class StageProgram:
    """This rank's stage: its graphs (one per micro-batch size), parameters and schedule.

    `cpu_autocast`: apply the plan's bf16/fp16 precision on CPU ranks too (see precision.py).
    """

    def __init__(self, plan: Plan, ctx: Context, model_file: frontend.ModelFile, model: nn.Module, *,
                 cpu_autocast: bool = False) -> None:
        self.plan, self.ctx, self.model_file = plan, ctx, model_file
        self.model = model.to(ctx.device)
        self.last_nodes = [s.last_node for s in ctx.replica.stages]
        self._splits: dict[int, StageSplit] = {}
        self.p2p = P2P()
        self.params = {name: self.model.get_parameter(name) for name in ctx.stage.params}
        self.compute_dtype = precision.stage_compute_dtype(ctx.stage, cpu_autocast)
        self.scaler = (precision.LossScaler(ctx.device)
                       if precision.needs_loss_scaling(plan, cpu_autocast) else None)
        self.grad_sync = GradientSync(list(plan.grad_groups), ctx.grad_groups, self.params)
        self.edges = edge_compressors(plan, ctx.replica.index)
        self.skipped_step = False

    @property
    def grad_bytes_reduced(self) -> int:
        """Gradient bytes (uncompressed) synchronised in the last step (1-bit Adam: its momentum)."""
        return self.grad_sync.bytes_reduced + sum(e.exchanged_bytes for e in self.grad_sync.exchanges)

    @property
    def grad_wire_bytes_by_group(self) -> dict[int, int]:
        """Measured payload bytes per gradient group in the last step: gradients or 1-bit Adam's momentum."""
        merged = dict(self.grad_sync.wire_bytes_by_group)
        for exchange in self.grad_sync.exchanges:
            if exchange.wire_bytes:
                merged[exchange.key] = merged.get(exchange.key, 0) + exchange.wire_bytes
        return merged

    @property
    def grad_wire_bytes(self) -> int:
        return sum(self.grad_wire_bytes_by_group.values())

    def reset_counters(self) -> None:
        """Per-step byte counters (p2p sent, gradients reduced, momentum exchanged)."""
        self.p2p.bytes_sent = 0
        self.grad_sync.bytes_reduced = 0
        self.grad_sync.wire_bytes_by_group = {}
        for exchange in self.grad_sync.exchanges:
            exchange.reset_counters()

    def make_optimizer(self, name: str, lr: float, *, onebit_freeze_step: int) -> torch.optim.Optimizer:
        """This rank's optimizer (`make_stage_optimizer`); call once."""
        if self.grad_sync.exchanges:
            raise RuntimeError("make_optimizer: the 1-bit groups' compressors already belong to an optimizer")
        return make_stage_optimizer(name, self.parameters(), self.grad_sync, lr,
                                    onebit_freeze_step=onebit_freeze_step)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.params.values())

    def split_for(self, micro_inputs: tuple[Any, ...]) -> StageSplit:
        """Trace the model at this micro-batch size (once per size) and split it like the plan."""
        rows = int(micro_inputs[0].shape[0])
        if rows not in self._splits:
            gm = frontend.trace(self.model, micro_inputs, file=str(self.model_file.path))
            self._splits[rows] = split_stages(gm, self.last_nodes)
        return self._splits[rows]

    def train_step(self, step: int) -> float:
        """Forward and backward of this rank's stage for every micro-batch; returns the loss
        contribution of this rank (last stages: share-weighted mean over their rows)."""
        ctx, plan = self.ctx, self.plan
        inputs, target = frontend.example_batch_for_step(self.model_file, plan.global_batch, step)
        start, _ = rows_of_replica(plan, ctx.replica.index)
        micro = []
        offset = start
        for size in ctx.replica.micro_batch_sizes:
            mb_inputs = frontend.to_device(_slice_rows(inputs, offset, offset + size), ctx.device)
            mb_target = frontend.to_device(_slice_rows(target, offset, offset + size), ctx.device)
            micro.append((mb_inputs, mb_target, size))
            offset += size
        actions = sched.make(ctx.replica.schedule, ctx.num_stages, len(micro))[ctx.stage.index]
        saved: dict[int, dict[str, Any]] = {}
        loss_sum = 0.0
        for action in actions:
            start_s = self._work_clock()
            if action.kind == "F":
                loss_sum += self._forward(action.micro, micro[action.micro], saved)
            else:
                self._backward(action.micro, micro[action.micro], saved)
            # pad the compute only: time blocked on incoming messages is not slowed down
            self._emulate_slowdown(self._work_clock() - start_s)
        self.p2p.wait_sends()
        return loss_sum

    def _work_clock(self) -> float:
        """Seconds of this rank's own work: CPU seconds on a CPU device (a blocked receive costs none, and a
        time slice lost to another process is not counted, so the padding does not multiply it); wall
        seconds less the time blocked in receives elsewhere."""
        if self.ctx.device.type == "cpu":
            return time.process_time()
        return time.perf_counter() - self.p2p.recv_wait_s

    def _emulate_slowdown(self, work_s: float) -> None:
        # busy, not asleep: an emulated slow device does `slowdown` times the work, keeping its share of
        # the host's cores for all of it, as a real device stays busy; asleep, it would hand that share
        # to the other emulated devices and make their speed depend on its schedule
        if self.ctx.stage.slowdown > 1.0:
            end_s = self._work_clock() + work_s * (self.ctx.stage.slowdown - 1.0)
            while self._work_clock() < end_s:
                pass

    def _forward(self, j: int, mb: tuple[Any, Any, int], saved: dict[int, dict[str, Any]]) -> float:
        ctx = self.ctx
        mb_inputs, mb_target, size = mb
        split = self.split_for(mb_inputs)
        stage = split.stages[ctx.stage.index]
        local = dict(zip(split.model_inputs, mb_inputs))
        value_index = {name: i for i, name in enumerate(sorted(split.values))}
        args, received = [], []
        for name in stage.inputs:
            info = split.values[name]
            if info.producer == -1:
                args.append(local[name])
                continue
            t = self.p2p.recv(info.shape, info.dtype, ctx.rank_of_stage(info.producer),
                              tag(j, value_index[name], False, len(value_index)), ctx.device,
                              compressor=self.edges[info.producer, ctx.stage.index])
            if info.needs_grad:
                t.requires_grad_(True)
            args.append(t)
            received.append((name, t))
        with precision.autocast(self.compute_dtype, ctx.device):
            if ctx.stage.recompute:   # keep only the stage inputs; rerun the forward during backward
                outs = torch.utils.checkpoint.checkpoint(stage.module, *args, use_reentrant=False)
            else:
                outs = stage.module(*args)
            if ctx.is_last:
                output = outs[0] if split.output_structure == "tensor" else outs
                loss = self.model_file.loss_fn(output, mb_target) * (size / self.plan.global_batch)
        record: dict[str, Any] = {"received": received, "sent": []}
        contribution = 0.0
        if ctx.is_last:
            record["loss"] = self.scaler.scale_loss(loss) if self.scaler else loss
            contribution = float(loss.detach())
        else:
            for name, t in zip(stage.outputs, outs):
                info = split.values[name]
                for consumer in info.consumers:
                    if consumer < ctx.num_stages:
                        self.p2p.send(t, ctx.rank_of_stage(consumer),
                                      tag(j, value_index[name], False, len(value_index)),
                                      dtype=info.dtype, compressor=self.edges[ctx.stage.index, consumer])
                record["sent"].append((name, t))
        record["split"] = split
        saved[j] = record
        return contribution

    def _backward(self, j: int, mb: tuple[Any, Any, int], saved: dict[int, dict[str, Any]]) -> None:
        ctx = self.ctx
        record = saved.pop(j)
        split: StageSplit = record["split"]
        value_index = {name: i for i, name in enumerate(sorted(split.values))}
        if ctx.is_last:
            record["loss"].backward()
        else:
            tensors, grads = [], []
            for name, t in record["sent"]:
                info = split.values[name]
                if not info.needs_grad:
                    continue
                total = None
                for consumer in info.consumers:
                    if consumer >= ctx.num_stages:
                        continue
                    g = self.p2p.recv(info.shape, info.dtype, ctx.rank_of_stage(consumer),
                                      tag(j, value_index[name], True, len(value_index)), ctx.device,
                                      compressor=self.edges[ctx.stage.index, consumer])
                    total = g if total is None else total + g
                if total is not None and t.requires_grad:
                    tensors.append(t)
                    grads.append(total.to(t.dtype))   # t may be half under autocast
            if tensors:
                torch.autograd.backward(tensors, grads)
        for name, t in record["received"]:
            if not split.values[name].needs_grad:   # context (masks, positions): no gradient flows
                continue
            grad = t.grad if t.grad is not None else torch.zeros_like(t)
            producer = split.values[name].producer
            self.p2p.send(grad, ctx.rank_of_stage(producer), tag(j, value_index[name], True, len(value_index)),
                          dtype=split.values[name].dtype, compressor=self.edges[producer, ctx.stage.index])

    def sync_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """`sync_step_gradients` for this rank; sets `skipped_step`."""
        self.skipped_step = sync_step_gradients(self.grad_sync, self.parameters(), optimizer, self.scaler)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step (through the loss scaler, which skips it after an overflow)."""
        if self.scaler is not None:
            self.scaler.step(optimizer)
        else:
            optimizer.step()

    def save_final(self, out_dir: Path) -> Path:
        path = out_dir / "final" / f"rank{self.ctx.rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({name: p.detach().cpu() for name, p in self.params.items()}, path)
        return path


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class Metrics:
    """One JSON line per step and rank, appended to out/run/metrics.jsonl."""

    def __init__(self, out_dir: Path, ctx: Context) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        self.ctx = ctx

    def log(self, **fields: Any) -> None:
        record = {"rank": self.ctx.rank, "replica": self.ctx.replica.index, "stage": self.ctx.stage.index,
                  "device": self.ctx.stage.device_label, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def load_plan(path: Path) -> Plan:
    return Plan.load(path)
