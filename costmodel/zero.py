"""ZeRO-1 (sharded optimizer state) per gradient group, as the cost model sees it: pure numbers.

Under ZeRO-1 (Rajbhandari et al., "ZeRO", SC 2020, stage 1) the k ranks of a gradient group each keep
the optimizer state of about 1/k of the group's parameters, step only those after the gradient sync,
and then gather the updated parameters from their owners. The emitted program runs it with torch's
`ZeroRedundancyOptimizer` (backends/torchdist/program/zero.py), which partitions whole parameter
tensors greedily (largest first, to the least loaded rank): the even split below is its ideal, reached
when the group's tensors divide evenly (the tests measure both on real gloo ranks).

  optimizer state per rank   state_factor x param_bytes / k        (`zero_state_bytes`)
                             AdamW: exp_avg + exp_avg_sq (2x the fp32 parameter bytes); SGD with
                             momentum: one momentum buffer (1x). AdamW's per-tensor `step` counter
                             (one scalar per parameter tensor) is left out: it does not scale with
                             the parameter bytes.
  gathered per rank / step   param_bytes x (k - 1) / k              (`zero_gather_bytes`)
                             the parameters the other ranks updated, received after the step (what a
                             ring all-gather moves per rank; torch issues it as one broadcast per
                             parameter from its owner, which hands every rank the same bytes)
  saved per rank             state_factor x param_bytes x (k - 1) / k  (`zero_saved_bytes`)

Gradients are still summed over the whole group (the gradient sync is unchanged: ZeRO-1 shards only
the optimizer state), so the gather is extra traffic on top of the group's all-reduce.
"""

from __future__ import annotations

STATE_BYTES_PER_PARAM_BYTE = {"adamw": 2.0, "sgd": 1.0}
"""Optimizer state bytes per fp32 parameter byte (torch.optim.AdamW: exp_avg and exp_avg_sq, each the
parameter's dtype and shape; torch.optim.SGD with momentum: momentum_buffer)."""


def _check(param_bytes: float, group_size: int) -> None:
    if param_bytes < 0:
        raise ValueError(f"param_bytes is {param_bytes}: a group holds zero or more bytes of parameters")
    if group_size < 1:
        raise ValueError(f"group_size is {group_size}: a gradient group has at least one rank")


def optimizer_state_bytes(param_bytes: float, optimizer: str) -> float:
    """Unsharded optimizer state of `param_bytes` of fp32 parameters under `optimizer` ("adamw" | "sgd")."""
    if optimizer not in STATE_BYTES_PER_PARAM_BYTE:
        raise ValueError(f"optimizer {optimizer!r}: the program's optimizers are {sorted(STATE_BYTES_PER_PARAM_BYTE)}")
    _check(param_bytes, 1)
    return STATE_BYTES_PER_PARAM_BYTE[optimizer] * param_bytes


def zero_state_bytes(param_bytes: float, optimizer: str, group_size: int) -> float:
    """Optimizer state per rank of a group of `group_size` ranks whose `param_bytes` of parameters are
    sharded with ZeRO-1 (the even split; group_size 1 is the unsharded state)."""
    _check(param_bytes, group_size)
    return optimizer_state_bytes(param_bytes, optimizer) / group_size


def zero_saved_bytes(param_bytes: float, optimizer: str, group_size: int) -> float:
    """Optimizer state per rank that ZeRO-1 saves against keeping it all on every rank."""
    return optimizer_state_bytes(param_bytes, optimizer) - zero_state_bytes(param_bytes, optimizer, group_size)


def zero_gather_bytes(param_bytes: float, group_size: int) -> float:
    """Parameter bytes each rank receives per step after the sharded step: the other ranks' shares of the
    group's `param_bytes` (0 for a group of one)."""
    _check(param_bytes, group_size)
    return param_bytes * (group_size - 1) / group_size
