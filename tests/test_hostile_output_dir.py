"""`-o` never destroys the user's files: the current directory, a directory above it or holding an
input, a file, or a non-empty directory hetplan did not write is refused with one line (only the last
with `--force` allowed), and every file is still there afterwards."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from costmodel.placeholders import NOTE_PREFIX
from planner.cli.output_dir import MARKER
from tests.helpers import REPO
from tests.hostile import CPU4, MLP, assert_one_line, files_under, run_cli

FAST = ["--global-batch", "8", "--no-runners-up"]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch) -> Path:
    """A user's project folder, the working directory: their notes, the model file, the spec."""
    folder = tmp_path / "project"
    (folder / "models").mkdir(parents=True)
    shutil.copyfile(MLP, folder / "models" / "model.py")
    shutil.copyfile(CPU4, folder / "spec.yaml")
    (folder / "notes.txt").write_text("three weeks of notes\n")
    (folder / "data").mkdir()
    (folder / "data" / "rows.csv").write_text("1,2,3\n")
    monkeypatch.chdir(folder)
    return folder


def plan_to(capfd, out: str | Path, *extra: str) -> tuple[int, str]:
    code, _, err = run_cli(capfd, ["models/model.py", "--cluster", "spec.yaml", "-o", out, *FAST, *extra])
    # the catalog's placeholder CPU figures are warned about on every plan of this spec: not what is tested here
    return code, "".join(ln for ln in err.splitlines(keepends=True) if NOTE_PREFIX not in ln)


@pytest.mark.parametrize(("out", "words"), [
    (".", ["the current directory"]),
    ("./", ["the current directory"]),
    ("..", ["a directory above the current one"]),
    ("/", ["a directory above the current one"]),
    ("notes.txt", ["is a file"]),
    ("models/model.py", ["is a file"]),
    ("models", ["holds the input models/model.py"]),
    ("data", ["did not write", MARKER, "--force"]),
])
def test_refused_and_nothing_is_touched(capfd, workdir: Path, out: str, words: list[str]) -> None:
    before = files_under(workdir.parent)
    code, err = plan_to(capfd, out)
    assert_one_line(code, err, 2, f"-o {Path(out)}", *words)
    assert files_under(workdir.parent) == before            # every file still there, unchanged
    assert not [p for p in workdir.rglob(".*") if p.name.startswith((".notes", ".data", ".models", ".project"))]


@pytest.mark.parametrize(("flag", "folder", "words"), [
    ("--dump-ir", ".", ["the current directory"]),
    ("--dump-ir", "models", ["holds the input models/model.py"]),
    ("--dump-cp-model", "data", ["did not write", "--force"]),
    ("--dump-cp-model", "notes.txt", ["is a file"]),
])
def test_a_dump_folder_follows_the_same_rules(capfd, workdir: Path, flag: str, folder: str, words: list[str]) -> None:
    before = files_under(workdir.parent)
    code, err = plan_to(capfd, workdir.parent / "out", flag, folder)      # -o in none of them
    assert_one_line(code, err, 2, f"{flag} {folder}", *words)
    assert files_under(workdir.parent) == before


@pytest.mark.parametrize("out", [".", "..", "notes.txt", "models"])
def test_force_does_not_override_the_first_rules(capfd, workdir: Path, out: str) -> None:
    before = files_under(workdir.parent)
    code, err = plan_to(capfd, out, "--force")
    assert_one_line(code, err, 2, f"-o {out}")
    assert files_under(workdir.parent) == before


def test_the_spec_folder_is_an_input_too(capfd, workdir: Path) -> None:
    (workdir / "clusters").mkdir()
    shutil.move(workdir / "spec.yaml", workdir / "clusters" / "spec.yaml")
    code, _, err = run_cli(capfd, ["models/model.py", "--cluster", "clusters/spec.yaml", "-o", "clusters", *FAST])
    assert_one_line(code, err, 2, "holds the input clusters/spec.yaml")
    assert (workdir / "clusters" / "spec.yaml").is_file()


