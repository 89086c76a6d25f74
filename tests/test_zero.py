"""ZeRO-1 per gradient group (backends/torchdist/program/zero.py, costmodel/zero.py) on real gloo ranks.

Each scenario runs on 2 and on 3 spawned processes, under AdamW and under SGD (momentum 0.9), as the
emitted program runs a step: `GradientSync` over three plan gradient groups of all ranks (two `zero`
ones: six equal Linear layers, whose 12 tensors split evenly; the head's weight, one tensor, which one
rank owns; and a plain one: the head's bias), the program's optimizer from
`optimizers.make_stage_optimizer`, fp16 loss scaling (`precision.LossScaler`), `sync_step_gradients`
and `optimizer_step`. One rank overflows at one step: every rank skips it.

Next to it each rank runs the unsharded reference, `optimizers.make_optimizer` on a copy of the model,
stepped with the very gradients the sync produced: the parameters must agree within 1e-6 at every
step, and on every rank. Measured per rank: the optimizer state bytes (state tensors this rank holds)
and the parameter bytes the shards' broadcasts deliver after each step, checked against
costmodel.zero. A checkpoint (torch.distributed.checkpoint through `checkpoint_state`) taken mid-run
and resumed into a fresh model and optimizer continues bit for bit as the uninterrupted run.

End to end, the emitted program of a real plan (the MLP in 2 stages x 2 replicas on cpu-hetero-4, 4
torchrun ranks) with `zero` set on its gradient groups trains as the same plan without it, and a run
stopped at a checkpoint and resumed equals its uninterrupted run bit for bit (train.py unchanged: its
`make_stage_optimizer` builds the sharded optimizer, its checkpoints save each rank's own state).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from backends.torchdist.program import checkpoint, checkpoint_save, checkpoint_state, optimizers, precision, zero
from backends.torchdist.program.gradsync import GradientSync
from costmodel import zero as costs
from planner.core.errors import PlanFileError
from planner.core.ir import GradGroup, Plan
from tests.helpers import EXAMPLES, read_metrics, spawn_gloo_workers
from tests.test_checkpoint_e2e import losses_by_step, plan_program, train_program

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)
JOIN_DEADLINE_S = 120.0
WIDTH, BODY_LAYERS, ROWS = 12, 6, 5
STEPS, SAVE_AFTER, OVERFLOW_STEP = 6, 3, 1
LR = 1e-2
TOLERANCE = 1e-6
FP32_BYTES = 4
OPTIMIZERS = ("adamw", "sgd")


# ----------------------------------------------------------------------------- the model and its groups

def _model(seed: int) -> nn.Sequential:
    """Six equal Linear layers (the first `zero` group: 12 tensors, an even split over 2 or 3 ranks) and
    a head (its weight the second `zero` group, its bias a plain one)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(BODY_LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    layers.append(nn.Linear(WIDTH, WIDTH))
    return nn.Sequential(*layers)


HEAD = str(2 * BODY_LAYERS)
BODY_PARAMS = tuple(f"{2 * i}.{kind}" for i in range(BODY_LAYERS) for kind in ("weight", "bias"))
BODY_BYTES = BODY_LAYERS * (WIDTH * WIDTH + WIDTH) * FP32_BYTES
HEAD_WEIGHT_BYTES = WIDTH * WIDTH * FP32_BYTES


def _groups(world: int) -> list[GradGroup]:
    ranks = tuple(range(world))
    return [GradGroup(0, ranks, BODY_PARAMS, BODY_BYTES, "none", "ring", 0.0, zero=True),
            GradGroup(1, ranks, (f"{HEAD}.weight",), HEAD_WEIGHT_BYTES, "none", "ring", 0.0, zero=True),
            GradGroup(2, ranks, (f"{HEAD}.bias",), WIDTH * FP32_BYTES, "none", "ring", 0.0)]


def _batch(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(ROWS, WIDTH, generator=generator)


# ----------------------------------------------------------------------------- one rank's run

class _Run:
    """One rank's training under the program's optimizer, its reference beside it."""

    def __init__(self, name: str, world: int, rank: int, process_groups: dict[int, dist.ProcessGroup],
                 seed: int = 0) -> None:
        self.name, self.world, self.rank = name, world, rank
        self.model = _model(seed)
        self.params = dict(self.model.named_parameters())
        self.grad_sync = GradientSync(_groups(world), process_groups, self.params)
        self.optimizer = optimizers.make_stage_optimizer(name, list(self.params.values()), self.grad_sync, LR,
                                                         onebit_freeze_step=1)
        assert isinstance(self.optimizer, zero.ShardedStageOptimizer)
        self.scaler = precision.LossScaler(torch.device("cpu"))
        self.reference = _model(seed)
        self.reference_params = dict(self.reference.named_parameters())
        self.reference_optimizer = optimizers.make_optimizer(name, list(self.reference_params.values()), LR)
        self.received_bytes: list[int] = []

    def state(self) -> checkpoint_state.RankState:
        return checkpoint_state.RankState(
            tensors=dict(self.model.state_dict(keep_vars=True)), optimizer=self.optimizer, compressors={},
            scaler=self.scaler, rank=self.rank, device=torch.device("cpu"), seed=0, optimizer_name=self.name,
            plan_digest="zero-test", plan_compresses=False)

    def step(self, step: int) -> bool:
        loss = self.model(_batch(step, self.rank)).pow(2).mean()
        self.scaler.scale_loss(loss).backward()
        if step == OVERFLOW_STEP and self.rank == 1:
            self.params["0.weight"].grad[0, 0] = float("inf")     # type: ignore[index]
        skipped = optimizers.sync_step_gradients(self.grad_sync, list(self.params.values()), self.optimizer,
                                                 self.scaler)
        if not skipped:                                         # the reference: the same gradients, unsharded
            for name, p in self.reference_params.items():
                p.grad = self.params[name].grad.clone()          # type: ignore[union-attr]
            self.reference_optimizer.step()
        with _BroadcastTap(self.rank) as tap:
            optimizers.optimizer_step(self.optimizer, self.scaler)
        self.received_bytes.append(tap.received_bytes)
        self.optimizer.zero_grad(set_to_none=False)
        return skipped

    def check_equal_to_reference(self, step: int) -> None:
        for name, p in self.params.items():
            difference = (p.detach() - self.reference_params[name].detach()).abs().max().item()
            assert difference <= TOLERANCE, f"{self.name}, step {step}, {name}: {difference} from the reference"
        flat = torch.cat([p.detach().reshape(-1) for p in self.params.values()])
        gathered = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(g, flat) for g in gathered), f"{self.name}, step {step}: ranks differ"


class _BroadcastTap:
    """Counts the bytes the broadcasts inside the `with` deliver to this rank (torch's
    ZeroRedundancyOptimizer sends each updated parameter from its owner with dist.broadcast)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.received_bytes = rank, 0
        self._original = dist.broadcast

    def __enter__(self) -> _BroadcastTap:
        def counted(tensor: torch.Tensor, src: int | None = None, *args: Any, **kwargs: Any) -> Any:
            if src != self.rank:
                self.received_bytes += tensor.numel() * tensor.element_size()
            return self._original(tensor, src, *args, **kwargs)

        dist.broadcast = counted   # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.broadcast = self._original


def _state_bytes_of(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    held = {id(p) for p in zero.held_parameters(optimizer)}
    return sum(v.numel() * v.element_size() for p in params if id(p) in held
               for k, v in optimizer.state.get(p, {}).items() if isinstance(v, torch.Tensor) and k != "step")


def _scenario(name: str, world: int, rank: int, folder: Path) -> dict[str, Any]:
    process_groups = {g.index: dist.new_group(list(g.ranks)) for g in _groups(world)}
    run = _Run(name, world, rank, process_groups)
    root = folder / f"ckpt_{name}"
    saver = checkpoint_save.Checkpointer(root, SAVE_AFTER, rank=rank, world_size=world, plan_digest="zero-test",
                                         synchronous=True, timeout_s=30)
    skipped_steps = []
    for step in range(STEPS):
        if run.step(step):
            skipped_steps.append(step)
        run.check_equal_to_reference(step)
        if saver.due(step + 1) and step + 1 == SAVE_AFTER:
            saver.save(step + 1, checkpoint_state.collect(run.state(), step + 1))
    saver.close()
    assert skipped_steps == [OVERFLOW_STEP]
    body = [run.params[n] for n in BODY_PARAMS]
    head_weight = [run.params[f"{HEAD}.weight"]]
    optim_keys = sorted(k for k in checkpoint_state.collect(run.state(), STEPS) if k.startswith("optim/"))

    resumed = _Run(name, world, rank, process_groups, seed=1)     # other values: the checkpoint must fill them
    first = checkpoint_state.restore(checkpoint.step_folder(root, SAVE_AFTER), resumed.state())
    assert first == SAVE_AFTER
    for step in range(first, STEPS):
        resumed.step(step)
    for param_name, p in run.params.items():
        assert torch.equal(p, resumed.params[param_name]), f"{name}: resumed {param_name} differs"
    for p, q in zip(zero.held_parameters(run.optimizer), zero.held_parameters(resumed.optimizer)):
        for key, value in run.optimizer.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(resumed.optimizer.state[q][key])), key
    assert resumed.scaler.scale == run.scaler.scale

    reference_body = [run.reference_params[n] for n in BODY_PARAMS]
    assert isinstance(run.optimizer, zero.ShardedStageOptimizer)
    return {"body_state_bytes": _state_bytes_of(run.optimizer, body),
            "head_weight_state_bytes": _state_bytes_of(run.optimizer, head_weight),
            "state_bytes": zero.state_bytes(run.optimizer),
            "reference_body_state_bytes": _state_bytes_of(run.reference_optimizer, reference_body),
            "reference_state_bytes": zero.state_bytes(run.reference_optimizer),
            "received_bytes_per_step": run.received_bytes, "gather_bytes": run.optimizer.gather_bytes(),
            "optim_keys": optim_keys}


def _worker(rank: int, store_port: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    try:
        results = {name: _scenario(name, world, rank, Path(folder)) for name in OPTIMIZERS}
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- the tests

@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_zero_steps_equal_plain_steps_shard_state_and_resume_bit_for_bit(world: int, tmp_path: Path) -> None:
    spawn_gloo_workers(_worker, (world, str(tmp_path)), world, deadline_s=JOIN_DEADLINE_S)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for name in OPTIMIZERS:
        measured = [r[name] for r in ranks]
        # optimizer state: the even split of the body, exactly what the cost model says; 1/world of unsharded
        unsharded = costs.optimizer_state_bytes(BODY_BYTES, name)
        for m in measured:
            assert m["reference_body_state_bytes"] == unsharded
            assert m["body_state_bytes"] == costs.zero_state_bytes(BODY_BYTES, name, world)
            assert m["body_state_bytes"] * world == m["reference_body_state_bytes"]
            assert m["state_bytes"] < m["reference_state_bytes"]
        # one tensor cannot split: its owner holds it all; summed over the group it is the unsharded state
        head = [m["head_weight_state_bytes"] for m in measured]
        assert sorted(head) == [0] * (world - 1) + [costs.optimizer_state_bytes(HEAD_WEIGHT_BYTES, name)]
        replicated = costs.optimizer_state_bytes(WIDTH * FP32_BYTES, name)       # the plain group's, everywhere
        assert sum(m["state_bytes"] for m in measured) == measured[0]["reference_state_bytes"] + \
            (world - 1) * replicated
        # the gather after each step taken: what the broadcasts delivered = the optimizer's own count; the
        # even body per rank and the whole group's total as the cost model says; nothing on the skipped step
        total_per_step = sum(costs.zero_gather_bytes(b, world) for b in (BODY_BYTES, HEAD_WEIGHT_BYTES)) * world
        for step in range(STEPS):
            received = [m["received_bytes_per_step"][step] for m in measured]
            if step == OVERFLOW_STEP:
                assert received == [0] * world
                continue
            assert received == [m["gather_bytes"] for m in measured]
            assert sum(received) == total_per_step
        body_owner_free = [m for m in measured if m["head_weight_state_bytes"] == 0]
        for m in body_owner_free:      # a rank that owns none of the head receives the body's share and the head
            assert m["gather_bytes"] == costs.zero_gather_bytes(BODY_BYTES, world) + HEAD_WEIGHT_BYTES
        # the checkpoint: every zero parameter's state saved by one rank alone, the plain one's by all
        keys = [set(m["optim_keys"]) for m in measured]
        for key in set().union(*keys):
            holders = sum(key in k for k in keys)
            assert holders == (world if key.startswith(f"optim/{HEAD}.bias/") else 1), key


def test_cost_model_numbers() -> None:
    assert costs.optimizer_state_bytes(1000.0, "adamw") == 2000.0
    assert costs.optimizer_state_bytes(1000.0, "sgd") == 1000.0
    assert costs.zero_state_bytes(1200.0, "adamw", 3) == 800.0
    assert costs.zero_state_bytes(1200.0, "adamw", 1) == costs.optimizer_state_bytes(1200.0, "adamw")
    assert costs.zero_saved_bytes(1200.0, "sgd", 4) == 900.0
    assert costs.zero_gather_bytes(1200.0, 4) == 900.0
    assert costs.zero_gather_bytes(1200.0, 1) == 0.0
    with pytest.raises(ValueError, match="optimizer 'lamb'"):
        costs.zero_state_bytes(1.0, "lamb", 2)
    with pytest.raises(ValueError, match="group_size is 0"):
        costs.zero_gather_bytes(1.0, 0)


def test_zero_with_onebit_is_refused_naming_the_field() -> None:
    from costmodel.compression import settings_of

    onebit = GradGroup(3, (0, 1), ("w",), 16.0, "onebit", "ring", 0.0, settings=settings_of("onebit"), zero=True)
    with pytest.raises(PlanFileError, match="onebit") as raised:
        zero.check_groups([onebit], "sgd")
    assert raised.value.field == "grad_groups[3].zero"
    plain_onebit = GradGroup(0, (0, 1), ("v",), 16.0, "onebit", "ring", 0.0, settings=settings_of("onebit"))
    sharded = GradGroup(1, (0, 1), ("w",), 16.0, "none", "ring", 0.0, zero=True)
    with pytest.raises(PlanFileError, match="1-bit Adam") as raised:
        zero.check_groups([plain_onebit, sharded], "adamw")
    assert raised.value.field == "grad_groups[1].zero"
    zero.check_groups([plain_onebit, sharded], "sgd")           # 1-bit gradients beside ZeRO: allowed
    zero.check_groups([GradGroup(0, (0,), ("w",), 4.0, "none", "ring", 0.0)], "adamw")


# ----------------------------------------------------------------------------- the emitted program

E2E_STEPS, E2E_SAVE_AFTER = 4, 2


def _with_zero(program: Path, copy: Path) -> Path:
    """A copy of the emitted program whose plan shards every gradient group's optimizer state."""
    shutil.copytree(program, copy)
    plan = Plan.load(copy / "plan.json")
    groups = tuple(dataclasses.replace(g, zero=True) for g in plan.grad_groups)
    (copy / "plan.json").write_text(dataclasses.replace(plan, grad_groups=groups).to_json())
    return copy


@pytest.fixture(scope="module")
def mlp_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The MLP's 2 x 2 plan without and with zero, each trained E2E_STEPS steps in one go."""
    root = tmp_path_factory.mktemp("zero_e2e")
    plain = plan_program(root / "plan", EXAMPLES / "mlp" / "model.py", "--stages", "2", "--use-all-devices")
    sharded = _with_zero(plain, root / "zero_program")
    assert all(len(g.ranks) == 2 and g.compressor == "none" for g in Plan.load(sharded / "plan.json").grad_groups)
    train_program(plain, root / "plain", E2E_STEPS)
    train_program(sharded, root / "zero", E2E_STEPS)
    return sharded, root / "plain", root / "zero"


@pytest.mark.slow
def test_program_with_zero_groups_trains_as_without(mlp_runs: tuple[Path, Path, Path]) -> None:
    _, plain, zero_run = mlp_runs
    expected, got = losses_by_step(plain), losses_by_step(zero_run)
    assert sorted(got) == list(range(E2E_STEPS))
    assert all(abs(got[step] - expected[step]) <= TOLERANCE for step in expected), (got, expected)
    for rank in range(4):
        want = torch.load(plain / "final" / f"rank{rank}.pt")
        have = torch.load(zero_run / "final" / f"rank{rank}.pt")
        assert have.keys() == want.keys()
        for name in want:
            assert (have[name] - want[name]).abs().max().item() <= TOLERANCE, (rank, name)


@pytest.mark.slow
def test_program_with_zero_groups_resumes_bit_for_bit(mlp_runs: tuple[Path, Path, Path], tmp_path: Path) -> None:
    sharded, _, full = mlp_runs
    work = tmp_path / "run"
    train_program(sharded, work, E2E_SAVE_AFTER, "--checkpoint-every", str(E2E_SAVE_AFTER))
    first_part = len(read_metrics(work / "metrics.jsonl"))
    proc = train_program(sharded, work, E2E_STEPS, "--checkpoint-every", str(E2E_SAVE_AFTER), "--resume")
    assert f"step_{E2E_SAVE_AFTER} at step {E2E_SAVE_AFTER}" in proc.stdout
    names = checkpoint_state.read_metadata(checkpoint.step_folder(work / "ckpt", E2E_SAVE_AFTER)).state_dict_metadata
    assert any(key.startswith("optim/") and key.endswith("/exp_avg") for key in names)
    resumed, expected = losses_by_step(work, first_part), losses_by_step(full)
    assert resumed == {step: expected[step] for step in range(E2E_SAVE_AFTER, E2E_STEPS)}      # exact floats
    for rank in range(4):
        want = torch.load(full / "final" / f"rank{rank}.pt")
        have = torch.load(work / "final" / f"rank{rank}.pt")
        assert all(torch.equal(have[name], want[name]) for name in want), rank
