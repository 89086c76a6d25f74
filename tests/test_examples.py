"""The bundled example models keep the model-file contract the planner relies on.

Each ``examples/<name>/model.py`` provides ``model()``, ``batch(batch_size, step)`` and
``loss_fn(output, target)``; see the module docstrings for the contract itself.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import Tensor, nn

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
RUNNABLE = ["gpt", "mlp", "resnet", "hf_llama"]  # small enough to run on CPU
TRAINABLE = ["gpt", "mlp", "resnet"]
NEEDS_TRANSFORMERS = {"hf_llama", "llama7b", "llama70b"}
LLAMA_PARAM_COUNTS = {"llama7b": 6_738_415_616, "llama70b": 68_976_648_192}
SMALL_SEQ_LEN = 128


def _load_fresh(name: str) -> ModuleType:
    if name in NEEDS_TRANSFORMERS:
        pytest.importorskip("transformers")
    path = EXAMPLES_DIR / name / "model.py"
    spec = importlib.util.spec_from_file_location(f"hetplan_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _load(name: str) -> ModuleType:
    return _load_fresh(name)


def _seeded_model(example: ModuleType, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return example.model()


def _rows(inputs: tuple[Tensor, ...], start: int, stop: int) -> tuple[Tensor, ...]:
    return tuple(t[start:stop] for t in inputs)


def _assert_all_meta(module: nn.Module) -> None:
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        assert tensor.is_meta, f"{name} has real storage on {tensor.device}"


def _export_on_meta(
    example: ModuleType, inputs: tuple[Tensor, ...], **config: object
) -> torch.export.ExportedProgram:
    with torch.device("meta"):
        module = example.model(**config)
    _assert_all_meta(module)
    meta_inputs = tuple(t.to("meta") for t in inputs)
    program = torch.export.export(module, meta_inputs, strict=False)
    for name, tensor in [*program.state_dict.items(), *program.constants.items()]:
        assert not isinstance(tensor, Tensor) or tensor.is_meta, f"{name} has real storage"
    return program


def _output_shape(program: torch.export.ExportedProgram) -> torch.Size:
    (output_node,) = [n for n in program.graph.nodes if n.op == "output"]
    (logits,) = output_node.args[0]
    return logits.meta["val"].shape


@pytest.mark.parametrize("name", RUNNABLE)
def test_exports_on_meta_without_storage(name: str) -> None:
    example = _load(name)
    inputs, target = example.batch(2, 0)
    program = _export_on_meta(example, inputs)
    assert _output_shape(program)[0] == 2
    assert _output_shape(program)[: target.dim()] == target.shape


@pytest.mark.parametrize("name", RUNNABLE)
def test_seeded_build_is_deterministic(name: str) -> None:
    example = _load(name)
    first = _seeded_model(example, seed=3).state_dict()
    second = _seeded_model(example, seed=3).state_dict()
    other = _seeded_model(example, seed=4).state_dict()
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key
    assert any(not torch.equal(first[k], other[k]) for k in first if first[k].is_floating_point())


@pytest.mark.parametrize("name", [*RUNNABLE, "llama70b"])
def test_batch_rows_are_independent_of_batch_size(name: str) -> None:
    example = _load(name)
    rng_before = torch.get_rng_state()
    small_inputs, small_target = example.batch(2, 3)
    large_inputs, large_target = example.batch(5, 3)
    assert torch.equal(torch.get_rng_state(), rng_before), "batch() must not use the global RNG"
    for small, large in zip(small_inputs, large_inputs, strict=True):
        assert torch.equal(small, large[:2])
    assert torch.equal(small_target, large_target[:2])
    again_inputs, _ = example.batch(2, 3)
    next_inputs, _ = example.batch(2, 4)
    assert torch.equal(again_inputs[0], small_inputs[0])
    assert not torch.equal(next_inputs[0], small_inputs[0])


@pytest.mark.parametrize("name", RUNNABLE)
def test_loss_is_the_mean_over_rows(name: str) -> None:
    example = _load(name)
    module = _seeded_model(example)
    inputs, target = example.batch(5, 1)
    with torch.no_grad():
        output = module(*inputs)
        whole = example.loss_fn(output, target)
        head = example.loss_fn(module(*_rows(inputs, 0, 2)), target[:2])
        tail = example.loss_fn(module(*_rows(inputs, 2, 5)), target[2:])
    assert whole.dim() == 0
    torch.testing.assert_close(whole, (2 * head + 3 * tail) / 5, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", TRAINABLE)
def test_a_few_adam_steps_reduce_the_loss(name: str) -> None:
    example = _load(name)
    module = _seeded_model(example)
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    inputs, target = example.batch(16, 0)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = example.loss_fn(module(*inputs), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.95 * losses[0], losses


@pytest.mark.parametrize("name", RUNNABLE)
def test_exported_module_matches_eager(name: str) -> None:
    example = _load(name)
    module = _seeded_model(example)
    inputs, _ = example.batch(3, 2)
    program = torch.export.export(module, inputs, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(*inputs), module(*inputs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama7b", "llama70b"])
def test_real_llama_configs_trace_on_meta(name: str) -> None:
    example = _load(name)
    started_s = time.perf_counter()
    inputs, target = example.batch(1, 0, seq_len=SMALL_SEQ_LEN)
    program = _export_on_meta(example, inputs)
    assert _output_shape(program) == (1, SMALL_SEQ_LEN, example.CONFIG["vocab_size"])
    assert target.shape == (1, SMALL_SEQ_LEN)
    n_params = sum(t.numel() for t in program.state_dict.values() if isinstance(t, nn.Parameter))
    assert n_params == LLAMA_PARAM_COUNTS[name]
    assert time.perf_counter() - started_s < 120


@pytest.mark.parametrize("name", ["llama7b", "llama70b"])
def test_real_llama_configs_plan_from_a_few_traced_layers(name: str) -> None:
    """The planner's trace exports the first decoder layers and replicates the rest: every parameter is there."""
    from planner import frontend
    from planner.frontend.repeated import HEAD, REPLICATED_KEY, Replicated

    example = _load(name)
    with torch.device("meta"):
        module = example.model()
    inputs, _ = example.batch(1, 0, seq_len=SMALL_SEQ_LEN)
    started_s = time.perf_counter()
    gm = frontend.trace(module, tuple(t.to("meta") for t in inputs), replicate_repeated=True)
    layers = example.CONFIG["num_hidden_layers"]
    assert gm.meta[REPLICATED_KEY] == (Replicated("lm.model.layers", layers, HEAD),)
    assert sum(p.numel() for p in gm.parameters()) == LLAMA_PARAM_COUNTS[name]
    _assert_all_meta(gm)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    assert output.args[0][0].meta["val"].shape == (1, SMALL_SEQ_LEN, example.CONFIG["vocab_size"])
    assert time.perf_counter() - started_s < 60


def test_llama70b_seq_len_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HETPLAN_SEQ_LEN", raising=False)
    assert _load_fresh("llama70b").SEQ_LEN == 4096
    monkeypatch.setenv("HETPLAN_SEQ_LEN", str(SMALL_SEQ_LEN))
    example = _load_fresh("llama70b")
    inputs, target = example.batch(2, 0)
    assert example.SEQ_LEN == SMALL_SEQ_LEN
    assert inputs[0].shape == target.shape == (2, SMALL_SEQ_LEN)


def test_llama70b_default_batch_is_cheap() -> None:
    example = _load("llama70b")
    started_s = time.perf_counter()
    inputs, _ = example.batch(8, 0)
    assert inputs[0].shape == (8, example.SEQ_LEN)
    assert time.perf_counter() - started_s < 1.0
