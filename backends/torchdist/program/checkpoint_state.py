"""What a checkpoint of the emitted program holds, keyed so that a rank of any plan of the same model
loads what it needs: DCP reads by name, so each rank asks only for the names it holds.

  model/<name>                          parameters and buffers by the model's qualified names (a tied
                                        tensor under one name: the first of its aliases in the model's
                                        state-dict order, `canonical_names`; a tensor-parallel shard as
                                        <name>@tp<j>of<t>: a plan of another degree puts the lanes'
                                        pieces together and cuts its own, checkpoint_reshard.py)
  optim/<name>/<key>                    optimizer state per parameter (AdamW exp_avg, exp_avg_sq, step;
                                        SGD momentum_buffer; 1-bit Adam's also variance_step); in a
                                        `zero` gradient group written and read by the parameter's
                                        owner alone (zero.held_parameters)
  compressor/<group>/rank<r>/<key>      gradient-compressor state per plan group and plan rank
  scaler/<key>                          the fp16 loss scaler's state (plan-wide)
  rng/rank<r>/cpu, rng/rank<r>/cuda     each rank's torch generator states
  meta/step, meta/seed, meta/optimizer, meta/plan_digest, meta/onebit_freeze_step
  meta/tp/<name>                        how a split parameter's shards were cut (checkpoint_reshard.py)
  meta/micro_batches                    each replica's micro-batch sizes when the checkpoint was taken
                                        (a --rebalance may have changed the plan's): the same plan resumes
                                        with them

Names every rank of a plan writes alike (a replicated parameter, the step) are written once (DCP's
de-duplication keeps one copy); replicas and the stages sharing a tied weight hold identical values.
The data position needs no entry: step k's rows follow from (seed, k) (rows.Selection), and the
resumed run reads from step k on (data.ReplicaData.micro_batches restarts there).

On the same plan (equal plan digest) everything is restored exactly, so a resumed run continues bit for
bit. On another plan, gradient-compressor state cannot be resharded (group members and bucket contents
differ) and each rank's generator state has no counterpart: both start fresh, and rank 0 says so in one
warning line; parameters, optimizer state, the loss scale and the step carry over, at any
tensor-parallel degree.

DCP is imported by the readers on first use, as checkpoint_save.py is by train.py: a run that neither
saves nor resumes never needs it (checkpoint.py).
"""

from __future__ import annotations

import hashlib
import math
import pickle
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from backends.compression import GradientCompressor, OneBitAdamW
from passes.tensor_parallel import ShardSpec
from planner.core.ir import Plan

from . import checkpoint_reshard
from .checkpoint import CheckpointError, step_of
from .precision import LossScaler
from .zero import held_parameters

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

MODEL, OPTIM, COMPRESSOR, SCALER, RNG, META = "model/", "optim/", "compressor/", "scaler/", "rng/", "meta/"
# one DCP load of tensors saved at another tensor-parallel degree holds at most this many bytes of their pieces
# and state (a larger tensor's alone): each load costs ~20 ms beside its bytes, one per tensor ~2 s a rank
RESHARD_LOAD_BYTES = 256 << 20


def plan_digest(plan: Plan) -> str:
    """sha256 of the plan's JSON: two runs restore each other's per-rank state only when it is equal."""
    return hashlib.sha256(plan.to_json().encode()).hexdigest()


def canonical_names(module: torch.nn.Module) -> dict[str, str]:
    """Every state-dict name of `module` -> the name its tensor is saved under: itself, or for a tied
    tensor the first of its names in state-dict order (the same in every plan). Works on meta."""
    first: dict[int, str] = {}
    out = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        out[name] = first.setdefault(id(tensor), name)
    return out


@dataclass
class RankState:
    """This rank's live training state, which `collect` reads and `restore` writes in place."""

    tensors: dict[str, torch.Tensor]        # canonical model name -> parameter or buffer of this stage
    optimizer: torch.optim.Optimizer
    compressors: Mapping[int, GradientCompressor]   # plan group index -> compressor (gradsync.compressors)
    scaler: LossScaler | None
    rank: int
    device: torch.device
    seed: int
    optimizer_name: str
    plan_digest: str
    plan_compresses: bool                   # any gradient group of the plan has a compressor
    cuts: Mapping[str, ShardSpec] = field(default_factory=dict)   # saved base name -> how its shard is cut
    # each replica's micro-batch sizes the run trains with now (a rebalance changes them), and those a
    # checkpoint of the same plan was taken with, which `restore` sets
    micro_batches: Callable[[], tuple[tuple[int, ...], ...]] | None = None
    resumed_micro_batches: tuple[tuple[int, ...], ...] | None = None

    def _param_names(self) -> dict[int, str]:
        return {id(t): name for name, t in self.tensors.items() if isinstance(t, torch.nn.Parameter)}


