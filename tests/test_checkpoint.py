"""Checkpoints of the emitted program, unit by unit: the folder layout and when a checkpoint counts
(program/checkpoint.py), what a rank's state holds and how it loads (program/checkpoint_state.py), and
the compressors' state across a save (backends/compression state_dict / load_state_dict).

Real files and real torch.distributed.checkpoint throughout; the compressors run on a 2-process gloo
group. The whole program saving and resuming is tests/test_checkpoint_e2e.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from backends.torchdist.program import checkpoint, checkpoint_state
from backends.torchdist.program.checkpoint import CheckpointError
from tests.helpers import spawn_gloo_workers


def _fake_checkpoint(root: Path, step: int, *, complete: bool = True) -> Path:
    """A step folder with a DCP .metadata (a real save of one tensor), marked complete or not."""
    folder = checkpoint.step_folder(root, step)
    dcp.save({"model/w": torch.full((2,), float(step))}, checkpoint_id=str(folder), no_dist=True)
    if complete:
        checkpoint.write_marker(folder, step, "digest", 1)
    return folder


# ----------------------------------------------------------------------------- layout


def test_step_of_reads_the_folder_name_and_refuses_others(tmp_path: Path) -> None:
    assert checkpoint.step_of(tmp_path / "step_12") == 12
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        checkpoint.step_of(tmp_path / "step_x")


def test_latest_complete_skips_incomplete_and_foreign_folders(tmp_path: Path) -> None:
    assert checkpoint.latest_complete(tmp_path / "missing") is None
    _fake_checkpoint(tmp_path, 3)
    _fake_checkpoint(tmp_path, 10)
    _fake_checkpoint(tmp_path, 12, complete=False)          # a save that crashed: no marker
    (tmp_path / "step_20").mkdir()                           # nothing in it
    (tmp_path / "notes").mkdir()
    assert checkpoint.latest_complete(tmp_path) == tmp_path / "step_10"   # by number, not by name


def test_a_marker_of_another_step_does_not_count(tmp_path: Path) -> None:
    folder = _fake_checkpoint(tmp_path, 4, complete=False)
    checkpoint.write_marker(folder, 5, "digest", 1)
    assert not checkpoint.is_complete(folder)


def test_write_marker_leaves_no_temporary_behind(tmp_path: Path) -> None:
    folder = _fake_checkpoint(tmp_path, 6)
    marker = json.loads((folder / checkpoint.COMPLETE_FILE).read_text())
    assert marker["step"] == 6 and marker["plan_digest"] == "digest" and marker["world_size"] == 1
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == [checkpoint.METADATA_FILE]


def test_prune_deletes_older_complete_checkpoints_only(tmp_path: Path) -> None:
    for step in (3, 6, 9, 12):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 4, complete=False)
    deleted = checkpoint.prune(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["step_3", "step_6"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_12", "step_4", "step_9"]


def test_resolve_takes_a_root_or_one_complete_step_folder(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 3)
    incomplete = _fake_checkpoint(tmp_path, 6, complete=False)
    assert checkpoint.resolve(tmp_path) == tmp_path / "step_3"
    assert checkpoint.resolve(tmp_path / "step_3") == tmp_path / "step_3"
    with pytest.raises(CheckpointError, match="not complete"):
        checkpoint.resolve(incomplete)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        checkpoint.resolve(tmp_path / "empty")


def test_resume_folder_by_flags_and_restarts(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match="--resume: no complete checkpoint"):
        checkpoint.resume_folder(root, resume=True, resume_from=None, restart_count=0)
    assert checkpoint.resume_folder(root, resume=False, resume_from=None, restart_count=1) is None   # step 0
    _fake_checkpoint(root, 3)
    assert checkpoint.resume_folder(root, resume=False, resume_from=None, restart_count=0) is None
    assert checkpoint.resume_folder(root, resume=False, resume_from=None, restart_count=2) == root / "step_3"
    assert checkpoint.resume_folder(root, resume=True, resume_from=None, restart_count=0) == root / "step_3"


# ----------------------------------------------------------------------------- a rank's state


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


def _rank_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, seed: int = 0,
                digest: str = "plan-a") -> checkpoint_state.RankState:
    canonical = checkpoint_state.canonical_names(module)
    tensors = {canonical[name]: t for name, t in module.state_dict(keep_vars=True).items()}
    return checkpoint_state.RankState(tensors=tensors, optimizer=optimizer, compressors={}, scaler=None, rank=0,
                                      device=torch.device("cpu"), seed=seed, optimizer_name="adamw",
                                      plan_digest=digest, plan_compresses=False)


def _train_a_step(module: _Tied, optimizer: torch.optim.Optimizer, step: int) -> None:
    ids = torch.arange(4) % 5 + step % 2
    loss = module.head(module.norm(module.embed(ids))).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_canonical_names_put_a_tied_tensor_under_its_first_name() -> None:
    names = checkpoint_state.canonical_names(_Tied())
    assert names["head.weight"] == "embed.weight" and names["embed.weight"] == "embed.weight"
    assert names["norm.running_mean"] == "norm.running_mean"


def test_state_saves_and_restores_parameters_buffers_and_optimizer_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(3):
        _train_a_step(model, optimizer, step)
    folder = checkpoint.step_folder(tmp_path, 3)
    dcp.save(checkpoint_state.collect(_rank_state(model, optimizer), 3), checkpoint_id=str(folder), no_dist=True)
    rng_after_save = torch.get_rng_state()
    # one copy of both: the optimizer refers to the parameters
    expected_model, expected_optimizer = copy.deepcopy((model, optimizer))
    _train_a_step(expected_model, expected_optimizer, 3)

    torch.manual_seed(1)                       # other initial values, another generator state
    resumed = _Tied()
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=0.1)
    steps_done = checkpoint_state.restore(folder, _rank_state(resumed, resumed_optimizer))
    assert steps_done == 3
    assert torch.equal(torch.get_rng_state(), rng_after_save)       # the same plan: generators restored
    assert torch.equal(resumed.norm.num_batches_tracked, model.norm.num_batches_tracked)
    assert resumed.head.weight is resumed.embed.weight              # still tied after loading in place
    _train_a_step(resumed, resumed_optimizer, 3)
    for (name, got), want in zip(resumed.state_dict().items(), expected_model.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_another_plan_keeps_its_own_generators_and_says_the_compressors_start_fresh(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = checkpoint.step_folder(tmp_path, 2)
    model = _Tied()
    optimizer = torch.optim.AdamW(model.parameters())
    _train_a_step(model, optimizer, 0)
    dcp.save(checkpoint_state.collect(_rank_state(model, optimizer, digest="plan-a"), 2), checkpoint_id=str(folder),
             no_dist=True)
    other = _Tied()
    other_optimizer = torch.optim.AdamW(other.parameters())
    own_generator = torch.get_rng_state()
    state = _rank_state(other, other_optimizer, digest="plan-b")
    state.plan_compresses = True
    assert checkpoint_state.restore(folder, state) == 2
    assert torch.equal(torch.get_rng_state(), own_generator)
    assert torch.equal(other.embed.weight, model.embed.weight)            # the model's state carries over
    moments = other_optimizer.state[other.embed.weight]["exp_avg"], optimizer.state[model.embed.weight]["exp_avg"]
    assert torch.equal(*moments)
    assert capsys.readouterr().err.count("written by another plan") == 1


def test_restore_names_the_folder_and_the_missing_tensor(tmp_path: Path) -> None:
    folder = checkpoint.step_folder(tmp_path, 2)
    small = torch.nn.Linear(3, 5)
    state = _rank_state(small, torch.optim.AdamW(small.parameters()))
    dcp.save(checkpoint_state.collect(state, 2), checkpoint_id=str(folder), no_dist=True)
    model = _Tied()
    with pytest.raises(CheckpointError, match="holds no tensor embed.weight") as raised:
        checkpoint_state.restore(folder, _rank_state(model, torch.optim.AdamW(model.parameters())))
    assert str(folder) in raised.value.one_line()


def test_restore_refuses_another_seed(tmp_path: Path) -> None:
    folder = checkpoint.step_folder(tmp_path, 1)
    model = _Tied()
    optimizer = torch.optim.AdamW(model.parameters())
    dcp.save(checkpoint_state.collect(_rank_state(model, optimizer, seed=4), 1), checkpoint_id=str(folder),
             no_dist=True)
    with pytest.raises(CheckpointError, match="trained with --seed 4"):
        checkpoint_state.restore(folder, _rank_state(model, optimizer, seed=5))


# ----------------------------------------------------------------------------- compressor state


COMPRESSORS = ("powersgd", "onebit")


def _compressor_worker(rank: int, store_port: int, result_file: str) -> None:
    """spawn_gloo_workers' entry. For each compressor: three steps, a snapshot of its state through DCP's
    own save and load, one more step on the original and on a fresh compressor loaded from the snapshot
    (they must agree), and on one that starts fresh (it must not: the state matters)."""
    import datetime

    import torch.distributed as dist

    from backends.compression import make_compressor

    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    outcome = {}
    try:
        for name in COMPRESSORS:
            options = {"start_iter": 2, "rank": 1} if name == "powersgd" else {}
            original = make_compressor(name, None, **options)
            grads = [torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * rank + step))
                     for step in range(4)]
            for step in range(3):
                original.allreduce_mean_buckets_([grads[step].clone()], [(0, 1)])
            saved = original.state_dict()
            folder = Path(result_file).parent / f"{name}_rank{rank}"
            dcp.save(dict(saved), checkpoint_id=str(folder), no_dist=True)
            loaded = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in saved.items()}
            dcp.load(loaded, checkpoint_id=str(folder), no_dist=True)
            restored = make_compressor(name, None, **options)
            restored.load_state_dict(loaded)
            results = []
            for compressor in (original, restored, make_compressor(name, None, **options)):
                grad = grads[3].clone()
                compressor.allreduce_mean_buckets_([grad], [(0, 1)])
                results.append(grad)
            outcome[name] = {"keys": sorted(saved), "equal": torch.equal(results[0], results[1]),
                             "fresh_differs": not torch.equal(results[0], results[2])}
        if rank == 0:
            Path(result_file).write_text(json.dumps(outcome))
    finally:
        dist.destroy_process_group()


def test_compressor_state_survives_a_checkpoint_exactly(tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    spawn_gloo_workers(_compressor_worker, (str(result),), 2, deadline_s=90)
    outcome = json.loads(result.read_text())
    assert {"iter", "error/0", "q/0", "rng_keys"} <= set(outcome["powersgd"]["keys"])
    assert {"worker_error/0", "server_error/0"} <= set(outcome["onebit"]["keys"])
    for name in COMPRESSORS:
        assert outcome[name]["equal"], f"{name}: the restored compressor reduces like the original"
        assert outcome[name]["fresh_differs"], f"{name}: the state matters (a fresh compressor reduces otherwise)"
