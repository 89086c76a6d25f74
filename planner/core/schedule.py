"""Pipeline schedules as data.

An action is `(stage, kind, micro_batch)` with the text form `2F0` (stage 2, forward, micro-batch 0)
or `1B3`; a schedule is one action list per device and parses back from its text. Under 1F1B and GPipe a
device runs one stage; under interleaved 1F1B (`interleaved`: Megatron's virtual pipeline stages) each of
the S devices runs `chunks` stages of the model, stage k on device k mod S, so the fill and drain are
chunk-sized. Under `zbh1` (zero bubble, ZB-H1: Qi et al., "Zero Bubble Pipeline Parallelism", 2024) a
backward is two actions: `B` computes the gradients of the stage's inputs (what the previous stage waits
for) and `W` those of its weights (what nobody waits for), so the weight gradients fill the drain.
The deadlock checker replays all devices together: a forward needs the previous stage's forward of the
same micro-batch done, a backward needs the next stage's backward done, a W its own stage's B.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from planner.core.errors import PassError

_ACTION = re.compile(r"^(\d+)([FBW])(\d+)$")
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zbh1")
CHOICES = ("auto", *SCHEDULES)   # what a user may ask for: auto lets the search choose per replica


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str          # "F" | "B" | "W" (zbh1: the weights' part of a backward)
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


def zero_bubble_h1(num_stages: int, num_micro: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's order of forwards and backwards, each backward's weight gradients (W) split off.
    Stage s runs the W of a micro-batch right after its B, except that it holds back s of them (the
    later a stage, the fewer activations 1F1B keeps there, so every stage keeps at most S micro-batches
    between F and W, stage 0's 1F1B peak) and runs those last, where it would wait for the drain."""
    out = []
    for s, acts in enumerate(one_f_one_b(num_stages, num_micro)):
        split: list[Action] = []
        backwards = 0
        for a in acts:
            split.append(a)
            if a.kind == "B":
                if backwards >= s:
                    split.append(Action(s, "W", backwards - s))
                backwards += 1
        split.extend(Action(s, "W", i) for i in range(max(0, num_micro - s), num_micro))
        out.append(split)
    return out


def weight_split(kind: str) -> bool:
    """Whether schedule `kind` runs a backward as two actions, B then W."""
    return kind == "zbh1"


