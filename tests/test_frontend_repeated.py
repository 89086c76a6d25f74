"""Tracing deep stacks of identical layers through a few of them (planner/repeated.py).

The replicated graph must equal the full torch.export graph node for node (names, targets, arguments,
shapes, module paths) and own the same parameters; every model the shortcut cannot prove right must
fall back to the full trace, and the model must come back unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import Tensor, nn

from planner import frontend
from planner.frontend import repeated
from planner.frontend.replicate import value_key
from tests.helpers import EXAMPLES

D = 16


def _describe(gm: fx.GraphModule) -> list[tuple[Any, ...]]:
    def name(a: fx.Node) -> str:
        return a.name

    return [(n.name, n.op, str(n.target), repr(fx.map_arg(n.args, name)), repr(fx.map_arg(n.kwargs, name)),
             value_key(n.meta.get("val")), repr(n.meta.get("nn_module_stack")))
            for n in gm.graph.nodes]


def _both(module: nn.Module, inputs: tuple[Tensor, ...]) -> tuple[fx.GraphModule, fx.GraphModule]:
    return frontend.trace(module, inputs), frontend.trace(module, inputs, replicate_repeated=True)


def _assert_same_graph(full: fx.GraphModule, fast: fx.GraphModule) -> None:
    assert _describe(fast) == _describe(full)
    assert {k: (v.shape, v.dtype, v.requires_grad) for k, v in fast.named_parameters()} == \
        {k: (v.shape, v.dtype, v.requires_grad) for k, v in full.named_parameters()}
    assert {k: v.shape for k, v in fast.named_buffers()} == {k: v.shape for k, v in full.named_buffers()}


class Layer(nn.Module):
    def __init__(self, index: int, reads_index: bool = False) -> None:
        super().__init__()
        self.index = index                   # differs per layer, like HF's layer_idx
        self.reads_index = reads_index
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x: Tensor, memory: Tensor | None = None) -> Tensor:
        y = self.fc(self.norm(x)).relu()
        if memory is not None:
            y = y * memory.mean()
        if self.reads_index and self.index == 6:
            y = y * 2
        return x + y


class KernelFunc(nn.Module):
    """A stateless module a layer holds in a plain attribute (not registered as a child)."""

    def __init__(self, flavour: int) -> None:
        super().__init__()
        self.flavour = flavour


class Toy(nn.Module):
    """Embedding, a stack of `n` layers with an op of the parent's between them, a head; `variant`
    adds what the shortcut must refuse."""

    def __init__(self, n: int = 8, variant: str = "") -> None:
        super().__init__()
        self.variant = variant
        self.embed = nn.Linear(4, D)
        self.layers = nn.ModuleList(Layer(i, reads_index=variant == "reads_index") for i in range(n))
        if variant == "alternating":
            for i, layer in enumerate(self.layers):
                layer.window = "local" if i % 2 else "global"
        if variant == "shared":
            for layer in self.layers:
                layer.fc = self.layers[0].fc
        # a per-layer module of kernel functions in a plain dict, as transformers 5 keeps: alike in every
        # layer, or differing in an attribute, or holding state of its own
        if variant in ("kernel_funcs", "kernel_funcs_differ", "kernel_funcs_stateful"):
            for i, layer in enumerate(self.layers):
                func = KernelFunc(i % 2 if variant == "kernel_funcs_differ" else 0)
                if variant == "kernel_funcs_stateful":
                    func.scale = nn.Parameter(torch.ones(()))
                layer._kernel_funcs = {"rotary": func}
        self.head = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        outputs = []
        for i, layer in enumerate(self.layers):
            if self.variant == "before_last" and i == len(self.layers) - 1:
                x = x * 3
            x = layer(x) * 0.5
            if self.variant == "parity" and i % 2:
                x = x + 1
            if self.variant == "after_last" and i == len(self.layers) - 1:
                x = x * 3
            outputs.append(x)
        if self.variant == "all_outputs":
            x = torch.stack(outputs).sum(0)
        if self.variant == "late_index":
            x = self.layers[6](x)
        if self.variant == "last_weight":
            x = x @ self.layers[-1].fc.weight
        return self.head(x)


class EncoderDecoder(nn.Module):
    """Two stacks; the second reads the first's output at every layer."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(Layer(i) for i in range(7))
        self.decoder = nn.ModuleList(Layer(i) for i in range(9))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.encoder:
            x = layer(x)
        memory, y = x, x.flip(1)
        for layer in self.decoder:
            y = layer(y, memory)
        return y


def _meta(module_fn: Any) -> nn.Module:
    with torch.device("meta"):
        return module_fn()


INPUTS = (torch.empty(2, 5, 4, device="meta"),)


def test_toy_stack_is_replicated_exactly() -> None:
    model = _meta(Toy)
    full, fast = _both(model, INPUTS)
    assert fast.meta[repeated.REPLICATED_KEY] == (repeated.Replicated("layers", 8, repeated.HEAD),)
    _assert_same_graph(full, fast)
    # the model comes back whole: every layer, original attribute values
    assert len(model.layers) == 8 and [type(layer.index) for layer in model.layers] == [int] * 8


