"""The training program's checkpoints read as the whole model (program/checkpoint_weights.py): by `--weights`
(weights.ProgramCheckpointSource) and written out by `plan export --safetensors` (export_weights.py), on real
DCP files of tensor-parallel degrees 1, 2 and 4 (written as tests/test_checkpoint_reshard.py writes them).
The end-to-end run, a TP=2 x DP=2 plan's checkpoint exported and compared with one process, is in
tests/test_tp_e2e.py.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn

from backends.torchdist.export_weights import INDEX_FILE, SINGLE_FILE, cut_shards, export_weights
from backends.torchdist.program import checkpoint, checkpoint_state
from backends.torchdist.program.checkpoint_weights import TrainedModel
from backends.torchdist.program.weights import (
    ProgramCheckpointSource,
    WeightsError,
    check_weights,
    load_into,
    model_tensors,
    open_weights,
    tied_aliases,
)
from backends.torchdist.reference import train_reference
from planner.cli import main
from tests.helpers import CLUSTERS, EXAMPLES, run_program
from tests.test_checkpoint_reshard import STEP, _lane, _state, _whole, _write
from tests.test_rebalance_e2e import _mlp_plan


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24, bias=False)
        self.out = nn.Linear(8, 8, bias=False)


class Model(nn.Module):
    """The names and shapes of the checkpoints _write makes: attn.qkv.weight, attn.out.weight, norm.weight."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.norm = nn.LayerNorm(8, bias=False)


def _checkpoint(root: Path, degree: int, optimizer: str = "adamw") -> Path:
    """A complete checkpoint of `degree` under `root` (its step folder and COMPLETE marker)."""
    folder = checkpoint.step_folder(root, STEP)
    _write(folder, degree, optimizer)
    checkpoint.write_marker(folder, STEP, f"tp{degree}", degree)
    return folder


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_a_checkpoint_of_any_degree_reads_as_the_whole_model(tmp_path, degree):
    _checkpoint(tmp_path / "ckpt", degree)
    trained = TrainedModel(tmp_path / "ckpt")                  # the root: its latest complete step
    assert trained.folder == tmp_path / "ckpt" / f"step_{STEP}" and trained.step == STEP
    whole = _whole()
    assert trained.tensors() == {name: (tuple(t.shape), t.dtype) for name, t in whole.items()}
    read = dict(trained.read(sorted(whole)))
    for name, tensor in whole.items():
        assert torch.equal(read[name], tensor), name


def test_weights_start_a_model_from_a_training_checkpoint_of_shards(tmp_path):
    """`--weights CKPT`: the headers check passes, and the module gets the whole tensors (the optimizer's
    entries are not the model's and are not offered as names)."""
    folder = _checkpoint(tmp_path / "ckpt", 2)
    source = open_weights(folder)
    assert isinstance(source, ProgramCheckpointSource)
    assert sorted(source.tensor_names()) == sorted(_whole())
    model = Model()
    check_weights(folder, model_tensors(model), tied_aliases(model))
    wanted = {name: t.detach() for name, t in model.state_dict(keep_vars=True).items()}
    read = load_into(tmp_path / "ckpt", wanted, tied_aliases(model), model_names=list(wanted))
    assert read == sum(t.numel() * t.element_size() for t in _whole().values())
    for name, tensor in _whole().items():
        assert torch.equal(wanted[name], tensor), name


def test_an_unfinished_or_partial_checkpoint_is_one_line_naming_it(tmp_path):
    folder = checkpoint.step_folder(tmp_path, STEP)
    _write(folder, 2, "sgd")                                      # no COMPLETE marker: its save did not finish
    with pytest.raises(WeightsError, match="not complete") as info:
        open_weights(folder)
    assert info.value.file == str(folder)
    partial = checkpoint.step_folder(tmp_path / "partial", STEP)    # only lane 0 of 2
    dcp.save(checkpoint_state.collect(_state(2, 0, _lane(_whole(), 2, 0), "sgd"), STEP),
             storage_writer=dcp.FileSystemWriter(str(partial)), no_dist=True)
    checkpoint.write_marker(partial, STEP, "tp2", 2)
    with pytest.raises(WeightsError, match=r"attn.\w+.weight lacks shards: .* only \{2: \[0\]\}"):
        open_weights(partial)


