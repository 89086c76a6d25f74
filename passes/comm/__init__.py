"""The communication verifier: every rank's ordered communication derived from the plan, proved to run
to completion, and recorded so that the program can check it runs the stream that was verified.

    events     CommEvent (send / recv / wait / collective), its text form, the stream digest
    inputs     what the streams are derived from beside the plan: stage splits per micro-batch size,
               gradient-group parameters (StreamInputs); from traces, a program's split, or a record
    derive     rank_stream / streams: the one derivation, call for call as the program communicates
    simulate   check_streams: run all streams together; mismatches, wait cycles, stalls as PassError

`verify_comm(plan, inputs)` checks every run variant and returns the plan's `comm` record;
`first_difference` tells the program where its stream leaves the verified one.
"""

from __future__ import annotations

from collections.abc import Sequence

from passes.comm.derive import (
    COMMON,
    Derivation,
    Schedules,
    Variant,
    rank_parts,
    rank_stream,
    rank_streams,
    streams,
    variants,
)
from passes.comm.events import CommEvent, digest, message_tag
from passes.comm.inputs import SplitView, StreamInputs, from_record, to_record, trace_inputs
from passes.comm.simulate import check_streams, format_grid
from planner.core.comm_records import CommRecord
from planner.core.frozen_heap import collector_paused, frozen_heap
from planner.core.ir import Plan

__all__ = ["CommEvent", "Derivation", "Schedules", "SplitView", "StreamInputs", "Variant", "check_streams", "digest",
           "first_difference", "format_grid", "from_record", "message_tag", "rank_digest", "rank_stream",
           "rank_parts", "rank_streams", "stream_digest", "streams", "trace_inputs", "variants", "verify_comm"]


def verify_comm(plan: Plan, inputs: StreamInputs, schedules: Schedules | None = None) -> CommRecord:
    """Derive every rank's stream in every run variant, check them (raises PassError naming the ranks),
    and return the record: the inputs and each rank's digest.

    The part every variant shares runs once, then each variant's rest (derive.rank_parts: each part
    completes on its own or not at all, so this equals running every variant's whole streams)."""
    runs = variants(plan)
    with frozen_heap(), collector_paused():               # 10^6 events: no collection walks them
        derivation = Derivation(plan, inputs, schedules)  # what ranks share, made once
        parts = [derivation.parts(rank, runs) for rank in range(plan.world_size)]
        check_streams([common for common, _ in parts], COMMON)
        for v in runs:
            check_streams([tails[v] for _, tails in parts], f"after the pipeline, {v.name}")
        return to_record(plan, inputs, tuple(derivation.digest(rank, common, runs)
                                             for rank, (common, _) in enumerate(parts)))


def rank_digest(plan: Plan, rank: int, inputs: StreamInputs) -> tuple[str, dict[Variant, list[CommEvent]]]:
    """`rank`'s digest over every run variant, and its whole stream in each."""
    runs = variants(plan)
    derivation = Derivation(plan, inputs)
    common, tails = derivation.parts(rank, runs)
    return derivation.digest(rank, common, runs), {v: common + tails[v] for v in runs}


def stream_digest(common: list[CommEvent], tails: dict[Variant, list[CommEvent]], runs: list[Variant]) -> str:
    """The digest of one rank's streams from their events alone (what Derivation.digest equals)."""
    return digest([(COMMON, common)] + [(v.name, tails[v]) for v in runs])


def first_difference(mine: dict[Variant, list[CommEvent]],
                     verified: dict[Variant, list[CommEvent]]) -> tuple[Variant, int, str, str] | None:
    """The first event where two streams of one rank differ: (variant, position, this one's text, the
    verified one's text; `end` past a stream's end), or None when they are equal."""
    for v, events in mine.items():
        other: Sequence[CommEvent] = verified.get(v, [])
        for i in range(max(len(events), len(other))):
            a = events[i].text() if i < len(events) else "end"
            b = other[i].text() if i < len(other) else "end"
            if a != b:
                return v, i, a, b
    return None
