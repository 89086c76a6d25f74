from __future__ import annotations

import pytest

from planner.core import schedule as sched
from planner.core.errors import PassError


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 1), (2, 5), (4, 3), (4, 8), (3, 2)])
def test_generated_schedules_pass_the_checker(kind, stages, micro):
    s = sched.make(kind, stages, micro)
    sched.check(s, micro)
    assert sched.from_text(sched.to_text(s)) == s


def test_1f1b_keeps_at_most_s_minus_stage_in_flight():
    s = sched.one_f_one_b(4, 8)
    for stage, acts in enumerate(s):
        live, peak = 0, 0
        for a in acts:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(4 - stage, 8)


def test_action_text_form():
    assert str(sched.Action(2, "F", 0)) == "2F0"
    assert sched.Action.parse("1B13") == sched.Action(1, "B", 13)
    with pytest.raises(ValueError):
        sched.Action.parse("F1")


def test_checker_rejects_backward_before_forward_and_prints_grid():
    bad = sched.from_text("0F0 0B1 0F1 0B0\n1F0 1F1 1B0 1B1")
    with pytest.raises(PassError) as err:
        sched.check(bad, 2)
    assert "runs 0B1 before 0F1" in str(err.value) and "device 1:" in str(err.value)


def test_checker_finds_cross_stage_deadlock():
    bad = sched.from_text("0F0 0F1 0B1 0B0\n1F0 1B0 1F1 1B1")
    sched.check(bad, 2)  # valid: stage 1 finishes micro 0 before micro 1
    worse = sched.from_text("0F0 0B0 0F1 0B1\n1F0 1F1 1B1 1B0")
    with pytest.raises(PassError, match="deadlock"):
        sched.check(worse, 2)


def test_checker_rejects_missing_actions():
    with pytest.raises(PassError, match="exactly once"):
        sched.check(sched.from_text("0F0 0B0\n1F0"), 1)


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_interleaved_runs_every_chunk_once_without_deadlock(devices: int, chunks: int):
    for micro in range(1, 3 * devices + 2):
        if sched.interleaved_rounds(devices, micro) is None:
            with pytest.raises(PassError, match="micro-batches"):
                sched.interleaved(devices, chunks, micro)
            continue
        acts = sched.make("interleaved", devices * chunks, micro, chunks)
        sched.check(acts, micro, chunks)
        assert sched.from_text(sched.to_text(acts)) == acts
        # device d runs stages d, d + S, ...; its forwards take a round through one chunk, then the next
        assert {a.stage for a in acts[0]} == set(range(0, devices * chunks, devices))


def test_interleaved_holds_at_most_its_warm_up_plus_one_chunk_forward():
    devices, chunks, micro = 4, 2, 8
    acts = sched.interleaved(devices, chunks, micro)
    for d, row in enumerate(acts):
        live = peak = 0
        for a in row:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        assert peak == (chunks - 1) * devices + 2 * (devices - 1 - d) + 1


def test_interleaved_counts_must_fill_whole_rounds():
    assert sched.interleaved_rounds(4, 8) == 4 and sched.interleaved_rounds(4, 10) == 5
    assert sched.interleaved_rounds(4, 3) == 3 and sched.interleaved_rounds(4, 9) is None


def test_one_stage_schedules_refuse_chunks():
    with pytest.raises(PassError, match="one stage per device"):
        sched.make("1f1b", 4, 4, 2)
