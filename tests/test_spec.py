"""Cluster spec loader and device catalog: every example loads, units convert, bad input is named.

Expected numbers are worked out by hand from the YAML (TFLOP/s * 1e12, GiB * 2**30, GB/s * 1e9,
Gbit/s * 1e9 / 8, us * 1e-6), not computed with the loader's own constants.
"""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path

import pytest
import yaml

from costmodel.catalog import load_catalog, load_links
from planner.core.cluster import PRECISIONS, ClusterSpec
from planner.core.errors import SpecError
from planner.frontend.cluster import load_cluster

REPO = Path(__file__).resolve().parents[1]
SHARED_CLUSTERS = Path(__file__).resolve().parents[2] / "shared" / "clusters"
EXAMPLE_CLUSTERS = REPO / "examples" / "clusters"
CLUSTER_FILES = sorted({*SHARED_CLUSTERS.glob("*.yaml"), *EXAMPLE_CLUSTERS.glob("*.yaml")})
EXPECTED_DEVICES = {"seed-mixed-32": 32, "large-1024": 1024, "cpu-hetero-4": 4, "cv-80-20": 40,
                    "edge-t4": 12, "mixed-vendor": 40}
CATALOG_DEVICES = {"A100-40GB", "A100-80GB", "V100-16GB", "V100-32GB", "P100-16GB", "T4", "L4", "A10",
                   "H100-80GB", "H200", "MI100", "MI250X", "Ascend-910B", "Jetson-AGX-Orin", "CPU"}
CATALOG_LINKS = {"nvlink2", "nvlink3", "nvlink4", "pcie3", "pcie4", "pcie5", "shm", "none"}
GIB = 1024 ** 3


def cluster(name: str) -> ClusterSpec:
    """An example cluster, from shared/clusters if present, else from the repo's copies."""
    folder = SHARED_CLUSTERS if (SHARED_CLUSTERS / f"{name}.yaml").exists() else EXAMPLE_CLUSTERS
    return load_cluster(folder / f"{name}.yaml")


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---- every example loads ----------------------------------------------------------------------

def test_example_clusters_exist() -> None:
    assert {p.stem for p in CLUSTER_FILES} >= set(EXPECTED_DEVICES)


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: f"{p.parent.parent.name}/{p.stem}")
def test_every_example_loads(path: Path) -> None:
    spec = load_cluster(path)
    devices = spec.devices()
    assert spec.source_path == str(path)
    assert spec.num_devices == len(devices) == EXPECTED_DEVICES.get(spec.name, len(devices))
    assert [d.index for d in devices] == list(range(len(devices)))
    assert set(spec.device_types) == {g.device.name for g in spec.nodes}
    assert spec.inter_node.bandwidth_bytes_s > 0 and spec.inter_node.latency_s >= 0


def test_cpu_hetero_derives_slowdown_from_catalog_cpu() -> None:
    spec = cluster("cpu-hetero-4")
    slow, fast = spec.device_types["cpu-slow"], spec.device_types["cpu-fast"]
    assert (slow.slowdown, fast.slowdown) == (3.0, 1.0)
    assert slow.base == fast.base == "CPU"
    assert slow.peak("fp32") == load_catalog()["CPU"].peak("fp32")
    assert "cpu-hetero-4.yaml" in slow.source and load_catalog()["CPU"].source in slow.source
    assert [d.type.slowdown for d in spec.devices()] == [1.0, 1.0, 3.0, 3.0]
    assert spec.inter_node.kind == "loopback"
    assert spec.inter_node.bandwidth_bytes_s == pytest.approx(1.25e9)        # 10 Gbit/s
    assert spec.inter_node.latency_s == pytest.approx(20e-6)
    assert spec.nodes[0].intra_link.bandwidth_bytes_s == pytest.approx(10e9)  # shm, 10 GB/s


# ---- unit conversions, checked against hand-computed numbers ------------------------------------

def test_catalog_units_converted() -> None:
    a100 = load_catalog()["A100-40GB"]
    assert a100.peak_flops_s["fp32"] == pytest.approx(19.5e12)
    assert a100.peak("bf16") == pytest.approx(312e12)
    assert a100.memory_bytes == 42_949_672_960                                 # 40 GiB
    assert a100.memory_bandwidth_bytes_s == pytest.approx(1.555e12)
    p100 = load_catalog()["P100-16GB"]
    assert not p100.supports("bf16") and not p100.supports("tf32")
    assert p100.peak("bf16") == pytest.approx(9.3e12)                          # falls back to fp32


