"""Gradient and activation compression end to end: policy -> cost model -> plan -> emitted program
on gloo processes; the bytes the program measures equal the cost model's figures.

The multi-process runs plan the example GPT on cpu-hetero-4 (4 CPU ranks) with a forced
compressor, run a few steps with `plan run` (collective timeout 60 s, processes in their own
session) and read the metrics lines: `grad_wire_bytes_by_group` (measured by the compressors'
counters) per group against `costmodel.compression` on the group's parameter shapes, and
`p2p_bytes` against the activation compressor's wire bytes.
"""

from __future__ import annotations

import math

import pytest
import torch

from backends.torchdist.program.gradsync import group_payload_bytes
from backends.torchdist.reference import train_reference
from costmodel import activation_compression as activation_costs
from costmodel import compression as costs
from planner import frontend
from planner.api import PlanOptions, plan
from planner.core.cluster import Link
from planner.core.errors import OptionError
from planner.core.ir import Plan
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli, run_program

GPT = EXAMPLES / "gpt" / "model.py"
CPU4 = CLUSTERS / "cpu-hetero-4.yaml"
STEPS = costs.POWERSGD_START_ITER + 2      # PowerSGD: vanilla steps, then two compressed ones
LOSS_RTOL = 2e-2                           # a few compressed steps stay close to exact training
A100_BANDWIDTH = 1555e9 * 0.8
LAUNCH_S = 8e-6                            # costmodel.constants.GPU_OP_OVERHEAD_S
NVLINK = Link("nvlink3", 300e9, 2e-6)
TCP_10G = Link("tcp", 1.25e9, 50e-6)


def _shapes() -> dict[str, tuple[int, ...]]:
    module = frontend.build_on_meta(frontend.load_model_file(GPT))
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def _plan(tmp_path, compression: str, *extra: str) -> tuple:
    out = tmp_path / "out"
    proc = run_plan_cli(str(GPT), "--cluster", str(CPU4), "--global-batch", "16", "--use-all-devices",
                        "--compression", compression, "-o", str(out), *extra)
    assert proc.returncode == 0, proc.stderr
    return out, Plan.load(out)


