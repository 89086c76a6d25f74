"""`plan` beside Metis' own planner (SamsungLabs/Metis), on Metis' GPT example, timed side by side.

    python benchmarks/vs_metis.py --metis ~/Metis            # median of 3 runs of each, per case
    python benchmarks/vs_metis.py --metis ~/Metis --quick    # one run of each
    python benchmarks/vs_metis.py --write-clusters           # regenerate benchmarks/clusters/metis-*.yaml

The model is Metis' "GPT 1.5B" of `scripts/cost_het_cluster.sh` (hidden 4096, 8 blocks = its 10
layers, sequence 1024, vocabulary 51,200, global batch 128), as the hetplan example
examples/gpt_metis/model.py. The cases are four clusters of 4-GPU nodes: 1 T4 + 3 A100 nodes (16 GPUs)
and T4 : V100 : A100 nodes 1 : 1 : 2 at 32, 64 and 256 GPUs, checked in as hetplan specs
(benchmarks/clusters/metis-*.yaml, written by `cluster_yaml`).

Metis is run from the user's checkout (`--metis DIR`; its licence is CC BY-NC, so nothing of it is
copied into this repository). Per case, in a temporary directory, this writes what Metis reads:
its hostfile and clusterfile (`metis_hostfile`, `metis_clusterfile`: the same nodes, device types,
memory and link bandwidths as the hetplan spec), and its profile folder: the A100 samples of
`profile_data_samples/` and, for the V100 and T4 it lacks, the A100 ones with every per-device compute
time scaled by the ratio of peak fp16 throughputs in hetplan's catalog (`scaled_profile`). Then it runs
the command Metis' script runs (`python cost_het_cluster.py --model_name=GPT ...`, output to a log,
as the script does) and `plan` (`python -m planner.cli ... -o DIR`), each as a whole subprocess,
interleaved (Metis, plan, Metis, plan, ...). Wall time and the child's CPU time (user + system) are
measured around each command; the table shows medians, the ratio plan / Metis (at most 1: `plan` is no
slower) and what each chose. Results go to benchmarks/results/vs_metis.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common

from costmodel.catalog import load_catalog
from planner.core.cluster import ClusterSpec
from planner.core.errors import HetplanError, OptionError
from planner.core.ir import Plan
from planner.core.units import BYTES_PER_GIB, BYTES_PER_MIB
from planner.frontend.cluster import load_cluster

CLUSTERS = common.REPO / "benchmarks" / "clusters"
MODEL = common.EXAMPLES / "gpt_metis" / "model.py"
GLOBAL_BATCH = 128                # GBS of Metis' example run (its README)
GPUS_PER_NODE = 4
# The GPT 1.5B arguments Metis' cost_het_cluster.sh passes (its NUM_LAYERS=10 counts embedding and head).
METIS_MODEL_ARGS = ("--model_name=GPT", "--model_size=1.5B", "--num_layers=10", f"--gbs={GLOBAL_BATCH}",
                    "--hidden_size=4096", "--sequence_length=1024", "--vocab_size=51200")
# Search-space knobs of the README's example run (MAX_PROFILED_* come from the profile samples found).
METIS_SEARCH_ARGS = ("--min_group_scale_variance=1", "--max_permute_len=4")
PROFILED_DEVICE = "A100-80GB"     # the device of Metis' profile_data_samples (both A100s: 312 TFLOP/s fp16)
PROFILE_SAMPLE = re.compile(r"DeviceType\.A100_tp(\d+)_bs(\d+)\.json")
METIS_FILES = ("cost_het_cluster.py", "arguments.py", "data_loader.py", "scripts/cost_het_cluster.sh")
# Per-device times Metis reads from a profile (data_loader.py); the model-level ones (optimizer, batch
# generator) it reads from whichever file it lists first, so they stay the A100's in every copy.
DEVICE_TIME_FIELDS = ("layer_compute_total_ms", "forward_backward_time_ms")
NETWORK = {"kind": "infiniband", "bandwidth_gbit_s": 100, "latency_us": 5}
# hetplan catalog device -> (Metis DeviceType name, intra-node link in hetplan's catalog)
NODE_TYPES = {"T4": ("T4", "pcie3"), "V100-16GB": ("V100", "nvlink2"), "A100-80GB": ("A100", "nvlink3")}
CASES: dict[str, tuple[tuple[str, int], ...]] = {   # name -> (device, nodes of 4) per node group
    "metis-16": (("T4", 1), ("A100-80GB", 3)),
    "metis-32": (("T4", 2), ("V100-16GB", 2), ("A100-80GB", 4)),
    "metis-64": (("T4", 4), ("V100-16GB", 4), ("A100-80GB", 8)),
    "metis-256": (("T4", 16), ("V100-16GB", 16), ("A100-80GB", 32)),
}
REPEATS, QUICK_REPEATS = 3, 1
COMMAND_TIMEOUT_S = 900


@dataclass(frozen=True)
class MetisCheckout:
    """A folder holding Metis' planner: its entry script and the A100 profiles, by (tp, batch size)."""

    root: Path
    samples: dict[tuple[int, int], Path]

    @property
    def max_tp(self) -> int:
        return max(tp for tp, _ in self.samples)

    @property
    def max_batch(self) -> int:
        return max(bs for _, bs in self.samples)


