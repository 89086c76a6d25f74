"""Writing a plan directory: built in a temporary sibling, then renamed into place, so a failed run
leaves no partial output and an earlier directory untouched.

`-o OUT` never destroys the user's files. OUT is written when it does not exist or is empty, and
replaced whole only when it holds a previous hetplan output (the MARKER file hetplan writes into each)
or with `--force`. Never, `--force` or not: the current directory (or one above it), a directory
holding the model file or the spec (or another input), or a file. The runs of a replaced plan
(`run/`, `runs/`: their metrics and logs) are kept, under the new directory's `runs/`. A directory filled
as a command goes (`plan --dump-ir DIR`) follows the same rule (`written_as_it_goes`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from planner.core.errors import OutputDirError, printable
from planner.core.file_modes import plain_dir_mode, plain_file_mode

MARKER = ".hetplan-output"
MARKER_TEXT = "hetplan output 1: written by `plan -o` (or a dump flag), which may replace this directory whole\n"


def check_output_dir(out: Path, *, inputs: Iterable[str | Path] = (), force: bool = False,
                     option: str = "-o") -> Path:
    """The absolute directory `plan -o out` may write; raises OutputDirError (one line: which rule,
    and the fix) when writing there could delete a file of the user's. `inputs` are the files the run
    reads (model file, spec, ...): no directory above one of them is replaced. `option`: the command's
    option that named `out` (`plan export --onnx DIR`), as the line names it."""
    inputs = tuple(inputs)
    target = out.resolve()
    here = Path.cwd().resolve()
    if target == here or target in here.parents:
        what = "the current directory" if target == here else "a directory above the current one"
        raise OutputDirError(f"{option} {out} is {what}; replacing it would delete everything in it",
                             fix=f"name a new directory, e.g. {option} {free_name(option, inputs)}")
    for path in inputs:
        source = Path(path).resolve()
        if target in source.parents:
            raise OutputDirError(f"{option} {out} holds the input {path}; replacing it would delete it",
                                 fix=f"name a directory that holds none of the inputs, e.g. {option} "
                                     f"{free_name(option, inputs)}")
    if target.exists() and not target.is_dir():
        raise OutputDirError(f"{option} {out} is a file, not a directory",
                             fix="name a directory (a new one, or one hetplan wrote before)")
    try:
        foreign = target.is_dir() and not (target / MARKER).is_file() and any(target.iterdir())
    except OSError as exc:
        raise OutputDirError(f"cannot read {option} {out}: {exc.strerror or exc}",
                             fix="name a readable directory") from exc
    if foreign and not force:
        raise OutputDirError(f"{option} {out} is a directory hetplan did not write (no {MARKER} in it), and not "
                             "empty: replacing it would delete its files",
                             fix="name a new directory, or pass --force to replace this one")
    return target


def write_atomically(out: Path, fill: Callable[[Path], None], *, inputs: Iterable[str | Path] = (),
                     force: bool = False, option: str = "-o") -> None:
    """Build the output in a temporary sibling directory with `fill`, mark it as hetplan's, then swap it
    in for `out` (checked with check_output_dir first, and again just before the swap)."""
    inputs = tuple(inputs)
    target = check_output_dir(out, inputs=inputs, force=force, option=option)
    tmp = _sibling(target, out, option)
    with _removed_on_failure(tmp, out, option):
        fill(tmp)
        _mark_and_swap(tmp, out, target, inputs=inputs, force=force, option=option)


@contextmanager
def written_as_it_goes(out: Path, *, inputs: Iterable[str | Path] = (), force: bool = False,
                       option: str) -> Iterator[Path]:
    """A directory a command fills while it runs (`plan --dump-ir DIR`), under `-o`'s rule: the command
    writes into the temporary sibling this yields, which takes `out`'s place when the command ends, also
    when it ends in an error (a failed search's dumps are for its bug report); an interrupt (Ctrl-C) leaves
    `out` as it was."""
    inputs = tuple(inputs)
    target = check_output_dir(out, inputs=inputs, force=force, option=option)
    tmp = _sibling(target, out, option)
    try:
        yield tmp
    except Exception:
        with _removed_on_failure(tmp, out, option):
            _mark_and_swap(tmp, out, target, inputs=inputs, force=force, option=option)
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with _removed_on_failure(tmp, out, option):
        _mark_and_swap(tmp, out, target, inputs=inputs, force=force, option=option)


@contextmanager
def _removed_on_failure(tmp: Path, out: Path, option: str) -> Iterator[None]:
    """`tmp` deleted should the block fail; an OSError is one line about `option`'s directory."""
    try:
        yield
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputDirError(f"cannot write {option} {out}: {exc.strerror or exc}",
                             fix="free space or choose a writable directory") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sibling(target: Path, out: Path, option: str) -> Path:
    """A new empty directory beside `target`, with a plain directory's mode."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        os.chmod(tmp, plain_dir_mode())          # mkdtemp's 0700, as a plain mkdir would have it
    except OSError as exc:
        raise OutputDirError(f"cannot create a directory beside {option} {out}: {exc.strerror or exc}",
                             fix="name a directory in a writable place") from exc
    return tmp


def _mark_and_swap(tmp: Path, out: Path, target: Path, *, inputs: tuple[str | Path, ...], force: bool,
                   option: str) -> None:
    (tmp / MARKER).write_text(MARKER_TEXT)
    check_output_dir(out, inputs=inputs, force=force, option=option)   # what is there now, not at the start
    _swap(tmp, target)


# the README's names for each option's directory, the first one tried in a fix
SUGGESTED_NAMES = {"-o": "out", "--onnx": "stages", "--safetensors": "trained"}


def free_name(option: str, inputs: Iterable[str | Path] = ()) -> str:
    """A directory name a fix may suggest for `option`: the README's (`out`), or that name numbered (`out2`,
    ...) where it exists already or holds one of `inputs` (suggesting `-o out` to a `-o out/program` that
    holds the plan it reads would be refused in turn)."""
    base = SUGGESTED_NAMES.get(option, "out")
    sources = [Path(p).resolve() for p in inputs]
    for n in range(1, 1000):
        name = base if n == 1 else f"{base}{n}"
        target = Path(name).resolve()
        if not target.exists() and not any(target in source.parents for source in sources):
            return name
    return base


def _swap(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`; a previous `target` is moved aside first, and back should the rename fail.
    Its runs move into the new `target/runs/`; only then is the rest of it deleted."""
    if not target.exists():
        os.replace(tmp, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    os.replace(target, old / "previous")
    try:
        os.replace(tmp, target)
    except BaseException:
        os.replace(old / "previous", target)
        raise
    _keep_runs(old / "previous", target)
    shutil.rmtree(old, ignore_errors=True)


def _keep_runs(previous: Path, target: Path) -> None:
    """Move `previous/runs/*` and then `previous/run` into `target/runs/` (numbered as `plan run` numbers
    them: 1, 2, ...), so re-planning into a directory never deletes a run's metrics and logs."""
    def order(run: Path) -> tuple[int, int, str]:    # numbered runs by number, then any others by name
        return (0, int(run.name), "") if run.name.isdigit() else (1, 0, run.name)

    earlier = sorted((run for run in (previous / "runs").glob("*") if run.is_dir()), key=order)
    if (previous / "run").is_dir():
        earlier.append(previous / "run")
    if not earlier:
        return
    runs = target / "runs"
    runs.mkdir(exist_ok=True)
    for number, run in enumerate(earlier, start=1):
        os.replace(run, runs / str(number))


def write_text_atomically(path: Path, text: str) -> None:
    """Write a file whole or not at all: into a temporary sibling, then renamed over `path` (a
    directory there is refused: one line)."""
    if path.is_dir():
        raise OutputDirError(f"{path} is a directory", fix="name a file, e.g. report.html")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        raise OutputDirError(f"cannot write beside {path}: {exc.strerror or exc}",
                             fix="choose a writable place") from exc
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, plain_file_mode())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputDirError(f"cannot write {path}: {exc.strerror or exc}",
                             fix="free space or choose a writable place") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def wrote_line(out: Path, *, program: bool = True) -> str:
    """The line a command ends with once it wrote the plan directory `out`: its files, as paths (`-o out/` is
    not `out//plan.json`), and the command that runs it, `out` quoted for a shell; printable either way."""
    if not program:
        return printable(f"wrote {out / 'plan.json'} and {out / 'summary.txt'}")
    return printable(f"wrote {out / 'plan.json'} and {out / 'program'}/ (run: plan run {shlex.quote(str(out))})")