def test_new_empty_and_previous_outputs_are_written(capfd, workdir: Path) -> None:
    assert plan_to(capfd, "out") == (0, "")
    assert (workdir / "out" / MARKER).is_file() and (workdir / "out" / "plan.json").is_file()
    assert stat.S_IMODE((workdir / "out").stat().st_mode) == 0o777 & ~_umask()   # not mkdtemp's 0700
    (workdir / "out" / "stale.txt").write_text("from an earlier plan")
    assert plan_to(capfd, "out") == (0, "")                  # a previous hetplan output: replaced whole
    assert not (workdir / "out" / "stale.txt").exists() and (workdir / "out" / MARKER).is_file()
    (workdir / "empty").mkdir()
    assert plan_to(capfd, "empty") == (0, "")
    assert (workdir / "empty" / "plan.json").is_file()
    assert (workdir / "notes.txt").read_text() == "three weeks of notes\n"


def test_replanning_keeps_the_runs_of_the_plan_it_replaces(capfd, workdir: Path) -> None:
    assert plan_to(capfd, "out") == (0, "")
    (workdir / "out" / "runs" / "1").mkdir(parents=True)
    (workdir / "out" / "runs" / "1" / "metrics.jsonl").write_text("first\n")
    (workdir / "out" / "run" / "logs").mkdir(parents=True)
    (workdir / "out" / "run" / "metrics.jsonl").write_text("second\n")
    assert plan_to(capfd, "out") == (0, "")
    runs = workdir / "out" / "runs"
    assert (runs / "1" / "metrics.jsonl").read_text() == "first\n"      # earlier runs first, in order
    assert (runs / "2" / "metrics.jsonl").read_text() == "second\n"     # then the latest one
    assert (runs / "2" / "logs").is_dir() and not (workdir / "out" / "run").exists()


def test_force_replaces_a_foreign_directory(capfd, workdir: Path) -> None:
    assert plan_to(capfd, "data", "--force") == (0, "")
    assert (workdir / "data" / "plan.json").is_file() and not (workdir / "data" / "rows.csv").exists()
    assert (workdir / "models" / "model.py").is_file() and (workdir / "notes.txt").is_file()


def test_an_unwritable_place_is_one_line(capfd, workdir: Path) -> None:
    code, err = plan_to(capfd, "notes.txt/out")
    assert_one_line(code, err, 2, "notes.txt/out")
    assert (workdir / "notes.txt").read_text() == "three weeks of notes\n"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_last_line_names_the_files_and_a_command_that_runs_as_printed(capfd, workdir: Path) -> None:
    # `-o out/` (the README's spelling) names out/plan.json, not out//plan.json; a folder with a space is quoted
    # in the command, so the printed `plan run ...` runs as pasted
    code, out, _ = run_cli(capfd, ["models/model.py", "--cluster", "spec.yaml", "-o", "my runs/out/", *FAST])
    assert code == 0
    assert out.splitlines()[-1] == "wrote my runs/out/plan.json and my runs/out/program/ (run: plan run 'my runs/out')"
    assert (workdir / "my runs" / "out" / "plan.json").is_file()


def test_a_folder_name_prints_as_one_inert_line() -> None:
    from planner.cli.output_dir import wrote_line

    line = wrote_line(Path("runs\x1b[2J\nout"))
    assert "\x1b" not in line and "\n" not in line
    assert line.startswith("wrote runs\\x1b[2J\\nout/plan.json and ")