def test_a_checkpoint_of_another_model_is_refused_before_anything_is_written(tmp_path):
    _checkpoint(tmp_path / "ckpt", 2)
    other = Model()
    other.attn.out = nn.Linear(8, 16, bias=False)
    (tmp_path / "w").mkdir()
    with pytest.raises(WeightsError, match=r"attn.out.weight has shape \[8, 8\] in the file but \[16, 8\]"):
        export_weights(tmp_path / "ckpt", other, tmp_path / "w")
    assert list((tmp_path / "w").iterdir()) == []


@pytest.mark.parametrize("max_shard_bytes", [10**9, 1100])
def test_export_writes_the_whole_tensors_as_save_pretrained_lays_them_out(tmp_path, max_shard_bytes):
    """One file, or shards of at most the size (each tensor is 768, 256 or 32 bytes) with their index, each
    with the mode a plain `open` gives (0666 less the umask, so other users may read it); what is written
    reads back through safetensors and through --weights."""
    _checkpoint(tmp_path / "ckpt", 4)
    out = tmp_path / "w"
    out.mkdir()
    done = export_weights(tmp_path / "ckpt", Model(), out, max_shard_bytes=max_shard_bytes)
    whole = _whole()
    assert done.step == STEP and done.tensors == 3 and done.total_bytes == 4 * (192 + 64 + 8)
    written: dict[str, torch.Tensor] = {}
    mask = os.umask(0)
    os.umask(mask)
    for file in done.files:
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~mask, oct(file.stat().st_mode)
        assert file.stat().st_size <= max_shard_bytes + 1000 or len(load_file(file)) == 1
        written.update(load_file(file))
    assert sorted(written) == sorted(whole)
    for name, tensor in whole.items():
        assert torch.equal(written[name], tensor), name
    if max_shard_bytes < 1000:
        index = json.loads((out / INDEX_FILE).read_text())
        assert [f.name for f in done.files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        assert index == {"metadata": {"total_size": done.total_bytes},           # cut in the model's order
                         "weight_map": {"attn.qkv.weight": done.files[0].name, "attn.out.weight": done.files[1].name,
                                        "norm.weight": done.files[1].name}}
    else:
        assert [f.name for f in done.files] == [SINGLE_FILE] and not (out / INDEX_FILE).exists()
    model = Model()
    wanted = {name: t.detach() for name, t in model.state_dict(keep_vars=True).items()}
    load_into(out, wanted, {}, model_names=list(wanted))
    for name, tensor in whole.items():
        assert torch.equal(wanted[name], tensor), name


def test_export_casts_and_writes_a_tied_tensor_once(tmp_path):
    """--dtype casts every tensor; a tied pair is saved under its first name, as the program saves it."""
    class Tied(Model):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 8, bias=False)
            self.head.weight = self.attn.out.weight

    _checkpoint(tmp_path / "ckpt", 2)
    out = tmp_path / "w"
    out.mkdir()
    done = export_weights(tmp_path / "ckpt", Tied(), out, dtype=torch.bfloat16)
    written = load_file(done.files[0])
    assert sorted(written) == sorted(_whole()) and done.total_bytes == 2 * (192 + 64 + 8)
    for name, tensor in _whole().items():
        assert written[name].dtype == torch.bfloat16 and torch.equal(written[name], tensor.to(torch.bfloat16)), name


def test_shards_are_cut_in_order_and_a_large_tensor_is_a_shard_alone():
    assert cut_shards({"a": 4, "b": 4, "c": 10, "d": 1, "e": 2}, 8) == [["a", "b"], ["c"], ["d", "e"]]
    assert cut_shards({"a": 4}, 1) == [["a"]]


