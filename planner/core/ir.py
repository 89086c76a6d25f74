"""The plan: the typed, versioned IR between the search and the lowering passes.

Frozen dataclasses serialised to JSON with `schema_version`. A plan file alone is enough to inspect, simulate,
diff and emit. Same inputs give a byte-identical file: nothing here depends on wall-clock time (`solve.json`).

Fields added after a schema's first release are marked `OPTIONAL`: written only when they differ from their
default, so a plan that uses none of them reads byte for byte as before, and a file without them loads with
the default.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.core.comm_records import CommRecord
from planner.core.errors import PlanFileError
from planner.core.plan_records import OPTIONAL, CheckpointAdvice, CompressorSettings, Lineage

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class BlockInfo:
    index: int
    first_node: str
    last_node: str
    label: str
    fwd_flops: float
    bwd_flops: float
    param_bytes: float
    activation_bytes: float       # what autograd keeps of the block for its backward (trace batch, fp32)
    boundary_bytes: float
    signature: str
    transient_bytes: float = field(default=0.0, metadata=OPTIONAL)   # its backward's working set (costmodel.memory)
    output_bytes: float = field(default=0.0, metadata=OPTIONAL)      # the last block's: the model's output


@dataclass(frozen=True)
class StagePlan:
    index: int                    # position in its pipeline
    first_block: int
    last_block: int
    last_node: str                # the stage ends after this compute node
    rank: int
    device: int                   # index into the cluster's device list
    device_label: str
    device_type: str
    precision: str
    recompute: bool
    fwd_s_per_sample: float
    bwd_s_per_sample: float
    overhead_s: float             # per micro-batch
    memory_bytes: float           # estimated peak
    params: tuple[str, ...]
    slowdown: float = 1.0         # emulation: pad each compute step to this multiple (spec `slowdown`)
    # tensor parallelism: the ranks that run this stage's shards, `rank` first (shard 0), devices in one
    # node; empty: `rank` alone runs the whole stage (passes.tensor_parallel shards it)
    tp_ranks: tuple[int, ...] = field(default=(), metadata=OPTIONAL)
    tp_devices: tuple[int, ...] = field(default=(), metadata=OPTIONAL)        # their devices, as `device`
    tp_device_labels: tuple[str, ...] = field(default=(), metadata=OPTIONAL)  # and labels, as `device_label`
    # fp32 parameter bytes one rank of the stage holds (one shard's under tensor parallelism), each parameter
    # once however many of the stage's blocks read it (a tied embedding and LM head). 0: not recorded (plans
    # written before it; readers then sum the blocks' param_bytes)
    shard_param_bytes: float = field(default=0.0, metadata=OPTIONAL)
    # `memory_bytes` as the search priced it, per rank of the stage (under interleaved 1F1B its device's, all
    # its stages together): the training state (weights, gradients, optimizer state, as sharded by tensor
    # parallelism and ZeRO), of which the optimizer state, and the activations kept at the schedule's peak;
    # the rest of `memory_bytes` is the framework's. 0: not recorded (plans written before them)
    state_bytes: float = field(default=0.0, metadata=OPTIONAL)
    optimizer_bytes: float = field(default=0.0, metadata=OPTIONAL)
    activation_bytes: float = field(default=0.0, metadata=OPTIONAL)
    # of bwd_s_per_sample, the weight gradients' part, which the replica's zbh1 schedule runs apart (W); 0
    # under the other schedules
    wgrad_s_per_sample: float = field(default=0.0, metadata=OPTIONAL)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank of the stage: its tensor-parallel shards in shard order (`rank` alone without)."""
        return self.tp_ranks or (self.rank,)

    @property
    def tp_degree(self) -> int:
        return len(self.ranks)

    def rank_devices(self) -> tuple[tuple[int, int, str], ...]:
        """(rank, device index, device label) of each shard, in shard order."""
        if not self.tp_ranks:
            return ((self.rank, self.device, self.device_label),)
        return tuple(zip(self.tp_ranks, self.tp_devices, self.tp_device_labels))


