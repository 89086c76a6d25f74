"""Options outside what they may be: exit 2 with one line about the option itself (not "raise
--time-limit" or "fits on no device", exit 3; not a traceback), from the CLI and from the Python API."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.api import PlanOptions, RunControls, plan
from planner.core.errors import OptionError
from planner.options import check_options
from tests.hostile import CPU4, MLP, assert_one_line, run_cli

BAD_OPTIONS = [  # (flags, the flag the message must name, a word of the message)
    (["--micro-batch", "0"], "--micro-batch", "micro-batch size 0"),
    (["--micro-batch", "-3"], "--micro-batch", "micro-batch size -3"),
    (["--micro-batch", "65"], "--micro-batch", "from 1 to 64"),          # more than the global batch
    (["--memory-margin", "nan"], "--memory-margin", "[0, 1)"),
    (["--memory-margin", "1"], "--memory-margin", "[0, 1)"),
    (["--memory-margin", "-0.5"], "--memory-margin", "[0, 1)"),
    (["--memory-margin", "inf"], "--memory-margin", "[0, 1)"),
    (["--lr", "nan"], "--lr", "positive finite"),
    (["--lr", "-0.001"], "--lr", "positive finite"),
    (["--lr", "0"], "--lr", "positive finite"),
    (["--time-limit", "0"], "--time-limit", "positive number of seconds"),
    (["--time-limit", "-1"], "--time-limit", "positive number of seconds"),
    (["--time-limit", "nan"], "--time-limit", "positive number of seconds"),
    (["--time-limit", "inf"], "--time-limit", "positive number of seconds"),
    (["--stages", "0"], "--stages", "pipeline depth 0"),
    (["--stages", "1000"], "--stages", "from 1 to 96"),
    (["--global-batch", "0"], "--global-batch", "global batch 0"),
    (["--global-batch", "-64"], "--global-batch", "global batch -64"),
    (["--global-batch", str(10**12)], "--global-batch", "from 1 to"),
    (["--strategy", "magic"], "--strategy", "ilp, exact, uniform"),
    (["--trace-timeout", "0"], "--trace-timeout", "positive finite"),
    (["--trace-timeout", "-5"], "--trace-timeout", "positive finite"),
    (["--trace-timeout", "nan"], "--trace-timeout", "positive finite"),
    (["--precision", "fp64"], "--precision", "invalid choice"),
    (["--global-batch", "lots"], "--global-batch", "invalid int value"),
    (["--model-fn", "os.system"], "--model-fn", "not the name of a function"),
]


@pytest.mark.parametrize(("flags", "flag", "words"), BAD_OPTIONS, ids=[" ".join(c[0]) for c in BAD_OPTIONS])
def test_a_bad_option_is_one_line_about_the_option(capfd, tmp_path: Path, flags: list[str], flag: str,
                                                   words: str) -> None:
    code, out, err = run_cli(capfd, [MLP, "--cluster", CPU4, "-o", tmp_path / "out", *flags], max_s=30)
    assert_one_line(code, err, 2, flag, words)
    assert not (tmp_path / "out").exists()


def test_options_are_refused_before_anything_is_read(capfd, tmp_path: Path) -> None:
    """The option is what is wrong: named even when the model file and spec are missing too."""
    code, _, err = run_cli(capfd, [tmp_path / "none.py", "--cluster", tmp_path / "none.yaml",
                                   "-o", tmp_path / "out", "--micro-batch", "0"], max_s=10)
    assert_one_line(code, err, 2, "--micro-batch")


@pytest.mark.parametrize("options", [
    PlanOptions(micro_batch=0), PlanOptions(memory_margin=math.nan), PlanOptions(memory_margin=1.0),
    PlanOptions(time_limit_s=-1.0), PlanOptions(time_limit_s=math.inf), PlanOptions(stages=0),
    PlanOptions(global_batch=0), PlanOptions(global_batch=True), PlanOptions(global_batch=2.5),  # type: ignore[arg-type]
    PlanOptions(strategy="magic"), PlanOptions(precision="fp64"), PlanOptions(objective="speed"),
    PlanOptions(optimizer="lamb"), PlanOptions(names={"model": "not an identifier"}),
    PlanOptions(names={"forward": "f"}),
], ids=repr)
def test_the_python_api_refuses_them_too(options: PlanOptions) -> None:
    with pytest.raises(OptionError) as caught:
        check_options(options)
    assert caught.value.exit_code == 2 and caught.value.field
    with pytest.raises(OptionError):
        plan(str(MLP), str(CPU4), options)


@pytest.mark.parametrize("seconds", [0.0, -1.0, math.nan, math.inf, "10"])
def test_a_bad_trace_timeout_is_refused_where_it_is_set(seconds: object) -> None:
    with pytest.raises(OptionError, match="trace timeout"):
        RunControls(trace_timeout_s=seconds)  # type: ignore[arg-type]


def test_the_trace_timeout_is_a_run_control_not_a_plan_option() -> None:
    """Plans stay byte-identical whatever the timeout: it is not among the options plan.json records."""
    assert "trace_timeout_s" not in PlanOptions.__dataclass_fields__
    assert not any("timeout" in key for key, _ in PlanOptions().as_pairs())
    assert RunControls().trace_timeout_s and RunControls(trace_timeout_s=None).trace_timeout_s is None


@pytest.mark.parametrize("lr", ["-1", "0", "nan", "inf"])
def test_plan_run_refuses_a_learning_rate_before_any_rank_starts(capfd, tmp_path: Path, lr: str) -> None:
    # (the ranks' optimizers refused it, each after tracing its stage)
    code, _, err = run_cli(capfd, ["run", tmp_path / "no-such-plan", "--lr", lr])
    assert_one_line(code, err, 2, "--lr", "positive finite number")


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_plan_run_refuses_a_run_that_trains_nothing_before_reading_the_plan(capfd, tmp_path: Path,
                                                                            steps: str) -> None:
    code, _, err = run_cli(capfd, ["run", tmp_path / "no-such-plan", "--steps", steps])
    assert_one_line(code, err, 2, "--steps", f"{steps} is not a number of steps to train", "1 or more", "--dry-run")


def test_plan_run_data_needs_a_path_and_a_dataset_to_read_it(capfd, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, _, err = run_cli(capfd, [MLP, "--cluster", CPU4, "--global-batch", "8", "--no-runners-up", "-o", out])
    assert code == 0, err
    code, _, err = run_cli(capfd, ["run", out, "--data", tmp_path / "rows.bin"])
    assert_one_line(code, err, 2, "--data", "rows.bin: no such file or folder")
    (tmp_path / "rows.bin").write_bytes(b"\0" * 64)
    # the MLP example makes its rows with batch(): it would train on them and never read the file
    code, _, err = run_cli(capfd, ["run", out, "--data", tmp_path / "rows.bin"])
    assert_one_line(code, err, 2, "--data", "defines no dataset()", "or drop --data")
    assert not (out / "run").exists()                  # refused before any rank started


def test_the_programs_own_arguments_are_one_line_each_before_any_rank_starts(capfd, tmp_path: Path) -> None:
    # `torchrun ... train.py --lr -1` (launch.sh passes its arguments on): every rank's optimizer refused it
    # after tracing, and --steps 0 or --keep-checkpoints 0 started training; checked as `plan run` checks them
    out = tmp_path / "out"
    code, _, err = run_cli(capfd, [MLP, "--cluster", CPU4, "--global-batch", "8", "--no-runners-up", "-o", out])
    assert code == 0, err
    for flags, words in [(["--lr", "nan"], "positive finite number"), (["--steps", "0"], "at least 1"),
                         (["--keep-checkpoints", "0"], "at least 1"), (["--checkpoint-every", "two"], "whole number")]:
        proc = subprocess.run([sys.executable, str(out / "program" / "train.py"), *flags], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "LOCAL_RANK": "0"})
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"train.py: argument {flags[0]}: ") and words in lines[0], lines[0]
    # the other processes of an agent see the same arguments: only its first one says so
    proc = subprocess.run([sys.executable, str(out / "program" / "train.py"), "--lr", "-1"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "LOCAL_RANK": "1"})
    assert proc.returncode == 2 and proc.stderr == ""
    assert not (out / "run").exists()