def test_ops_after_the_last_layer_follow_the_copies() -> None:
    """`if i == len(layers) - 1` after the layer call: in the shortened trace it follows the last traced
    period, so it lands after the stack, where the full trace has it too."""
    model = _meta(lambda: Toy(variant="after_last"))
    full, fast = _both(model, INPUTS)
    assert fast.meta[repeated.REPLICATED_KEY] == (repeated.Replicated("layers", 8, repeated.HEAD),)
    _assert_same_graph(full, fast)


def test_two_stacks_are_replicated_exactly() -> None:
    model = _meta(EncoderDecoder)
    inputs = (torch.empty(2, 5, D, device="meta"),)
    full, fast = _both(model, inputs)
    assert fast.meta[repeated.REPLICATED_KEY] == (repeated.Replicated("encoder", 7, repeated.HEAD),
                                                  repeated.Replicated("decoder", 9, repeated.HEAD))
    _assert_same_graph(full, fast)


def test_gpt_example_is_replicated_exactly() -> None:
    model_file = frontend.load_model_file(EXAMPLES / "gpt" / "model.py")
    model = _meta(lambda: model_file.module.model(n_layers=10))
    inputs = frontend.to_device(frontend.example_batch(model_file, 2)[0], "meta")
    full, fast = _both(model, inputs)
    assert fast.meta[repeated.REPLICATED_KEY] == (repeated.Replicated("blocks", 10, repeated.HEAD),)
    _assert_same_graph(full, fast)


def test_hf_llama_is_replicated_exactly() -> None:
    pytest.importorskip("transformers")
    model_file = frontend.load_model_file(EXAMPLES / "hf_llama" / "model.py")
    model = _meta(lambda: model_file.module.model(num_hidden_layers=8))
    inputs = frontend.to_device(frontend.example_batch(model_file, 2)[0], "meta")
    full, fast = _both(model, inputs)
    # the layers differ in `layer_idx`, which forward never reads (use_cache=False)
    assert [s.varying for s in repeated.find_stacks(model)] == [(("self_attn", "layer_idx"),)]
    assert fast.meta[repeated.REPLICATED_KEY] == (repeated.Replicated("lm.model.layers", 8, repeated.HEAD),)
    _assert_same_graph(full, fast)


def test_llama7b_real_config_is_replicated_exactly() -> None:
    pytest.importorskip("transformers")
    model_file = frontend.load_model_file(EXAMPLES / "llama7b" / "model.py")
    model = frontend.build_on_meta(model_file)
    inputs = frontend.to_device(model_file.module.batch(2, 0, seq_len=128)[0], "meta")
    full, fast = _both(model, inputs)
    assert fast.meta[repeated.REPLICATED_KEY] == (repeated.Replicated("lm.model.layers", 32, repeated.HEAD),)
    _assert_same_graph(full, fast)


@pytest.mark.parametrize("variant", ["parity", "before_last", "reads_index", "all_outputs", "late_index",
                                     "last_weight"])
def test_layers_that_do_not_repeat_are_traced_in_full(variant: str) -> None:
    """A stack is found, but the trace shows the layers are not interchangeable: the full graph."""
    model = _meta(lambda: Toy(variant=variant))
    assert [s.path for s in repeated.find_stacks(model)] == ["layers"]
    full, fast = _both(model, INPUTS)
    assert repeated.REPLICATED_KEY not in fast.meta
    _assert_same_graph(full, fast)
    assert len(model.layers) == 8 and [type(layer.index) for layer in model.layers] == [int] * 8


def test_stateless_modules_alike_in_a_plain_attribute_still_repeat() -> None:
    model = _meta(lambda: Toy(variant="kernel_funcs"))
    assert [s.varying for s in repeated.find_stacks(model)] == [(("", "index"),)]
    full, fast = _both(model, INPUTS)
    assert fast.meta[repeated.REPLICATED_KEY] == (repeated.Replicated("layers", 8, repeated.HEAD),)
    _assert_same_graph(full, fast)


@pytest.mark.parametrize("variant, n", [("alternating", 8), ("shared", 8), ("", repeated.MIN_STACK - 1),
                                        ("kernel_funcs_differ", 8), ("kernel_funcs_stateful", 8)])
def test_no_stack_when_layers_differ_share_or_are_few(variant: str, n: int) -> None:
    model = _meta(lambda: Toy(n, variant))
    assert repeated.find_stacks(model) == []
    full, fast = _both(model, INPUTS)
    assert repeated.REPLICATED_KEY not in fast.meta
    _assert_same_graph(full, fast)


def test_a_read_of_a_varying_attribute_is_seen() -> None:
    reads: list[str] = []
    value = repeated._Watched(3, reads, "layers.*.index")
    assert [10, 20, 30, 40][value] == 40       # an index: CPython asks __index__
    assert value + 1 == 4
    assert reads == ["layers.*.index"] * 2