def collect(state: RankState, steps_done: int) -> dict[str, Any]:
    """The flat state dict of the checkpoint taken after `steps_done` steps (tensors shared, not copied:
    DCP's staging copies them)."""
    out: dict[str, Any] = {MODEL + name: t.detach() for name, t in state.tensors.items()}
    names = state._param_names()
    for p in held_parameters(state.optimizer):
        for key, value in state.optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) or isinstance(value, (int, float)):
                out[f"{OPTIM}{names[id(p)]}/{key}"] = value
    for index, compressor in state.compressors.items():
        for key, value in compressor.state_dict().items():
            out[f"{COMPRESSOR}{index}/rank{state.rank}/{key}"] = value
    if state.scaler is not None:
        out.update({SCALER + key: value for key, value in state.scaler.state_dict().items()})
    out[f"{RNG}rank{state.rank}/cpu"] = torch.get_rng_state()
    if state.device.type == "cuda":
        out[f"{RNG}rank{state.rank}/cuda"] = torch.cuda.get_rng_state(state.device)
    out.update({META + "step": steps_done, META + "seed": state.seed, META + "optimizer": state.optimizer_name,
                META + "plan_digest": state.plan_digest})
    out.update(checkpoint_reshard.cut_entries(state.cuts))
    if state.micro_batches is not None:
        out[META + "micro_batches"] = ";".join(",".join(map(str, sizes)) for sizes in state.micro_batches())
    if isinstance(state.optimizer, OneBitAdamW):
        out[META + "onebit_freeze_step"] = state.optimizer.freeze_step
    return out


def read_metadata(folder: Path) -> Metadata:
    """DCP's metadata of a checkpoint folder (a pickle: open only checkpoints you trust)."""
    import torch.distributed.checkpoint as dcp  # on first use, as in every reader here (module docstring)

    try:
        return dcp.FileSystemReader(str(folder)).read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"not a readable torch.distributed.checkpoint: {exc}", file=str(folder),
                              fix="resume from another checkpoint") from exc


def empty_like_entry(entry: Any) -> Any:
    """A tensor DCP can fill for a tensor entry; None for a plain value (DCP replaces it)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if isinstance(entry, TensorStorageMetadata):
        return torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    return None


def restore(folder: Path, state: RankState, *, keep_freeze_step: bool = False) -> int:
    """Load the checkpoint `folder` into this rank's live state (see the module docstring for what
    carries over between plans); the steps it was taken after. Each rank reads alone
    (`no_dist=True`), only its own names. `keep_freeze_step`: 1-bit Adam keeps its own freeze step
    (given on the command line) instead of the checkpoint's."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = read_metadata(folder).state_dict_metadata
    request: dict[str, Any] = {}
    moved: list[str] = []                 # names saved at another tensor-parallel degree (checkpoint_reshard)
    for name, tensor in state.tensors.items():
        entry = entries.get(MODEL + name)
        if entry is None:
            moved.append(name)
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"the checkpoint holds no tensor {name}, which this rank trains", file=str(folder),
                                  fix="resume from a checkpoint of this model")
        if tuple(entry.size) != tuple(tensor.shape):
            raise CheckpointError(f"tensor {name} has shape {list(entry.size)} in the checkpoint but "
                                  f"{list(tensor.shape)} here", file=str(folder),
                                  fix="resume from a checkpoint of this model's configuration")
        request[MODEL + name] = tensor.detach()           # filled in place
    names = state._param_names()
    held = [names[id(p)] for p in held_parameters(state.optimizer)]
    wanted_prefixes = [OPTIM + name + "/" for name in held if name not in moved]
    mine = (f"{COMPRESSOR}", f"{RNG}rank{state.rank}/", SCALER, META)
    for key, entry in entries.items():
        if key.startswith(OPTIM) and any(key.startswith(p) for p in wanted_prefixes):
            request[key] = empty_like_entry(entry)
        elif key.startswith(mine) and (not key.startswith(COMPRESSOR) or f"/rank{state.rank}/" in key):
            request[key] = empty_like_entry(entry)
    meta = {key: request.pop(key) for key in [k for k in request if k.startswith(META)]}
    load_entries(folder, meta)                            # the run's kind first: nothing changed if it differs
    _check_run(folder, meta, state)
    lanes = checkpoint_reshard.saved_lanes(entries, MODEL) if moved else {}
    pieces = [_pieces(folder, entries, lanes, meta, state, name) for name in moved]   # all found before any is read
    load_entries(folder, request)
    request.update(meta)
    request.update(_resharded(folder, entries, state, pieces, set(held)))
    same_plan = request[META + "plan_digest"] == state.plan_digest
    _restore_optimizer(request, state, keep_freeze_step)
    if state.scaler is not None and any(k.startswith(SCALER) for k in request):
        state.scaler.load_state_dict({k.removeprefix(SCALER): v for k, v in request.items() if k.startswith(SCALER)})
    if same_plan:
        _restore_rank_state(request, state)
        saved = request.get(META + "micro_batches")
        if isinstance(saved, str) and saved:
            state.resumed_micro_batches = tuple(tuple(int(n) for n in sizes.split(",")) for sizes in saved.split(";"))
    elif state.rank == 0 and (state.plan_compresses or any(k.startswith(COMPRESSOR) for k in entries)):
        print(f"train.py: warning: {folder} was written by another plan: the gradient compressors' state "
              "(error feedback, PowerSGD's P and Q) starts fresh", file=sys.stderr, flush=True)
    return int(request[META + "step"])