def metis_checkout(path: Path) -> MetisCheckout:
    """`path` as a Metis checkout; OptionError naming `--metis` and the missing file otherwise."""
    fix = "pass the folder of a clone of https://github.com/SamsungLabs/Metis"
    if not path.is_dir():
        raise OptionError("is not a directory", file=str(path), field="--metis", fix=fix)
    for name in METIS_FILES:
        if not (path / name).is_file():
            raise OptionError(f"is not a Metis checkout: it has no {name}", file=str(path), field="--metis", fix=fix)
    samples = {(int(m[1]), int(m[2])): f for f in sorted((path / "profile_data_samples").glob("*.json"))
               if (m := PROFILE_SAMPLE.fullmatch(f.name))}
    if (1, 1) not in samples:
        raise OptionError("is not a Metis checkout: profile_data_samples/ has no DeviceType.A100_tp1_bs1.json",
                          file=str(path), field="--metis", fix=fix)
    return MetisCheckout(path, samples)


def cluster_yaml(name: str) -> str:
    """The hetplan spec of case `name`: its node groups of 4 GPUs on one InfiniBand network."""
    lines = [f"# generated by benchmarks/vs_metis.py --write-clusters: a case of the Metis comparison, "
             f"{sum(n for _, n in CASES[name]) * GPUS_PER_NODE} GPUs", f"name: {name}", "nodes:"]
    for device, nodes in CASES[name]:
        metis_type, link = NODE_TYPES[device]
        lines.append(f"  - {{name: {metis_type.lower()}, count: {nodes}, device: {device}, "
                     f"per_node: {GPUS_PER_NODE}, intra_link: {link}}}")
    network = ", ".join(f"{k}: {v}" for k, v in NETWORK.items())
    return "\n".join([*lines, "network:", f"  inter_node: {{{network}}}"]) + "\n"


def metis_device_type(device: str) -> str:
    """Metis' DeviceType name (utils.py: A100, V100, P100, T4) of a hetplan catalog device."""
    name = device.split("-")[0].upper()
    if name not in {"A100", "V100", "P100", "T4"}:
        raise OptionError(f"Metis knows no device like {device!r}", field="device", fix="use A100, V100, P100 or T4")
    return name


def _node_names(spec: ClusterSpec) -> list[tuple[str, int]]:
    """(host name, node group position) of every node, in the spec's order."""
    out, index = [], 0
    for gi, group in enumerate(spec.nodes):
        for _ in range(group.count):
            out.append((f"node{index:03d}", gi))
            index += 1
    return out


def metis_hostfile(spec: ClusterSpec) -> str:
    """Metis' hostfile: one `HOST slots=N` line per node (utils.parse_hostfile reads one digit of N)."""
    return "".join(f"{host} slots={spec.nodes[gi].per_node}\n" for host, gi in _node_names(spec))