def interleaved_rounds(num_devices: int, num_micro: int) -> int | None:
    """Micro-batches per round of the interleaved schedule (each device runs a round through one chunk, then
    the next chunk): the device count, or fewer micro-batches in one round; None where `num_micro` does not
    split into whole rounds (it must be a multiple of max(1, num_micro // num_devices))."""
    rounds = max(1, num_micro // num_devices)
    return None if num_micro % rounds else num_micro // rounds


def interleaved(num_devices: int, chunks: int, num_micro: int) -> list[list[Action]]:
    """Interleaved 1F1B (Megatron's virtual pipeline stages): device d runs stages d, d + S, ... A round of
    micro-batches passes the device's first chunk, then its second, ...; backwards take the chunks in
    reverse. Device d starts with (chunks - 1) x round + 2 (S - 1 - d) forwards (enough for the last
    stage's first backward to be reachable), then alternates one forward and one backward, then drains."""
    S, v, M = num_devices, chunks, num_micro
    per_round = interleaved_rounds(S, M)
    if per_round is None:
        raise PassError(f"interleaved 1F1B cannot run {M} micro-batches on {S} devices",
                        fix=f"use a multiple of {max(1, M // S)} micro-batches")

    def order(i: int, backward: bool) -> tuple[int, int]:
        chunk = (i // per_round) % v
        micro = (i // (per_round * v)) * per_round + i % per_round
        return (v - 1 - chunk if backward else chunk), micro

    out = []
    for d in range(S):
        total = v * M
        warm = min(total, (v - 1) * per_round + 2 * (S - 1 - d))
        forwards = [Action(c * S + d, "F", j) for c, j in (order(i, False) for i in range(total))]
        backwards = [Action(c * S + d, "B", j) for c, j in (order(i, True) for i in range(total))]
        acts = forwards[:warm]
        for i in range(total - warm):
            acts += [forwards[warm + i], backwards[i]]
        acts += backwards[total - warm:]
        out.append(acts)
    return out


def make(kind: str, num_stages: int, num_micro: int, chunks: int = 1) -> list[list[Action]]:
    """The action list of each device: `num_stages` stages, each device running `chunks` of them (more than
    one under `interleaved` only)."""
    if kind == "interleaved":
        return interleaved(num_stages // chunks, chunks, num_micro)
    if chunks != 1:
        raise PassError(f"schedule `{kind}` runs one stage per device, not {chunks}", field="schedule",
                        fix="use the interleaved schedule for several stages per device")
    if kind == "gpipe":
        return gpipe(num_stages, num_micro)
    if kind == "1f1b":
        return one_f_one_b(num_stages, num_micro)
    if kind == "zbh1":
        return zero_bubble_h1(num_stages, num_micro)
    raise PassError(f"unknown schedule `{kind}`", field="schedule", fix="use gpipe, 1f1b, interleaved or zbh1")


def format_grid(schedule: list[list[Action]]) -> str:
    """Device x step grid, the form printed when a check fails."""
    width = max(len(a) for a in schedule) if schedule else 0
    lines = []
    for s, acts in enumerate(schedule):
        cells = [str(a).rjust(4) for a in acts] + ["    "] * (width - len(acts))
        lines.append(f"device {s}: " + " ".join(cells))
    return "\n".join(lines)


def to_text(schedule: list[list[Action]]) -> str:
    return "\n".join(" ".join(str(a) for a in acts) for acts in schedule)


def from_text(text: str) -> list[list[Action]]:
    return [[Action.parse(t) for t in line.split()] for line in text.strip().splitlines()]


def check(schedule: list[list[Action]], num_micro: int, chunks: int = 1) -> None:
    """Raise PassError unless every stage runs F and B (and W, where the schedule splits its backwards) of
    each micro-batch once, on its device (stage k on device k mod S), without deadlock."""
    S = len(schedule)
    stages = S * chunks
    kinds = "FBW" if any(a.kind == "W" for acts in schedule for a in acts) else "FB"
    for d, acts in enumerate(schedule):
        want = {(k, kind, i) for k in range(d, stages, S) for kind in kinds for i in range(num_micro)}
        got = [(a.stage, a.kind, a.micro) for a in acts]
        if sorted(got) != sorted(want):
            raise PassError(f"device {d} does not run each of its stages' {'/'.join(kinds)} of each micro-batch "
                            "exactly once:\n" + format_grid(schedule), fix="report this schedule")
        for k, kind, i in got:
            before = {"B": "F", "W": "B"}.get(kind)
            if before and got.index((k, kind, i)) < got.index((k, before, i)):
                raise PassError(f"device {d} runs {k}{kind}{i} before {k}{before}{i}:\n" + format_grid(schedule))
    done: set[tuple[int, str, int]] = set()
    pos = [0] * S
    while any(pos[d] < len(schedule[d]) for d in range(S)):
        progressed = False
        for d in range(S):
            while pos[d] < len(schedule[d]):
                a = schedule[d][pos[d]]
                k = a.stage
                if a.kind == "F":
                    ready = k == 0 or (k - 1, "F", a.micro) in done
                elif a.kind == "W":
                    ready = (k, "B", a.micro) in done
                else:
                    ready = (k, "F", a.micro) in done and (k == stages - 1 or (k + 1, "B", a.micro) in done)
                if not ready:
                    break
                done.add((k, a.kind, a.micro))
                pos[d] += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"device {d} at {schedule[d][pos[d]]}" for d in range(S) if pos[d] < len(schedule[d]))
            raise PassError(f"schedule deadlocks ({stuck}):\n" + format_grid(schedule),
                            fix="report this schedule")
