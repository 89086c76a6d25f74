"""Pipeline schedules as data.

An action is `(stage, kind, micro_batch)` with the text form `2F0` (stage 2, forward, micro-batch 0)
or `1B3`; a schedule is one action list per stage and parses back from its text. The deadlock
checker replays all stages together: a forward needs the previous stage's forward of the same
micro-batch done, a backward needs the next stage's backward done.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from planner.core.errors import PassError

_ACTION = re.compile(r"^(\d+)([FB])(\d+)$")
SCHEDULES = ("1f1b", "gpipe")
CHOICES = ("auto", *SCHEDULES)   # what a user may ask for: auto lets the search choose per replica


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str          # "F" | "B"
    micro: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro}"

    @staticmethod
    def parse(text: str) -> Action:
        m = _ACTION.match(text.strip())
        if not m:
            raise ValueError(f"not an action: {text!r}")
        return Action(int(m.group(1)), m.group(2), int(m.group(3)))


def gpipe(num_stages: int, num_micro: int) -> list[list[Action]]:
    return [[Action(s, "F", i) for i in range(num_micro)] + [Action(s, "B", i) for i in range(num_micro)]
            for s in range(num_stages)]


def one_f_one_b(num_stages: int, num_micro: int) -> list[list[Action]]:
    """1F1B: S-s-1 warm-up forwards, then alternate one forward and one backward, then drain."""
    out = []
    for s in range(num_stages):
        warm = min(num_stages - s - 1, num_micro)
        acts = [Action(s, "F", i) for i in range(warm)]
        f, b = warm, 0
        while f < num_micro:
            acts.append(Action(s, "F", f))
            f += 1
            acts.append(Action(s, "B", b))
            b += 1
        acts.extend(Action(s, "B", i) for i in range(b, num_micro))
        out.append(acts)
    return out


def make(kind: str, num_stages: int, num_micro: int) -> list[list[Action]]:
    if kind == "gpipe":
        return gpipe(num_stages, num_micro)
    if kind == "1f1b":
        return one_f_one_b(num_stages, num_micro)
    raise PassError(f"unknown schedule `{kind}`", field="schedule", fix="use gpipe or 1f1b")


def format_grid(schedule: list[list[Action]]) -> str:
    """Rank x step grid, the form printed when a check fails."""
    width = max(len(a) for a in schedule) if schedule else 0
    lines = []
    for s, acts in enumerate(schedule):
        cells = [str(a).rjust(4) for a in acts] + ["    "] * (width - len(acts))
        lines.append(f"stage {s}: " + " ".join(cells))
    return "\n".join(lines)


def to_text(schedule: list[list[Action]]) -> str:
    return "\n".join(" ".join(str(a) for a in acts) for acts in schedule)


def from_text(text: str) -> list[list[Action]]:
    return [[Action.parse(t) for t in line.split()] for line in text.strip().splitlines()]


def check(schedule: list[list[Action]], num_micro: int) -> None:
    """Raise PassError unless every stage runs F and B of each micro-batch once, without deadlock."""
    S = len(schedule)
    for s, acts in enumerate(schedule):
        want = {(k, i) for k in "FB" for i in range(num_micro)}
        got = [(a.kind, a.micro) for a in acts]
        if sorted(got) != sorted(want) or any(a.stage != s for a in acts):
            raise PassError(f"stage {s} does not run each micro-batch's F and B exactly once:\n"
                            + format_grid(schedule), fix="report this schedule")
        for i in range(num_micro):
            if got.index(("B", i)) < got.index(("F", i)):
                raise PassError(f"stage {s} runs B{i} before F{i}:\n" + format_grid(schedule))
    done: set[tuple[int, str, int]] = set()
    pos = [0] * S
    while any(pos[s] < len(schedule[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            while pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                if a.kind == "F":
                    ready = s == 0 or (s - 1, "F", a.micro) in done
                else:
                    ready = (s, "F", a.micro) in done and (s == S - 1 or (s + 1, "B", a.micro) in done)
                if not ready:
                    break
                done.add((s, a.kind, a.micro))
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"stage {s} at {schedule[s][pos[s]]}" for s in range(S) if pos[s] < len(schedule[s]))
            raise PassError(f"schedule deadlocks ({stuck}):\n" + format_grid(schedule),
                            fix="report this schedule")