def metis_clusterfile(spec: ClusterSpec) -> dict[str, dict[str, Any]]:
    """Metis' clusterfile: per host its device type, memory (GiB) and bandwidths in MiB/s (its cost model
    multiplies them by 1024 * 1024 to get bytes/s), the spec's figures."""
    inter_mib_s = spec.inter_node.bandwidth_bytes_s / BYTES_PER_MIB
    return {host: {"instance_type": metis_device_type(spec.nodes[gi].device.name),
                   "inter_bandwidth": inter_mib_s,
                   "intra_bandwidth": spec.nodes[gi].intra_link.bandwidth_bytes_s / BYTES_PER_MIB,
                   "memory": int(spec.nodes[gi].device.memory_bytes // BYTES_PER_GIB)}
            for host, gi in _node_names(spec)}


def fp16_slowdown(device: str) -> float:
    """How many times longer `device` computes than the profiled A100: the ratio of fp16 peaks."""
    catalog = load_catalog()
    return catalog[PROFILED_DEVICE].peak("fp16") / catalog[device].peak("fp16")


def scaled_profile(a100: dict[str, Any], slowdown: float) -> dict[str, Any]:
    """An A100 profile of Metis with the per-device compute times (DEVICE_TIME_FIELDS) `slowdown` x longer;
    memory and the model-level fields unchanged (same model, same batch)."""
    out = json.loads(json.dumps(a100))
    times = out["execution_time"]
    for key in DEVICE_TIME_FIELDS:
        value = times[key]
        times[key] = [v * slowdown for v in value] if isinstance(value, list) else value * slowdown
    return out


def write_metis_inputs(checkout: MetisCheckout, spec: ClusterSpec, home: Path) -> None:
    """hostfile, clusterfile.json, profile/ (A100 samples + scaled copies for the spec's other types) and
    logs/ under `home`, as Metis' script expects them under HOME_DIR."""
    (home / "logs").mkdir(parents=True)
    (home / "profile").mkdir()
    (home / "hostfile").write_text(metis_hostfile(spec))
    (home / "clusterfile.json").write_text(json.dumps(metis_clusterfile(spec), indent=1))
    devices = {g.device.name: metis_device_type(g.device.name) for g in spec.nodes}
    for (tp, bs), sample in sorted(checkout.samples.items()):
        a100 = json.loads(sample.read_text())
        for device, metis_type in sorted(devices.items()):
            profile = a100 if metis_type == "A100" else scaled_profile(a100, fp16_slowdown(device))
            (home / "profile" / f"DeviceType.{metis_type}_tp{tp}_bs{bs}.json").write_text(json.dumps(profile))


def metis_command(checkout: MetisCheckout, home: Path) -> list[str]:
    """What scripts/cost_het_cluster.sh runs for the GPT 1.5B example with HOME_DIR=`home`."""
    return [sys.executable, str(checkout.root / "cost_het_cluster.py"), *METIS_MODEL_ARGS,
            f"--hostfile_path={home / 'hostfile'}", f"--clusterfile_path={home / 'clusterfile.json'}",
            f"--profile_data_path={home / 'profile'}", f"--max_profiled_tp_degree={checkout.max_tp}",
            f"--max_profiled_batch_size={checkout.max_batch}", *METIS_SEARCH_ARGS,
            f"--home_dir={home}", f"--log_path={home / 'logs'}"]


BEST_ROW = re.compile(r"^1, (?P<cost>\S+), \((?P<sequence>[^)]*)\), (?P<groups>\[[^\]]*\]), "
                      r"(?P<strategies>\[[^\]]*\]), (?P<batches>\d+), (?P<partition>\[[^\]]*\])$", re.M)


def metis_choice(log: str) -> dict[str, Any]:
    """Metis' best plan from its log (the first row of its ranked table): device-type order, GPUs per
    stage, (dp, tp) per stage, micro-batches, layer boundaries, its cost estimate."""
    count = re.search(r"^len\(costs\): (\d+)$", log, re.M)
    found = BEST_ROW.search(log)
    if found is None:
        raise RuntimeError(f"Metis printed no ranked plan; its log ends:\n{log[-2000:]}")
    strategies = ast.literal_eval(found["strategies"])
    return {"cost": float(found["cost"]), "node_sequence": re.findall(r"DeviceType\.(\w+)", found["sequence"]),
            "device_groups": ast.literal_eval(found["groups"]), "strategies": [list(s) for s in strategies],
            "stages": len(strategies), "micro_batches": int(found["batches"]),
            "layer_partition": ast.literal_eval(found["partition"]), "plans_costed": int(count[1]) if count else None}


def plan_choice(out: Path) -> dict[str, Any]:
    """What `plan` chose, from OUT/plan.json: its replicas, grouped by shape (stage device types, stage
    count, tensor-parallel degree, samples of the global batch each), and its own step estimate."""
    chosen = Plan.from_json((out / "plan.json").read_text(), str(out / "plan.json"))
    shapes: dict[tuple[str, int, int, int], int] = {}
    for r in chosen.replicas:
        types = "+".join(dict.fromkeys(s.device_type for s in r.stages))
        key = (types, len(r.stages), r.tp_degree, r.batch_share)
        shapes[key] = shapes.get(key, 0) + 1
    return {"replicas": len(chosen.replicas), "devices_used": chosen.world_size, "tp_degree": chosen.tp_degree,
            "shapes": [{"count": n, "device_types": t, "stages": st, "tp": tp, "batch_share": b}
                       for (t, st, tp, b), n in shapes.items()],
            "estimated_iteration_s": chosen.estimates.iteration_s}


def timed(command: list[str], log: Path) -> tuple[float, float, int]:
    """Run `command` (stdout and stderr to `log`); its wall seconds, CPU seconds (user + system) and exit code."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with log.open("w") as sink:
        code = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, cwd=common.REPO,
                              timeout=COMMAND_TIMEOUT_S).returncode
    wall_s = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall_s, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), code


def run_metis(checkout: MetisCheckout, spec: ClusterSpec, work: Path) -> dict[str, Any]:
    """One Metis run on `spec` in a fresh HOME_DIR under `work`."""
    home = Path(tempfile.mkdtemp(prefix="metis-", dir=work))
    write_metis_inputs(checkout, spec, home)
    log = home / "logs" / "GPT_1.5B.log"
    wall_s, cpu_s, code = timed(metis_command(checkout, home), log)
    if code != 0:
        raise RuntimeError(f"Metis failed on {spec.name} (exit {code}); its log ends:\n{log.read_text()[-2000:]}")
    return {"wall_s": wall_s, "cpu_s": cpu_s, "choice": metis_choice(log.read_text())}


def run_plan(cluster: Path, work: Path) -> dict[str, Any]:
    """One `plan` run (the CLI, a fresh process) of the GPT example on `cluster`, into a fresh OUT."""
    out = Path(tempfile.mkdtemp(prefix="plan-", dir=work)) / "out"
    log = out.with_name("plan.log")
    command = [sys.executable, "-m", "planner.cli", str(MODEL), "--cluster", str(cluster), "-o", str(out),
               "--global-batch", str(GLOBAL_BATCH)]
    wall_s, cpu_s, code = timed(command, log)
    if code != 0:
        raise RuntimeError(f"plan failed on {cluster.name} (exit {code}):\n{log.read_text()[-2000:]}")
    return {"wall_s": wall_s, "cpu_s": cpu_s, "choice": plan_choice(out)}


def summary(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats of one case, the ratio plan / Metis and the last run's choices."""
    med = {f"{tool}_{k}": statistics.median(r[tool][k] for r in runs) for tool in ("metis", "plan")
           for k in ("wall_s", "cpu_s")}
    return {"case": name, "gpus": load_cluster(CLUSTERS / f"{name}.yaml").num_devices, **med,
            "ratio_wall": med["plan_wall_s"] / med["metis_wall_s"], "ratio_cpu": med["plan_cpu_s"] / med["metis_cpu_s"],
            "plan_no_slower": med["plan_wall_s"] <= med["metis_wall_s"],
            "metis_choice": runs[-1]["metis"]["choice"], "plan_choice": runs[-1]["plan"]["choice"], "runs": runs}


def describe_metis(c: dict[str, Any]) -> str:
    """`2 stages (dp x tp) 4x2 | 8x1 on T4>A100, 16 mb`: Metis' stages in its device-type order."""
    stages = " | ".join(f"{dp}x{tp}" for dp, tp in c["strategies"])
    return f"{c['stages']} stages (dp x tp) {stages} on {'>'.join(c['node_sequence'])}, {c['micro_batches']} mb"


def describe_plan(c: dict[str, Any]) -> str:
    """`1x T4 4st tp1 5 + 3x A100-80GB 4st tp1 41`: replicas by shape (count, types, stages, tp, samples)."""
    return " + ".join(f"{s['count']}x {s['device_types']} {s['stages']}st tp{s['tp']} {s['batch_share']}"
                      for s in c["shapes"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metis", type=Path, help="a checkout of SamsungLabs/Metis (required to run)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REPEATS} run of each, not {REPEATS}")
    parser.add_argument("--write-clusters", action="store_true", help="write benchmarks/clusters/metis-*.yaml")
    args = parser.parse_args()
    if args.write_clusters:
        for name in CASES:
            (CLUSTERS / f"{name}.yaml").write_text(cluster_yaml(name))
        return 0
    if args.metis is None:
        parser.error("--metis DIR is required (a checkout of https://github.com/SamsungLabs/Metis)")
    try:
        checkout = metis_checkout(args.metis.expanduser().resolve())
    except HetplanError as exc:
        print(exc.one_line(), file=sys.stderr)
        return exc.exit_code
    repeats = QUICK_REPEATS if args.quick else REPEATS
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory(prefix="vs-metis-") as tmp:
        for repeat in range(repeats):
            for name in CASES:      # interleaved: Metis then plan, case by case, repeat by repeat
                cluster = CLUSTERS / f"{name}.yaml"
                metis = run_metis(checkout, load_cluster(cluster), Path(tmp))
                planned = run_plan(cluster, Path(tmp))
                runs[name].append({"repeat": repeat, "metis": metis, "plan": planned})
                print(f"  {name} run {repeat + 1}/{repeats}: Metis {metis['wall_s']:.2f} s, "
                      f"plan {planned['wall_s']:.2f} s", flush=True)
    results = [summary(name, r) for name, r in runs.items()]
    rows = [[s["case"], str(s["gpus"]), f"{s['metis_wall_s']:.2f}", f"{s['plan_wall_s']:.2f}",
             f"{s['ratio_wall']:.2f}", f"{s['metis_cpu_s']:.2f}", f"{s['plan_cpu_s']:.2f}",
             "yes" if s["plan_no_slower"] else "NO", describe_metis(s["metis_choice"]),
             describe_plan(s["plan_choice"])] for s in results]
    print()
    print(common.table(["case", "GPUs", "Metis s", "plan s", "plan/Metis", "Metis CPU s", "plan CPU s",
                        "plan <= Metis", "Metis chose", "plan chose (replicas x types, stages, tp, samples)"], rows))
    print(f"median of {repeats} interleaved run(s) of each whole command; wall clock and the child's CPU time")
    out = common.write_json("vs_metis", {
        "model": "gpt_metis", "global_batch": GLOBAL_BATCH, "repeats": repeats, "metis_dir": str(checkout.root),
        "machine": platform.platform(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
        "definition": "wall_s / cpu_s: one whole subprocess (Metis: cost_het_cluster.py as its script runs it; "
                      "plan: python -m planner.cli), medians over interleaved repeats; ratio = plan / Metis",
        "cases": results})
    print(f"\nwrote {out}")
    return 0 if all(s["plan_no_slower"] for s in results) else 1


if __name__ == "__main__":
    sys.exit(main())
