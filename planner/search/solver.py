"""CP-SAT's settings for every model the search solves, in one place, and the model's dump.

The solver runs single-threaded on a deterministic work limit, so the same inputs give the same plan
on any machine. With a dump folder (`plan --dump-cp-model DIR`) each model is written there as text
(CP-SAT's own `CpModelProto` format, readable by any OR-Tools version) for a bug report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ortools.sat.python import cp_model

DEFAULT_WORK_LIMIT_S = 30.0

# the model is mostly big-M staircases: full linearisation gives the LP bound that proves them
LINEARIZATION_LEVEL = 2
# CP-SAT presolve rounds and probing level (its defaults: 3 and 2). The model is staircases of
# implications: repeated rounds re-probe them and find nothing new (2.3 of 2.8 s at 1024 GPUs), so one
# round and light probing prove the same optimum sooner (benchmarks/solver_settings.py).
PRESOLVE_ITERATIONS = 1
PROBING_LEVEL = 1
# CP-SAT 9.15's inclusion presolve can cut optimal solutions of this model and still report
# OPTIMAL (seen on all-devices instances, cf. or-tools#5293); the exact enumerator caught it
PRESOLVE_INCLUSION_WORK_LIMIT = 0
RANDOM_SEED = 0


@dataclass(frozen=True)
class SolverSettings:
    """How a CP-SAT model is solved: its work limit (CP-SAT's deterministic seconds, work units rather
    than wall time, so reproducible), presolve effort, and where to dump the model (None: nowhere)."""

    work_limit_s: float = DEFAULT_WORK_LIMIT_S
    presolve_iterations: int = PRESOLVE_ITERATIONS
    probing_level: int = PROBING_LEVEL
    dump_dir: Path | None = None


def make_solver(settings: SolverSettings) -> cp_model.CpSolver:
    """A solver with the project's fixed settings and `settings`' limits."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = RANDOM_SEED
    solver.parameters.linearization_level = LINEARIZATION_LEVEL
    solver.parameters.max_deterministic_time = settings.work_limit_s
    solver.parameters.presolve_inclusion_work_limit = PRESOLVE_INCLUSION_WORK_LIMIT
    solver.parameters.max_presolve_iterations = settings.presolve_iterations
    solver.parameters.cp_model_probing_level = settings.probing_level
    # CP-SAT's own Ctrl-C handler ends the search as if its limit were reached (planning went on with
    # that plan: the first Ctrl-C was lost) and leaves SIGINT at SIG_DFL (the next one killed the process
    # without cleanup); without it, Ctrl-C is Python's KeyboardInterrupt once this solve returns
    solver.parameters.catch_sigint_signal = False
    return solver


def solve_model(model: cp_model.CpModel, settings: SolverSettings,
                name: str) -> tuple[cp_model.CpSolver, cp_model.CpSolverStatus]:
    """Solve `model`; with `settings.dump_dir`, write it there first as `<name>.pbtxt`. Returns the
    solver (for its values) and the status."""
    if settings.dump_dir is not None:
        settings.dump_dir.mkdir(parents=True, exist_ok=True)
        model.export_to_file(str(settings.dump_dir / f"{name}.pbtxt"))
    solver = make_solver(settings)
    return solver, solver.solve(model)


DEFAULT_SETTINGS = SolverSettings()
