"""Tensor parallelism priced: the cost tables of a cluster whose stages run on t devices of a node each.

At degree t a device class's "device" is a group of t devices inside one node (t must divide the
devices per node, else the class has none at that degree). Per block (planner.core.blocks.BlockSharding):

- compute: the pairs' share of the FLOPs runs 1/t on each shard, the rest is repeated on every shard;
- collectives: each pair all-reduces its output in the forward and its input's gradient in the backward,
  a ring over the node's collective link (ClassTable.collective_link: the intra link, or on calibrated
  CPU devices the measured all-reduce; as costmodel.network.ring_allreduce_s), on the critical path
  (Megatron's scheme does not overlap them); the latency hops go with the launches, per micro-batch;
- memory: the sharded parameters' weights, gradients and optimizer state 1/t per shard, the replicated
  ones whole; the kept activations of the pairs 1/t, the rest whole; what a cut sends stays whole
  (a block's output is replicated);
- the gradient sync across replicas runs per shard lane in parallel, each lane its 1/t of the sharded
  gradients plus the replicated ones (each device has its own link to the network, as in nodes with a
  network card per GPU).

The search sees the result as ordinary tables (the solver sees only numbers); planner.search.assemble
gives each stage t ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from costmodel.tables import ClassTable, CostTables
from planner.core.blocks import BlockSharding
from planner.core.cluster import Link

DEGREES = (1, 2, 4, 8)


def usable_degrees(tables: CostTables, shardings: Sequence[BlockSharding], fixed: int | None = None,
                   use_all_devices: bool = False) -> list[int]:
    """Degrees worth a search: those some block shards at (every block's pairs divide it or stay whole)
    and some class's nodes hold (with `use_all_devices`, every device can join a group of that size);
    `fixed` (`--tp`) alone where given."""
    if fixed is not None:
        return [fixed] if not use_all_devices or covers_every_device(tables, fixed) else []
    shards_any = {t for sh in shardings for t in sh.degrees if sh.sharded_params}
    return [t for t in DEGREES if t == 1 or (t in shards_any and any(c.per_node % t == 0 for c in tables.classes)
                                              and (not use_all_devices or covers_every_device(tables, t)))]


def at_degree(tables: CostTables, shardings: Sequence[BlockSharding], degree: int) -> CostTables:
    """The tables at tensor-parallel degree `degree` (1: `tables` itself)."""
    if degree == 1:
        return tables
    if len(shardings) != tables.num_blocks:
        raise ValueError(f"{len(shardings)} block shardings for {tables.num_blocks} blocks")
    classes = tuple(_class_at(c, shardings, tables.grad_bytes, degree) for c in tables.classes)
    grad = tuple(g - _sharded(sh, degree) * sh.sharded_param_bytes * (1 - 1 / degree)
                 for g, sh in zip(tables.grad_bytes, shardings))
    tied = tuple((blocks, nbytes) for blocks, nbytes in tables.tied)     # tied weights (embeddings) stay whole
    return dataclasses.replace(tables, classes=classes, grad_bytes=grad, tied=tied)


def _sharded(sh: BlockSharding, degree: int) -> float:
    """1 where the block's pairs split at `degree`, else 0 (the block then runs whole on every shard)."""
    return 1.0 if sh.sharded_params and sh.divides(degree) else 0.0


def shard_units(table: ClassTable, degree: int) -> int:
    """Groups of `degree` devices of one node the class offers: each node's devices // degree, less one
    for each device a node lacks (a spec less lost devices: costmodel.tables counts devices, not nodes)."""
    missing = table.per_node * table.num_nodes - table.num_devices
    return max(0, table.num_nodes * (table.per_node // degree) - missing)


def covers_every_device(tables: CostTables, degree: int) -> bool:
    """Whether groups of `degree` can take every device of every class (`--use-all-devices`)."""
    return all(c.per_node % degree == 0 and c.per_node * c.num_nodes == c.num_devices for c in tables.classes)


def _class_at(table: ClassTable, shardings: Sequence[BlockSharding], param_bytes: Sequence[float],
              t: int) -> ClassTable:
    if table.per_node % t:
        return dataclasses.replace(table, num_devices=0, per_node=0)
    intra = table.collective_link
    fwd, bwd, over, state, act, opt = [], [], [], [], [], []
    for b, sh in enumerate(shardings):
        on = _sharded(sh, t)
        flops_kept = 1 - on * sh.sharded_flops_fraction * (1 - 1 / t)
        fwd.append(table.fwd_s[b] * flops_kept + on * allreduce_s_per_sample(sh.allreduce_bytes_fwd, t, intra))
        bwd.append(table.bwd_s[b] * flops_kept + on * allreduce_s_per_sample(sh.allreduce_bytes_bwd, t, intra))
        over.append(table.overhead_s[b] + on * 2 * sh.allreduces * allreduce_latency_s(t, intra))
        part = min(1.0, sh.sharded_param_bytes / param_bytes[b]) if param_bytes[b] > 0 else 0.0
        param_kept = 1 - on * part * (1 - 1 / t)
        state.append(table.state_bytes[b] * param_kept)
        opt.append(table.optimizer_s[b] * param_kept)
        act.append(table.act_bytes[b] * (1 - on * sh.sharded_activation_fraction * (1 - 1 / t)))
    return dataclasses.replace(
        table, num_devices=shard_units(table, t), per_node=table.per_node // t,
        fwd_s=tuple(fwd), bwd_s=tuple(bwd), overhead_s=tuple(over), state_bytes=tuple(state),
        act_bytes=tuple(act), optimizer_s=tuple(opt), tp_degree=t)


def allreduce_s_per_sample(nbytes_per_sample: float, degree: int, link: Link) -> float:
    """Bandwidth part of a ring all-reduce of `nbytes_per_sample` over `degree` shards, per sample."""
    if degree <= 1 or nbytes_per_sample <= 0:
        return 0.0
    return 2 * (degree - 1) / degree * nbytes_per_sample / link.bandwidth_bytes_s


def allreduce_latency_s(degree: int, link: Link) -> float:
    """Latency part of one ring all-reduce over `degree` shards (2(t-1) hops)."""
    return 2 * (degree - 1) * link.latency_s if degree > 1 else 0.0
