"""What the search is asked: the strategy and the constraints a user may put on it.

The API fills these in from the user's `PlanOptions`; the search reads nothing else of the user's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.search.solver import SolverSettings


@dataclass(frozen=True)
class SearchOptions:
    strategy: str = "ilp"              # ilp | exact | a baseline (planner.search.baselines.SOLVERS)
    stages: int | None = None          # every pipeline's stages (interleaved: on stages / v devices)
    tp: int | None = None              # force the tensor-parallel degree of every stage (None: searched)
    zero: str = "auto"                 # ZeRO-1: auto (offered where memory is short) | on (every group) | off
    micro_batch: int | None = None     # force the micro-batch size
    use_all_devices: bool = False      # every device must serve a stage
    schedule: str = "auto"             # auto (chosen per replica) | 1f1b | gpipe | interleaved | zbh1
    objective: str = "time"            # time per iteration | cost per sample
    solver: SolverSettings = field(default_factory=SolverSettings)
    # how, not what: the later variants' builds in a forked child (planner.search.ahead); False keeps them
    # in this process (a caller that must not fork: RunControls.fork_steps)
    fork: bool = True
