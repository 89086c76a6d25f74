"""The collectives fidelity benchmark (benchmarks/fidelity_collectives.py) on its smallest case: 2 gloo
processes run the TP=2 rewrite of examples/gpt and a ZeRO-1 step, and the collectives they issue are
the cost model's, call for call and byte for byte (times are measured, never asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import fidelity_collectives as fc

WORLD = 2
ROWS = 2
WIDTH = 64                      # 8 tensors of 64 x 64 fp32: 128 KiB, 64 KiB received per rank
GPT_PAIRS = 8                   # attention and MLP of 4 layers
GPT_ALLREDUCE_BYTES_PER_SAMPLE = 8 * 32 * 64 * 4     # one (seq, d_model) fp32 activation per pair, each way
SETTINGS = {"steps": 1, "fit_repeats": 1, "tp_models": ["gpt"], "tp_rows": [ROWS], "zero_widths": [WIDTH]}


def test_ring_fit_recovers_the_ring_model():
    latency_s, bandwidth = 1e-4, 5e8
    samples = [(b, 2 * (4 - 1) * latency_s + 2 * (4 - 1) / 4 * b / bandwidth) for b in (4, 1 << 16, 1 << 20)]
    fit = fc.fit_ring(4, samples)
    assert fit.latency_s == pytest.approx(latency_s, rel=1e-6)
    assert fit.bandwidth_bytes_s == pytest.approx(bandwidth, rel=1e-6)


@pytest.mark.slow
def test_tp2_and_zero2_collectives_are_the_cost_models(tmp_path: Path, monkeypatch, capsys):
    """One spawn of 2 ranks serves every check (its imports are most of its time; one test, so that
    pytest-xdist's workers do not each spawn it)."""
    measured = fc.measure(WORLD, SETTINGS)
    fit = fc.fit_ring(WORLD, [(int(b), s) for b, s in measured[0]["fit"]])
    assert fit.latency_s >= 0 and fit.bandwidth_bytes_s > 0

    (tp,) = fc.tp_rows(WORLD, measured, fc.Links(fit))
    # per pair: the row linears' output forward, the region input's gradient backward
    assert tp.calls_measured == tp.calls_model == 2 * GPT_PAIRS
    assert tp.bytes_measured == tp.bytes_model == 2 * ROWS * GPT_ALLREDUCE_BYTES_PER_SAMPLE
    for rank in measured:
        step = rank["tp"][0]["steps"][0]
        assert step["fwd"]["calls"] == step["bwd"]["calls"] == GPT_PAIRS
        assert len(step["fwd"]["call_seconds"]) == GPT_PAIRS
    assert tp.measured_s >= tp.measured_least_waiting_s > 0 and tp.model_fit_s > 0 and tp.replayed_s > 0
    assert all(len(rank["tp"][0]["replay_s"]) == SETTINGS["steps"] for rank in measured)

    (zero,) = fc.zero_rows(WORLD, measured, fc.Links(fit))
    param_bytes = fc.ZERO_TENSORS * WIDTH * WIDTH * 4
    assert zero.param_bytes == param_bytes
    assert zero.broadcasts_measured == zero.broadcasts_model == fc.ZERO_TENSORS     # one per parameter
    assert zero.received_bytes_measured == zero.received_bytes_model == param_bytes // 2
    for rank in measured:
        assert rank["zero"][0]["steps"][0]["received_bytes"] == param_bytes // 2  # every rank alike

    monkeypatch.setattr(fc, "measure", lambda world, settings: measured)      # the run above, not another
    out = tmp_path / "fidelity_collectives.json"
    assert fc.main(["--worlds", str(WORLD), "--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["tp"][0]["calls_measured"] == 2 * GPT_PAIRS and doc["zero"][0]["broadcasts_model"] == 8
    assert "TP all-reduce per step" in capsys.readouterr().out
