"""A file a command writes at a path the user names (`plan inspect --html FILE`, `plan profile --out FILE`)
never destroys a file of the user's: it is written new, or over one the command wrote before (each
command knows its own files: `is_ours`), or over another file only with `--force`; never over one of the
command's inputs, `--force` or not."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from planner.core.errors import OutputDirError

READ_BYTES = 1 << 20        # what `is_ours` sees of an existing file at most


def check_output_file(path: Path, *, option: str, is_ours: Callable[[bytes], bool],
                      inputs: Iterable[str | Path] = (), force: bool = False, example: str = "report.html") -> None:
    """Refuse (OutputDirError, one line) to write the file `path` that `option` names where that would
    destroy a file of the user's (the module docstring's rule); `example`: a file name the fix suggests."""
    target = path.resolve()
    if any(target == Path(p).resolve() for p in inputs):
        raise OutputDirError(f"{option} {path} is an input of this command; writing it would destroy it",
                             fix=f"name a new file, e.g. {option} {example}")
    if not target.is_file() or force:
        return
    try:
        with open(target, "rb") as f:
            head = f.read(READ_BYTES)
    except OSError as exc:
        raise OutputDirError(f"cannot read {option} {path}: {exc.strerror or exc}", fix="name a new file") from exc
    if not is_ours(head):
        raise OutputDirError(f"{option} {path} is a file hetplan did not write; writing it would replace it",
                             fix="name a new file, or pass --force to replace this one")