@dataclass(frozen=True)
class ReplicaPlan:
    index: int
    node_group: str
    stages: tuple[StagePlan, ...]
    batch_share: int
    micro_batch_sizes: tuple[int, ...]
    schedule: str                 # "1f1b" | "gpipe" | "interleaved" | "zbh1" (planner.core.schedule)
    estimated_s: float
    # interleaved 1F1B: the stages each device runs; stage k runs on the ranks of stage k mod (stages / chunks)
    chunks: int = field(default=1, metadata=OPTIONAL)
    # the optimizer step after the pipeline (its slowest stage's, ZeRO's gather included), part of estimated_s
    optimizer_s: float = field(default=0.0, metadata=OPTIONAL)

    @property
    def device_stages(self) -> tuple[StagePlan, ...]:
        """Each device's first stage, in pipeline order (every stage but under interleaved 1F1B)."""
        return self.stages[:len(self.stages) // self.chunks]

    def stages_with(self, stage: StagePlan) -> tuple[StagePlan, ...]:
        """The stages that run on `stage`'s ranks (`stage` alone but under interleaved 1F1B)."""
        return self.stages[stage.index % len(self.device_stages)::len(self.device_stages)]

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank of the replica, device by device (a stage's tensor-parallel shards together)."""
        return tuple(r for s in self.device_stages for r in s.ranks)

    @property
    def tp_degree(self) -> int:
        """Tensor-parallel degree of the replica's stages (one for all of them)."""
        return self.stages[0].tp_degree if self.stages else 1

    def lane(self, rank: int) -> int:
        """Which tensor-parallel shard `rank` runs in its stage (0 without tensor parallelism)."""
        for s in self.device_stages:
            if rank in s.ranks:
                return s.ranks.index(rank)
        raise KeyError(rank)

    def lane_ranks(self, lane: int) -> tuple[int, ...]:
        """The ranks of one shard lane, device by device: a pipeline of its own, trained on the replica's rows."""
        return tuple(s.ranks[lane] for s in self.device_stages)


@dataclass(frozen=True)
class GradGroup:
    index: int
    ranks: tuple[int, ...]
    params: tuple[str, ...]
    nbytes: float
    compressor: str
    algorithm: str
    estimated_s: float
    settings: CompressorSettings | None = field(default=None, metadata=OPTIONAL)   # none: no settings
    # ZeRO-1: the optimizer state of the group's parameters is sharded across its ranks (each steps its
    # part, then the updated parameters are gathered); costmodel.zero
    zero: bool = field(default=False, metadata=OPTIONAL)


@dataclass(frozen=True)
class P2PEdge:
    replica: int
    src_stage: int
    dst_stage: int
    src_rank: int
    dst_rank: int
    bytes_per_sample: float
    compressor: str
    block_elems: int = field(default=0, metadata=OPTIONAL)   # int8: elements per block (one fp32 scale)


@dataclass(frozen=True)
class Estimates:
    iteration_s: float
    throughput_samples_s: float
    pipeline_s: float
    sync_s: float
    bubble_fraction: float
    memory_bytes: tuple[float, ...]      # per rank
    capacity_bytes: tuple[float, ...]    # per rank
    busy_s: tuple[float, ...]            # per rank
    cost_per_sample: float | None = None
    # a rank fits when memory_bytes <= capacity_bytes x (1 - memory_margin) (costmodel.memory.fits)
    memory_margin: float = field(default=0.1, metadata=OPTIONAL)


@dataclass(frozen=True)
class RunnerUp:
    """Another plan the search considered, under the same cost model and simulator."""

    name: str                     # `ilp one-node`, a baseline strategy, ...
    estimated_iteration_s: float
    simulated_iteration_s: float
    pipeline_s: float
    sync_s: float
    devices_used: int
    layout: str                   # replicas as `group:stages x count`
    why_slower: str               # against the chosen plan, in words


@dataclass(frozen=True)
class SolverFacts:
    strategy: str
    status: str
    objective_s: float
    bound_s: float
    gap: float
    configurations: int
    runners_up: tuple[RunnerUp, ...] = ()
    simulated_iteration_s: float | None = None   # the chosen plan under backends.sim


@dataclass(frozen=True)
class PlanInputs:
    model_path: str
    model_digest: str
    cluster_path: str
    cluster_digest: str
    cluster_name: str
    options: tuple[tuple[str, str], ...]
    trace_batch: int
    model_input_names: tuple[str, ...] = ()
    # labels of the spec's devices the plan was made without (`plan replan --without`): the cluster planned
    # on is the spec less these (ClusterSpec.without), and its device indices count the devices left
    lost_devices: tuple[str, ...] = field(default=(), metadata=OPTIONAL)


@dataclass(frozen=True)
class ProgramDefaults:
    """The emitted program's defaults, from `plan`'s options; `plan run` / train.py flags override them."""

    learning_rate: float
    optimizer: str                                  # adamw | sgd
    functions: tuple[tuple[str, str], ...] = ()     # contract name -> the model file's name, where renamed


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    global_batch: int
    world_size: int
    blocks: tuple[BlockInfo, ...]
    replicas: tuple[ReplicaPlan, ...]
    grad_groups: tuple[GradGroup, ...]
    p2p: tuple[P2PEdge, ...]
    estimates: Estimates
    solver: SolverFacts
    schema_version: int = SCHEMA_VERSION
    devices: tuple[str, ...] = field(default=())   # per rank: device label
    program: ProgramDefaults | None = field(default=None, metadata=OPTIONAL)
    # planner.api: the streams passes.comm verified. A record of the decisions, not one of them: plans that
    # decide the same are equal with it or without it (an assembled plan equals the one `plan()` verified)
    comm: CommRecord | None = field(default=None, metadata=OPTIONAL, compare=False)
    # planner.api: why a run of this plan will not equal training on one process though it runs (BatchNorm
    # statistics per micro-batch, dropout masks per rank: passes.stage_check.training_notes), one line each
    warnings: tuple[str, ...] = field(default=(), metadata=OPTIONAL, compare=False)
    # planner.replanning: the plan this one re-plans on fewer devices (or a new spec); a record, as `comm`
    lineage: Lineage | None = field(default=None, metadata=OPTIONAL, compare=False)
    # costmodel.checkpoint: a checkpoint's cost and the interval it suggests; a record, as `comm`
    checkpoint: CheckpointAdvice | None = field(default=None, metadata=OPTIONAL, compare=False)

    def stage_of_rank(self, rank: int) -> tuple[ReplicaPlan, StagePlan]:
        """The replica and stage `rank` runs (one of the stage's tensor-parallel shards, where it has several;
        under interleaved 1F1B the first of the rank's stages: `ReplicaPlan.stages_with` gives them all)."""
        for replica in self.replicas:
            for stage in replica.device_stages:
                if rank in stage.ranks:
                    return replica, stage
        raise KeyError(rank)

    @property
    def tp_degree(self) -> int:
        """Tensor-parallel degree of the plan's stages (1: none)."""
        return max((r.tp_degree for r in self.replicas), default=1)

    def to_json(self) -> str:
        return json.dumps(_to_data(self), indent=1, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def from_json(text: str, source: str = "plan.json") -> Plan:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:   # JSONDecodeError; an integer of 5000 digits; deep nesting
            raise PlanFileError(f"not valid JSON: {str(exc)[:120]}", file=source,
                                fix="re-run `plan` to write it again") from exc
        version = data.get("schema_version") if isinstance(data, dict) else None
        if version != SCHEMA_VERSION:
            raise PlanFileError(f"schema_version {str(version)[:20]}, this hetplan reads {SCHEMA_VERSION}",
                                file=source, field="schema_version", fix="re-plan with this version")
        try:
            return _build(Plan, data, "")
        except MalformedPlan as exc:
            raise PlanFileError(f"malformed plan: {exc}", file=source, field=exc.field,
                                fix="re-run `plan`; do not edit plan.json") from exc

    @staticmethod
    def load(path: str | Path) -> Plan:
        p = Path(path)
        if p.is_dir():
            p = p / "plan.json"
        if not p.is_file():
            raise PlanFileError("no plan here", file=str(p), fix="run `plan MODEL --cluster SPEC -o DIR` first")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PlanFileError(f"cannot read it: {str(exc)[:120]}", file=str(p), fix="re-run `plan`") from exc
        return Plan.from_json(text, str(p))


def _to_data(value: Any) -> Any:
    """JSON data of a record: dataclasses as mappings (OPTIONAL fields only where not at their default),
    tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if f.metadata.get("omit_default") and item == _default_of(f):
                continue
            out[f.name] = _to_data(item)
        return out
    if isinstance(value, (tuple, list)):
        return [_to_data(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_data(v) for k, v in value.items()}
    return value


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


class MalformedPlan(ValueError):
    """A plan file's value does not have its field's type; `field` is its path (`replicas[0].stages`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field or 'the file'}: {message}")
        self.field = field or None


MAX_PLAN_INT = 1 << 53    # integers beyond a float's exact range are no plan's counts, sizes or indices


def _build(tp: Any, value: Any, at: str = "") -> Any:
    """Rebuild typed dataclasses from JSON data, guided by the type hints; every value is checked against
    its field's type (an edited file is refused with the field's path, never half-read)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise MalformedPlan(at, f"expected an object, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            where = f"{at}.{f.name}" if at else f.name
            if f.name in value:
                kwargs[f.name] = _build(hints[f.name], value[f.name], where)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MalformedPlan(where, "missing")
        return tp(**kwargs)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list):
            raise MalformedPlan(at, f"expected a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v, f"{at}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise MalformedPlan(at, f"expected {len(args)} items, got {len(value)}")
        return tuple(_build(a, v, f"{at}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        non_none = [a for a in typing.get_args(tp) if a is not type(None)]
        return _build(non_none[0], value, at)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or abs(value) > 1e300 or value != value:
            raise MalformedPlan(at, f"expected a finite number, got {str(value)[:40]}")
        return float(value)
    if tp is int and (isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_PLAN_INT):
        raise MalformedPlan(at, f"expected an integer up to 2**53, got {str(value)[:40]}")
    if tp in (str, bool) and not isinstance(value, tp):
        raise MalformedPlan(at, f"expected {'a string' if tp is str else 'true or false'}, got {str(value)[:40]}")
    return value