def test_export_of_a_plan_without_a_usable_checkpoint_is_one_line_and_writes_nothing(tmp_path, capsys):
    """No run yet (the default OUT/run/ckpt), a checkpoint of another model, a shard size of 0: each a line
    naming the file or flag and the fix, a non-zero exit, no DIR."""
    out, target = tmp_path / "out", tmp_path / "trained"
    assert main([str(EXAMPLES / "gpt" / "model.py"), "--cluster", str(CLUSTERS / "cpu-hetero-4.yaml"),
                 "--global-batch", "8", "--stages", "2", "--no-runners-up", "-o", str(out)]) == 0
    capsys.readouterr()
    _checkpoint(tmp_path / "other", 2)
    cases = [([], 1, [str(out / "run" / "ckpt"), "no complete checkpoint", "fix:"]),
             (["--checkpoint", str(tmp_path / "other")], 2, ["is not in the checkpoint", "step_3", "fix:"]),
             (["--max-shard-gib", "0"], 2, ["--max-shard-gib", "fix:"])]
    for flags, code, words in cases:
        assert main(["export", str(out), "--safetensors", str(target), *flags]) == code, flags
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(w in err for w in words), (flags, err)
        assert not target.exists()


@pytest.mark.slow
def test_a_run_starts_from_the_checkpoint_of_the_run_it_replaces(tmp_path):
    """`plan run out/ --weights out/run/ckpt`: the earlier run moves to out/runs/1 before the new one starts,
    and its checkpoint is read there: the first loss is one process's from those weights, not the seed's."""
    out = tmp_path / "out"
    _mlp_plan(out)
    run_program(out, 2, lr=0.05, extra=("--checkpoint-every", "2"))
    metrics = run_program(out, 1, lr=0.05, extra=("--weights", str(out / "run" / "ckpt")))
    assert (out / "runs" / "1" / "ckpt" / "step_2").is_dir()
    model = str(EXAMPLES / "mlp" / "model.py")
    ref = train_reference(model, global_batch=24, steps=1, weights_path=out / "runs" / "1" / "ckpt")
    seeded = train_reference(model, global_batch=24, steps=1)
    assert ref.losses[0] != pytest.approx(seeded.losses[0], rel=1e-3)          # the weights count
    assert {m["step"] for m in metrics} == {0}
    for m in metrics:
        assert m["loss"] == pytest.approx(ref.losses[0], rel=1e-5)


def test_transformers_from_pretrained_reads_the_export_of_a_wrapped_model(tmp_path):
    """The hf_llama example wraps LlamaForCausalLM as `self.lm`: exported with --strip-prefix lm. in shards,
    beside the model's config, `from_pretrained` gives back every trained value."""
    transformers = pytest.importorskip("transformers")
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_llama_export", EXAMPLES / "hf_llama" / "model.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(3)
    trained = example.model()
    folder = checkpoint.step_folder(tmp_path / "ckpt", 1)
    entries = {checkpoint_state.MODEL + name: t.detach() for name, t in trained.state_dict().items()}
    dcp.save({**entries, checkpoint_state.META + "step": 1}, storage_writer=dcp.FileSystemWriter(str(folder)),
             no_dist=True)
    checkpoint.write_marker(folder, 1, "plan", 1)
    out = tmp_path / "hf"
    out.mkdir()
    done = export_weights(tmp_path / "ckpt", trained, out, max_shard_bytes=100_000, strip_prefix="lm.")
    assert len(done.files) > 1 and (out / INDEX_FILE).is_file()
    transformers.LlamaConfig(**example.CONFIG).save_pretrained(out)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    for name, tensor in trained.lm.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(WeightsError, match="does not start with 'model.'"):
        export_weights(tmp_path / "ckpt", trained, tmp_path, strip_prefix="model.")
