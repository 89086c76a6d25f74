"""Injected faults: how a run is tested against the failures of a real cluster (`plan run --fault`,
train.py --fault), each on the rank of one device, named by its label as in plan.json:

  kill:DEVICE@STEP            the rank dies (SIGKILL) as step STEP begins, in the launcher's first attempt
                              only: a device that fails once, so a restarted group runs on
  kill-always:DEVICE@STEP     the same in every attempt: a device that stays dead
  crash-in-save:DEVICE@STEP   the rank dies (SIGKILL) while the checkpoint of step STEP is being written,
                              first attempt only
  slow:DEVICE=FACTOR@STEP     from step STEP on the device computes FACTOR times slower than planned (its
                              emulated slowdown, program/slowdown.py, becomes FACTOR x the spec's)

The attempt is torchrun's restart count (TORCHELASTIC_RESTART_COUNT, 0 first). A kill is SIGKILL: no
handler runs, nothing is flushed, as when a device or its host goes.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.core.errors import OptionError

KINDS = ("kill", "kill-always", "crash-in-save", "slow")
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
FORMAT = "kill:DEVICE@STEP, kill-always:DEVICE@STEP, crash-in-save:DEVICE@STEP or slow:DEVICE=FACTOR@STEP"
_FAULT = re.compile(r"^(?P<kind>[a-z-]+):(?P<device>[^=@\s]+)(=(?P<factor>[0-9.]+))?@(?P<step>[0-9]+)$")


@dataclass(frozen=True)
class Fault:
    kind: str
    device: str          # a device label of the plan, e.g. fast/0:1
    step: int
    factor: float = 1.0  # slow: the slowdown from `step` on, times the planned one

    def __str__(self) -> str:
        factor = f"={self.factor:g}" if self.kind == "slow" else ""
        return f"{self.kind}:{self.device}{factor}@{self.step}"


def parse(text: str) -> Fault:
    """One `--fault` value, or OptionError naming the form."""
    found = _FAULT.match(text.strip())
    if found is None or found["kind"] not in KINDS or (found["factor"] is None) != (found["kind"] != "slow"):
        raise OptionError(f"{text!r} is not a fault", field="--fault", fix=f"write {FORMAT}")
    factor = float(found["factor"]) if found["factor"] else 1.0
    if found["kind"] == "slow" and not factor > 0:
        raise OptionError(f"{text!r}: the factor must be above 0", field="--fault", fix="write e.g. slow:fast/0:1=3@10")
    return Fault(found["kind"], found["device"], int(found["step"]), factor)


def check_devices(faults: Sequence[Fault], labels: Sequence[str]) -> None:
    """Every fault names a device of the plan, or OptionError."""
    for fault in faults:
        if fault.device not in labels:
            raise OptionError(f"{fault}: the plan runs nothing on {fault.device}", field="--fault",
                              fix=f"name one of the plan's devices: {', '.join(labels)}")


class Faults:
    """The faults of the rank on `device` (a plan's device label), in launcher attempt `attempt`."""

    def __init__(self, faults: Sequence[Fault], device: str, attempt: int | None = None) -> None:
        self.attempt = int(os.environ.get(RESTART_ENV, "0") or 0) if attempt is None else attempt
        self.mine = [f for f in faults if f.device == device]

    def _due(self, kind: str, step: int) -> bool:
        return any(f.kind == kind and f.step == step for f in self.mine)

    def before_step(self, step: int, settle: Callable[[], None] = lambda: None) -> None:
        """Die here if a kill is due as `step` begins, after `settle()` (the program: wait for the checkpoint
        in flight), so that which checkpoint a test resumes from does not depend on the save's speed; a
        crash in the middle of a save is `crash-in-save`."""
        if self._due("kill-always", step) or (self.attempt == 0 and self._due("kill", step)):
            settle()
            os.kill(os.getpid(), signal.SIGKILL)

    def during_save(self, step: int) -> None:
        """Die here if a crash is due while the checkpoint of `step` is being written."""
        if self.attempt == 0 and self._due("crash-in-save", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def slowdown(self, step: int) -> float:
        """The factor on the planned slowdown at `step`: that of the latest `slow` fault begun by then."""
        begun = [f for f in self.mine if f.kind == "slow" and f.step <= step]
        return max(begun, key=lambda f: f.step).factor if begun else 1.0
