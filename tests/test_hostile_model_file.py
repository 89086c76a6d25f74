"""Hostile or broken model files: each is the model file's error, one line, exit 2 (never exit 0, a
traceback, torch's log, or "report this"); code that never returns is stopped by --trace-timeout; one
Ctrl-C ends `plan` with exit 130."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from planner.core import interrupts
from planner.core.errors import ModelFileError
from planner.frontend import load_model_file, trace_model
from tests.helpers import CLUSTERS, EXAMPLES, sigint_handled_by
from tests.hostile import CPU4, assert_one_line, run_cli, write

HEADER = "import sys, time\nimport torch\nfrom torch import nn\n"
LINEAR = "def model():\n    return nn.Linear(4, 2)\n"
BATCH = ("def batch(batch_size, step):\n    g = torch.Generator().manual_seed(step)\n"
         "    return (torch.randn(batch_size, 4, generator=g),), torch.randn(batch_size, 2, generator=g)\n")

CASES = [  # (case, model file body after the imports, words of the one line)
    ("loss_not_scalar", LINEAR + BATCH + "def loss_fn(output, target):\n    return (output - target) ** 2\n",
     ["loss_fn(output, target) returned float32[2, 2]", "not a scalar"]),
    ("loss_raises", LINEAR + BATCH + "def loss_fn(output, target):\n    raise ValueError('no loss today')\n",
     ["loss_fn(output, target) failed", "ValueError: no loss today"]),
    ("loss_not_callable", LINEAR + BATCH + "loss_fn = 3\n", ["`loss_fn` is a int, not a function"]),
    ("loss_wrong_shape", LINEAR + BATCH + "def loss_fn(output, target):\n    return output[:, :3].sum() + target\n",
     ["loss_fn(output, target)"]),
    ("batch_ignores_size", LINEAR + "def batch(b, step):\n    return (torch.randn(8, 4),), torch.randn(8, 2)\n",
     ["batch", "float32[8, 4] does not have 2 rows"]),
    ("batch_types_change", LINEAR + "def batch(b, step):\n    x = torch.randn(b, 4) if b == 2 else torch.randn(b, 5)\n"
                                    "    return (x,), torch.randn(b, 2)\n",
     ["batch(2, 0) returned", "batch(3, 0) returned"]),
    ("no_parameters", "def model():\n    return nn.Sequential(nn.ReLU())\n" + BATCH, ["no trainable parameters"]),
    ("frozen_parameters", "def model():\n    m = nn.Linear(4, 2)\n    m.requires_grad_(False)\n    return m\n" + BATCH,
     ["no trainable parameters"]),
    ("sys_exit_at_import", "sys.exit(0)\n" + LINEAR + BATCH, ["importing the model file called sys.exit(0)"]),
    ("sys_exit_in_batch", LINEAR + "def batch(b, s):\n    sys.exit('bye')\n", ["batch(2, 0) called sys.exit('bye')"]),
    ("keyboard_interrupt_in_model", "def model():\n    raise KeyboardInterrupt\n" + BATCH,
     ["model() raised KeyboardInterrupt"]),
    ("wrong_input_width", "def model():\n    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 2))\n"
                          + BATCH, ["model()'s forward fails on the traced batch", "[2, 4]"]),
]


@pytest.mark.parametrize(("case", "body", "words"), CASES, ids=[c[0] for c in CASES])
def test_a_broken_model_file_is_its_own_one_line_error(capfd, tmp_path: Path, case: str, body: str,
                                                       words: list[str]) -> None:
    model = write(tmp_path, f"{case}.py", HEADER + body)
    code, out, err = run_cli(capfd, [model, "--cluster", CPU4, "-o", tmp_path / "out", "--no-runners-up"])
    assert_one_line(code, err, 2, f"{case}.py", *words)     # one line: no torch log, no traceback
    assert not (tmp_path / "out").exists()


HANGS = [  # (case, model file body, the step the message names)
    ("import", "while True:\n    time.sleep(0.01)\n", "importing the model file"),
    ("model", "def model():\n    while True:\n        pass\n" + BATCH, "model()"),
    ("batch", LINEAR + "def batch(b, s):\n    while True:\n        time.sleep(0.01)\n", "batch(2, 0)"),
    ("forward", "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                "        self.l = nn.Linear(4, 2)\n    def forward(self, x):\n        while True:\n"
                "            try:\n                time.sleep(0.01)\n            except Exception:\n"
                "                pass\n" + "def model():\n    return M()\n" + BATCH, "tracing model()'s forward"),
    ("loss", LINEAR + BATCH + "def loss_fn(o, t):\n    while True:\n        pass\n", "loss_fn(output, target)"),
]


@pytest.mark.parametrize(("case", "body", "step"), HANGS, ids=[c[0] for c in HANGS])
def test_code_that_never_returns_is_stopped_by_the_trace_timeout(capfd, tmp_path: Path, case: str, body: str,
                                                                  step: str) -> None:
    model = write(tmp_path, f"hang_{case}.py", HEADER + body)
    start = time.monotonic()
    code, _, err = run_cli(capfd, [model, "--cluster", CPU4, "-o", tmp_path / "out", "--trace-timeout", "2",
                                   "--no-runners-up"], max_s=60)
    assert_one_line(code, err, 2, f"hang_{case}.py", f"{step} did not finish within 2 s", "--trace-timeout")
    assert time.monotonic() - start < 40
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None) and signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_the_timeout_is_not_a_limit_on_code_that_returns(tmp_path: Path) -> None:
    """A generous limit leaves the bundled examples alone, and the contract checks pass on them."""
    for name in ("mlp", "gpt", "hf_llama", "resnet"):
        model_file = load_model_file(EXAMPLES / name / "model.py", time_limit_s=120)
        gm, inputs = trace_model(model_file, 2)
        assert any(n.op == "output" for n in gm.graph.nodes) and inputs


@pytest.fixture
def sigint_reaches_main() -> Iterator[None]:
    """A Ctrl-C test runs as from a terminal: SIGINT with Python's handler, not blocked in the main thread.
    A suite started as a background job of a script (`pytest &` where the shell has no job control)
    inherits SIGINT ignored, which `plan` then keeps ignoring as it should (the test below): the three Ctrl-C
    tests failed so once."""
    with sigint_handled_by(signal.default_int_handler):
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        assert signal.SIGINT not in blocked, f"SIGINT is blocked in the main thread ({sorted(blocked)})"
        yield


def _send_sigint_after(delay_s: float) -> threading.Timer:
    """Ctrl-C after `delay_s`, to this process's main thread: a terminal's SIGINT goes to the process, and
    the kernel may hand a process-wide signal to any of its threads, where it interrupts no sleep and no
    wait of the main thread (a 30 s model-file import then ran to its end under a loaded test worker)."""
    timer = threading.Timer(delay_s, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    return timer


@pytest.mark.usefixtures("sigint_reaches_main")
def test_one_ctrl_c_during_the_search_ends_plan(capfd, tmp_path: Path, monkeypatch) -> None:
    """CP-SAT's own SIGINT handler used to end the search as if its limit were reached: planning went on
    and exited 0. The signal lands inside a solve here (20 ms into it, each takes over 100 ms)."""
    from ortools.sat.python import cp_model

    real_solve = cp_model.CpSolver.solve
    timers: list[threading.Timer] = []

    def solve_then_interrupted(self, *args, **kwargs):
        if not timers:
            timers.append(_send_sigint_after(0.02))
        return real_solve(self, *args, **kwargs)

    monkeypatch.setattr(cp_model.CpSolver, "solve", solve_then_interrupted)
    code, out, err = run_cli(capfd, [EXAMPLES / "gpt" / "model.py", "--cluster", CLUSTERS / "seed-mixed-32.yaml",
                                     "-o", tmp_path / "out"])
    assert timers, "the search never solved a model"
    assert (code, err.strip()) == (130, "plan: interrupted"), (code, err, out[-500:])
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


@pytest.mark.usefixtures("sigint_reaches_main")
def test_a_ctrl_c_the_interpreter_could_only_ignore_still_ends_plan(capfd, tmp_path: Path, monkeypatch) -> None:
    """Python runs a signal's handler at the main thread's next bytecode; inside a finaliser (a `__del__`, a
    dropped generator's close) its KeyboardInterrupt is printed as ignored and the code goes on: planning
    then went on and exited 0. Here the signal is handled inside a finaliser while the costs are made."""
    import planner.api as api

    real_cost_tables = api.cost_tables

    class Finaliser:
        def __del__(self) -> None:
            signal.raise_signal(signal.SIGINT)        # handled here, in the finaliser

    def finalised_then_costed(*args, **kwargs):
        Finaliser()                                   # dropped at once: its __del__ runs now
        return real_cost_tables(*args, **kwargs)

    dropped: list[type[BaseException] | None] = []
    monkeypatch.setattr(api, "cost_tables", finalised_then_costed)
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))
    code, out, err = run_cli(capfd, [EXAMPLES / "gpt" / "model.py", "--cluster", CLUSTERS / "seed-mixed-32.yaml",
                                     "-o", tmp_path / "out"])
    assert dropped == [KeyboardInterrupt], (dropped, code, err[-500:])   # "Exception ignored in ..."
    assert (code, err.strip()) == (130, "plan: interrupted"), (code, err[-500:], out[-500:])
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    interrupts.check()                              # forgotten with the command: a later write is not refused


@pytest.mark.usefixtures("sigint_reaches_main")
def test_ctrl_c_while_the_model_file_runs_is_the_users_interrupt(capfd, tmp_path: Path) -> None:
    """Not reported as the model file's KeyboardInterrupt: the user pressed Ctrl-C, `plan` ends (130)."""
    model = write(tmp_path, "slow.py", HEADER + "time.sleep(30)\n" + LINEAR + BATCH)
    _send_sigint_after(0.5)
    code, out, err = run_cli(capfd, [model, "--cluster", CPU4, "-o", tmp_path / "out"], max_s=20)
    assert (code, err.strip()) == (130, "plan: interrupted"), (code, err[-500:], out[-500:])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_plan_started_with_sigint_ignored_keeps_ignoring_it(capfd, tmp_path: Path, monkeypatch) -> None:
    """`plan ... &` from a script without job control: SIGINT ignored from the start stays ignored, in the
    model file's code (which would otherwise take it as the user's Ctrl-C) and in the planner's own (the
    search). The signals are sent from inside each, so they land there."""
    from ortools.sat.python import cp_model

    model = write(tmp_path, "signals.py", HEADER + "import signal\nsignal.raise_signal(signal.SIGINT)\n"
                  + LINEAR + BATCH)
    real_solve = cp_model.CpSolver.solve
    sent: list[bool] = []

    def interrupted_solve(self, *args, **kwargs):
        if not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGINT)
        return real_solve(self, *args, **kwargs)

    monkeypatch.setattr(cp_model.CpSolver, "solve", interrupted_solve)
    with sigint_handled_by(signal.SIG_IGN):
        code, _, err = run_cli(capfd, [model, "--cluster", CPU4, "-o", tmp_path / "out"], max_s=60)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert sent, "the search never solved a model"
    assert code == 0, (code, err[-500:])
    assert (tmp_path / "out" / "plan.json").exists()


def test_a_model_file_error_from_the_python_api(tmp_path: Path) -> None:
    model = write(tmp_path, "exits.py", HEADER + "sys.exit(3)\n")
    with pytest.raises(ModelFileError, match=r"sys.exit\(3\)"):
        load_model_file(model)