def test_links_units_converted() -> None:
    links = load_links()
    assert links["nvlink3"].bandwidth_bytes_s == pytest.approx(300e9)
    assert links["pcie3"].bandwidth_bytes_s == pytest.approx(15.75e9)
    assert links["nvlink2"].latency_s == pytest.approx(2e-6)


def test_seed_cluster_network_and_types() -> None:
    spec = cluster("seed-mixed-32")
    assert spec.inter_node.kind == "roce"
    assert spec.inter_node.bandwidth_bytes_s == pytest.approx(12.5e9)          # 100 Gbit/s
    assert spec.inter_node.latency_s == pytest.approx(5e-6)
    assert spec.inter_node.transfer_s(12.5e9) == pytest.approx(1 + 5e-6)
    assert spec.device_types["V100-32GB"].memory_bytes == 32 * GIB
    assert [g.device.name for g in spec.nodes] == ["A100-40GB", "V100-32GB", "P100-16GB"]


def test_declared_type_and_explicit_intra_link() -> None:
    spec = cluster("mixed-vendor")
    ascend = spec.device_types["Ascend-910B"]
    assert ascend.base is None and "declared in mixed-vendor.yaml" in ascend.source
    assert ascend.peak("fp16") == pytest.approx(320e12)
    assert ascend.memory_bytes == 68_719_476_736                               # 64 GiB
    assert ascend.memory_bandwidth_bytes_s == pytest.approx(1.6e12)
    fabric = spec.group("mi100").intra_link
    assert fabric.kind == "infinity-fabric"
    assert (fabric.bandwidth_bytes_s, fabric.latency_s) == (pytest.approx(92e9), pytest.approx(3e-6))
    assert spec.inter_node.bandwidth_bytes_s == pytest.approx(25e9)           # 200 Gbit/s


def test_base_overrides_merge_and_node_price(tmp_path: Path) -> None:
    path = write(tmp_path, "derived.yaml", """
devices:
  half-a100: {base: A100-80GB, peak_tflops: {fp16: 100}, memory_gib: 40, slowdown: 2, price_per_hour: 1.5}
nodes:
  - {name: g, count: 1, device: half-a100, per_node: 2, price_per_hour: 2.5,
     intra_link: {kind: pcie4, bandwidth_gbyte_s: 20, latency_us: 4}}
""")
    spec = load_cluster(path)
    half = spec.device_types["half-a100"]
    assert half.peak("fp16") == pytest.approx(100e12) and half.peak("bf16") == pytest.approx(312e12)
    assert half.memory_bytes == 40 * GIB
    assert half.memory_bandwidth_bytes_s == pytest.approx(2.039e12)            # kept from the base
    assert (half.base, half.slowdown, half.price_per_hour) == ("A100-80GB", 2.0, 1.5)
    assert spec.nodes[0].device.price_per_hour == 2.5                           # per device-hour, group only
    assert spec.nodes[0].intra_link.bandwidth_bytes_s == pytest.approx(20e9)
    assert spec.nodes[0].intra_link.latency_s == pytest.approx(4e-6)
    assert spec.name == "derived"                                               # file stem without `name:`


def test_one_node_needs_no_network(tmp_path: Path) -> None:
    spec = load_cluster(write(tmp_path, "solo.yaml", "nodes: [{name: n, count: 1, device: T4, per_node: 1}]"))
    assert spec.num_devices == 1
    assert spec.nodes[0].intra_link.kind == spec.inter_node.kind == "none"


# ---- topology ----------------------------------------------------------------------------------

def test_link_between_intra_and_inter() -> None:
    spec = cluster("seed-mixed-32")
    d = spec.devices()
    assert (d[5].group, d[5].node, d[5].local, d[5].label) == ("a100", 1, 1, "a100/1:1")
    assert spec.link_between(d[0], d[1]).kind == "nvlink3"                      # same A100 node
    assert spec.link_between(d[0], d[4]).kind == "roce"                         # two A100 nodes
    assert spec.link_between(d[3], d[8]).kind == "roce"                         # A100 node -> V100 node
    assert spec.link_between(d[8], d[11]).kind == "nvlink2"
    assert spec.link_between(d[24], d[27]).kind == "pcie3"
    assert spec.link_between(d[27], d[28]).kind == "roce"                       # last two P100 nodes