def _pieces(folder: Path, entries: Mapping[str, Any], lanes: Mapping[str, Mapping[int, set[int]]],
            meta: Mapping[str, Any], state: RankState, name: str) -> checkpoint_reshard.Pieces:
    """Where the tensor this rank saves as `name` lies in a checkpoint of another tensor-parallel degree
    (`lanes`: checkpoint_reshard.saved_lanes of its model entries)."""
    base = checkpoint_reshard.split_name(name)[0]
    pieces = checkpoint_reshard.find_pieces(entries, MODEL, lanes, name, state.cuts.get(base), meta, folder)
    if pieces is None:
        raise CheckpointError(f"the checkpoint holds no tensor {base}, which this rank trains", file=str(folder),
                              fix="resume from a checkpoint of this model")
    if pieces.shape != tuple(state.tensors[name].shape):
        raise CheckpointError(f"tensor {base} has shape {list(pieces.whole)} in the checkpoint (in "
                              f"{len(pieces.sources)} pieces), which does not give this rank's "
                              f"{list(state.tensors[name].shape)}", file=str(folder),
                              fix="resume from a checkpoint of this model's configuration")
    return pieces


def _resharded(folder: Path, entries: Mapping[str, Any], state: RankState, moved: list[checkpoint_reshard.Pieces],
               held: set[str]) -> dict[str, Any]:
    """The tensors saved at another tensor-parallel degree put in place from their pieces (checkpoint_reshard.py),
    read in loads of up to RESHARD_LOAD_BYTES and put together one at a time; returns the optimizer state
    entries of those this rank holds state for, under this rank's names (as `restore` reads them)."""
    out: dict[str, Any] = {}
    for batch in _load_batches(entries, [(pieces, OPTIM if pieces.name in held else None) for pieces in moved]):
        request = {name: empty_like_entry(entries[name])
                   for pieces, prefix in batch for name in checkpoint_reshard.wanted(pieces, entries, prefix)}
        load_entries(folder, request)
        for pieces, prefix in batch:
            value, optim = checkpoint_reshard.put_together(pieces, request, entries, prefix)
            with torch.no_grad():
                state.tensors[pieces.name].copy_(value)
            out.update({f"{OPTIM}{pieces.name}/{key}": v for key, v in optim.items()})
    return out


