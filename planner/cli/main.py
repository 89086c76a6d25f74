"""`plan`: the command line. Typed options at the edge; domain errors become one line + exit code.

    plan MODEL.py --cluster SPEC.yaml [-o OUT]     trace, cost, solve, verify, emit
    plan inspect OUT                               summary of a plan
    plan run OUT [--steps N --seed S --lr X]       run the emitted program locally (torchrun)
    plan profile [--out FILE] [--model M] [--quick]  measure this machine; `plan --calibration FILE` uses it

Each command is a module of its own, imported on demand: `plan run --help` need not import the planner.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from planner.core.errors import HetplanError

SUBCOMMANDS = ("inspect", "run", "profile")


def _command(name: str) -> Callable[[list[str]], int]:
    if name == "inspect":
        from planner.cli.inspect_cmd import cmd_inspect

        return cmd_inspect
    if name == "run":
        from planner.cli.run_cmd import cmd_run

        return cmd_run
    if name == "profile":
        from planner.profile.command import cmd_profile

        return cmd_profile
    from planner.cli.plan_cmd import cmd_plan

    return cmd_plan


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in SUBCOMMANDS:
            return _command(argv[0])(argv[1:])
        return _command("plan")(argv)
    except HetplanError as exc:
        print(f"plan: error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
