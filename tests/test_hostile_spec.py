"""Hostile cluster specs: names outside the safe set, too many devices, alias bombs, 16k keys, huge
values. Each is one line naming the file, the field, the rule and the fix, quickly, and quotes no
value whole; every bundled and shared spec still loads."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from planner.core.errors import SpecError, printable
from planner.core.fields import MAX_ECHO_CHARS, MAX_SPEC_BYTES, NAME_RULE
from planner.frontend.cluster import MAX_DEVICES, load_cluster
from tests.helpers import CLUSTERS, REPO, SHARED_CLUSTERS
from tests.hostile import NETWORK, write

EVERY_SPEC = sorted({*CLUSTERS.glob("*.yaml"), *SHARED_CLUSTERS.glob("*.yaml"),
                     *(REPO / "benchmarks" / "clusters").glob("*.yaml")})


def refused(path: Path, field: str, *words: str, max_s: float = 5.0) -> str:
    """load_cluster(path) raises one SpecError line naming `path` and `field` (and `words`), in time."""
    start = time.monotonic()
    with pytest.raises(SpecError) as caught:
        load_cluster(path)
    assert time.monotonic() - start < max_s
    line = caught.value.one_line()
    assert line.startswith(f"{path}: {field}: " if field else f"{path}: "), line
    assert "\n" not in line and "\x1b" not in line and "(fix: " in line, line
    for word in words:
        assert word in line, line
    return line


@pytest.mark.parametrize("path", EVERY_SPEC, ids=lambda p: f"{p.parent.parent.name}/{p.stem}")
def test_every_bundled_and_shared_spec_still_loads(path: Path) -> None:
    assert load_cluster(path).num_devices >= 1


BAD_GROUP_NAMES = ["a/b", "a:b", "a b", 'a\\"b', "a'b", "a\\nb", "\\x1b[31mred", "<script>", "-lead", "x" * 65,
                   'pwn\\"\\"\\"', "a\\tb"]


@pytest.mark.parametrize("name", BAD_GROUP_NAMES)
def test_node_group_names_outside_the_safe_set_are_refused(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, "spec.yaml", f'nodes:\n  - {{name: "{name}", count: 1, device: T4, per_node: 1}}\n')
    refused(path, "nodes[0].name", "not a safe name", NAME_RULE)


@pytest.mark.parametrize("name", ["gpu/fast", "my gpu", "x\\x1by"])
def test_declared_device_type_names_outside_the_safe_set_are_refused(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, "spec.yaml", f'devices:\n  "{name}": {{base: T4}}\n'
                                        f'nodes:\n  - {{name: a, count: 1, device: "{name}", per_node: 1}}\n')
    refused(path, f"devices.{printable(name.encode().decode('unicode_escape'))}", "device type", "not a safe name")


@pytest.mark.parametrize("name", ["a\\nimport os", "red\\x1b[31m", "bell\\a", "x" * 121])
def test_a_cluster_name_must_be_one_printable_line(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, "spec.yaml", f'name: "{name}"\nnodes: [{{name: a, count: 1, device: T4, per_node: 1}}]\n')
    refused(path, "name", "printable characters", "one line")


def test_a_cluster_name_may_hold_quotes_backslashes_and_markup(tmp_path: Path) -> None:
    path = write(tmp_path, "spec.yaml", "name: 'pwn\"\"\" \\x <script>alert(1)</script>'\n"
                                        "nodes: [{name: a, count: 1, device: T4, per_node: 1}]\n")
    assert load_cluster(path).name == 'pwn""" \\x <script>alert(1)</script>'


def test_more_than_the_device_cap_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    groups = "".join(f"  - {{name: g{i}, count: 50000, device: T4, per_node: 1}}\n" for i in range(3))
    path = write(tmp_path, "spec.yaml", f"nodes:\n{groups}{NETWORK}\n")
    refused(path, "nodes[2].count", str(MAX_DEVICES), "devices", max_s=1.0)
    huge = write(tmp_path, "huge.yaml", f"nodes:\n  - {{name: a, count: {10**30}, device: T4, per_node: 8}}\n")
    refused(huge, "nodes[0].count", str(MAX_DEVICES), max_s=1.0)


