"""ZeRO-1 per gradient group: the optimizer state of a `zero` group's parameters sharded across its ranks.

A plan `GradGroup` with `zero` set keeps, on each of its k ranks, the optimizer state of only about 1/k
of the group's parameters: after the group's gradient sync (unchanged: every rank holds the summed
gradient) each rank steps the parameters it owns, and the owners then send the updated parameters to
the others. Both are torch's `ZeroRedundancyOptimizer` over the group's process group (its sorted-greedy
partition of whole tensors; one broadcast per parameter from its owner after the step), with the
program's optimizer inside (optimizers.make_optimizer: AdamW, or SGD with momentum 0.9), so a step
equals the unsharded one. Cost model: costmodel.zero.

A rank's parameters may lie in several groups, some `zero` and some not: `ShardedStageOptimizer` holds
one ZeroRedundancyOptimizer per `zero` group (in plan group order on every rank, so that the groups'
broadcasts never wait on each other in a cycle) and one plain optimizer for the rest, behind a single
torch.optim.Optimizer, so that fp16 loss scaling (precision.LossScaler) unscales every gradient of the
rank (`param_groups` lists them all) and skips or takes the step on all parts together.

`state` holds what this rank steps: the parameters of the rest and those of its own shards, each in
the optimizer that updates it; `held_parameters` lists them, which is what a checkpoint saves and loads
per rank (checkpoint_state.py): every parameter of a `zero` group is saved by its owner alone.

Not for `onebit` groups: 1-bit Adam exchanges compressed momentum itself (backends.compression.onebit_adam),
so a `zero` `onebit` group is refused, and so is a `zero` group beside 1-bit Adam on one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from planner.core.errors import PlanFileError
from planner.core.ir import GradGroup

from .gradsync import GradientSync

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

MakeOptimizer = Callable[[list[Any]], torch.optim.Optimizer]
"""Builds the program's optimizer over parameters or parameter groups (optimizers.make_optimizer, its
name and learning rate bound)."""


def is_zero(group: GradGroup) -> bool:
    """Whether the plan shards `group`'s optimizer state (a plan from before the field: no)."""
    return bool(getattr(group, "zero", False))


def check_groups(groups: Sequence[GradGroup], optimizer_name: str) -> None:
    """Refuse what ZeRO-1 cannot run with: a `zero` group with the `onebit` compressor, and (under AdamW,
    where the `onebit` groups train with 1-bit Adam) `zero` groups beside `onebit` ones on one rank."""
    for group in groups:
        if is_zero(group) and group.compressor == "onebit":
            raise PlanFileError(f"gradient group {group.index} shards its optimizer state (zero) and uses the "
                                "onebit compressor, whose 1-bit Adam exchanges the momentum itself",
                                field=f"grad_groups[{group.index}].zero",
                                fix="re-plan with zero off for onebit groups, or another compressor")
    sharded = [g.index for g in groups if is_zero(g) and len(g.ranks) > 1]
    onebit = [g.index for g in groups if g.compressor == "onebit"]
    if optimizer_name == "adamw" and sharded and onebit:
        raise PlanFileError(f"this rank's gradient groups {sharded} shard their optimizer state (zero) and "
                            f"{onebit} train with 1-bit Adam: one rank cannot run both",
                            field=f"grad_groups[{sharded[0]}].zero",
                            fix="re-plan with zero off on the ranks of onebit groups, or pass --optimizer sgd")


def sharded_groups(grad_sync: GradientSync) -> list[tuple[GradGroup, dist.ProcessGroup | None, list[nn.Parameter]]]:
    """This rank's `zero` groups of more than one rank, in plan order: (plan group, process group, params)."""
    return [(g.plan, g.process_group, g.params) for g in grad_sync.groups if is_zero(g.plan) and g.size > 1]


