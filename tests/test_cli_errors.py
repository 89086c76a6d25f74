"""Bad input: one clear line naming the file and field, a non-zero exit, and no partial output."""

from __future__ import annotations

import textwrap

import pytest

from planner.cli import main
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli

GPT = str(EXAMPLES / "gpt" / "model.py")
SPEC = str(CLUSTERS / "cpu-hetero-4.yaml")


def _run(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def _assert_one_line_error(code, err, *needles):
    assert code != 0
    assert len(err.splitlines()) == 1, err
    assert err.startswith("plan: error: ")
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


@pytest.fixture
def out(tmp_path):
    return tmp_path / "out"


def _no_output(out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_missing_model_file(capsys, tmp_path, out):
    code, err = _run(capsys, [str(tmp_path / "nope.py"), "--cluster", SPEC, "-o", str(out)])
    _assert_one_line_error(code, err, "nope.py", "not found")
    _no_output(out)


def test_missing_cluster_file(capsys, tmp_path, out):
    code, err = _run(capsys, [GPT, "--cluster", str(tmp_path / "none.yaml"), "-o", str(out)])
    _assert_one_line_error(code, err, "none.yaml")
    _no_output(out)


def test_malformed_yaml(capsys, tmp_path, out):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nnodes: [ {name: a, count: 1\n")
    code, err = _run(capsys, [GPT, "--cluster", str(bad), "-o", str(out)])
    _assert_one_line_error(code, err, "bad.yaml")
    _no_output(out)


def test_unknown_device(capsys, tmp_path, out):
    bad = tmp_path / "unknown.yaml"
    bad.write_text("name: x\nnodes:\n  - {name: a, count: 1, device: A300, per_node: 1}\n")
    code, err = _run(capsys, [GPT, "--cluster", str(bad), "-o", str(out)])
    _assert_one_line_error(code, err, "unknown.yaml", "nodes[0].device", "A300")
    _no_output(out)


def test_negative_bandwidth(capsys, tmp_path, out):
    bad = tmp_path / "neg.yaml"
    bad.write_text(textwrap.dedent("""\
        name: x
        nodes:
          - {name: a, count: 2, device: T4, per_node: 1}
        network:
          inter_node: {kind: tcp, bandwidth_gbit_s: -5, latency_us: 10}
        """))
    code, err = _run(capsys, [GPT, "--cluster", str(bad), "-o", str(out)])
    _assert_one_line_error(code, err, "neg.yaml", "network.inter_node.bandwidth_gbit_s")
    _no_output(out)


def test_model_that_fits_nowhere(capsys, tmp_path, out):
    huge = tmp_path / "huge.py"
    huge.write_text(textwrap.dedent("""\
        import torch
        from torch import nn
        def model():
            return nn.Sequential(nn.Linear(100_000, 100_000), nn.Linear(100_000, 8))
        def batch(batch_size, step):
            g = torch.Generator().manual_seed(step)
            return (torch.randn(batch_size, 100_000, generator=g),), torch.randn(batch_size, 8, generator=g)
        """))
    code, err = _run(capsys, [str(huge), "--cluster", str(CLUSTERS / "edge-t4.yaml"), "-o", str(out)])
    _assert_one_line_error(code, err, "huge.py", "fits on no device", "GiB")
    _no_output(out)


def test_model_file_without_model_function(capsys, tmp_path, out):
    bad = tmp_path / "nomodel.py"
    bad.write_text("def batch(batch_size, step):\n    return (), None\n")
    code, err = _run(capsys, [str(bad), "--cluster", SPEC, "-o", str(out)])
    _assert_one_line_error(code, err, "nomodel.py", "model", "fix:")
    _no_output(out)


def test_failed_replan_leaves_previous_output_untouched(capsys, tmp_path, out):
    out.mkdir()
    (out / "plan.json").write_text("previous")
    code, err = _run(capsys, [str(tmp_path / "missing.py"), "--cluster", SPEC, "-o", str(out)])
    assert code != 0
    assert (out / "plan.json").read_text() == "previous"


def test_console_exit_code_and_stderr(tmp_path):
    proc = run_plan_cli(str(tmp_path / "missing.py"), "--cluster", SPEC, "-o", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "missing.py" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_cost_objective_without_prices(capsys, out):
    code, err = _run(capsys, [GPT, "--cluster", SPEC, "--objective", "cost", "-o", str(out)])
    assert code == 3
    _assert_one_line_error(code, err, "cpu-hetero-4.yaml", "price_per_hour", "--objective time")
    _no_output(out)
