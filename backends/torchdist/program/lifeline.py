"""Die with the launcher: a worker, or a torchrun agent, must not train on after its parent is gone.

torchrun starts each worker in a session of its own, so a signal to the agent's process group does not
reach them, and a killed agent (or a killed `plan run`) used to leave its workers training for minutes.
Linux's PR_SET_PDEATHSIG asks the kernel to signal a process when its parent exits; it is set by

  - each worker, first thing at start-up (train.py, before torch loads): SIGKILL when its agent exits;
  - `plan run` for its torchrun agent, through `python -m backends.torchdist.program.lifeline PID CMD...`,
    which then execs torchrun: SIGKILL too, as the agent may sit in a call to the store that died with
    `plan run` and never see a SIGTERM in time; its workers follow it by their own lifelines. (A stop
    asked of `plan run` reaches the agent as SIGTERM instead, and it stops its workers itself.)

A parent that died before the request took effect is not seen by the kernel, hence the check after it:
the parent must still be the expected one. The launchers (`launch.sh`, `plan run`) export their pid as
HETPLAN_AGENT_PID before they exec torchrun, which is then the workers' parent under that same pid.

Only the standard library here: this runs before anything else is imported.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1                 # <linux/prctl.h>
AGENT_PID_ENV = "HETPLAN_AGENT_PID"  # the torchrun agent's pid, exported by launch.sh and `plan run`
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun in every worker's environment


def die_with_parent(sig: int, expected_parent_pid: int | None = None) -> bool:
    """Have the kernel send `sig` to this process when its parent exits (Linux; elsewhere nothing).

    Returns False when the parent is already gone: the parent is no longer `expected_parent_pid` (default:
    the parent seen just before the request), so the request came too late and the caller should exit.
    """
    parent = os.getppid() if expected_parent_pid is None else expected_parent_pid
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return os.getppid() == parent


def guard_worker() -> None:
    """In a worker started by torchrun: die with the agent; exit at once if it is already gone."""
    if TORCHRUN_ENV not in os.environ:      # run by hand (python -m program.train): no agent to follow
        return
    agent = os.environ.get(AGENT_PID_ENV, "")
    if not die_with_parent(signal.SIGKILL, int(agent) if agent.isdigit() else None):
        sys.stderr.write(f"train.py: the torchrun agent (pid {agent or 'parent'}) is gone; not starting\n")
        raise SystemExit(1)


def main(argv: list[str]) -> None:
    """`python -m backends.torchdist.program.lifeline PARENT_PID CMD [ARGS...]`: exec CMD so that it is
    killed when PARENT_PID (the caller) exits, and with HETPLAN_AGENT_PID set to its own pid."""
    if len(argv) < 2 or not argv[0].isdigit():
        raise SystemExit("usage: python -m backends.torchdist.program.lifeline PARENT_PID CMD [ARGS...]")
    if not die_with_parent(signal.SIGKILL, int(argv[0])):
        raise SystemExit(1)                 # the caller died while this process started
    os.environ[AGENT_PID_ENV] = str(os.getpid())   # exec keeps the pid: CMD's children see their parent
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
