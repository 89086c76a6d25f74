"""benchmarks/vs_metis.py's own parts, without Metis: the profiles it synthesises, the cluster files it
writes for both planners, how it reads Metis' answer, and its one-line error for a folder that is not a
Metis checkout. With METIS_DIR naming a checkout, one real Metis run on the 16-GPU case too."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from costmodel.catalog import load_catalog
from planner.core.errors import OptionError
from planner.core.units import BYTES_PER_MIB
from planner.frontend.cluster import load_cluster
from tests.helpers import REPO, import_benchmark

vs_metis = import_benchmark("vs_metis")

CLI_TIMEOUT_S = 60


def a100_profile() -> dict:
    """A profile in the layout Metis' README documents (made-up figures, three layers)."""
    return {"model": {"model_name": "GPT", "num_layers": 3,
                      "parameters": {"total_parameters_bytes": 60, "parameters_per_layer_bytes": [20, 30, 10]}},
            "execution_time": {"total_time_ms": 20.0, "forward_backward_time_ms": 12.0,
                               "batch_generator_time_ms": 0.5, "layernorm_grads_all_reduce_time_ms": 0.1,
                               "embedding_grads_all_reduce_time_ms": 0.2, "optimizer_time_ms": 4.0,
                               "layer_compute_total_ms": [1.0, 8.0, 2.0]},
            "execution_memory": {"total_memory": 700, "layer_memory_total_mb": [100, 400, 200]}}


def fake_checkout(root: Path) -> Path:
    """The files vs_metis.metis_checkout looks for, with one A100 profile (tp1, bs1) of our own."""
    for name in vs_metis.METIS_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    (root / "profile_data_samples").mkdir()
    (root / "profile_data_samples" / "DeviceType.A100_tp1_bs1.json").write_text(json.dumps(a100_profile()))
    return root


def test_the_example_is_metis_gpt_with_its_sizes_on_meta() -> None:
    spec = importlib.util.spec_from_file_location("hetplan_example_gpt_metis", vs_metis.MODEL)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with torch.device("meta"):
        gpt = example.model()
    hidden, vocab, seq, blocks = 4096, 51200, 1024, 8        # Metis' cost_het_cluster.sh, GPT 1.5B
    per_block = 12 * hidden**2 + 13 * hidden                 # qkv + proj + 4x MLP, biases, two LayerNorms
    assert sum(p.numel() for p in gpt.parameters()) == (vocab + seq) * hidden + blocks * per_block + 2 * hidden
    assert len(gpt.blocks) == blocks and gpt.blocks[0].attn.n_heads == 32
    (input_ids,), target = example.batch(2, 0)
    assert input_ids.shape == target.shape == (2, seq) and int(input_ids.max()) < vocab


def test_the_fp16_slowdown_is_the_catalog_peak_ratio_to_the_a100() -> None:
    catalog = load_catalog()
    assert vs_metis.fp16_slowdown("T4") == pytest.approx(catalog["A100-80GB"].peak("fp16") / catalog["T4"].peak("fp16"))
    assert vs_metis.fp16_slowdown("T4") == pytest.approx(312 / 65)
    assert vs_metis.fp16_slowdown("V100-16GB") == pytest.approx(312 / 125)
    assert vs_metis.fp16_slowdown("A100-80GB") == 1.0


def test_a_scaled_profile_stretches_per_device_times_only() -> None:
    a100 = a100_profile()
    t4 = vs_metis.scaled_profile(a100, 4.8)
    assert t4["execution_time"]["layer_compute_total_ms"] == pytest.approx([4.8, 38.4, 9.6])
    assert t4["execution_time"]["forward_backward_time_ms"] == pytest.approx(57.6)
    # read from one file for all devices by Metis, so kept: optimizer, batch generator; and the same memory
    for key in ("optimizer_time_ms", "batch_generator_time_ms", "total_time_ms"):
        assert t4["execution_time"][key] == a100["execution_time"][key]
    assert t4["execution_memory"] == a100["execution_memory"] and t4["model"] == a100["model"]
    assert a100 == a100_profile()   # the A100 original untouched


@pytest.mark.parametrize("name", list(vs_metis.CASES))
def test_the_checked_in_cluster_specs_are_the_generated_ones(name: str) -> None:
    path = vs_metis.CLUSTERS / f"{name}.yaml"
    assert path.read_text() == vs_metis.cluster_yaml(name), "run benchmarks/vs_metis.py --write-clusters"
    spec = load_cluster(path)
    assert spec.num_devices == int(name.split("-")[1])
    assert all(g.per_node == vs_metis.GPUS_PER_NODE for g in spec.nodes)