def _torch_kernels(monkeypatch) -> None:
    """Programs use the torch references of the kernels (tests/test_compression.py sets
    TRITON_INTERPRET=1 in this process; interpreted kernels are exact but slow, and tested there)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _optimizer(compressor: str) -> str:
    """1-bit compression of gradients is the SGD path; under AdamW (the default) a `onebit` group
    trains with 1-bit Adam, whose warm-up and momentum exchange tests/test_onebit_adam_e2e.py checks."""
    return "sgd" if compressor == "onebit" else "adamw"


def _check_run(plan_: Plan, metrics: list[dict], compressor: str) -> None:
    """Wire bytes per group per rank and step = cost model; losses agree across ranks and with exact."""
    shapes = _shapes()
    ref = train_reference(str(GPT), global_batch=plan_.global_batch, steps=STEPS, seed=1,
                          optimizer=_optimizer(compressor))
    for m in metrics:
        mine = [g for g in plan_.grad_groups if m["rank"] in g.ranks]
        assert sorted(m["grad_wire_bytes_by_group"]) == sorted(str(g.index) for g in mine)
        for g in mine:
            vanilla = compressor == "powersgd" and m["step"] < costs.POWERSGD_START_ITER
            expected = g.nbytes if vanilla else group_payload_bytes(g, shapes)
            assert m["grad_wire_bytes_by_group"][str(g.index)] == expected, (m["rank"], m["step"], g.index)
        assert m["grad_wire_bytes"] == sum(m["grad_wire_bytes_by_group"].values())
    for step in range(STEPS):
        losses = {m["loss"] for m in metrics if m["step"] == step}
        assert len(losses) == 1, (step, losses)
        assert losses.pop() == pytest.approx(ref.losses[step], rel=LOSS_RTOL)


def _replicas_agree(out, plan_: Plan) -> None:
    """Every compressor returns the same result on every rank: replicas stay bit-identical."""
    finals = [torch.load(out / "run" / "final" / f"rank{r}.pt") for r in range(plan_.world_size)]
    for g in plan_.grad_groups:
        for name in g.params:
            first = finals[g.ranks[0]][name]
            assert all(torch.equal(finals[r][name], first) for r in g.ranks[1:]), name


@pytest.mark.slow
@pytest.mark.parametrize("compressor", ["fp16", "powersgd", "onebit"])
def test_forced_gradient_compressor_runs_and_measured_bytes_match_the_cost_model(tmp_path, monkeypatch,
                                                                                compressor):
    _torch_kernels(monkeypatch)
    out, plan_ = _plan(tmp_path, compressor, "--stages", "1")
    assert plan_.grad_groups and {g.compressor for g in plan_.grad_groups} == {compressor}
    assert {g.algorithm for g in plan_.grad_groups} == {"allgather" if compressor == "onebit" else "ring"}
    metrics = run_program(out, STEPS, seed=1, optimizer=_optimizer(compressor))
    _check_run(plan_, metrics, compressor)
    _replicas_agree(out, plan_)
    saving = {"fp16": 2.0, "powersgd": 8.0, "onebit": 30.0}[compressor]
    last = [m for m in metrics if m["step"] == STEPS - 1]
    assert all(m["grad_bytes"] >= saving * m["grad_wire_bytes"] for m in last)


@pytest.mark.slow
def test_two_stages_onebit_gradients_and_int8_activations(tmp_path, monkeypatch):
    _torch_kernels(monkeypatch)
    out, plan_ = _plan(tmp_path, "onebit", "--stages", "2", "--micro-batch", "2",
                       "--activation-compression", "int8")
    assert {e.compressor for e in plan_.p2p} == {"int8"} and len(plan_.p2p) == 2
    metrics = run_program(out, STEPS, seed=1, optimizer=_optimizer("onebit"))
    _check_run(plan_, metrics, "onebit")
    _replicas_agree(out, plan_)
    for edge in plan_.p2p:   # activations forward from src, their gradients back from dst: int8 both ways
        micro = plan_.replicas[edge.replica].micro_batch_sizes
        expected = sum(activation_costs.activation_wire_bytes("int8", edge.bytes_per_sample * m, costs.FP32_BYTES)
                       for m in micro)
        for rank in (edge.src_rank, edge.dst_rank):
            sent = {m["p2p_bytes"] for m in metrics if m["rank"] == rank}
            assert sent == {expected}, (rank, sent, expected)


# ----------------------------------------------------------------------------- planner and cost model

def test_policy_none_is_exact_auto_compresses_where_it_pays():
    none = plan(GPT, CPU4, PlanOptions(global_batch=16, stages=1, use_all_devices=True))
    auto = plan(GPT, CPU4, PlanOptions(global_batch=16, stages=1, use_all_devices=True, compression="auto"))
    assert {g.compressor for g in none.plan.grad_groups} == {"none"}
    chosen = {g.compressor for g in auto.plan.grad_groups}
    assert chosen and "none" not in chosen             # a 10 Gbit/s loopback network: compression pays
    assert auto.plan.estimates.sync_s < none.plan.estimates.sync_s
    assert dict(auto.plan.inputs.options)["compression"] == "auto"


def test_bad_policy_is_an_option_error():
    proc = run_plan_cli(str(GPT), "--cluster", str(CPU4), "--compression", "topk")
    assert proc.returncode == 2 and "--compression" in proc.stderr
    with pytest.raises(OptionError, match="unknown activation-compression 'int4'"):
        plan(GPT, CPU4, PlanOptions(activation_compression="int4"))


def test_auto_keeps_nvlink_uncompressed_and_compresses_a_slow_network():
    volume = costs.GradVolume(4.0 * 4096 * 4096, ((4096, 4096),))
    options = costs.candidates("auto", volume)
    assert costs.best_gradient(options, 8, NVLINK, A100_BANDWIDTH, LAUNCH_S).name == "none"
    assert costs.best_gradient(options, 8, TCP_10G, A100_BANDWIDTH, LAUNCH_S).name != "none"
    assert costs.best_gradient(options, 1, TCP_10G, A100_BANDWIDTH, LAUNCH_S).time_s == 0.0   # one rank: no sync


def test_payload_formulas():
    n = 1000
    vector = costs.GradVolume(4.0 * n, ((n,),))
    assert costs.compress_volume("none", vector).payload_bytes == 4 * n
    assert costs.compress_volume("fp16", vector).payload_bytes == 2 * n
    assert costs.compress_volume("onebit", vector).payload_bytes == math.ceil(n / 8) + 4
    assert costs.compress_volume("onebit", vector).state_bytes == 2 * 4 * n     # worker + server error
    matrix = costs.GradVolume(4.0 * 256 * 64, ((256, 64), (64,)))
    r = costs.POWERSGD_RANK
    psgd = costs.compress_volume("powersgd", matrix)
    assert psgd.payload_bytes == 4 * (64 + (256 + 64) * r)
    assert psgd.state_bytes == 4 * (256 * 64 + 64 + (256 + 64) * r)             # error feedback + P, Q
    # forced PowerSGD on vectors only does not apply: the group stays uncompressed
    assert [v.name for v in costs.candidates("powersgd", vector)] == ["none"]


def test_buckets_and_activation_choices():
    assert costs.bucket_ranges([3, 3, 3, 10, 1], cap_elems=6) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert costs.bucket_ranges([], cap_elems=6) == []
    # casts do not apply to 2-byte activations; int8 does
    assert activation_costs.choose_activation("fp16", 1e6, 2, TCP_10G, A100_BANDWIDTH, LAUNCH_S).name == "none"
    assert activation_costs.choose_activation("int8", 1e6, 2, TCP_10G, A100_BANDWIDTH, LAUNCH_S).name == "int8"
    assert activation_costs.activation_wire_bytes("int8", 4.0 * 512, 4) == 512 + 2 * 4
    assert activation_costs.choose_activation("auto", 1e6, 4, NVLINK, A100_BANDWIDTH, LAUNCH_S).name == "none"
