"""Pretrained weights (program/weights.py): real checkpoints on disk in every format read, loaded into a
model or a rank's share of it; the name mapping; and one-line errors naming the tensor and the file."""

from __future__ import annotations

import datetime
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn

from backends.torchdist.program.weights import (
    PrefixRewrite,
    WeightsError,
    check_weights,
    choose_rewrite,
    load_into,
    match_names,
    model_tensors,
    open_weights,
    tied_aliases,
)
from tests.helpers import spawn_gloo_workers

transformers = pytest.importorskip("transformers")

LLAMA = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32}
SHARD_SIZE = "8KB"            # the tiny Llama in several shards (its embedding alone is 4 KiB)
COLLECTIVE_TIMEOUT_S = 30
RUN_TIMEOUT_S = 120


def _llama(tied: bool, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, tie_word_embeddings=tied))


class Wrapped(nn.Module):
    """What a model file does around a Hugging Face model: its names gain the attribute's prefix."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.lm = inner


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _assert_state_equal(module: nn.Module, reference: dict[str, torch.Tensor], prefix: str = "") -> None:
    state = module.state_dict()
    assert {prefix + name for name in reference} <= state.keys()
    for name, tensor in reference.items():
        assert torch.equal(state[prefix + name], tensor), name


def _error(excinfo: pytest.ExceptionInfo[WeightsError]) -> str:
    line = excinfo.value.one_line()
    assert "\n" not in line and excinfo.value.exit_code == 2
    return line


# ----------------------------------------------------------------------------- safetensors file


def test_safetensors_file_loads_only_the_wanted_tensors_cast_to_the_model_dtype(tmp_path: Path) -> None:
    file = tmp_path / "w.safetensors"
    saved = {"a": torch.randn(3, 4), "b": torch.arange(6).reshape(2, 3), "c": torch.randn(5).to(torch.bfloat16)}
    save_file(saved, str(file))

    source = open_weights(file)
    assert source.names() == {"a": ((3, 4), torch.float32), "b": ((2, 3), torch.int64), "c": ((5,), torch.bfloat16)}

    wanted = {"a": torch.zeros(3, 4, dtype=torch.float64), "c": torch.zeros(5)}
    read_bytes = load_into(file, wanted, {}, model_names=["a", "b", "c"])
    assert read_bytes == 3 * 4 * 4 + 5 * 2                      # a (fp32) and c (bf16); not b
    assert wanted["a"].dtype == torch.float64 and torch.equal(wanted["a"], saved["a"].double())
    assert torch.equal(wanted["c"], saved["c"].float())


def test_a_parameter_is_loaded_in_place_and_keeps_requiring_grad(tmp_path: Path) -> None:
    file = tmp_path / "w.safetensors"
    save_file({"weight": torch.ones(2, 2)}, str(file))
    layer = nn.Linear(2, 2, bias=False)
    before = layer.weight
    load_into(file, {"weight": layer.weight}, {}, model_names=["weight"])
    assert layer.weight is before and layer.weight.requires_grad and torch.equal(layer.weight, torch.ones(2, 2))


# ----------------------------------------------------------------------------- Hugging Face directories


def test_tied_llama_fills_lm_head_from_the_input_embedding(tmp_path: Path) -> None:
    saved = _llama(tied=True, seed=0)
    saved.save_pretrained(tmp_path / "hf")
    assert "lm_head.weight" not in open_weights(tmp_path / "hf").names()   # save_pretrained leaves it out

    model = _llama(tied=True, seed=1)
    aliases = tied_aliases(model)
    assert aliases["lm_head.weight"] == ["model.embed_tokens.weight"]
    check_weights(tmp_path / "hf", model_tensors(model), aliases)
    names = list(model_tensors(model))
    load_into(tmp_path / "hf", dict(model.state_dict(keep_vars=True)), aliases, model_names=names)
    _assert_state_equal(model, _state(saved))
    assert model.lm_head.weight is model.model.embed_tokens.weight

    # a last pipeline stage holds its own copy of the tied weight: filled from the embedding too
    head = torch.zeros(LLAMA["vocab_size"], LLAMA["hidden_size"])
    load_into(tmp_path / "hf", {"lm_head.weight": head}, aliases, model_names=names)
    assert torch.equal(head, saved.model.embed_tokens.weight)

    with pytest.raises(WeightsError) as excinfo:                 # without the aliases, lm_head is missing
        check_weights(tmp_path / "hf", model_tensors(model), {})
    line = _error(excinfo)
    assert "tensor lm_head.weight is not in the checkpoint" in line and str(tmp_path / "hf") in line


def test_untied_llama_loads_into_a_model_file_that_wraps_it(tmp_path: Path) -> None:
    saved = _llama(tied=False, seed=0)
    saved.save_pretrained(tmp_path / "hf")
    model = Wrapped(_llama(tied=False, seed=1))                  # names: lm.model.*, lm.lm_head.weight
    expected = model_tensors(model)
    assert "lm.lm_head.weight" in expected and tied_aliases(model) == {}
    assert choose_rewrite(open_weights(tmp_path / "hf").tensor_names(), list(expected), {}) == PrefixRewrite("lm.")
    check_weights(tmp_path / "hf", expected, {})
    read_bytes = load_into(tmp_path / "hf", dict(model.state_dict(keep_vars=True)), {}, model_names=list(expected))
    _assert_state_equal(model, _state(saved), prefix="lm.")
    assert read_bytes == sum(t.numel() * t.element_size() for t in saved.state_dict().values())


def test_sharded_checkpoint_opens_only_the_shards_holding_the_wanted_tensors(tmp_path: Path) -> None:
    saved = _llama(tied=False, seed=0)
    saved.save_pretrained(tmp_path / "hf", max_shard_size=SHARD_SIZE)
    weight_map = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) >= 3
    reference = _state(saved)

    model = _llama(tied=False, seed=1)
    names = list(model_tensors(model))
    check_weights(tmp_path / "hf", model_tensors(model), {})
    load_into(tmp_path / "hf", dict(model.state_dict(keep_vars=True)), {}, model_names=names)
    _assert_state_equal(model, reference)

    # a rank whose tensors are all in the first shard: the second shard deleted, the third garbage
    kept, deleted, corrupted = shards[0], shards[1], shards[2]
    (tmp_path / "hf" / deleted).unlink()
    (tmp_path / "hf" / corrupted).write_bytes(b"\xff" * 64)
    mine = [name for name, shard in weight_map.items() if shard == kept]
    wanted = {name: torch.zeros_like(reference[name]) for name in mine}
    read_bytes = load_into(tmp_path / "hf", wanted, {}, model_names=names)
    assert read_bytes == sum(reference[name].numel() * 4 for name in mine)
    assert all(torch.equal(wanted[name], reference[name]) for name in mine)

    # the whole-model check reads every header, so it names the first broken shard it meets
    with pytest.raises(WeightsError) as excinfo:
        check_weights(tmp_path / "hf", model_tensors(model), {})
    line = _error(excinfo)
    assert line.startswith((f"{tmp_path / 'hf' / deleted}: cannot read the file: No such file",
                            f"{tmp_path / 'hf' / corrupted}: not a safetensors file"))
    # a rank wanting a tensor of the corrupted shard is told which file is not a safetensors file
    theirs = next(name for name, shard in weight_map.items() if shard == corrupted)
    with pytest.raises(WeightsError) as excinfo:
        load_into(tmp_path / "hf", {theirs: torch.zeros_like(reference[theirs])}, {}, model_names=names)
    line = _error(excinfo)
    assert "not a safetensors file" in line and str(tmp_path / "hf" / corrupted) in line


# ----------------------------------------------------------------------------- torch.distributed.checkpoint


def _save_dcp(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """A training job's checkpoint: the model's state under `model`, beside a non-tensor entry."""
    with warnings.catch_warnings():         # no_dist: torch warns that it assumes one process, as meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": state, "step": 7}, checkpoint_id=str(directory), no_dist=True)


def test_dcp_checkpoint_loads_in_one_process_without_a_process_group(tmp_path: Path) -> None:
    saved = _llama(tied=False, seed=0)
    reference = _state(saved)
    _save_dcp(tmp_path / "dcp", reference)
    source = open_weights(tmp_path / "dcp")
    assert set(source.names()) == {"model." + name for name in reference}        # `step` is no tensor

    assert not dist.is_initialized()
    model = _llama(tied=False, seed=1).double()                                   # cast on load: fp32 -> fp64
    names = list(model_tensors(model))
    check_weights(tmp_path / "dcp", model_tensors(model), {})
    read_bytes = load_into(tmp_path / "dcp", dict(model.state_dict(keep_vars=True)), {}, model_names=names)
    assert read_bytes == sum(t.numel() * 4 for t in reference.values())
    _assert_state_equal(model, {name: t.double() for name, t in reference.items()})


def _dcp_half_worker(rank: int, port: int, world_size: int, directory: str, reference_file: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        reference = torch.load(reference_file)
        names = sorted(reference)
        mine = names[rank::world_size]
        # rank 0 loads its half in two calls, rank 1 in one: a collective load would hang or mismatch
        calls = [mine[: len(mine) // 2], mine[len(mine) // 2:]] if rank == 0 else [mine]
        for call in calls:
            wanted = {name: torch.zeros_like(reference[name]) for name in call}
            read_bytes = load_into(Path(directory), wanted, {}, model_names=names)
            assert read_bytes == sum(reference[name].numel() * 4 for name in call)
            for name in call:
                assert torch.equal(wanted[name], reference[name]), name
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_dcp_checkpoint_loads_a_different_half_on_each_of_two_gloo_ranks(tmp_path: Path) -> None:
    reference = _state(_llama(tied=False, seed=0))
    _save_dcp(tmp_path / "dcp", reference)
    torch.save({"model." + name: t for name, t in reference.items()}, tmp_path / "reference.pt")
    spawn_gloo_workers(_dcp_half_worker, (2, str(tmp_path / "dcp"), str(tmp_path / "reference.pt")), 2,
                       deadline_s=RUN_TIMEOUT_S)


# ----------------------------------------------------------------------------- names


def test_match_names_is_exact_when_every_name_is_found() -> None:
    names = ["model.a.weight", "b.weight"]
    assert match_names(["model.a.weight", "b.weight", "a.weight"], names, {}) == {n: n for n in names}


def test_match_names_strips_a_prefix_the_model_adds(tmp_path: Path) -> None:
    file = tmp_path / "w.safetensors"
    saved = {"embed.weight": torch.randn(4, 2), "layers.0.weight": torch.randn(2, 2), "head.weight": torch.randn(3)}
    save_file(saved, str(file))
    model = {"model." + name: torch.zeros_like(t) for name, t in saved.items()}
    assert match_names(saved, list(model), {}) == {"model." + name: name for name in saved}
    assert load_into(file, model, {}, model_names=list(model)) == sum(t.numel() * 4 for t in saved.values())
    assert all(torch.equal(model["model." + name], t) for name, t in saved.items())


def test_match_names_adds_a_prefix_the_checkpoint_carries() -> None:
    checkpoint = ["transformer.wte.weight", "transformer.h.0.attn.weight", "transformer.ln_f.weight"]
    model = ["wte.weight", "h.0.attn.weight", "ln_f.weight", "lm_head.weight"]
    aliases = {"lm_head.weight": ["wte.weight"], "wte.weight": ["lm_head.weight"]}
    assert match_names(checkpoint, model, aliases) == {
        "wte.weight": "transformer.wte.weight", "h.0.attn.weight": "transformer.h.0.attn.weight",
        "ln_f.weight": "transformer.ln_f.weight", "lm_head.weight": "transformer.wte.weight"}


def test_every_rank_reads_the_name_the_whole_model_decides(tmp_path: Path) -> None:
    # alone, `model.a.w` is found exactly; with the whole model one rewrite (model. -> none) finds both
    file = tmp_path / "w.safetensors"
    saved = {"a.w": torch.full((2,), 1.0), "b.w": torch.full((2,), 2.0), "model.a.w": torch.full((2,), 9.0)}
    save_file(saved, str(file))
    model_names = ["model.a.w", "model.b.w"]
    assert match_names(saved, model_names, {}) == {"model.a.w": "a.w", "model.b.w": "b.w"}
    wanted = {"model.a.w": torch.zeros(2)}
    load_into(file, wanted, {}, model_names=model_names)
    assert torch.equal(wanted["model.a.w"], saved["a.w"])
    with pytest.raises(ValueError, match="outside model_names"):
        load_into(file, {"other": torch.zeros(2)}, {}, model_names=model_names)


# ----------------------------------------------------------------------------- errors


def test_a_missing_tensor_names_the_tensor_the_file_and_the_closest_name(tmp_path: Path) -> None:
    file = tmp_path / "w.safetensors"
    save_file({"layer.weight": torch.zeros(2, 2), "layer.bias": torch.zeros(2)}, str(file))
    expected = {"layer.weight": ((2, 2), torch.float32), "layer.biases": ((2,), torch.float32)}
    with pytest.raises(WeightsError) as excinfo:
        check_weights(file, expected, {})
    line = _error(excinfo)
    assert line.startswith(f"{file}: tensor layer.biases is not in the checkpoint")
    assert "closest checkpoint name: layer.bias" in line

    untouched = torch.full((2, 2), 5.0)
    with pytest.raises(WeightsError):
        load_into(file, {"layer.weight": untouched, "layer.biases": torch.zeros(2)}, {}, model_names=list(expected))
    assert torch.equal(untouched, torch.full((2, 2), 5.0))        # checked before anything is copied


def test_a_missing_tensor_of_a_sharded_checkpoint_names_its_index(tmp_path: Path) -> None:
    _llama(tied=False, seed=0).save_pretrained(tmp_path / "hf", max_shard_size=SHARD_SIZE)
    expected = {"model.norm.weight": ((16,), torch.float32), "model.nrom.weight": ((16,), torch.float32)}
    with pytest.raises(WeightsError) as excinfo:
        check_weights(tmp_path / "hf", expected, {})
    line = _error(excinfo)
    assert line.startswith(f"{tmp_path / 'hf' / 'model.safetensors.index.json'}: tensor model.nrom.weight")
    assert "closest checkpoint name: model.norm.weight" in line


def test_a_misshaped_tensor_names_both_shapes_and_its_file(tmp_path: Path) -> None:
    _llama(tied=False, seed=0).save_pretrained(tmp_path / "hf", max_shard_size=SHARD_SIZE)
    weight_map = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    model = Wrapped(_llama(tied=False, seed=1))
    expected = model_tensors(model)
    expected["lm.model.norm.weight"] = ((17,), torch.float32)
    with pytest.raises(WeightsError) as excinfo:
        check_weights(tmp_path / "hf", expected, {})
    line = _error(excinfo)
    shard = tmp_path / "hf" / weight_map["model.norm.weight"]
    assert line.startswith(f"{shard}: tensor lm.model.norm.weight (as model.norm.weight) has shape [16] in the "
                           f"file but [17] in the model")

    untouched = torch.full((17,), 5.0)
    with pytest.raises(WeightsError):
        load_into(tmp_path / "hf", {"lm.model.norm.weight": untouched}, {}, model_names=list(expected))
    assert torch.equal(untouched, torch.full((17,), 5.0))


@pytest.mark.parametrize("make", ["missing", "empty_dir", "bin_file", "text_file", "garbage_safetensors",
                                  "escaping_index"])
def test_a_path_of_no_known_format_is_one_line_naming_it(tmp_path: Path, make: str) -> None:
    path = tmp_path / {"missing": "nothing", "empty_dir": "dir", "bin_file": "pytorch_model.bin",
                       "text_file": "weights.txt", "garbage_safetensors": "w.safetensors",
                       "escaping_index": "hf"}[make]
    if make == "empty_dir":
        path.mkdir()
    elif make == "bin_file":
        torch.save({"w": torch.zeros(1)}, path)
    elif make == "text_file":
        path.write_text("w = 1\n")
    elif make == "garbage_safetensors":
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    elif make == "escaping_index":
        path.mkdir()
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../w.safetensors"}}))
    with pytest.raises(WeightsError) as excinfo:
        open_weights(path)
    line = _error(excinfo)
    expected = {"missing": "does not exist, not a .safetensors file, a Hugging Face model directory",
                "empty_dir": "is a directory, not a .safetensors file",
                "bin_file": "PyTorch .bin weights are not read",
                "text_file": "is a file, not a .safetensors file",
                "garbage_safetensors": "not a safetensors file: Error while deserializing header",
                "escaping_index": "shard '../w.safetensors' is not a file name inside the directory"}[make]
    where = path / "model.safetensors.index.json" if make == "escaping_index" else path
    assert line.startswith(f"{where}: ") and expected in line


# ----------------------------------------------------------------------------- devices


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tensors_on_a_gpu_are_filled_from_every_format(tmp_path: Path) -> None:
    saved = _llama(tied=False, seed=0)
    reference = _state(saved)
    saved.save_pretrained(tmp_path / "hf", max_shard_size=SHARD_SIZE)
    _save_dcp(tmp_path / "dcp", reference)
    for path in (tmp_path / "hf", tmp_path / "dcp"):
        model = _llama(tied=False, seed=1).to("cuda", torch.bfloat16)
        load_into(path, dict(model.state_dict(keep_vars=True)), {}, model_names=list(model_tensors(model)))
        for name, tensor in model.state_dict().items():
            assert tensor.device.type == "cuda"
            assert torch.equal(tensor.cpu(), reference[name].to(torch.bfloat16)), (path.name, name)
