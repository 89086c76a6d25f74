"""What a user asks of `plan`: the options that shape the plan (recorded in it), and the controls
that only shape how planning runs (never recorded: the same plan comes out whatever they are)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from costmodel import compression
from planner.core import schedule
from planner.core.errors import OptionError
from planner.search.interleave_configs import CHUNK_OPTIONS, device_splits
from planner.search.options import SearchOptions
from planner.search.solver import SolverSettings
from planner.search.strategies import STRATEGIES

PRECISION_POLICIES = ("auto", "fp32", "bf16", "fp16")
OBJECTIVES = ("time", "cost")
OPTIMIZERS = ("adamw", "sgd")
TP_DEGREES = (1, 2, 4, 8)             # tensor-parallel degrees (costmodel.tensor_parallel.DEGREES)
ZERO_CHOICES = ("auto", "on", "off")
CONTRACT_NAMES = ("model", "batch", "loss_fn", "dataset")
MAX_GLOBAL_BATCH = 1 << 20            # samples per step; the search's integer variables stay small
DEFAULT_TRACE_TIMEOUT_S = 300.0       # the model file's code (import, model(), batch(), tracing) may take this long


@dataclass
class PlanOptions:
    """Everything the user can set; recorded in the plan's inputs."""

    global_batch: int = 64
    strategy: str = "ilp"
    precision: str = "auto"            # fp32 | auto | bf16 | fp16
    stages: int | None = None          # force the pipeline depth of every replica
    tp: int | None = None              # force the tensor-parallel degree of every stage (None: searched)
    zero: str = "auto"                 # ZeRO-1 across replicas: auto (where memory is short) | on | off
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
        return SearchOptions(strategy=self.strategy, stages=self.stages, tp=self.tp, zero=self.zero,
                             micro_batch=self.micro_batch,
                             use_all_devices=self.use_all_devices, schedule=self.schedule, objective=self.objective,
                             solver=SolverSettings(work_limit_s=self.time_limit_s, dump_dir=dump),
                             fork=controls.fork_steps if controls else True)

    def as_pairs(self) -> tuple[tuple[str, str], ...]:
        items = {k: v for k, v in vars(self).items() if k != "names"}
        items.update({f"name.{k}": v for k, v in self.names.items()})
        return tuple(sorted((k, str(v)) for k, v in items.items()))


@dataclass(frozen=True)
class RunControls:
    """How planning runs, not what it plans: nothing here reaches plan.json."""

    dump_ir_dir: Path | None = None          # the graph after each pass and the costed problem, as text
    dump_cp_model_dir: Path | None = None    # every CP-SAT model the search solves (planner.search.solver)
    # the user's code (importing the model file, model(), batch(), loss_fn, tracing) is stopped after this
    # long, as the model file's error (None: never; a time limit needs the main thread, SIGALRM)
    trace_timeout_s: float | None = DEFAULT_TRACE_TIMEOUT_S
    # hears each phase's name as it starts (load, trace, cost, search, comm, runners-up): the CLI's progress line
    progress: Callable[[str], None] | None = None
    # the runners-up and the communication verifier in forked children beside the stage checks (Linux, two
    # cores; planner.core.forked); False keeps every step in this process (a caller that must not fork)
    fork_steps: bool = True

    def __post_init__(self) -> None:
        timeout = self.trace_timeout_s
        if timeout is not None and not (_is_number(timeout) and math.isfinite(timeout) and timeout > 0):
            raise OptionError(f"trace timeout {timeout!r} must be a positive number of seconds",
                              field="--trace-timeout",
                              fix=f"give seconds, e.g. --trace-timeout {DEFAULT_TRACE_TIMEOUT_S:g}")


def check_options(options: PlanOptions) -> None:
    """Raise OptionError (exit 2) naming the option, by its `plan` flag, when one is outside what it may be:
    before anything is loaded, so a bad option never reads as "no plan" or "fits on no device"."""
    _whole(options.global_batch, "--global-batch", "global batch", maximum=MAX_GLOBAL_BATCH)
    if options.stages is not None:
        _whole(options.stages, "--stages", "pipeline depth", maximum=options.max_blocks)
        if options.schedule == "interleaved" and not device_splits(options.stages):
            raise OptionError(f"{options.stages} stages cannot interleave: each device holds "
                              f"{' or '.join(map(str, CHUNK_OPTIONS))} stages and a pipeline needs two devices "
                              "at least", field="--stages",
                              fix="use an even number of stages from 4 (two devices holding two each), or drop "
                                  "--stages")
    if options.tp is not None and options.tp not in TP_DEGREES:
        raise OptionError(f"tensor-parallel degree {options.tp!r} is not one of {', '.join(map(str, TP_DEGREES))}",
                          field="--tp", fix="give 1, 2, 4 or 8 (a divisor of the devices per node), or leave it out")
    if options.zero not in ZERO_CHOICES:
        raise OptionError(f"--zero {options.zero!r} is not one of {', '.join(ZERO_CHOICES)}", field="--zero",
                          fix="use auto (where memory is short), on or off")
    if options.micro_batch is not None:
        _whole(options.micro_batch, "--micro-batch", "micro-batch size", maximum=options.global_batch)
    _whole(options.max_blocks, "max_blocks", "block limit", maximum=10_000)
    margin = options.memory_margin
    if not (_is_number(margin) and math.isfinite(margin) and 0 <= margin < 1):
        raise OptionError(f"memory margin {margin!r} must be a fraction in [0, 1)", field="--memory-margin",
                          fix="give the fraction of device memory kept free, e.g. --memory-margin 0.1")
    limit = options.time_limit_s
    if not (_is_number(limit) and math.isfinite(limit) and limit > 0):
        raise OptionError(f"time limit {limit!r} must be a positive number of seconds", field="--time-limit",
                          fix="give the solver's work limit in deterministic seconds, e.g. --time-limit 10")
    for value, known, flag in ((options.strategy, STRATEGIES, "--strategy"),
                               (options.precision, PRECISION_POLICIES, "--precision"),
                               (options.compression, compression.GRADIENT_POLICIES, "--compression"),
                               (options.activation_compression, compression.ACTIVATION_POLICIES,
                                "--activation-compression"),
                               (options.schedule, schedule.CHOICES, "--schedule"),
                               (options.objective, OBJECTIVES, "--objective"),
                               (options.optimizer, OPTIMIZERS, "--optimizer")):
        if value not in known:
            raise OptionError(f"unknown {flag.removeprefix('--')} {str(value)[:60]!r}", field=flag,
                              fix=f"use one of: {', '.join(known)}")
    for role, name in options.names.items():
        flag = f"--{role.replace('_', '-').removesuffix('-fn')}-fn"
        if role not in CONTRACT_NAMES or not (isinstance(name, str) and name.isidentifier()):
            raise OptionError(f"{str(name)[:60]!r} is not the name of a function for `{role}`", field=flag,
                              fix=f"give a Python identifier defined in the model file (renamable: "
                                  f"{', '.join(CONTRACT_NAMES)})")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _whole(value: object, flag: str, what: str, *, maximum: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= maximum):
        raise OptionError(f"{what} {str(value)[:60]} must be a whole number from 1 to {maximum}", field=flag,
                          fix=f"pass {flag} N with 1 <= N <= {maximum}")
