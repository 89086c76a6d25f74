"""Records a plan carries beside its decisions (`Plan.lineage`, `Plan.checkpoint`, planner.core.ir): they
are written to plan.json and read back, but two plans that decide the same are equal with or without them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Lineage:
    """What a re-planned plan replaces (`plan replan`): the plan directory it was made from, that plan's
    digest, the devices lost since it, and the spec it was planned on."""

    plan_dir: str                 # the replaced plan's directory, resolved
    plan_digest: str              # sha256 of the replaced plan's plan.json
    without: tuple[str, ...]      # device labels removed since that plan (`--without`)
    cluster: str                  # the spec planned on (the replaced plan's, or `--cluster`'s), resolved


@dataclass(frozen=True)
class CheckpointAdvice:
    """How long a checkpoint takes under this plan and how often to take one (costmodel.checkpoint).

    A record beside the plan's decisions, not one of them: Young/Daly's interval from the blocking cost
    of one save and the job's mean time between failures (none when no device of the plan has one)."""

    state_bytes: float            # the largest rank's checkpoint: parameters + optimizer state
    state_rank: int               # that rank
    blocking_s: float             # the step's pause: staging a copy of each rank's state (slowest rank)
    write_s: float                # the background write to storage (busiest node)
    storage_write_bytes_s: float  # per node, the spec's `storage.write_gbyte_s` or the catalog placeholder
    storage_source: str           # where that figure comes from
    devices_with_mtbf: int        # ranks whose device type gives mtbf_hours
    job_mtbf_s: float | None = None      # 1 / sum over those devices of 1 / MTBF
    interval_s: float | None = None      # sqrt(2 x blocking_s x job_mtbf_s), at least write_s
    interval_steps: int | None = None    # interval_s in the plan's estimated steps, at least 1
