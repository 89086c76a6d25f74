"""ZB-H1's split backward: B, the gradients of a stage's inputs (what the stage before waits for), keeping what
the weights' gradients need; W, those weights' gradients, later.

The split is torch.distributed.pipelining's (`stage_backward_input` / `stage_backward_weight`, which its
zero-bubble schedules run): B groups the weights by the nodes where their paths meet the inputs' and keeps
the gradients flowing into those nodes; W runs from there to the weights. Two cases it leaves to its
caller, both mended here:

- a weight whose paths never meet the inputs' (a stage output made from the stage's own inputs alone, such
  as token ids through an embedding) is in no group, so W would never compute its gradient (its own code
  notes the case). `splits_cleanly` finds it, once per stage graph; the program then runs that stage's
  whole backward at B, as under 1F1B.
- its grouping merges a weight's group into the first one it meets but not the others its paths meet as
  well (the result depends on set order), so a weight can sit in two groups and W would add its gradient
  twice (T5, whose position bias every layer reads: losses off by 1e-5, differently from run to run).
  `disjoint_groups` merges groups that share a weight.

Imported on a ZB-H1 plan's first backward only: torch.distributed.pipelining imports FSDP.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.pipelining import _backward as split


def splits_cleanly(outputs: list[torch.Tensor], inputs: list[torch.Tensor], params: Iterable[torch.Tensor]) -> bool:
    """Every weight the backward from `outputs` reaches has its paths meet those of `inputs`."""
    roots = [fn for fn in (t.grad_fn for t in outputs) if fn is not None]
    reverse = split.construct_reverse_graph(roots)
    reached = [acc for acc in (split._get_grad_fn_or_grad_acc(p) for p in params if p.requires_grad)
               if acc in reverse]
    input_nodes = [n for n in (split._get_grad_fn_or_grad_acc(t) for t in inputs) if n is not None]
    grouped: set[Any] = set()
    for group in split.get_param_groups(input_nodes, reached, reverse):
        grouped |= group["params"]
    return set(reached) <= grouped


def input_gradients(outputs: list[torch.Tensor], grads: list[torch.Tensor] | None, inputs: list[torch.Tensor],
                    params: Iterable[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """B: the inputs' gradients (into their .grad); returns what W needs."""
    _, groups = split.stage_backward_input(outputs, grads, inputs, iter(params))
    return disjoint_groups(groups)


def weight_gradients(params: Iterable[torch.nn.Parameter], groups: list[dict[str, Any]]) -> None:
    """W: the weights' gradients, added to their .grad. The graph is kept until the caller drops it: a weight
    reached along several paths has gradients crossing the same saved tensors from several intermediates."""
    split.stage_backward_weight(iter(params), groups, retain_graph=True)


def disjoint_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`stage_backward_input`'s groups, those sharing a weight merged (transitively): each weight gets its
    gradient once, from all its intermediates together (W clamps what flows between the intermediates of one
    group, so no path counts twice); an intermediate B's gradient never reached adds nothing and goes."""
    merged: list[dict[str, Any]] = []
    for group in groups:
        params = set(group["params"])
        pairs = dict(zip(group["intermediates"], group.get("grads") or [None] * len(group["intermediates"])))
        for other in [m for m in merged if m["params"] & params]:
            merged.remove(other)
            params |= other["params"]
            for node, grad in zip(other["intermediates"], other["grads"]):
                pairs.setdefault(node, grad)
        merged.append({"params": params, "intermediates": list(pairs), "grads": list(pairs.values())})
    for m in merged:
        kept = [(node, grad) for node, grad in zip(m["intermediates"], m["grads"]) if grad is not None]
        m["intermediates"], m["grads"] = [n for n, _ in kept], [g for _, g in kept]
    return merged
