"""Reading a plan directory back: every command that loads a `plan.json` goes through here, so each
checks the plan the way `plan` did before it was written, and against the files it was made from.

A plan is refused (PlanFileError: one line, exit 2) when it is malformed (planner.core.ir checks every
value's type), when it breaks an invariant of the verifier `plan` runs (passes.verify), when the
plan directory's two copies (`plan.json`, `program/plan.json`) differ, or when a recorded input
changed since planning: the model file, the program's copy of it, or the spec (`inputs.*_digest`
against the files present). `allow_changed=True` (`--allow-changed`) accepts changed inputs only.
Nothing else is read: a file named in the plan is hashed, never parsed or shown, unless its digest
is the recorded one (`recorded_spec`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import NoReturn

from costmodel.compression import ACTIVATION_COMPRESSORS, GRADIENT_COMPRESSORS
from passes.verify import verify_plan
from planner.core import schedule
from planner.core.cluster import PRECISIONS
from planner.core.errors import HetplanError, PlanFileError
from planner.core.ir import Plan

MAX_PLAN_BYTES = 256 << 20       # the plan of 10^5 devices is tens of MB
MAX_DIGEST_BYTES = 4 << 30       # over any model file, spec or .onnx (protobuf caps those at 2 GiB)
MAX_WORLD_SIZE = 100_000         # planner.frontend.cluster.MAX_DEVICES
MAX_SCHEDULE_ACTIONS = 1 << 22   # stages x micro-batches of one replica the verifier expands
GRADIENT_ALGORITHMS = ("ring", "allgather")   # costmodel.compression: all-reduce, or all-gather (1-bit)
PROGRAM_COPY = Path("program") / "plan.json"
ALLOW_FIX = "re-run `plan` with the current files, or pass --allow-changed to use the plan as it is"


def plan_file(path: str | Path) -> Path:
    """The plan.json that `path` (a plan directory, a program directory, or a plan.json) names."""
    p = Path(path)
    return p / "plan.json" if p.is_dir() else p


def load_checked_plan(path: str | Path, *, allow_changed: bool = False) -> Plan:
    """The plan in `path` (a plan directory or a plan.json), checked as the module docstring says.
    Raises PlanFileError naming the file, the field and what changed."""
    file = plan_file(path)
    if file.is_file() and file.stat().st_size > MAX_PLAN_BYTES:
        raise PlanFileError(f"larger than {MAX_PLAN_BYTES >> 20} MiB: no plan is", file=str(file),
                            fix="re-run `plan`")
    plan = Plan.load(file)
    _check_shape(plan, str(file))
    try:
        verify_plan(plan)
    except HetplanError as exc:     # an invariant a written plan always keeps: the file was edited
        raise PlanFileError(f"the plan breaks an invariant: {exc.message}", file=str(file),
                            fix="re-run `plan`; do not edit plan.json") from exc
    except (LookupError, ArithmeticError, ValueError, TypeError) as exc:  # what _check_shape did not foresee
        raise PlanFileError(f"the plan is inconsistent: {type(exc).__name__}: {str(exc)[:120]}", file=str(file),
                            fix="re-run `plan`; do not edit plan.json") from exc
    _check_copies(file)
    changed = [] if allow_changed else changed_inputs(plan, file)
    if changed:
        field, message = changed[0]
        raise PlanFileError(message, file=str(file), field=field, fix=ALLOW_FIX)
    return plan


def changed_inputs(plan: Plan, file: Path) -> list[tuple[str, str]]:
    """(field, what changed) for each recorded input whose file present differs from the one planned
    with: the model file, the program's copy of it beside `file`, the spec. A file that is not there
    is not compared (a plan directory copied to another machine)."""
    inputs, out = plan.inputs, []
    program_model = file.parent / "model.py" if file.parent.name == "program" else \
        file.parent / "program" / "model.py"
    for field, path, recorded, what in (
            ("inputs.model_digest", inputs.model_path, inputs.model_digest, "the model file"),
            ("inputs.model_digest", str(program_model), inputs.model_digest, "the program's copy of the model file"),
            ("inputs.cluster_digest", inputs.cluster_path, inputs.cluster_digest, "the cluster spec")):
        if not path or not recorded or not Path(path).exists():
            continue
        now = file_digest(Path(path))
        if now != recorded:
            found = f"{now[:12]} now" if now else "now not a readable file"
            out.append((field, f"{what} {path} changed since planning (sha256 {recorded[:12]} recorded, {found})"))
    return out


def recorded_spec(plan: Plan) -> Path | None:
    """The spec the plan was made for, if the file at its recorded path is still that one (its digest)."""
    path, recorded = plan.inputs.cluster_path, plan.inputs.cluster_digest
    if path and recorded and Path(path).is_file() and file_digest(Path(path)) == recorded:
        return Path(path)
    return None


def file_digest(path: Path) -> str | None:
    """sha256 of a regular file of at most MAX_DIGEST_BYTES (read in chunks); None for anything else
    (a FIFO would block, a device never end)."""
    try:
        if not path.is_file() or path.stat().st_size > MAX_DIGEST_BYTES:
            return None
        digest = hashlib.sha256()
        with path.open("rb") as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
        return digest.hexdigest()
    except OSError:
        return None


def _check_copies(file: Path) -> None:
    """`plan.json` and `program/plan.json` of one plan directory hold the same plan (the program runs
    from its copy: an edit of one alone would run a plan nobody inspected)."""
    if file.parent.name == "program" and (file.parent.parent / "plan.json").is_file():
        other = file.parent.parent / "plan.json"
    elif (file.parent / PROGRAM_COPY).is_file():
        other = file.parent / PROGRAM_COPY
    else:
        return
    try:
        mine, theirs = json.loads(file.read_text()), json.loads(other.read_text())
    except (OSError, ValueError, RecursionError):
        mine, theirs = None, False
    if mine != theirs:
        keys = sorted(set(mine) | set(theirs)) if isinstance(mine, dict) and isinstance(theirs, dict) else []
        differ = [k for k in keys if mine.get(k) != theirs.get(k)]
        raise PlanFileError(f"{file} and {other} differ" + (f" (in {', '.join(differ[:4])})" if differ else ""),
                            file=str(file), field=differ[0] if differ else None,
                            fix="re-run `plan` to write both again; do not edit them")


def _check_shape(plan: Plan, file: str) -> None:
    """What the verifier and the reports index by must be in range (an edited file could say anything)."""
    def fail(field: str, message: str) -> NoReturn:
        raise PlanFileError(message, file=file, field=field, fix="re-run `plan`; do not edit plan.json")

    world, blocks = plan.world_size, len(plan.blocks)
    if not 1 <= world <= MAX_WORLD_SIZE:
        fail("world_size", f"world_size {world} is not from 1 to {MAX_WORLD_SIZE}")
    if not 1 <= plan.global_batch <= 1 << 20:
        fail("global_batch", f"global_batch {plan.global_batch} is out of range")
    if not plan.replicas or not blocks:
        fail("replicas" if not plan.replicas else "blocks", "the plan has no replicas or no blocks")
    e = plan.estimates
    for name in ("memory_bytes", "capacity_bytes", "busy_s"):
        if len(getattr(e, name)) != world:
            fail(f"estimates.{name}", f"{len(getattr(e, name))} entries for {world} ranks")
    if len(plan.devices) != world:
        fail("devices", f"{len(plan.devices)} device labels for {world} ranks")
    if min(e.capacity_bytes) <= 0:
        fail("estimates.capacity_bytes", "a device without memory")
    for i, r in enumerate(plan.replicas):
        where = f"replicas[{i}]"
        if r.index != i or not r.stages or not r.micro_batch_sizes:
            fail(where, "a replica out of order, or without stages or micro-batches")
        if r.schedule not in schedule.SCHEDULES:
            fail(f"{where}.schedule", f"unknown schedule {r.schedule[:20]!r}")
        if not (isinstance(r.chunks, int) and 1 <= r.chunks <= len(r.stages) and len(r.stages) % r.chunks == 0
                and (r.chunks > 1) == (r.schedule == "interleaved")):
            fail(f"{where}.chunks", f"{str(r.chunks)[:20]} stages per device for {len(r.stages)} stages under "
                 f"{r.schedule[:20]}")
        if len(r.stages) * len(r.micro_batch_sizes) > MAX_SCHEDULE_ACTIONS:
            fail(where, "more stages x micro-batches than any plan has")
        for j, st in enumerate(r.stages):
            if not (st.index == j and 0 <= st.rank < world and 0 <= st.first_block <= st.last_block < blocks):
                fail(f"{where}.stages[{j}]", f"stage {st.index}, rank {st.rank} or blocks {st.first_block}.."
                     f"{st.last_block} out of place ({world} ranks, {blocks} blocks)")
            if st.precision not in PRECISIONS:
                fail(f"{where}.stages[{j}].precision", f"unknown precision {st.precision[:20]!r}")
            if st.tp_ranks and not (st.tp_ranks[0] == st.rank and all(0 <= t < world for t in st.tp_ranks)
                                    and len(st.tp_devices) == len(st.tp_device_labels) == len(st.tp_ranks)):
                fail(f"{where}.stages[{j}].tp_ranks", "tensor-parallel ranks out of place (the first is `rank`, "
                     "one device and label each)")
    for g in plan.grad_groups:
        if not all(0 <= rank < world for rank in g.ranks):
            fail(f"grad_groups[{g.index}].ranks", f"a rank outside 0..{world - 1}")
        if g.compressor not in GRADIENT_COMPRESSORS or g.algorithm not in GRADIENT_ALGORITHMS:
            fail(f"grad_groups[{g.index}]", f"unknown compressor {g.compressor[:20]!r} or algorithm "
                 f"{g.algorithm[:20]!r}")
    sends = set()
    for k, edge in enumerate(plan.p2p):
        stages = len(plan.replicas[edge.replica].stages) if 0 <= edge.replica < len(plan.replicas) else 0
        if not (0 <= edge.src_rank < world and 0 <= edge.dst_rank < world
                and 0 <= edge.src_stage < edge.dst_stage < stages) or edge.compressor not in ACTIVATION_COMPRESSORS:
            fail(f"p2p[{k}]", "an edge between ranks, stages or replicas the plan does not have, or an unknown "
                 "compressor")
        sends.add((edge.replica, edge.src_stage))
    for r in plan.replicas:
        if any((r.index, s) not in sends for s in range(len(r.stages) - 1)):
            fail("p2p", f"replica {r.index} has a stage that sends to no next stage")
