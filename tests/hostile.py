"""Shared by the hostile-input tests (tests/test_hostile_*.py): the CLI run in-process, its one-line
error checked, small specs and model files written to a temporary folder."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

from planner.cli import main
from tests.helpers import CLUSTERS, EXAMPLES

MLP = EXAMPLES / "mlp" / "model.py"
CPU4 = CLUSTERS / "cpu-hetero-4.yaml"
NETWORK = "network: {inter_node: {kind: loopback, bandwidth_gbit_s: 10, latency_us: 20}}"


def run_cli(capfd, argv: list[str], *, max_s: float = 120.0) -> tuple[int, str, str]:
    """`plan ARGV` in this process: (exit code, stdout, stderr), file descriptors captured (torch logs to
    the real stderr). Fails when the call takes longer than `max_s` (a hang)."""
    capfd.readouterr()
    start = time.monotonic()
    code = main([str(a) for a in argv])
    elapsed = time.monotonic() - start
    out, err = capfd.readouterr()
    assert elapsed < max_s, f"`plan {' '.join(map(str, argv))}` took {elapsed:.0f} s"
    return code, out, err


def assert_one_line(code: int, err: str, expected_code: int, *needles: str) -> str:
    """A refusal: the exit code, exactly one line on stderr starting `plan: error:`, no traceback, and
    each needle in it. Returns the line."""
    assert code == expected_code, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("plan: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def cpu_spec(folder: Path, *, name: str = "hostile", fast: str = "fast", slow: str = "slow",
             file: str = "spec.yaml") -> Path:
    """A cpu-hetero-4-like spec (two fast and two slow CPU processes) with the given names, quoted
    as YAML double-quoted strings (so escapes in them are YAML's)."""
    return write(folder, file, f"""\
        name: "{name}"
        devices:
          cpu-fast: {{base: CPU, slowdown: 1.0}}
          cpu-slow: {{base: CPU, slowdown: 3.0}}
        nodes:
          - {{name: "{fast}", count: 1, device: cpu-fast, per_node: 2, intra_link: shm}}
          - {{name: "{slow}", count: 1, device: cpu-slow, per_node: 2, intra_link: shm}}
        {NETWORK}
        """)


def files_under(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by relative path, with its bytes (to show nothing was touched)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