def test_an_alias_bomb_is_refused_quickly_in_a_short_message(tmp_path: Path) -> None:
    # seven levels of nine aliases each: 9**7 strings once expanded, where a name is read (a message
    # quoting the value was 39 MB)
    levels = ["&a0 [" + ", ".join(["lol"] * 9) + "]"]
    levels += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 8)]
    path = write(tmp_path, "bomb.yaml", f"name: [{', '.join(levels)}]\nnodes: [{{name: a, count: 1, device: T4, "
                                        "per_node: 1}]\n")
    line = refused(path, "", "aliases expand", max_s=2.0)
    assert len(line) < 300


def test_a_few_aliases_still_work(tmp_path: Path) -> None:
    path = write(tmp_path, "merge.yaml", "nodes:\n  - &t4 {name: a, count: 1, device: T4, per_node: 1}\n"
                                         "  - {<<: *t4, name: b}\n" + NETWORK + "\n")
    assert [g.name for g in load_cluster(path).nodes] == ["a", "b"]


def test_recursive_aliases_and_deep_nesting_are_refused(tmp_path: Path) -> None:
    refused(write(tmp_path, "rec.yaml", "name: &a [*a]\nnodes: []\n"), "", "recursive")
    refused(write(tmp_path, "deep.yaml", "name: " + "[" * 5000 + "]" * 5000 + "\n"), "", "nested deeper")


def test_sixteen_thousand_keys_take_linear_time(tmp_path: Path) -> None:
    keys = "".join(f"    k{i}: 1\n" for i in range(16_000))
    path = write(tmp_path, "keys.yaml", f"nodes:\n  - name: a\n{keys}    k77: 2\n")
    refused(path, "line 16003, column 5", "duplicate key 'k77'", max_s=5.0)   # 9 s when quadratic
    many = write(tmp_path, "many.yaml", f"nodes:\n  - name: a\n{keys}")
    line = refused(many, "nodes[0].k0", "unknown key(s)", "and 15995 more", max_s=5.0)
    assert len(line) < 400


def test_a_spec_over_the_size_cap_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("# padding\n" * (MAX_SPEC_BYTES // 10 + 1))
    refused(path, "", "larger than 1 MiB", max_s=1.0)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    refused(fifo, "", "not a regular file", max_s=1.0)    # opening it would wait for a writer


def test_exponent_numbers_read_as_numbers(tmp_path: Path) -> None:
    path = write(tmp_path, "spec.yaml", "nodes:\n  - {name: a, count: 1, device: T4, per_node: 1, "
                                        "price_per_hour: 1e-9}\n"
                                        "devices: {}\n")
    assert load_cluster(path).nodes[0].device.price_per_hour == pytest.approx(1e-9)
    net = write(tmp_path, "net.yaml", "nodes:\n  - {name: a, count: 2, device: T4, per_node: 1}\n"
                                      "network: {inter_node: {kind: tcp, bandwidth_gbit_s: 1e2, latency_us: 5E+1}}\n")
    link = load_cluster(net).inter_node
    assert link.bandwidth_bytes_s == pytest.approx(100e9 / 8) and link.latency_s == pytest.approx(50e-6)


@pytest.mark.parametrize("value", ["1" + "0" * 500, "1e400", "2001-02-30"])
def test_values_no_figure_has_are_one_line(tmp_path: Path, value: str) -> None:
    path = write(tmp_path, "spec.yaml", "nodes:\n  - {name: a, count: 1, device: T4, per_node: 1, "
                                        f"price_per_hour: {value}}}\n")
    line = refused(path, "nodes[0].price_per_hour" if value[0] == "1" else "")
    assert len(line) < 300


def test_a_value_is_never_quoted_whole(tmp_path: Path) -> None:
    long_value = "A" * 10_000
    path = write(tmp_path, "spec.yaml", f"nodes:\n  - {{name: a, count: {long_value}, device: T4, per_node: 1}}\n")
    line = refused(path, "nodes[0].count", "expected a whole number")
    assert "A" * MAX_ECHO_CHARS not in line and len(line) < 300
    listed = write(tmp_path, "list.yaml", "nodes:\n  - {name: [" + ", ".join(["x" * 50] * 200) + "], count: 1, "
                                          "device: T4, per_node: 1}\n")
    assert len(refused(listed, "nodes[0].name", "expected a non-empty string")) < 300
