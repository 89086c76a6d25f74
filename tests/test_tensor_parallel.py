"""Tensor parallelism as a graph rewrite (passes/tensor_parallel): regions found in the traced graphs of the
GPT, HF Llama (GQA, SwiGLU, rotary) and BERT examples, and the rewritten graph run on 2 gloo processes equal
to the unsharded graph on one, forward and backward (loss and every parameter's gradient)."""

from __future__ import annotations

import copy
import importlib.util
import socket
import time
from datetime import timedelta
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.multiprocessing as mp
import torch.nn as nn

from benchmarks.fidelity_collectives_ranks import install_values
from passes.split import split_stages
from passes.tensor_parallel import ShardSpec, find_regions, shard_tensor, unshard
from passes.tensor_parallel.costs import block_cost
from passes.tensor_parallel.rewrite import shard_graph
from planner import frontend
from planner.core.errors import PassError
from tests.helpers import EXAMPLES

ROWS = 4                  # batch rows of the runs
REL_TOL = 1e-5            # fp32: the sharded sums differ from the full ones by rounding only
NOISE_NORM = 1e-9         # BERT's key bias has gradient 0 exactly (softmax ignores it): its norm is ~1e-11 noise
SPAWN_TIMEOUT_S = 120
GQA = {"num_key_value_heads": 2}


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"tp_example_{name}", EXAMPLES / name / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trace(example: Any, config: dict[str, Any], rows: int = ROWS) -> fx.GraphModule:
    with torch.device("meta"):
        module = example.model(**config)
    inputs, _ = example.batch(rows, 0)
    return frontend.trace(module, tuple(i.to("meta") for i in inputs), replicate_repeated=True)


def _attr(gm: fx.GraphModule, target: str) -> torch.Tensor:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal within REL_TOL of `want`'s norm, or both at the rounding noise of an exactly-zero gradient."""
    return float((got - want).norm()) <= REL_TOL * float(want.norm()) + NOISE_NORM


# --- unit: regions found in the graph ---------------------------------------------------------------------


def test_gpt_regions_fused_qkv_interleaved_and_degrees():
    gm = _trace(_load("gpt"), {})
    layout = find_regions(gm)
    assert len(layout.regions) == 8                              # attention and MLP of each of 4 layers
    specs = layout.specs()
    assert specs["blocks.0.attn.qkv.weight"] == ShardSpec("blocks.0.attn.qkv.weight", 0, 3, (192, 64))
    assert specs["blocks.0.attn.proj.weight"].dim == 1 and "blocks.0.attn.proj.bias" not in specs
    assert specs["blocks.3.mlp.fc_in.bias"].dim == 0 and specs["blocks.3.mlp.fc_out.weight"].dim == 1
    assert not any("ln" in name or "embedding" in name for name in specs)   # norms, embeddings, tied head
    assert layout.degrees(8) == (1, 2, 4)                        # 4 heads
    assert [r.reason for r in layout.rejected] == ["reaches the graph's output"]   # the tied LM head only
    first = layout.regions[0]
    assert first.fwd_allreduce_elems_per_sample == 32 * 64 == first.bwd_allreduce_elems_per_sample