def test_an_export_folder_is_refused_under_its_own_option_with_a_fix_that_works(capfd, workdir: Path) -> None:
    code, _ = plan_to(capfd, "out")
    assert code == 0
    before = files_under(workdir.parent)
    code, _, err = run_cli(capfd, ["export", "out", "--onnx", "out/program"])
    # the line names --onnx (not -o), and the directory it suggests holds none of the inputs: not `out`
    line = assert_one_line(code, err, 2, "--onnx out/program holds the input", "e.g. --onnx stages)")
    assert "-o " not in line
    assert files_under(workdir.parent) == before
    # a suggested name that exists already, or holds an input, is numbered
    code, err = plan_to(capfd, ".")
    assert_one_line(code, err, 2, "-o . is the current directory", "e.g. -o out2)")   # out/ is there
    (workdir / "stages").mkdir()
    code, _, err = run_cli(capfd, ["export", "out", "--onnx", "out/program"])
    assert_one_line(code, err, 2, "e.g. --onnx stages2)")
    # the folder is checked first, before the checkpoint (there is none yet) and before the model is built
    code, _, err = run_cli(capfd, ["export", "out", "--safetensors", "data"])
    assert_one_line(code, err, 2, "--safetensors data is a directory hetplan did not write", "--force")


def test_an_html_page_never_replaces_a_file_of_the_users(capfd, workdir: Path) -> None:
    code, _ = plan_to(capfd, "out")
    assert code == 0
    before = files_under(workdir.parent)
    for flags, words in ((["--html", "notes.txt"], ["--html notes.txt is a file hetplan did not write", "--force"]),
                         (["--html", "models/model.py", "--force"], ["an input of this command"]),
                         (["--html", "out/plan.json", "--force"], ["an input of this command"]),
                         (["--html", "spec.yaml", "--force"], ["an input of this command"])):
        code, _, err = run_cli(capfd, ["inspect", "out", *flags])
        assert_one_line(code, err, 2, *words)
    assert files_under(workdir.parent) == before
    # a page it wrote is replaced; another file only with --force
    for _ in range(2):
        code, _, _ = run_cli(capfd, ["inspect", "out", "--html", "report.html"])
        assert code == 0 and (workdir / "report.html").read_text().startswith("<!DOCTYPE html>")
    code, _, _ = run_cli(capfd, ["inspect", "out", "--html", "notes.txt", "--force"])
    assert code == 0 and "<title>hetplan: " in (workdir / "notes.txt").read_text()


def test_a_profile_never_replaces_a_file_of_the_users(capfd, workdir: Path) -> None:
    from planner.profiling.command import is_calibration

    before = files_under(workdir.parent)
    code, _, err = run_cli(capfd, ["profile", "--out", "notes.txt", "--quick"])     # refused before measuring
    assert_one_line(code, err, 2, "--out notes.txt is a file hetplan did not write", "--force")
    code, _, err = run_cli(capfd, ["profile", "--out", "models/model.py", "--model", "models/model.py", "--force"])
    assert_one_line(code, err, 2, "--out models/model.py is an input of this command")
    assert files_under(workdir.parent) == before
    # what it may replace: a calibration file plan profile wrote (the repository's own)
    assert is_calibration((REPO / "benchmarks" / "results" / "calibration.json").read_bytes())
    assert not is_calibration(b'{"comm": {}}') and not is_calibration((workdir / "notes.txt").read_bytes())


def test_an_interrupted_dump_leaves_the_earlier_one(tmp_path: Path) -> None:
    from planner.cli.output_dir import written_as_it_goes
    dump = tmp_path / "ir"
    with written_as_it_goes(dump, option="--dump-ir") as tmp:
        (tmp / "001_meta_shapes.txt").write_text("first")
    with pytest.raises(KeyboardInterrupt), written_as_it_goes(dump, option="--dump-ir") as tmp:
        (tmp / "001_meta_shapes.txt").write_text("half")
        raise KeyboardInterrupt
    assert (dump / "001_meta_shapes.txt").read_text() == "first"
    with pytest.raises(ValueError), written_as_it_goes(dump, option="--dump-ir") as tmp:
        (tmp / "002_annotate.txt").write_text("up to the failure")
        raise ValueError("a failed search")
    assert sorted(p.name for p in dump.iterdir()) == [MARKER, "002_annotate.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ir"]
