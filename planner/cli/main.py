"""`plan`: the command line. Typed options at the edge; domain errors become one line + exit code.

    plan MODEL.py --cluster SPEC.yaml [-o OUT]     trace, cost, solve, verify, emit
    plan inspect OUT [--html FILE]                 summary of a plan (or one self-contained HTML page)
    plan diff A B                                  what changed between two plans, and what it costs
    plan run OUT [--steps N --seed S --lr X]       run the emitted program locally (torchrun)
    plan profile [--out FILE] [--model M] [--quick]  measure this machine; `plan --calibration FILE` uses it
    plan export OUT --onnx DIR                     each stage as ONNX, checked in onnxruntime
    plan replan OUT --without LABEL -o OUT2        the same model and options on the cluster less lost devices
    plan estimate MODEL.py --cluster SPEC.yaml --layout LAYOUT [-o OUT]   a layout you wrote, estimated

Each command is a module of its own, imported on demand: `plan run --help` need not import the planner.
Every error a user can act on is one line on stderr and an exit code: 2 bad input (model file, spec,
options, plan directory), 3 no feasible plan, 4 internal pass failure, 5 a layout given to
`plan estimate` does not fit its devices' memory, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable

from planner.core import interrupts
from planner.core.errors import HetplanError

SUBCOMMANDS = ("inspect", "diff", "run", "profile", "export", "replan", "estimate")
PLANNING = ("plan", "replan", "estimate")     # the commands that plan, then write a plan directory
INTERRUPTED_EXIT_CODE = 130   # 128 + SIGINT, as a shell reports a process Ctrl-C ended
BROKEN_PIPE_EXIT_CODE = 141   # 128 + SIGPIPE, as for any command whose reader went away


def _command(name: str) -> Callable[[list[str]], int]:
    if name == "inspect":
        from planner.cli.inspect_cmd import cmd_inspect

        return cmd_inspect
    if name == "diff":
        from planner.cli.diff_cmd import cmd_diff

        return cmd_diff
    if name == "run":
        from planner.cli.run_cmd import cmd_run

        return cmd_run
    if name == "profile":
        from planner.profiling.command import cmd_profile

        return cmd_profile
    if name == "export":
        from planner.cli.export_cmd import cmd_export

        return cmd_export
    if name == "replan":
        from planner.cli.replan_cmd import cmd_replan

        return cmd_replan
    if name == "estimate":
        from planner.cli.estimate_cmd import cmd_estimate

        return cmd_estimate
    from planner.cli.plan_cmd import cmd_plan

    return cmd_plan


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name, rest = (argv[0], argv[1:]) if argv and argv[0] in SUBCOMMANDS else ("plan", argv)
    try:
        # the commands that plan: a Ctrl-C is remembered, wherever its KeyboardInterrupt went (core.interrupts)
        with interrupts.kept() if name in PLANNING else contextlib.nullcontext():
            return _command(name)(rest)
    except HetplanError as exc:
        print(f"plan: error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("plan: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    except BrokenPipeError:     # `plan inspect OUT | head`: the reader left; no traceback for that
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # nor at exit, flushing stdout
        return BROKEN_PIPE_EXIT_CODE


def entry() -> None:
    """The `plan` console script and `python3 -m planner.cli`: `main`, then the process ends without the
    interpreter's teardown of its heap. Everything the command writes is closed by then and its streams
    are flushed here; what would be torn down is only memory (at 1024 GPUs some 600 thousand objects of
    graphs, tables and streams, and torch's modules: 0.75 s of a 12 s command)."""
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):     # the reader left, or the stream was closed
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