def test_metis_is_told_the_nodes_devices_memory_and_links_of_the_spec() -> None:
    spec = load_cluster(vs_metis.CLUSTERS / "metis-32.yaml")
    hosts = vs_metis.metis_hostfile(spec).splitlines()
    assert hosts == [f"node{i:03d} slots=4" for i in range(8)]
    info = vs_metis.metis_clusterfile(spec)
    assert list(info) == [h.split()[0] for h in hosts]
    assert [n["instance_type"] for n in info.values()] == ["T4"] * 2 + ["V100"] * 2 + ["A100"] * 4
    assert [n["memory"] for n in info.values()] == [16] * 4 + [80] * 4
    assert info["node000"]["intra_bandwidth"] == pytest.approx(15.75e9 / BYTES_PER_MIB)    # pcie3
    assert info["node002"]["intra_bandwidth"] == pytest.approx(150e9 / BYTES_PER_MIB)      # nvlink2
    assert info["node007"]["intra_bandwidth"] == pytest.approx(300e9 / BYTES_PER_MIB)      # nvlink3
    assert [n["inter_bandwidth"] for n in info.values()] == pytest.approx([100e9 / 8 / BYTES_PER_MIB] * 8)


def test_the_metis_home_holds_a100_profiles_and_scaled_ones_for_the_other_types(tmp_path: Path) -> None:
    checkout = vs_metis.metis_checkout(fake_checkout(tmp_path / "metis"))
    home = tmp_path / "home"
    vs_metis.write_metis_inputs(checkout, load_cluster(vs_metis.CLUSTERS / "metis-16.yaml"), home)
    assert sorted(p.name for p in (home / "profile").iterdir()) == ["DeviceType.A100_tp1_bs1.json",
                                                                     "DeviceType.T4_tp1_bs1.json"]
    t4 = json.loads((home / "profile" / "DeviceType.T4_tp1_bs1.json").read_text())
    assert t4["execution_time"]["layer_compute_total_ms"] == pytest.approx([312 / 65 * t for t in (1.0, 8.0, 2.0)])
    assert json.loads((home / "profile" / "DeviceType.A100_tp1_bs1.json").read_text()) == a100_profile()
    assert (home / "hostfile").read_text().count("slots=4") == 4 and (home / "logs").is_dir()
    command = vs_metis.metis_command(checkout, home)
    assert command[1] == str(checkout.root / "cost_het_cluster.py")
    assert "--max_profiled_tp_degree=1" in command and "--gbs=128" in command


def test_metis_best_plan_is_read_from_its_ranked_table() -> None:
    log = ("len(costs): 7\n"
           "rank, cost, node_sequence, device_groups, strategies(dp_deg, tp_deg), batches(number of batch), "
           "layer_partition\n"
           "1, 812.5, (<DeviceType.T4: 't4'>, <DeviceType.A100: 'a100'>), [4, 12], [(2, 2), (12, 1)], 8, [0, 2, 10]\n"
           "2, 900.0, (<DeviceType.A100: 'a100'>, <DeviceType.T4: 't4'>), [16], [(16, 1)], 8, [0, 10]\n")
    choice = vs_metis.metis_choice(log)
    assert choice == {"cost": 812.5, "node_sequence": ["T4", "A100"], "device_groups": [4, 12],
                      "strategies": [[2, 2], [12, 1]], "stages": 2, "micro_batches": 8,
                      "layer_partition": [0, 2, 10], "plans_costed": 7}
    assert "2 stages (dp x tp) 2x2 | 12x1 on T4>A100, 8 mb" == vs_metis.describe_metis(choice)
    with pytest.raises(RuntimeError, match="no ranked plan"):
        vs_metis.metis_choice("Traceback (most recent call last):\n")


def test_a_folder_that_is_not_a_metis_checkout_is_one_line_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(OptionError) as caught:
        vs_metis.metis_checkout(tmp_path)
    line = caught.value.one_line()
    assert line.startswith(f"{tmp_path}: --metis: is not a Metis checkout: it has no cost_het_cluster.py"), line
    assert "(fix: " in line
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "vs_metis.py"), "--metis", str(tmp_path)],
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [line]


def test_a_checkout_without_the_a100_samples_is_refused(tmp_path: Path) -> None:
    root = fake_checkout(tmp_path)
    (root / "profile_data_samples" / "DeviceType.A100_tp1_bs1.json").unlink()
    with pytest.raises(OptionError, match="DeviceType.A100_tp1_bs1.json"):
        vs_metis.metis_checkout(root)


@pytest.mark.skipif(not os.environ.get("METIS_DIR"), reason="set METIS_DIR to a checkout of SamsungLabs/Metis")
def test_metis_plans_the_16_gpu_case_from_the_written_inputs(tmp_path: Path) -> None:
    checkout = vs_metis.metis_checkout(Path(os.environ["METIS_DIR"]))
    run = vs_metis.run_metis(checkout, load_cluster(vs_metis.CLUSTERS / "metis-16.yaml"), tmp_path)
    choice = run["choice"]
    assert sum(choice["device_groups"]) == 16 and sorted(choice["node_sequence"]) == ["A100", "T4"]
    assert all(g == dp * tp for g, (dp, tp) in zip(choice["device_groups"], choice["strategies"]))
    assert run["wall_s"] > 0 and choice["plans_costed"] >= 1