def _load_batches(entries: Mapping[str, Any], moved: list[tuple[checkpoint_reshard.Pieces, str | None]]
                  ) -> Iterator[list[tuple[checkpoint_reshard.Pieces, str | None]]]:
    """`moved` in runs whose wanted entries hold at most RESHARD_LOAD_BYTES together (a larger tensor alone)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    def nbytes(name: str) -> int:
        entry = entries[name]
        if not isinstance(entry, TensorStorageMetadata):
            return 0
        return math.prod(entry.size) * torch.empty((), dtype=entry.properties.dtype).element_size()

    batch: list[tuple[checkpoint_reshard.Pieces, str | None]] = []
    held = 0
    for pieces, prefix in moved:
        size = sum(nbytes(name) for name in checkpoint_reshard.wanted(pieces, entries, prefix))
        if batch and held + size > RESHARD_LOAD_BYTES:
            yield batch
            batch, held = [], 0
        batch.append((pieces, prefix))
        held += size
    if batch:
        yield batch


def load_entries(folder: Path, request: dict[str, Any]) -> None:
    """DCP's load of `request`'s names from `folder` by this process alone (`no_dist`: in a process with
    a group, DCP's load is otherwise collective), in place: tensors filled, plain values replaced."""
    import torch.distributed.checkpoint as dcp

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(request, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError, EOFError) as exc:
        raise CheckpointError(f"reading the checkpoint failed: {exc}", file=str(folder),
                              fix="resume from another checkpoint (this one may be damaged)") from exc


def _check_run(folder: Path, request: Mapping[str, Any], state: RankState) -> None:
    """The checkpoint is this run's kind: its step matches its folder, same seed, same optimizer."""
    missing = [key for key in ("step", "seed", "optimizer", "plan_digest") if META + key not in request]
    if missing:
        raise CheckpointError(f"the checkpoint lacks {META}{missing[0]}: not one the training program wrote",
                              file=str(folder), fix="resume from a checkpoint of --checkpoint-dir")
    step = request[META + "step"]
    if step != step_of(folder):
        raise CheckpointError(f"the checkpoint holds step {step}, its folder says {step_of(folder)}",
                              file=str(folder), fix="resume from a folder the program wrote")
    if request[META + "seed"] != state.seed:
        raise CheckpointError(f"the checkpoint was trained with --seed {request[META + 'seed']}, this run has "
                              f"{state.seed} (the data order follows the seed)", file=str(folder),
                              field="--seed", fix=f"pass --seed {request[META + 'seed']}")
    if request[META + "optimizer"] != state.optimizer_name:
        raise CheckpointError(f"the checkpoint was trained with {request[META + 'optimizer']}, this run uses "
                              f"{state.optimizer_name}", file=str(folder), field="--optimizer",
                              fix=f"pass --optimizer {request[META + 'optimizer']}")


def _restore_optimizer(request: Mapping[str, Any], state: RankState, keep_freeze_step: bool) -> None:
    """Each parameter's optimizer state from its `optim/<name>/` entries (state tensors shaped like the
    parameter go to its device; the step counters stay on the CPU, as torch keeps them)."""
    names = state._param_names()
    for p in held_parameters(state.optimizer):
        prefix = f"{OPTIM}{names[id(p)]}/"
        loaded = {k.removeprefix(prefix): v for k, v in request.items() if k.startswith(prefix)}
        if loaded:
            state.optimizer.state[p] = {
                k: v.to(p.device) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                for k, v in loaded.items()}
    freeze = request.get(META + "onebit_freeze_step")
    if isinstance(state.optimizer, OneBitAdamW) and freeze is not None and not keep_freeze_step:
        state.optimizer.freeze_step = int(freeze)


def _restore_rank_state(request: Mapping[str, Any], state: RankState) -> None:
    """The same plan: this rank's compressors and generators as they were."""
    for index, compressor in state.compressors.items():
        prefix = f"{COMPRESSOR}{index}/rank{state.rank}/"
        own = {k.removeprefix(prefix): v.to(state.device) if isinstance(v, torch.Tensor) else v
               for k, v in request.items() if k.startswith(prefix)}
        if own:
            compressor.load_state_dict(own)
    cpu = request.get(f"{RNG}rank{state.rank}/cpu")
    if isinstance(cpu, torch.Tensor):
        torch.set_rng_state(cpu)
    cuda = request.get(f"{RNG}rank{state.rank}/cuda")
    if isinstance(cuda, torch.Tensor) and state.device.type == "cuda":
        torch.cuda.set_rng_state(cuda, state.device)