def test_single_device_nodes_talk_over_the_network() -> None:
    spec = cluster("edge-t4")
    jetsons = [d for d in spec.devices() if d.group == "jetson"]
    assert len(jetsons) == 4 and len({d.node for d in jetsons}) == 4
    assert spec.link_between(jetsons[0], jetsons[1]).kind == "tcp"
    assert spec.inter_node.bandwidth_bytes_s == pytest.approx(3.125e9)         # 25 Gbit/s


# ---- the catalog -------------------------------------------------------------------------------

def test_catalog_entries_have_sources_and_positive_figures() -> None:
    catalog = load_catalog()
    assert set(catalog) >= CATALOG_DEVICES
    for name, device in catalog.items():
        assert device.name == name and device.source.strip() and device.vendor.strip()
        assert device.memory_bytes > 0 and device.memory_bandwidth_bytes_s > 0
        assert "fp32" in device.peak_flops_s and set(device.peak_flops_s) <= set(PRECISIONS)
        assert all(flops > 0 for flops in device.peak_flops_s.values()), name
        assert device.slowdown == 1.0 and device.base is None


def test_catalog_precisions_follow_the_hardware() -> None:
    catalog = load_catalog()
    assert not catalog["V100-32GB"].supports("bf16") and catalog["V100-32GB"].supports("fp16")
    assert not catalog["T4"].supports("bf16")
    assert catalog["H100-80GB"].supports("fp8") and not catalog["A100-80GB"].supports("fp8")
    assert not catalog["CPU"].tensor_cores and catalog["A100-80GB"].tensor_cores


def test_link_catalog_entries_have_sources_and_positive_figures() -> None:
    packaged = resources.files("costmodel") / "catalog" / "links.yaml"
    raw = yaml.safe_load(packaged.read_text(encoding="utf-8"))
    links = load_links()
    assert set(links) == set(raw) >= CATALOG_LINKS
    for kind, link in links.items():
        assert raw[kind]["source"].strip()
        assert link.kind == kind and link.bandwidth_bytes_s > 0 and link.latency_s >= 0


def test_bad_catalog_is_a_spec_error(tmp_path: Path) -> None:
    path = write(tmp_path, "devices.yaml", "X1: {vendor: v, peak_tflops: {fp32: 1}, memory_gib: 1, "
                                           "memory_bandwidth_gbyte_s: 1}\n")
    with pytest.raises(SpecError) as caught:
        load_catalog(path)
    assert "devices.yaml" in caught.value.one_line() and "X1.source" in caught.value.one_line()
    with pytest.raises(SpecError, match="must be > 0"):
        load_links(write(tmp_path, "links.yaml", "l: {bandwidth_gbyte_s: 0, latency_us: 1, source: s}\n"))


# ---- bad input: a SpecError naming the file, the field path and the fix -------------------------

NODE = "{name: a, count: 2, device: T4, per_node: 2, intra_link: pcie3}"
NETWORK = "network: {inter_node: {kind: tcp, bandwidth_gbit_s: 10, latency_us: 5}}"


def spec_text(node: str = NODE, network: str = NETWORK, devices: str = "") -> str:
    return f"name: bad\n{devices}nodes:\n  - {node}\n{network}\n"