class _HeldState(MutableMapping[torch.Tensor, dict[str, Any]]):
    """Optimizer state by parameter, for the parameters this rank steps, each kept in the state of the
    optimizer that updates it (a parameter another rank owns is not a key)."""

    def __init__(self, owners: dict[torch.Tensor, torch.optim.Optimizer]) -> None:
        self._owners = owners

    def _owner(self, param: torch.Tensor) -> torch.optim.Optimizer:
        owner = self._owners.get(param)
        if owner is None:
            raise KeyError("this rank holds no optimizer state for that parameter (another rank owns it)")
        return owner

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        state = self._owner(param).state
        if param not in state:
            raise KeyError("no optimizer state yet for that parameter")
        return state[param]

    def __setitem__(self, param: torch.Tensor, value: dict[str, Any]) -> None:
        self._owner(param).state[param] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        del self._owner(param).state[param]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p, owner in self._owners.items() if p in owner.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ShardedStageOptimizer(torch.optim.Optimizer):
    """One rank's optimizer: a ZeroRedundancyOptimizer per `zero` group and `make` over the rest.

    `param_groups` lists every parameter group of the parts (the shards' global views: all of a group's
    parameters, which the loss scaler unscales and `zero_grad` clears); `step` steps each shard (then
    its broadcasts) in plan group order, then the rest.
    """

    def __init__(self, params: Sequence[nn.Parameter],
                 shards: Sequence[tuple[GradGroup, dist.ProcessGroup | None, list[nn.Parameter]]],
                 make: MakeOptimizer) -> None:
        super().__init__([{"params": []}], {})
        sharded = {id(p) for _, _, members in shards for p in members}
        if len(sharded) != sum(len(members) for _, _, members in shards):
            raise PlanFileError("a parameter is listed by two zero gradient groups of one rank",
                                field="grad_groups.params", fix="re-plan: each parameter in one gradient group")
        # imported here, as checkpoints are (checkpoint.py): only a rank of a `zero` group needs it
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.shards: list[tuple[int, ZeroRedundancyOptimizer]] = []
        for group, process_group, members in sorted(shards, key=lambda s: s[0].index):
            # the shard's own optimizer is `make` over its partition: the same class and settings as the rest
            # the gather after the step: one broadcast per parameter tensor, from its owner (as
            # costmodel.sharded_state prices it)
            zero = ZeroRedundancyOptimizer(members, optimizer_class=make,  # type: ignore[arg-type]
                                           process_group=process_group)
            self.shards.append((group.index, zero))
        rest = [p for p in params if id(p) not in sharded]
        self.rest: torch.optim.Optimizer | None = make(rest) if rest else None
        self.param_groups = [g for part in self._parts() for g in part.param_groups]
        owners: dict[torch.Tensor, torch.optim.Optimizer] = {}
        for _, zero in self.shards:
            owners.update({p: zero.optim for g in zero.optim.param_groups for p in g["params"]})
        if self.rest is not None:
            owners.update({p: self.rest for g in self.rest.param_groups for p in g["params"]})
        self._owners = owners
        self.state = _HeldState(owners)  # type: ignore[assignment]

    def _parts(self) -> list[torch.optim.Optimizer]:
        return [zero for _, zero in self.shards] + ([self.rest] if self.rest is not None else [])

    def held_parameters(self) -> list[torch.Tensor]:
        """The parameters whose optimizer state this rank holds: the rest's and its own shards'."""
        return list(self._owners)

    def gather_bytes(self) -> int:
        """Parameter bytes this rank receives per step from the other owners of its `zero` groups (what
        the shards' broadcasts deliver; costmodel.zero.zero_gather_bytes is the cost model's view)."""
        return sum(p.numel() * p.element_size() for _, zero in self.shards for g in zero.param_groups
                   for p in g["params"] if p not in self._owners)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Each shard's step and broadcasts (plan group order), then the rest's; a closure is refused
        (it would run the model once per part)."""
        if closure is not None:
            raise ValueError("ShardedStageOptimizer.step takes no closure")
        for part in self._parts():
            part.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter of the rank (also those other ranks step)."""
        for part in self._parts():
            part.zero_grad(set_to_none=set_to_none)


def held_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters whose optimizer state `optimizer` keeps on this rank: all of its parameters, but
    only this rank's own shares of the `zero` groups of a ShardedStageOptimizer."""
    if isinstance(optimizer, ShardedStageOptimizer):
        return optimizer.held_parameters()
    return [p for group in optimizer.param_groups for p in group["params"]]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Measured bytes of the optimizer state tensors this rank holds (AdamW's moments, SGD's momentum;
    scalar step counters left out, as costmodel.zero leaves them out)."""
    total = 0
    for param in held_parameters(optimizer):
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and key != "step":
                total += value.numel() * value.element_size()
    return total
