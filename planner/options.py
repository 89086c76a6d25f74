"""What a user asks of `plan`: the options that shape the plan (recorded in it), and the controls
that only shape how planning runs (never recorded: the same plan comes out whatever they are)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from costmodel import compression
from planner.core import schedule
from planner.core.errors import PlanningError
from planner.search.options import SearchOptions
from planner.search.solver import SolverSettings


@dataclass
class PlanOptions:
    """Everything the user can set; recorded in the plan's inputs."""

    global_batch: int = 64
    strategy: str = "ilp"
    precision: str = "auto"            # fp32 | auto | bf16 | fp16
    stages: int | None = None          # force the pipeline depth of every replica
    use_all_devices: bool = False      # every device must serve a stage
    micro_batch: int | None = None     # force the micro-batch size
    memory_margin: float = 0.1
    schedule: str = "auto"             # auto (the search chooses per replica) | 1f1b | gpipe
    compression: str = "none"              # gradients: none | auto | fp16 | bf16 | powersgd | onebit
    activation_compression: str = "none"   # pipeline links: none | auto | fp16 | bf16 | int8
    time_limit_s: float = 10.0         # solver work limit (CP-SAT deterministic seconds)
    max_blocks: int = 96
    calibration: str | None = None     # `plan profile` file: measured figures replace datasheet ones
    runners_up: bool = True            # also plan the baselines and simulate all, for `plan inspect`
    objective: str = "time"            # time per iteration | cost per sample (needs prices in the spec)
    optimizer: str = "adamw"           # the program's default optimizer: adamw | sgd
    names: dict[str, str] = field(default_factory=dict)

    def search_options(self, controls: RunControls | None = None) -> SearchOptions:
        """What of these the search reads (and where `controls` ask it to dump its CP-SAT models)."""
        dump = controls.dump_cp_model_dir if controls else None
        return SearchOptions(strategy=self.strategy, stages=self.stages, micro_batch=self.micro_batch,
                             use_all_devices=self.use_all_devices, schedule=self.schedule, objective=self.objective,
                             solver=SolverSettings(work_limit_s=self.time_limit_s, dump_dir=dump))

    def as_pairs(self) -> tuple[tuple[str, str], ...]:
        items = {k: v for k, v in vars(self).items() if k != "names"}
        items.update({f"name.{k}": v for k, v in self.names.items()})
        return tuple(sorted((k, str(v)) for k, v in items.items()))


@dataclass(frozen=True)
class RunControls:
    """How planning runs, not what it plans: nothing here reaches plan.json."""

    dump_ir_dir: Path | None = None          # the graph after each pass and the costed problem, as text
    dump_cp_model_dir: Path | None = None    # every CP-SAT model the search solves (planner.search.solver)


def check_options(options: PlanOptions) -> None:
    """Raise PlanningError naming the option when one is outside what it may be."""
    if options.global_batch < 1:
        raise PlanningError(f"global batch {options.global_batch} must be at least 1", field="--global-batch",
                            fix="pass a positive --global-batch")
    for value, known, flag in ((options.compression, compression.GRADIENT_POLICIES, "--compression"),
                               (options.activation_compression, compression.ACTIVATION_POLICIES,
                                "--activation-compression")):
        if value not in known:
            raise PlanningError(f"unknown compression `{value}`", field=flag,
                                fix=f"use one of: {', '.join(known)}")
    if options.schedule not in schedule.CHOICES:
        raise PlanningError(f"unknown schedule `{options.schedule}`", field="--schedule",
                            fix=f"use one of: {', '.join(schedule.CHOICES)}")