BAD_SPECS = [  # (case, YAML text, field path in the message, other words it must contain)
    ("malformed", "name: x\nnodes:\n  - {name: a, count: 1\n", "line 4, column 1", ["malformed YAML"]),
    ("duplicate_key", "name: x\nname: y\nnodes: []\n", "line 2, column 1", ["duplicate key 'name'"]),
    ("tab_indent", "name: x\nnodes:\n\t- a\n", "line 3, column 1", ["malformed YAML"]),
    ("empty_file", "", "", ["the file is empty"]),
    ("top_level_list", "- a\n- b\n", "", ["got a list"]),
    ("unknown_top_key", spec_text() + "nodez: []\n", "nodez", ["unknown key", "allowed keys here: nodes"]),
    ("unknown_node_key", spec_text(node="{name: a, count: 2, devcie: T4, per_node: 1}"), "nodes[0].devcie",
     ["allowed keys here: device"]),
    ("missing_device", spec_text(node="{name: a, count: 2, per_node: 1}"), "nodes[0].device",
     ["missing required field"]),
    ("missing_nodes", "name: x\n" + NETWORK + "\n", "nodes", ["missing required field"]),
    ("count_not_integer", spec_text(node="{name: a, count: two, device: T4, per_node: 1}"), "nodes[0].count",
     ["expected a whole number", "'two'"]),
    ("count_boolean", spec_text(node="{name: a, count: true, device: T4, per_node: 1}"), "nodes[0].count",
     ["expected a whole number"]),
    ("count_zero", spec_text(node="{name: a, count: 0, device: T4, per_node: 1}"), "nodes[0].count",
     ["must be >= 1"]),
    ("per_node_negative", spec_text(node="{name: a, count: 2, device: T4, per_node: -1}"),
     "nodes[0].per_node", ["must be >= 1"]),
    ("name_not_string", spec_text(node="{name: [a], count: 2, device: T4, per_node: 1}"), "nodes[0].name",
     ["expected a non-empty string"]),
    ("bandwidth_zero", spec_text(network="network: {inter_node: {kind: tcp, bandwidth_gbit_s: 0, "
                                         "latency_us: 5}}"),
     "network.inter_node.bandwidth_gbit_s", ["must be > 0"]),
    ("bandwidth_string", spec_text(network="network: {inter_node: {kind: tcp, bandwidth_gbit_s: fast, "
                                           "latency_us: 5}}"),
     "network.inter_node.bandwidth_gbit_s", ["expected a finite number"]),
    ("bandwidth_nan", spec_text(network="network: {inter_node: {kind: tcp, bandwidth_gbit_s: .nan, "
                                        "latency_us: 5}}"),
     "network.inter_node.bandwidth_gbit_s", ["expected a finite number"]),
    ("latency_negative", spec_text(network="network: {inter_node: {kind: tcp, bandwidth_gbit_s: 10, "
                                           "latency_us: -1}}"),
     "network.inter_node.latency_us", ["must be >= 0"]),
    ("intra_latency_negative", spec_text(node="{name: a, count: 2, device: T4, per_node: 2, intra_link: "
                                              "{kind: x, bandwidth_gbyte_s: 5, latency_us: -2}}"),
     "nodes[0].intra_link.latency_us", ["must be >= 0"]),
    ("intra_bandwidth_missing", spec_text(node="{name: a, count: 2, device: T4, per_node: 2, intra_link: "
                                               "{kind: x, latency_us: 2}}"),
     "nodes[0].intra_link.bandwidth_gbyte_s", ["missing required field"]),
    ("intra_link_number", spec_text(node="{name: a, count: 2, device: T4, per_node: 2, intra_link: 5}"),
     "nodes[0].intra_link", ["got an integer"]),
    ("intra_link_missing", spec_text(node="{name: a, count: 2, device: T4, per_node: 2}"),
     "nodes[0].intra_link", ["missing required field", "per_node is 2"]),
    ("memory_zero", spec_text(node="{name: a, count: 2, device: x, per_node: 1}",
                              devices="devices:\n  x: {vendor: v, peak_tflops: {fp32: 1}, memory_gib: 0, "
                                      "memory_bandwidth_gbyte_s: 1}\n"),
     "devices.x.memory_gib", ["must be > 0"]),
    ("declared_missing_figure", spec_text(node="{name: a, count: 2, device: x, per_node: 1}",
                                          devices="devices:\n  x: {vendor: v, peak_tflops: {fp32: 1}, "
                                                  "memory_gib: 8}\n"),
     "devices.x.memory_bandwidth_gbyte_s", ["missing required field"]),
    ("declared_no_fp32", spec_text(node="{name: a, count: 2, device: x, per_node: 1}",
                                   devices="devices:\n  x: {base: T4, peak_tflops: {fp32: 0}}\n"),
     "devices.x.peak_tflops.fp32", ["must be > 0"]),
    ("unknown_precision", spec_text(node="{name: a, count: 2, device: x, per_node: 1}",
                                    devices="devices:\n  x: {base: T4, peak_tflops: {int8: 130}}\n"),
     "devices.x.peak_tflops.int8", ["allowed keys here"]),
    ("slowdown_zero", spec_text(node="{name: a, count: 2, device: x, per_node: 1}",
                                devices="devices:\n  x: {base: CPU, slowdown: 0}\n"),
     "devices.x.slowdown", ["must be > 0"]),
    ("device_not_mapping", spec_text(node="{name: a, count: 2, device: x, per_node: 1}",
                                     devices="devices:\n  x: T4\n"),
     "devices.x", ["expected device type x, got a string"]),
    ("unknown_device", spec_text(node="{name: a, count: 2, device: a100-80gb, per_node: 1}"),
     "nodes[0].device", ["unknown device 'a100-80gb'", "use one of: A100-80GB, ", "under `devices:`"]),
    ("unknown_base", spec_text(node="{name: a, count: 2, device: x, per_node: 1}",
                               devices="devices:\n  x: {base: V100}\n"),
     "devices.x.base", ["unknown catalog device 'V100'", "use one of: V100-"]),
    ("unknown_link_kind", spec_text(node="{name: a, count: 2, device: T4, per_node: 2, intra_link: nvlnk3}"),
     "nodes[0].intra_link", ["unknown link kind 'nvlnk3'", "use one of: nvlink3, "]),
    ("unknown_network_kind", spec_text(network="network: {inter_node: {kind: infiniband2, "
                                               "bandwidth_gbit_s: 10, latency_us: 5}}"),
     "network.inter_node.kind", ["unknown network kind", "use one of: infiniband, "]),
    ("none_link_on_multi_device_node", spec_text(node="{name: a, count: 1, device: T4, per_node: 4, "
                                                      "intra_link: none}"),
     "nodes[0].intra_link", ["per_node is 4"]),
    ("duplicate_group", spec_text(node=NODE + "\n  - " + NODE), "nodes[1].name",
     ["duplicate node group 'a'", "nodes[0]"]),
    ("empty_nodes", "nodes: []\n", "nodes", ["an empty list"]),
    ("nodes_mapping", "nodes: {a: 1}\n", "nodes", ["got a mapping"]),
    ("network_missing", spec_text(network=""), "network", ["missing required field", "2 nodes",
                                                           "inter_node: {kind:"]),
    ("network_null", spec_text(network="network:"), "network", ["got nothing (null)"]),
    ("inter_node_missing_latency", spec_text(network="network: {inter_node: {kind: tcp, "
                                                     "bandwidth_gbit_s: 10}}"),
     "network.inter_node.latency_us", ["missing required field"]),
    ("integer_key", spec_text(devices="devices:\n  100: {base: T4}\n"), "devices.100", ["quote the key"]),
]


@pytest.mark.parametrize(("case", "text", "field_path", "words"), BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
def test_bad_spec_names_file_field_and_fix(tmp_path: Path, case: str, text: str, field_path: str,
                                           words: list[str]) -> None:
    path = write(tmp_path, f"{case}.yaml", text)
    with pytest.raises(SpecError) as caught:
        load_cluster(path)
    line = caught.value.one_line()
    assert line.startswith(f"{path}: {field_path}: " if field_path else f"{path}: "), line
    assert caught.value.file == str(path) and (caught.value.field or "") == field_path
    assert "(fix: " in line and "\n" not in line
    for word in words:
        assert word in line, line


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="file not found") as caught:
        load_cluster(tmp_path / "absent.yaml")
    assert "absent.yaml" in caught.value.one_line()
    with pytest.raises(SpecError, match="cannot read"):
        load_cluster(tmp_path)                                                    # a directory
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00not text")
    with pytest.raises(SpecError, match="cannot read") as caught:
        load_cluster(binary)
    assert "binary.yaml" in caught.value.one_line()


WRONG_VALUES: list[object] = [None, "x", -1, 0, [], {}, True, 1.5]


def _leaf_paths(value: object, path: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    if isinstance(value, dict):
        return [path] + [p for k, v in value.items() for p in _leaf_paths(v, (*path, k))]
    if isinstance(value, list):
        return [path] + [p for i, v in enumerate(value) for p in _leaf_paths(v, (*path, i))]
    return [path]


@pytest.mark.parametrize("name", ["mixed-vendor", "cpu-hetero-4"])
def test_any_wrong_value_is_a_spec_error_or_loads(tmp_path: Path, name: str) -> None:
    """Replace every value of an example by values of the wrong kind: never a KeyError or TypeError."""
    folder = SHARED_CLUSTERS if (SHARED_CLUSTERS / f"{name}.yaml").exists() else EXAMPLE_CLUSTERS
    original = yaml.safe_load((folder / f"{name}.yaml").read_text(encoding="utf-8"))
    for where in _leaf_paths(original)[1:]:
        for wrong in WRONG_VALUES:
            data = copy.deepcopy(original)
            parent = data
            for step in where[:-1]:
                parent = parent[step]
            parent[where[-1]] = wrong
            path = write(tmp_path, "mutated.yaml", yaml.safe_dump(data))
            try:
                load_cluster(path)
            except SpecError as error:
                assert "mutated.yaml" in error.one_line()
