"""Every rank's ordered communication, derived from the plan and its StreamInputs: the one function the
planner verifies and the program checks itself against (backends/torchdist/program/comm_check.py).

It follows the program call for call (backends/torchdist/program/):

  set-up     process_group.init: every rank creates every gradient group, in plan order (a barrier over
             all ranks each); comm_check: one all-reduce over all ranks of who found its stream wrong
  step       pipeline.StageExecutor.train_step: per schedule action, a forward receives its stage's
             inputs from their producers and sends its outputs to each later consumer; a backward
             receives the gradients of its outputs from those consumers and sends its inputs' gradients
             back (values that need one); under interleaved 1F1B values are relayed stage to stage
             instead (passes.split.relayed); then the step's sends are waited for.
             optimizers.sync_step_gradients: the fp16 inf check over all ranks (loss scaling), then
             each gradient group this rank is in, in plan order: one flat all-reduce (`none`), or one
             compressed all-reduce per bucket; 1-bit Adam's momentum exchange in the optimizer step.
             train.py: the loss all-reduce over all ranks
  end        train.py: a barrier over all ranks

A step depends on how the program runs (`Variant`): with or without plan-wide loss scaling (a step
skipped after an overflow syncs nothing), and for `onebit` groups: gradients compressed (SGD), summed
exactly (AdamW's warm-up) or momentum exchanged (1-bit Adam after it). `variants` lists every one.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from passes.comm.events import (
    COLLECTIVE,
    DIGEST_CHARS,
    RECV,
    SEND,
    WAIT,
    WORLD,
    CommEvent,
    message_tag,
    section_text,
    stream_text,
)
from passes.comm.inputs import SplitView, StreamInputs
from passes.split import relayed
from planner.core import schedule as sched
from planner.core.errors import PassError
from planner.core.ir import GradGroup, P2PEdge, Plan, ReplicaPlan, StagePlan

Schedules = Callable[[int], list[list[sched.Action]]]   # replica index -> its action list per device
ONEBIT_MODES = ("gradients", "exact", "momentum")
COMMON = "set-up and pipeline"      # the name of the streams' first part in the digest
FP32 = "float32"


@dataclass(frozen=True)
class Variant:
    """How one step runs, as far as communication goes."""

    loss_scaling: bool = False    # a stage computes in fp16: the inf check over all ranks
    skipped: bool = False         # (loss scaling) an overflow somewhere: no gradient sync, no update
    onebit: str = "gradients"     # onebit groups: compressed gradients | exact warm-up | momentum

    @property
    def name(self) -> str:
        parts = [f"onebit {self.onebit}"] + (["loss scaling"] if self.loss_scaling else []) + \
            (["skipped"] if self.skipped else [])
        return ", ".join(parts)


def variants(plan: Plan) -> list[Variant]:
    """Every way the program may run a step of `plan`, whatever its flags (`--optimizer`,
    `--cpu-autocast`) and the step (1-bit Adam's warm-up, an fp16 overflow)."""
    modes = ONEBIT_MODES if any(g.compressor == "onebit" for g in plan.grad_groups) else ONEBIT_MODES[:1]
    out = [Variant(scaling, False, mode) for scaling in (False, True) for mode in modes]
    return out + [Variant(True, True, modes[0])]


def default_schedules(plan: Plan) -> Schedules:
    """Each replica's schedule (sched.make), made once per distinct (schedule, stages, micro-batches,
    stages per device)."""
    made: dict[tuple[str, int, int, int], list[list[sched.Action]]] = {}

    def of(r: int) -> list[list[sched.Action]]:
        replica = plan.replicas[r]
        shape = (replica.schedule, len(replica.stages), len(replica.micro_batch_sizes), replica.chunks)
        if shape not in made:
            made[shape] = sched.make(*shape)
        return made[shape]

    return of


def edge_pairs(plan: Plan, replica: int) -> dict[tuple[int, int], P2PEdge | None]:
    """(producer stage, consumer stage) -> the plan's edge whose codec a value between them travels with,
    for every pair of a replica (None: no edge recorded, no codec). A value skipping stages travels with
    the edge leaving its producer. The program pairs its codecs by this too (program/pipeline.edge_codecs)."""
    edges = {(e.src_stage, e.dst_stage): e for e in plan.p2p if e.replica == replica}
    stages = len(plan.replicas[replica].stages)
    return {(a, b): edges.get((a, b), edges.get((a, a + 1))) for a in range(stages) for b in range(a + 1, stages)}


def edge_codecs(plan: Plan, replica: int) -> dict[tuple[int, int], str]:
    """(producer stage, consumer stage) -> codec name (`none`, `fp16`, `int8/64`), by edge_pairs."""
    return {pair: "none" if e is None else e.compressor if e.compressor != "int8" else f"int8/{e.block_elems}"
            for pair, e in edge_pairs(plan, replica).items()}


def rank_stream(plan: Plan, rank: int, inputs: StreamInputs, variant: Variant,
                schedules: Schedules | None = None) -> list[CommEvent]:
    """The communication of `rank` in a run of one step of `variant`, in program order."""
    return rank_streams(plan, rank, inputs, [variant], schedules)[variant]


def rank_streams(plan: Plan, rank: int, inputs: StreamInputs, of: Sequence[Variant],
                 schedules: Schedules | None = None) -> dict[Variant, list[CommEvent]]:
    """`rank_stream` for each variant in `of`."""
    common, tails = rank_parts(plan, rank, inputs, of, schedules)
    return {v: common + tails[v] for v in of}


def rank_parts(plan: Plan, rank: int, inputs: StreamInputs, of: Sequence[Variant],
               schedules: Schedules | None = None) -> tuple[list[CommEvent], dict[Variant, list[CommEvent]]]:
    """`rank`'s streams in two parts: what every variant shares (the set-up, the pipeline, the wait for
    its sends) and each variant's rest (collectives only). Each part completes on its own or not at all:
    a rank past its wait has posted and received all its messages, so no rank's pipeline waits for it."""
    return Derivation(plan, inputs, schedules).parts(rank, of)


def streams(plan: Plan, inputs: StreamInputs, variant: Variant,
            schedules: Schedules | None = None) -> list[list[CommEvent]]:
    """Every rank's stream (index = rank) for one step of `variant`."""
    derivation = Derivation(plan, inputs, schedules)
    out = []
    for rank in range(plan.world_size):
        common, tails = derivation.parts(rank, [variant])
        out.append(common + tails[variant])
    return out


class Derivation:
    """The derivation of one plan's streams from its inputs, rank by rank, with what every rank shares
    made once: the set-up (alike on every rank but for `rank`), each rank's replica, stage, lane and
    gradient groups, each replica's codecs, each group's payload, each split's value order, and the
    gradient sync of ranks in the same groups. Made per rank, these cost O(stages^2 + ranks) each: a
    1024-rank plan of 64-stage pipelines spent seconds on them."""

    def __init__(self, plan: Plan, inputs: StreamInputs, schedules: Schedules | None = None) -> None:
        self.plan, self.inputs = plan, inputs
        self.schedules = schedules or default_schedules(plan)
        self.where: dict[int, tuple[ReplicaPlan, StagePlan]] = {}      # as plan.stage_of_rank: the first
        for replica in plan.replicas:
            for stage in replica.stages:
                for r in stage.ranks:
                    self.where.setdefault(r, (replica, stage))
        self.groups_of: dict[int, tuple[int, ...]] = {}                # rank -> its gradient groups, in order
        for i, g in enumerate(plan.grad_groups):
            for r in dict.fromkeys(g.ranks):
                self.groups_of[r] = self.groups_of.get(r, ()) + (i,)
        self.setup = self._collectives(-1, (), None)                  # made for rank -1
        self._setup_fields = _fields_after_rank(self.setup)
        self._codecs: dict[int, dict[tuple[int, int], str]] = {}
        self._order: dict[int, tuple[SplitView, dict[str, int]]] = {}
        self._flats: dict[int, tuple[int, str]] = {}                    # group index -> flat all-reduce
        self._bucket_sizes: dict[int, list[int]] = {}                   # group index -> bucket elements
        self._tails: dict[tuple[tuple[int, ...], Variant], tuple[list[tuple[object, ...]], str]] = {}
        self._action_rows: dict[tuple[int, int], list[tuple[str, int, str, int, int]]] = {}
        self._setup_hash = hashlib.sha256(f"# {COMMON}\n{stream_text(self.setup)}".encode())

    def parts(self, rank: int, of: Sequence[Variant]) -> tuple[list[CommEvent], dict[Variant, list[CommEvent]]]:
        """`rank`'s set-up, pipeline and wait, and its rest in each variant of `of` (rank_parts)."""
        common = _for_rank(self._setup_fields, rank) + self._pipeline(rank)
        common.append(CommEvent(WAIT, rank, "step"))
        return common, {v: _for_rank(self._tail(rank, v)[0], rank) for v in of}

    def digest(self, rank: int, common: Sequence[CommEvent], of: Sequence[Variant]) -> str:
        """The digest of `rank`'s streams (`common` from `parts`; each variant of `of` after it), equal to
        events.digest of its whole streams: the set-up's text (the same on every rank, since an event's
        text leaves out its rank) and each tail's (the same on ranks of the same groups) are made once."""
        h = self._setup_hash.copy()
        rest = common[len(self.setup):]
        joint = "\n" if self.setup and rest else ""        # stream_text joins the two parts' lines
        h.update(f"{joint}{stream_text(rest)}\n".encode())
        for v in of:
            h.update(self._tail(rank, v)[1].encode())
        return h.hexdigest()[:DIGEST_CHARS]

    # ----- per rank

    def _tail(self, rank: int, variant: Variant) -> tuple[list[tuple[object, ...]], str]:
        """What follows the pipeline in `variant` on the ranks of `rank`'s groups (_fields_after_rank),
        and its section's text."""
        key = (self.groups_of.get(rank, ()), variant)
        if key not in self._tails:
            events = self._collectives(-1, key[0], variant)
            self._tails[key] = _fields_after_rank(events), section_text(variant.name, events)
        return self._tails[key]

    def _collectives(self, rank: int, groups: tuple[int, ...], variant: Variant | None) -> list[CommEvent]:
        """The set-up (`variant` None), or what follows the step's pipeline and its wait on a rank of
        `groups`: gradient sync, optimizer, loss, and the run's end."""
        plan = self.plan
        world = _world(plan.world_size)
        out: list[CommEvent] = []

        def collective(label: str, group: str, members: tuple[int, ...], op: str, shape: tuple[int, ...],
                       dtype: str, nbytes: int) -> None:
            out.append(CommEvent(COLLECTIVE, rank, label, group=group, members=members, op=op,
                                 shape=shape, dtype=dtype, nbytes=nbytes))

        if variant is None:
            for g in plan.grad_groups:
                collective("setup", WORLD, world, f"new_group grad{g.index}", (len(g.ranks),), "", 0)
            for name, ranks in tp_groups(plan):
                collective("setup", WORLD, world, f"new_group {name}", (len(ranks),), "", 0)
            collective("check", WORLD, world, "all_reduce", (plan.world_size,), "int32", 4 * plan.world_size)
            return out
        if variant.loss_scaling:
            collective("inf check", WORLD, world, "all_reduce", (1,), FP32, 4)
        if not variant.skipped:
            mine = [plan.grad_groups[i] for i in groups]
            for g in mine:
                if g.compressor == "none" or (g.compressor == "onebit" and variant.onebit == "exact"):
                    numel, dtype = self._flat(g)
                    if numel:
                        collective("sync", f"grad{g.index}", g.ranks, "all_reduce", (numel,), dtype,
                                   numel * _itemsize(dtype))
                elif not (g.compressor == "onebit" and variant.onebit == "momentum"):
                    for b, n in enumerate(self._buckets(g)):
                        collective(f"sync b{b}", f"grad{g.index}", g.ranks, g.compressor, (n,), FP32, 4 * n)
            for g in mine if variant.onebit == "momentum" else ():
                if g.compressor == "onebit":
                    for b, n in enumerate(self._buckets(g)):
                        collective(f"step b{b}", f"grad{g.index}", g.ranks, "onebit", (n,), FP32, 4 * n)
        collective("loss", WORLD, world, "all_reduce", (1,), "float64", 8)
        collective("end", WORLD, world, "barrier", (), "", 0)
        return out

    def _flat(self, group: GradGroup) -> tuple[int, str]:
        if group.index not in self._flats:
            self._flats[group.index] = _flat(group, self.inputs)
        return self._flats[group.index]

    def _buckets(self, group: GradGroup) -> list[int]:
        if group.index not in self._bucket_sizes:
            self._bucket_sizes[group.index] = _buckets(group, self.inputs)
        return self._bucket_sizes[group.index]

    def _pipeline(self, rank: int) -> list[CommEvent]:
        replica, stage = self.where[rank]
        lane = stage.ranks.index(rank)
        # (micro-batch rows, stage) -> F and B messages: kind, peer, value index, backward, values, the rest
        plans: dict[tuple[int, int], dict[str, list[tuple[str, int, int, bool, int, tuple[object, ...]]]]] = {}
        out: list[CommEvent] = []
        new = tuple.__new__               # as _for_rank: some 10^6 events, CommEvent._make's checks left out
        for label, micro, kind, rows, k in self._actions(replica, stage.index):
            if (rows, k) not in plans:
                view = self.inputs.split(replica.index, rows)
                plans[rows, k] = {kind_: [(m.kind, m.peer, m.index, m.backward, m.num_values,
                                           (m.codec, "", (), "", m.shape, m.dtype, m.nbytes)) for m in ms]
                                  for kind_, ms in self._messages(replica.index, k, view, lane).items()}
            for m_kind, peer, index, backward, num_values, rest in plans[rows, k][kind]:
                tag = message_tag(micro, index, backward, num_values)
                out.append(new(CommEvent, (m_kind, rank, label, peer, tag) + rest))
        return out

    def _actions(self, replica: ReplicaPlan, device: int) -> list[tuple[str, int, str, int, int]]:
        """Device `device`'s schedule as (label, micro-batch, kind, its rows, stage), made once per device of
        a replica (every lane of the device runs it)."""
        key = (replica.index, device)
        if key not in self._action_rows:
            sizes = replica.micro_batch_sizes
            self._action_rows[key] = [(str(a), a.micro, a.kind, sizes[a.micro], a.stage)
                                      for a in self.schedules(replica.index)[device]]
        return self._action_rows[key]

    def _messages(self, replica_index: int, k: int, view: SplitView, lane: int) -> dict[str, list[_Message]]:
        if replica_index not in self._codecs:
            self._codecs[replica_index] = edge_codecs(self.plan, replica_index)
        known = self._order.get(id(view))
        if known is None or known[0] is not view:
            known = self._order[id(view)] = view, {name: i for i, name in enumerate(sorted(view.values))}
        return _messages(self.plan, replica_index, k, view, lane, self._codecs[replica_index], known[1])


def _for_rank(collectives: Sequence[tuple[object, ...]], rank: int) -> list[CommEvent]:
    """`rank`'s collectives from their fields after `rank` (_fields_after_rank). tuple.__new__ is what
    CommEvent._make calls, less its argument handling: a plan makes some 10^5 of these."""
    new = tuple.__new__
    return [new(CommEvent, (COLLECTIVE, rank) + fields) for fields in collectives]


def _fields_after_rank(collectives: Sequence[CommEvent]) -> list[tuple[object, ...]]:
    assert all(e.kind == COLLECTIVE for e in collectives)
    return [e[2:] for e in collectives]


def tp_groups(plan: Plan) -> list[tuple[str, tuple[int, ...]]]:
    """The tensor-parallel groups (each device's shards: its stages' under interleaved 1F1B), in the order
    every rank creates them (process_group.init, after the gradient groups): name `tp<replica>.<stage>` and
    ranks."""
    return [(f"tp{r.index}.{st.index}", st.ranks) for r in plan.replicas for st in r.device_stages
            if st.tp_degree > 1]


@dataclass(frozen=True)
class _Message:
    kind: str
    peer: int
    index: int            # the value's position among the split's values, sorted by name (its tag)
    num_values: int
    backward: bool
    codec: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


def _messages(plan: Plan, replica_index: int, k: int, view: SplitView, lane: int, codec: dict[tuple[int, int], str],
              index: dict[str, int]) -> dict[str, list[_Message]]:
    """Stage k's messages in a forward ("F") and a backward ("B") of one micro-batch, in program order (a
    zbh1 schedule's weight gradients, "W", send none):
    values in value order both ways (pipeline.py), since a pair's messages match in issue order. With
    tensor parallelism each shard lane is a pipeline of its own: its peers are the same lane's ranks.
    `codec`: edge_codecs of the replica; `index`: each value's position among the split's, by name."""
    replica = plan.replicas[replica_index]
    num_stages, last = len(replica.stages), len(replica.stages) - 1
    values = view.values

    def message(kind: str, name: str, peer_stage: int, backward: bool, edge: tuple[int, int]) -> _Message:
        v = values[name]
        return _Message(kind, replica.stages[peer_stage].ranks[lane], index[name], len(index), backward, codec[edge],
                        v.shape, v.dtype, math.prod(v.shape) * _itemsize(v.dtype))

    if replica.chunks > 1:     # interleaved 1F1B: values relayed stage to stage (passes.split.relayed)
        into, out = relayed(values, k, num_stages)
        into.sort(key=index.__getitem__)
        out.sort(key=index.__getitem__)
        forward = [message(RECV, n, k - 1, False, (k - 1, k)) for n in into]
        forward += [message(SEND, n, k + 1, False, (k, k + 1)) for n in out]
        backward = [message(RECV, n, k + 1, True, (k, k + 1)) for n in out if values[n].needs_grad]
        backward += [message(SEND, n, k - 1, True, (k - 1, k)) for n in into if values[n].needs_grad]
        return {"F": forward, "B": backward, "W": []}
    received = sorted((n for n in view.stage_inputs[k] if values[n].producer != -1), key=index.__getitem__)
    outputs = sorted(view.stage_outputs[k], key=index.__getitem__) if k != last else []
    forward = [message(RECV, n, values[n].producer, False, (values[n].producer, k)) for n in received]
    forward += [message(SEND, n, c, False, (k, c)) for n in outputs for c in values[n].consumers if c < num_stages]
    backward = [message(RECV, n, c, True, (k, c)) for n in outputs if values[n].needs_grad
                for c in values[n].consumers if c < num_stages]
    backward += [message(SEND, n, values[n].producer, True, (values[n].producer, k))
                 for n in received if values[n].needs_grad]
    return {"F": forward, "B": backward, "W": []}


@functools.lru_cache(maxsize=8)
def _world(size: int) -> tuple[int, ...]:
    """All ranks, one tuple shared by every event (the simulator and the text form look it up by it)."""
    return tuple(range(size))


def _numels(group: GradGroup, inputs: StreamInputs) -> list[tuple[int, str]]:
    return [inputs.param(name) for name in group.params]


def _flat(group: GradGroup, inputs: StreamInputs) -> tuple[int, str]:
    """One flat all-reduce of the group's gradients (gradsync.allreduce_sum_): elements and dtype."""
    params = _numels(group, inputs)
    if not params:
        return 0, FP32
    dtype = getattr(torch, params[0][1])
    for _, name in params[1:]:
        dtype = torch.promote_types(dtype, getattr(torch, name))
    return sum(n for n, _ in params), str(dtype).removeprefix("torch.")


def _buckets(group: GradGroup, inputs: StreamInputs) -> list[int]:
    """Elements of each bucket a compressed group reduces (CompressorSettings.bucket_ranges)."""
    if group.settings is None:
        raise PassError(f"gradient group {group.index} uses {group.compressor} without its settings",
                        field="grad_groups.settings", fix="re-plan with this hetplan version")
    numels = [n for n, _ in _numels(group, inputs)]
    sizes = [sum(numels[a:b]) for a, b in group.settings.bucket_ranges(numels)]
    # an empty bucket issues no collective under onebit (it returns early); torch's hooks reduce it
    return [n for n in sizes if n or group.compressor != "onebit"]


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize
