"""A checkpoint read at another tensor-parallel degree (program/checkpoint_reshard.py), on real DCP files.

Every lane of a degree writes its shards (a fused qkv projection cut in 3 interleaved blocks, a row-parallel
projection, a replicated norm) with SGD momentum or AdamW state, as `checkpoint_state.collect` writes them;
then ranks of another degree (1, 2, 4; and the same) restore from those files, and each must hold exactly
its shard of the whole tensors and of their optimizer state. The end-to-end run, a TP=2 plan resumed
without tensor parallelism, is in tests/test_tp_e2e.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from backends.torchdist.program import checkpoint_state
from backends.torchdist.program.checkpoint import CheckpointError
from backends.torchdist.program.checkpoint_reshard import CUT, shard_name
from passes.tensor_parallel import ShardSpec, shard_tensor

STEP = 3
SEED = 5
SPECS = {"attn.qkv.weight": ShardSpec("attn.qkv.weight", 0, 3, (24, 8)),     # fused: 3 blocks of 8 rows
         "attn.out.weight": ShardSpec("attn.out.weight", 1, 1, (8, 8))}      # row-parallel
NORM = "norm.weight"                                                         # replicated on every lane


def _whole() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"attn.qkv.weight": torch.randn(24, 8, generator=g), "attn.out.weight": torch.randn(8, 8, generator=g),
            NORM: torch.randn(8, generator=g)}


def _moments() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return {name: {"exp_avg": torch.randn(t.shape, generator=g), "exp_avg_sq": torch.rand(t.shape, generator=g)}
            for name, t in _whole().items()}


def _lane(whole: dict[str, torch.Tensor], degree: int, lane: int) -> dict[str, torch.Tensor]:
    """Saved name -> this lane's tensor (a split parameter's shard, or the whole)."""
    out = {}
    for name, tensor in whole.items():
        if name in SPECS and degree > 1:
            out[shard_name(name, lane, degree)] = shard_tensor(tensor, SPECS[name], degree, lane)
        else:
            out[name] = tensor.clone()
    return out


def _state(degree: int, lane: int, values: dict[str, torch.Tensor], optimizer: str,
           record_cuts: bool = True) -> checkpoint_state.RankState:
    params = {name: torch.nn.Parameter(t) for name, t in values.items()}
    opt = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9) if optimizer == "sgd" else \
        torch.optim.AdamW(params.values())
    return checkpoint_state.RankState(
        tensors=dict(params), optimizer=opt, compressors={}, scaler=None, rank=lane, device=torch.device("cpu"),
        seed=SEED, optimizer_name=optimizer, plan_digest=f"tp{degree}",
        plan_compresses=False, cuts=dict(SPECS) if degree > 1 and record_cuts else {})


def _set_optimizer_state(state: checkpoint_state.RankState, degree: int, lane: int, optimizer: str) -> None:
    for name, p in state.tensors.items():
        base = name.split("@")[0]
        moments = {key: _lane({base: t}, degree, lane) for key, t in _moments()[base].items()}
        own = {key: next(iter(m.values())) for key, m in moments.items()}
        state.optimizer.state[p] = {"momentum_buffer": own["exp_avg"]} if optimizer == "sgd" else \
            {"step": torch.tensor(float(STEP)), "exp_avg": own["exp_avg"], "exp_avg_sq": own["exp_avg_sq"]}


def _write(folder: Path, degree: int, optimizer: str, record_cuts: bool = True) -> None:
    """The checkpoint every lane of `degree` writes together (one DCP save of the union of their entries)."""
    entries: dict = {}
    for lane in range(degree):
        state = _state(degree, lane, _lane(_whole(), degree, lane), optimizer, record_cuts)
        _set_optimizer_state(state, degree, lane, optimizer)
        entries.update(checkpoint_state.collect(state, STEP))
    dcp.save(entries, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize(("saved", "read"), [(2, 1), (1, 2), (2, 4), (4, 2), (2, 2), (4, 1)])
def test_each_lane_of_another_degree_reads_its_shard_and_its_optimizer_state(tmp_path, saved, read, optimizer):
    folder = tmp_path / f"step_{STEP}"
    _write(folder, saved, optimizer)
    whole, moments = _whole(), _moments()
    for lane in range(read):
        zeros = {name: torch.zeros_like(t) for name, t in _lane(whole, read, lane).items()}
        state = _state(read, lane, zeros, optimizer)
        assert checkpoint_state.restore(folder, state) == STEP
        for name, tensor in state.tensors.items():
            base = name.split("@")[0]
            assert torch.equal(tensor, next(iter(_lane({base: whole[base]}, read, lane).values()))), name
            got = state.optimizer.state[tensor]
            want = {key: next(iter(_lane({base: t}, read, lane).values())) for key, t in moments[base].items()}
            if optimizer == "sgd":
                assert torch.equal(got["momentum_buffer"], want["exp_avg"]), name
            else:
                assert torch.equal(got["exp_avg"], want["exp_avg"]) and torch.equal(got["exp_avg_sq"],
                                                                                   want["exp_avg_sq"]), name
                assert float(got["step"]) == STEP


def test_the_cut_is_recorded_beside_the_shards(tmp_path):
    folder = tmp_path / f"step_{STEP}"
    _write(folder, 2, "sgd")
    entries = checkpoint_state.read_metadata(folder).state_dict_metadata
    assert {k for k in entries if k.startswith(CUT)} == {CUT + name for name in SPECS}
    assert not any(k.startswith("model/") and "@tp" in k and k.split("@")[0].removeprefix("model/") == NORM
                   for k in entries)


def test_shards_without_a_recorded_cut_are_read_with_the_ranks_own(tmp_path):
    """A checkpoint of an older program (no meta/tp/ entries) still reads at another degree > 1."""
    folder = tmp_path / f"step_{STEP}"
    _write(folder, 2, "sgd", record_cuts=False)
    zeros = {name: torch.zeros_like(t) for name, t in _lane(_whole(), 4, 3).items()}
    state = _state(4, 3, zeros, "sgd")
    checkpoint_state.restore(folder, state)
    qkv = state.tensors[shard_name("attn.qkv.weight", 3, 4)]
    assert torch.equal(qkv, shard_tensor(_whole()["attn.qkv.weight"], SPECS["attn.qkv.weight"], 4, 3))


def test_without_a_cut_a_rank_of_degree_one_says_which_degree_to_plan(tmp_path):
    folder = tmp_path / f"step_{STEP}"
    _write(folder, 2, "sgd", record_cuts=False)
    state = _state(1, 0, {name: torch.zeros_like(t) for name, t in _whole().items()}, "sgd")
    with pytest.raises(CheckpointError) as raised:
        checkpoint_state.restore(folder, state)
    assert "2 tensor-parallel shards" in raised.value.one_line() and "(fix: resume with a plan of --tp 2)" in \
        raised.value.one_line()
    assert torch.equal(state.tensors[NORM], torch.zeros(8)), "a tensor was restored before the refusal"


def test_a_lane_missing_from_the_checkpoint_is_the_tensor_it_lacks(tmp_path):
    """Pieces of only some lanes are no whole: the tensor is named as missing, nothing half-restored."""
    folder = tmp_path / f"step_{STEP}"
    state = _state(2, 0, _lane(_whole(), 2, 0), "sgd")
    dcp.save(checkpoint_state.collect(state, STEP), storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    reader = _state(1, 0, {name: torch.zeros_like(t) for name, t in _whole().items()}, "sgd")
    with pytest.raises(CheckpointError, match="holds no tensor attn.qkv.weight"):
        checkpoint_state.restore(folder, reader)
    assert torch.equal(reader.tensors[NORM], torch.zeros(8)), "a tensor was restored before the refusal"


@pytest.mark.parametrize(("limit", "batches"), [(checkpoint_state.RESHARD_LOAD_BYTES, 1), (1, 2)])
def test_the_resharded_tensors_are_read_in_loads_bounded_by_their_bytes(tmp_path, monkeypatch, limit, batches):
    """Both split tensors (qkv and out, with their AdamW moments) in one DCP load beside the rank's own
    entries and the meta; with a bound below one tensor's bytes, each in a load of its own. Either way every
    lane holds exactly its shard and state."""
    folder = tmp_path / f"step_{STEP}"
    _write(folder, 4, "adamw")
    loads: list[int] = []
    real = checkpoint_state.load_entries

    def counted(where, request):
        loads.append(len(request))
        real(where, request)

    monkeypatch.setattr(checkpoint_state, "load_entries", counted)
    monkeypatch.setattr(checkpoint_state, "RESHARD_LOAD_BYTES", limit)
    whole, moments = _whole(), _moments()
    for lane in range(2):
        loads.clear()
        state = _state(2, lane, {name: torch.zeros_like(t) for name, t in _lane(whole, 2, lane).items()}, "adamw")
        assert checkpoint_state.restore(folder, state) == STEP
        assert len(loads) == 2 + batches, loads          # the meta, the rank's own names, the resharded ones
        for name, tensor in state.tensors.items():
            base = name.split("@")[0]
            assert torch.equal(tensor, next(iter(_lane({base: whole[base]}, 2, lane).values()))), name
            want = next(iter(_lane({base: moments[base]["exp_avg_sq"]}, 2, lane).values()))
            assert torch.equal(state.optimizer.state[tensor]["exp_avg_sq"], want), name
