"""Injected faults (program/faults.py) and the launcher's record of failed attempts (local_run,
elastic): what `plan run --fault` accepts, when a fault fires, and which device a launch lost.

The faults' effect on a real run (a killed worker restarted and resumed, a device lost for good) is
tested end to end in tests/test_recovery_e2e.py."""

from __future__ import annotations

import pytest

from backends.torchdist.elastic import lost_device
from backends.torchdist.program import faults
from backends.torchdist.run_failures import attempt_failures
from planner.core.errors import OptionError


def test_each_kind_parses_and_prints_back():
    for text in ("kill:fast/0:1@5", "kill-always:slow/1:0@0", "crash-in-save:fast/0:0@6", "slow:fast/0:1=3@10"):
        assert str(faults.parse(text)) == text
    assert faults.parse("slow:a/0:0=2.5@3") == faults.Fault("slow", "a/0:0", 3, 2.5)


@pytest.mark.parametrize("text", ["kill:fast/0:1", "explode:fast/0:1@5", "kill:fast/0:1=3@5", "slow:fast/0:1@5",
                                  "slow:fast/0:1=0@5", "kill:@5", "kill:fast/0:1@-1"])
def test_a_malformed_fault_is_one_option_error(text):
    with pytest.raises(OptionError) as err:
        faults.parse(text)
    assert err.value.field == "--fault" and "@" in err.value.fix     # the fix shows the form


def test_a_fault_on_a_device_the_plan_does_not_use_is_refused():
    with pytest.raises(OptionError, match="runs nothing on gpu/0:0"):
        faults.check_devices([faults.parse("kill:gpu/0:0@1")], ["fast/0:0", "fast/0:1"])


def test_kill_fires_in_the_first_attempt_only_and_kill_always_in_every_one(monkeypatch):
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append(sig))
    once = [faults.parse("kill:fast/0:1@5"), faults.parse("crash-in-save:fast/0:1@6")]
    for attempt, expected in ((0, 2), (1, 0)):
        killed.clear()
        f = faults.Faults(once, "fast/0:1", attempt=attempt)
        for step in range(8):
            f.before_step(step)
            f.during_save(step)
        assert len(killed) == expected
    killed.clear()
    always = faults.Faults([faults.parse("kill-always:fast/0:1@5")], "fast/0:1", attempt=3)
    always.before_step(4)
    assert killed == []
    always.before_step(5)
    assert len(killed) == 1
    faults.Faults(once, "fast/0:0", attempt=0).before_step(5)     # another device's fault
    assert len(killed) == 1


def test_slow_takes_the_latest_factor_begun():
    f = faults.Faults([faults.parse("slow:d/0:0=3@10"), faults.parse("slow:d/0:0=1.5@20")], "d/0:0", attempt=0)
    assert [f.slowdown(s) for s in (0, 9, 10, 19, 20, 99)] == [1.0, 1.0, 3.0, 3.0, 1.5, 1.5]


API = "site-packages/torch/distributed/elastic/multiprocessing/api.py:1002]"
LAUNCHER = (
    "[default1]:step 4 done\n"
    f"E1201 20:39:15.175000 31191 {API} failed (exitcode: -9) local_rank: 1 (pid: 31289) of binary: python\n"
    "W1201 20:39:16.599000 31191 api.py:1028] Sending process 31313 closing signal SIGTERM\n"
    f"E1201 20:39:16.798000 31191 {API} failed (exitcode: {{code}}) local_rank: {{rank}} (pid: 31314) of binary: "
    "python\n")


def test_a_device_is_lost_when_its_rank_failed_again_after_a_restart():
    devices = ("fast/0:0", "fast/0:1")
    again = LAUNCHER.format(code=-9, rank=1)
    assert attempt_failures(again) == [(1, -9), (1, -9)]
    assert lost_device(devices, again) == "fast/0:1"
    assert lost_device(devices, LAUNCHER.format(code=1, rank=0)) is None     # failed once, then another rank
    assert lost_device(devices, LAUNCHER.split("W1201")[0]) is None          # one failed attempt only
    assert lost_device(devices, LAUNCHER.format(code=-9, rank=7).replace("local_rank: 1", "local_rank: 7")) is None
