"""Compressors are decisions of the search, recorded with their runtime settings.

- Activations: each cut's transfer is priced in the split with the compressor the policy picks on
  it; the plan's edge records that compressor, and the simulator's transfer of the plan is the
  split's, so the plan's estimate and the search's objective describe the same program.
- Gradients: a group records the settings its compressor was priced with (bucket size, PowerSGD's
  rank, minimum rate and start, 1-bit Adam's warm-up); they round-trip through plan.json, and a
  compressor built from them runs them (a rank of 2 in the plan is the rank the hook uses, on gloo).
- Plans without compression carry none of these fields.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json

import pytest
import torch
import torch.distributed as dist

from backends.compression import FlatBucket, freeze_step, make_compressor
from backends.sim.inputs import from_plan
from costmodel import compression as costs
from planner.api import PlanOptions, plan
from planner.core.cluster import Link
from planner.core.ir import CompressorSettings, Plan
from planner.frontend.cluster import load_cluster
from planner.search import ilp
from planner.search.assemble import assemble
from planner.search.configs import build_configs
from planner.search.solver import SolverSettings
from tests.helpers import CLUSTERS, EXAMPLES, spawn_gloo_workers

GPT = EXAMPLES / "gpt" / "model.py"
CPU4 = CLUSTERS / "cpu-hetero-4.yaml"
ONE_GBIT = Link("ethernet-1g", 1.25e8, 2e-5)      # slow enough between the nodes for int8 to pay
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
SHAPES = ((64, 32), (32,))                        # one compressible matrix and a bias


def _four_stages(activation_compression: str):
    """GPT in one 4-stage pipeline over both nodes of cpu-hetero-4 joined by 1 Gbit/s."""
    spec = dataclasses.replace(load_cluster(CPU4), inter_node=ONE_GBIT)
    options = PlanOptions(global_batch=16, use_all_devices=True, stages=4, runners_up=False,
                          activation_compression=activation_compression)
    return plan(GPT, spec, options), options


@pytest.mark.parametrize("policy", ["int8", "auto"])
def test_each_edge_records_the_compressor_its_cut_was_priced_with(policy):
    result, options = _four_stages(policy)
    p, tables = result.plan, result.tables
    # the search's own configurations and solution, re-solved: assembly of them is the plan
    configs = build_configs(tables, options.stages, None)
    solution = ilp.solve(tables, configs, SolverSettings(work_limit_s=options.time_limit_s), use_all_devices=True)
    assert assemble(solution=solution, tables=tables, blocks=result.blocks, spec=result.cluster, inputs=p.inputs,
                    strategy="ilp") == p
    sim = from_plan(p, result.cluster)
    for replica, work in zip(p.replicas, sim.replicas):
        bounds = (*(st.first_block for st in replica.stages), replica.stages[-1].last_block + 1)
        (config,) = [c.config for c in solution.choices if c.config.split.bounds == bounds]
        edges = [e for e in p.p2p if e.replica == replica.index]
        assert tuple(e.compressor for e in edges) == config.split.send_compressors
        for e in edges:
            assert e.block_elems == (costs.INT8_BLOCK_ELEMS if e.compressor == "int8" else 0)
        full = [j for j, rows in enumerate(replica.micro_batch_sizes) if rows == config.micro_batch]
        for s, send_s in enumerate(config.split.send_s):   # the simulated transfer is the priced one
            for j in full:
                assert work.stages[s].send_fwd_s[j] == pytest.approx(send_s, rel=1e-12)
                assert work.stages[s + 1].send_bwd_s[j] == pytest.approx(send_s, rel=1e-12)
    names = {e.compressor for e in p.p2p}
    if policy == "int8":
        assert names == {"int8"}
    else:   # shared memory inside a node is faster than int8's kernels; 1 Gbit/s between them is not
        assert names == {"none", "int8"}


def test_gradient_groups_record_their_compressors_settings_and_they_round_trip():
    spec = load_cluster(CPU4)
    base = dict(global_batch=16, use_all_devices=True, stages=2, runners_up=False)
    p = plan(GPT, spec, PlanOptions(**base, compression="powersgd")).plan
    assert {g.compressor for g in p.grad_groups} == {"powersgd"}
    for g in p.grad_groups:
        assert g.settings == costs.settings_of("powersgd")
        assert (g.settings.rank, g.settings.start_iter, g.settings.min_compression_rate,
                g.settings.bucket_cap_bytes) == (costs.POWERSGD_RANK, costs.POWERSGD_START_ITER,
                                                 costs.POWERSGD_MIN_COMPRESSION_RATE, costs.GRAD_BUCKET_CAP_BYTES)
    data = json.loads(p.to_json())
    assert data["grad_groups"][0]["settings"] == {"bucket_cap_bytes": costs.GRAD_BUCKET_CAP_BYTES,
                                                  "rank": costs.POWERSGD_RANK,
                                                  "min_compression_rate": costs.POWERSGD_MIN_COMPRESSION_RATE,
                                                  "start_iter": costs.POWERSGD_START_ITER}
    edited = dataclasses.replace(p, grad_groups=tuple(
        dataclasses.replace(g, settings=dataclasses.replace(g.settings, rank=2)) for g in p.grad_groups))
    again = Plan.from_json(edited.to_json())
    assert again == edited and {g.settings.rank for g in again.grad_groups} == {2}
    # fp16 records its bucket size alone; no compression records nothing
    half = plan(GPT, spec, PlanOptions(**base, compression="fp16")).plan
    assert {g.settings for g in half.grad_groups} == {CompressorSettings(costs.GRAD_BUCKET_CAP_BYTES)}
    plain = plan(GPT, spec, PlanOptions(**base)).plan
    text = plain.to_json()
    assert '"settings"' not in text and '"block_elems"' not in text
    assert Plan.from_json(text) == plain


def test_onebit_adams_warm_up_comes_from_the_recorded_fraction():
    settings = costs.settings_of("onebit")
    assert settings is not None and settings.warmup_fraction == costs.ONEBIT_ADAM_WARMUP_FRACTION
    assert freeze_step(200, settings.warmup_fraction) == costs.onebit_adam_freeze_step(200) == 50
    assert freeze_step(200, 0.1) == 20 and freeze_step(3, 0.1) == 1
    with pytest.raises(ValueError):
        freeze_step(200, 0.0)


def test_settings_and_options_may_not_both_set_a_value():
    with pytest.raises(ValueError, match="rank"):
        make_compressor("powersgd", None, costs.settings_of("powersgd"), rank=1)
    with pytest.raises(ValueError, match="rank"):
        make_compressor("powersgd", None, CompressorSettings(costs.GRAD_BUCKET_CAP_BYTES))


def _powersgd_worker(rank: int, store_port: int, world_size: int, settings: CompressorSettings) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        compressor = make_compressor("powersgd", None, settings)
        assert compressor.state.matrix_approximation_rank == settings.rank
        n = sum(torch.Size(s).numel() for s in SHAPES)
        volume = costs.GradVolume(n * costs.FP32_BYTES, SHAPES)
        priced = costs.compress_volume("powersgd", volume, settings).payload_bytes
        for step in range(settings.start_iter + 2):
            grad = torch.randn(n, generator=torch.Generator().manual_seed(10 * step + rank))
            compressor.allreduce_mean_(FlatBucket(grad, SHAPES, index=0))
            expected = n * costs.FP32_BYTES if step < settings.start_iter else priced
            assert compressor.last_wire_bytes == expected, (step, compressor.last_wire_bytes, expected)
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


def test_a_recorded_powersgd_rank_is_the_rank_the_hook_runs():
    """Rank 2 from a plan file: P [64, 2] + Q [32, 2] + the bias on the wire, what the cost model
    prices for those settings (rank 4, the default, would put twice the factors there)."""
    recorded = dataclasses.replace(costs.settings_of("powersgd"), rank=2)
    settings = CompressorSettings(**json.loads(json.dumps(dataclasses.asdict(recorded))))
    rank2 = costs.compress_volume("powersgd", costs.GradVolume(0.0, SHAPES), settings).payload_bytes
    assert rank2 == ((64 + 32) * 2 + 32) * costs.FP32_BYTES
    assert rank2 < costs.compress_volume("powersgd", costs.GradVolume(0.0, SHAPES)).payload_bytes
    spawn_gloo_workers(_powersgd_worker, (2, settings), 2, deadline_s=120.0)