def test_llama_gqa_swiglu_regions():
    gm = _trace(_load("hf_llama"), GQA)
    layout = find_regions(gm)
    assert len(layout.regions) == 4
    attn, mlp = layout.regions[0], layout.regions[1]
    prefix = "lm.model.layers.0."
    assert {s.name for s in attn.params} == {prefix + f"self_attn.{p}_proj.weight" for p in "qkvo"}
    assert {s.name for s in mlp.params} == {prefix + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert len(attn.columns) == 3 and len(mlp.columns) == 2
    assert layout.degrees(8) == (1, 2)                           # 2 KV heads
    assert find_regions(_trace(_load("hf_llama"), {})).degrees(8) == (1, 2, 4)
    assert not any("norm" in n or "embed" in n or "lm_head" in n for n in layout.specs())


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_bert_regions_leave_the_mlm_head_replicated(attention):
    gm = _trace(_load("bert"), {"attn_implementation": attention})   # eager: matmul, softmax, matmul
    layout = find_regions(gm)
    assert len(layout.regions) == 4
    names = set(layout.specs())
    assert "mlm.bert.encoder.layer.1.attention.self.value.bias" in names
    assert not any("cls." in n or "layer_norm" in n or "embeddings" in n for n in names)
    assert layout.degrees(8) == (1, 2, 4)
    assert len(layout.rejected) == 2 and "layer_norm" in layout.rejected[0].reason   # MLM transform, decoder


class _NormInside(nn.Module):
    """A linear whose output is normalised over its features before the next linear: not separable."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x))) + self.down(torch.relu(self.up(x))).sum(-1, keepdim=True)


def test_a_flood_that_needs_the_whole_dim_stays_replicated():
    with torch.device("meta"):
        module = _NormInside()
    gm = frontend.trace(module, (torch.empty(2, 8, device="meta"),))
    layout = find_regions(gm)
    assert layout.regions == ()
    assert any("layer_norm" in r.reason for r in layout.rejected)
    assert any("sum" in r.reason for r in layout.rejected)
    assert any("tied weight" in r.reason for r in layout.rejected)      # `up` is called twice


class _FusedGateUp(nn.Module):
    """SwiGLU with gate and up fused in one linear, split in 2 (as some Llama ports write it)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up, self.down = nn.Linear(8, 2 * 12, bias=False), nn.Linear(12, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


def test_fused_gate_up_is_sharded_interleaved():
    with torch.device("meta"):
        module = _FusedGateUp()
    layout = find_regions(frontend.trace(module, (torch.empty(2, 8, device="meta"),)))
    assert layout.specs()["gate_up.weight"] == ShardSpec("gate_up.weight", 0, 2, (24, 8))
    assert layout.degrees(12) == (1, 2, 3, 4, 6, 12)


def test_shard_and_unshard_interleaved():
    full = torch.arange(12 * 2, dtype=torch.float32).reshape(12, 2)
    spec = ShardSpec("w", 0, 3, (12, 2))
    shards = [shard_tensor(full, spec, 2, r) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 2, 8, 10, 16, 18]          # first half of each of 3 blocks
    assert torch.equal(unshard(shards, spec), full)


def test_degree_that_does_not_divide_the_heads_is_refused():
    gm = _trace(_load("gpt"), {})
    with pytest.raises(PassError, match="degree 3"):
        shard_graph(gm, find_regions(gm), 3, 0, None)


def test_block_cost_of_a_gpt_layer():
    gm = _trace(_load("gpt"), {})
    layout = find_regions(gm)
    attn, mlp = layout.regions[0], layout.regions[1]
    layer = set(attn.nodes) | set(mlp.nodes) | {"layer_norm", "layer_norm_1"}
    cost = block_cost(gm, layout, layer)
    assert cost.sharded_param_bytes == 4 * (192 * 64 + 64 * 64 + 256 * 64 + 256 + 64 * 256)
    assert cost.replicated_param_bytes == 4 * (64 + 64 + 4 * 64)       # norms and the row biases
    assert cost.sharded_flop_fraction == 1.0
    assert cost.fwd_allreduce_bytes_per_sample == 2 * 32 * 64 * 4 == cost.bwd_allreduce_bytes_per_sample
    assert block_cost(gm, layout, {"layer_norm"}).sharded_flop_fraction == 0.0


def test_split_stages_on_the_rewritten_graph():
    gm = _trace(_load("gpt"), {})
    layout = find_regions(gm)
    cut = next(iter(next(n for n in gm.graph.nodes if n.name == layout.regions[1].rows[0]).users))   # residual add
    shard_graph(gm, layout, 2, 0, None)
    last = [n for n in gm.graph.nodes if n.op == "call_function"][-1].name
    split = split_stages(gm, [cut.name, last])
    assert split.values[cut.name].shape == (ROWS, 32, 64)              # a replicated activation crosses
    stage1 = split.stages[1].module
    assert tuple(_attr(stage1, "blocks__1__attn__qkv__weight").shape) == (96, 64)
    inputs = {name: torch.zeros(ROWS, 32, dtype=torch.long, device="meta") for name in split.model_inputs}
    out0 = split.stages[0].module(*[inputs.get(n) for n in split.stages[0].inputs])
    env = {**inputs, **dict(zip(split.stages[0].outputs, out0))}
    (logits,) = stage1(*[env[n] for n in split.stages[1].inputs])
    assert tuple(logits.shape) == (ROWS, 32, 256)


# --- 2 gloo processes: the sharded graph computes the unsharded one -----------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, models: list[tuple[str, dict[str, Any]]], port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    try:
        for name, config in models:
            try:
                _check_rank(rank, name, config)
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}") from exc
    finally:
        dist.destroy_process_group()


def _fused_example() -> Any:
    """_FusedGateUp under the model-file contract (model, batch, loss_fn), for the gloo runs."""
    def batch(rows: int, step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        return (torch.randn(rows, 5, 8, generator=generator),), torch.randn(rows, 5, 8, generator=generator)

    return SimpleNamespace(model=lambda: _FusedGateUp(), batch=batch, loss_fn=nn.functional.mse_loss)


def _check_rank(rank: int, name: str, config: dict[str, Any]) -> None:
    example = _fused_example() if name == "fused_gate_up" else _load(name)
    inputs, target = example.batch(ROWS, 0)
    torch.manual_seed(0)
    real = example.model(**config)
    values = {**dict(real.named_parameters(remove_duplicate=False)), **dict(real.named_buffers(remove_duplicate=False))}
    ref = _trace(example, config)
    tp = copy.deepcopy(ref)
    install_values(ref, values)
    loss_ref = example.loss_fn(ref(*inputs), target)
    assert _close(loss_ref.detach(), example.loss_fn(real(*inputs), target).detach())
    loss_ref.backward()

    install_values(tp, values)
    layout = find_regions(tp)
    assert layout.regions
    shard_graph(tp, layout, 2, rank, dist.new_group([0, 1]))
    loss = example.loss_fn(tp(*inputs), target)
    assert _close(loss.detach(), loss_ref.detach()), (float(loss), float(loss_ref))
    loss.backward()
    specs = layout.specs()
    targets = dict.fromkeys(str(n.target) for n in ref.graph.nodes if n.op == "get_attr")
    checked = 0
    for target_name in targets:
        want = _attr(ref, target_name)
        if not isinstance(want, nn.Parameter):
            continue
        got = _attr(tp, target_name).grad
        assert got is not None and want.grad is not None, target_name
        gathered = [torch.empty_like(got) for _ in range(2)]
        dist.all_gather(gathered, got.contiguous())
        if target_name in specs:
            got = unshard(gathered, specs[target_name])
        else:
            assert _close(gathered[0], gathered[1]), (target_name, "differs across the TP ranks")
        assert _close(got, want.grad), (target_name, _rel_err(got, want.grad))
        checked += 1
    assert checked >= len(specs)


def _spawn(models: list[tuple[str, dict[str, Any]]]) -> None:
    context = mp.start_processes(_worker, args=(models, _free_port()), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, f"the TP=2 runs did not finish in {SPAWN_TIMEOUT_S} s"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


@pytest.mark.slow
def test_tp2_forward_and_backward_equal_the_unsharded_graph():
    """GPT (fused qkv), HF Llama (GQA, SwiGLU, rotary), BERT and a fused gate_up: one pair of processes runs
    them in turn (their imports are most of a run's time)."""
    _spawn([("gpt", {}), ("hf_llama", GQA), ("bert", {}), ("fused_gate_up", {})])
