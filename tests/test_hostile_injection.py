"""Nothing from a spec or a plan file becomes code or terminal control: names that could are refused at
the spec's edge (one line); a cluster name with quotes, backslashes and markup plans, appears in no
emitted source file, and runs without executing anything; names edited into a plan print escaped."""

from __future__ import annotations

import json
import py_compile
import shutil
import tempfile
from pathlib import Path

import pytest

from costmodel.placeholders import NOTE_PREFIX
from tests.helpers import run_program
from tests.hostile import MLP, assert_one_line, cpu_spec, run_cli

INJECTIONS = {  # YAML double-quoted spellings: `\"` a quote, `\n` a line break, `\x1b` ESC
    "triple_quote_newline": 'pwn\\"\\"\\"\\nimport os; os.system(\\"touch PWNED\\")\\n\\"\\"\\"',
    "ansi": "\\x1b[2J\\x1b[31mred",
    "backslash_x": "a\\\\x",
    "script": "<script>alert(1)</script>",
}


@pytest.mark.parametrize("role", ["fast", "device"])
@pytest.mark.parametrize("case", INJECTIONS, ids=list(INJECTIONS))
def test_group_and_device_names_that_could_inject_are_refused_at_the_edge(capfd, tmp_path: Path, case: str,
                                                                           role: str) -> None:
    name = INJECTIONS[case]
    spec = cpu_spec(tmp_path, fast=name if role == "fast" else "fast")
    if role == "device":    # the declared type and the group's `device:` both
        spec.write_text(spec.read_text().replace("cpu-fast", f'"{name}"'))
    code, out, err = run_cli(capfd, [MLP, "--cluster", spec, "-o", tmp_path / "out"])
    line = assert_one_line(code, err, 2, "spec.yaml", "not a safe name", "letters, digits and . _ + -")
    assert "\x1b" not in out + err and "\n" not in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["triple_quote_newline", "ansi"])
def test_a_cluster_name_with_line_breaks_or_escapes_is_refused(capfd, tmp_path: Path, case: str) -> None:
    code, out, err = run_cli(capfd, [MLP, "--cluster", cpu_spec(tmp_path, name=INJECTIONS[case]),
                                     "-o", tmp_path / "out"])
    assert_one_line(code, err, 2, "spec.yaml: name:", "printable characters")
    assert "\x1b" not in out + err


def _hostile_name(marker: Path, *, backslash: bool) -> str:
    """A cluster name, as YAML spells it, that would run `touch MARKER` if it were pasted into a Python
    string: it closes the string, runs the command, and opens another that the rest closes (one line);
    with `backslash`, a `\\x` too (a SyntaxError in such a string)."""
    return (f'pwn\\"\\"\\"; import os; os.system(\\"touch {marker}\\"); \\"\\"\\" <script>alert(1)</script>'
            + (" \\\\x" if backslash else ""))


@pytest.fixture
def marker():
    """Where the hostile name's command would create a file: a short path (the name has at most 120
    characters), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="h", dir="/tmp"))
    yield folder / "PWNED"
    shutil.rmtree(folder, ignore_errors=True)


def _plan_hostile(capfd, folder: Path, marker: Path, *, backslash: bool) -> tuple[Path, str]:
    """(plan directory, printed summary) of a plan of the MLP on a cpu-hetero-4-like spec with a
    hostile cluster name whose command would create `marker`."""
    spec = cpu_spec(folder, name=_hostile_name(marker, backslash=backslash))
    code, out, err = run_cli(capfd, [MLP, "--cluster", spec, "-o", folder / "out", "--global-batch", "8"])
    # nothing on stderr but the note on the catalog's placeholder CPU figures (the hostile name is not in it)
    assert code == 0 and all(NOTE_PREFIX in ln for ln in err.splitlines()), err
    return folder / "out", out


@pytest.mark.parametrize("backslash", [False, True])
def test_a_hostile_cluster_name_plans_and_is_in_no_source_file(capfd, tmp_path: Path, marker: Path,
                                                               backslash: bool) -> None:
    out, printed = _plan_hostile(capfd, tmp_path, marker, backslash=backslash)
    name = json.loads((out / "plan.json").read_text())["inputs"]["cluster_name"]
    assert name.startswith('pwn"""; import os') and "<script>" in name and ("\\x" in name) == backslash
    program = out / "program"
    for path in program.rglob("*"):
        if path.is_file() and path.name != "plan.json":   # the plan holds the name as data, JSON-escaped
            text = path.read_text(errors="replace")
            assert str(marker) not in text and "pwn" not in text and "<script>" not in text, path
        if path.suffix == ".py":
            py_compile.compile(str(path), doraise=True)    # `\x` in a docstring was a SyntaxError
    assert f"plan for {name}:" in printed and "\x1b" not in printed
    assert not marker.exists()


@pytest.mark.slow
def test_running_a_hostile_plan_executes_nothing_of_it(capfd, tmp_path: Path, marker: Path) -> None:
    out, _ = _plan_hostile(capfd, tmp_path, marker, backslash=False)
    metrics = run_program(out, 1, save_final=False, timeout_s=240)
    assert metrics and all(m["step"] == 0 for m in metrics)
    assert not marker.exists(), "the cluster name was executed"


def test_names_edited_into_a_plan_print_escaped(capfd, tmp_path: Path) -> None:
    spec = cpu_spec(tmp_path)
    assert run_cli(capfd, [MLP, "--cluster", spec, "-o", tmp_path / "out", "--global-batch", "8"])[0] == 0
    ansi, title = "\x1b[2J\x1b[31m", "\x1b]0;owned\x07"

    def edit(change) -> None:
        for plan_json in (tmp_path / "out" / "plan.json", tmp_path / "out" / "program" / "plan.json"):
            data = json.loads(plan_json.read_text())
            change(data)
            plan_json.write_text(json.dumps(data))

    def names(data: dict) -> None:
        data["inputs"]["cluster_name"] = f"c{ansi}\nx"
        data["devices"] = [f"{title}{d}" for d in data["devices"]]
        for replica in data["replicas"]:
            replica["node_group"] = f"g{ansi}"
            for stage in replica["stages"]:
                stage["device_type"] = f"t\r{ansi}"
        for runner_up in data["solver"].get("runners_up", []):
            runner_up["name"] = f"r{ansi}"
            runner_up["why_slower"] = f"w\n{ansi}"

    edit(names)
    code, printed, err = run_cli(capfd, ["inspect", tmp_path / "out"])
    assert (code, err) == (0, "")
    assert "\x1b" not in printed and "\x07" not in printed and "\r" not in printed
    assert "plan for c\\x1b[2J\\x1b[31m\\nx:" in printed and "\\x1b]0;owned\\x07" in printed
    assert "g\\x1b[2J" in printed and "t\\r\\x1b" in printed

    def label(data: dict) -> None:
        data["replicas"][0]["stages"][0]["device_label"] = f"d{ansi}\nrm -rf"

    edit(label)
    code, printed, err = run_cli(capfd, ["inspect", tmp_path / "out"])
    assert_one_line(code, err, 2, "d\\x1b[2J\\x1b[31m")     # not the spec's device: refused, escaped
    assert "\x1b" not in printed + err
