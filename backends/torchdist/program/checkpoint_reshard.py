"""A checkpoint read by a plan of another tensor-parallel degree: each tensor a rank trains, and its
optimizer state, put together from the pieces the other plan saved and cut to this rank's shard.

A shard of lane j of degree t is saved as <name>@tp<j>of<t> (checkpoint_state.shard_name), and how it was
cut (the sharded dim, and the interleave of a fused projection: passes.tensor_parallel.ShardSpec) under
meta/tp/<name>, so that any plan of the model reads it back: the pieces of every lane, in lane order, put
together (`unshard`), then this rank's lane cut from the whole (`shard_tensor`); a plan of degree 1 keeps
the whole, and a checkpoint of degree 1 holds the whole under the name itself. The same for each tensor of
the parameter's optimizer state (AdamW's moments, SGD's momentum: shaped like the parameter), whose
counters (a step) every lane holds alike. The cut is the model's, found in its graph whatever the degree,
so a checkpoint written before cuts were recorded is read with this rank's own (degree 1 has none: it
says which degree to plan instead).

A tensor's pieces and its state are read together (`wanted`, then `put_together`); the caller loads
several tensors' at once up to a bound on the bytes (checkpoint_state.RESHARD_LOAD_BYTES: each DCP load
costs ~20 ms beside its bytes), and puts them together one at a time, so a rank holds one load's pieces
and one whole parameter beside its own tensors at most.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from passes.tensor_parallel import ShardSpec, shard_tensor, unshard

from .checkpoint import CheckpointError

CUT = "meta/tp/"                 # meta/tp/<name> -> "<dim>/<interleave>": how the shards of <name> were cut
_SHARD = re.compile(r"^(?P<base>.+)@tp(?P<lane>\d+)of(?P<degree>\d+)$")


def shard_name(name: str, lane: int, degree: int) -> str:
    """The name shard `lane` of `degree` of the parameter `name` is saved under (and its optimizer state)."""
    return f"{name}@tp{lane}of{degree}"


def split_name(name: str) -> tuple[str, int, int]:
    """(base name, lane, degree) of a saved name; a whole tensor is lane 0 of degree 1."""
    found = _SHARD.match(name)
    return (found["base"], int(found["lane"]), int(found["degree"])) if found else (name, 0, 1)


def cut_entries(cuts: Mapping[str, ShardSpec]) -> dict[str, str]:
    """The meta/tp/ entries recording how each of a rank's split parameters is cut (by base name)."""
    return {CUT + name: f"{spec.dim}/{spec.interleave}" for name, spec in cuts.items()}


@dataclass(frozen=True)
class Pieces:
    """Where a tensor this rank trains lies in a checkpoint of another degree."""

    name: str                    # this rank's saved name (its own shard's, or the whole's)
    sources: tuple[str, ...]     # the checkpoint's names of the pieces, lane order (one: the whole)
    cut: ShardSpec | None        # how the pieces were cut (None: one whole tensor)
    own: ShardSpec | None        # how this rank's tensor is cut from the whole (None: it is the whole)
    lane: int
    degree: int
    whole: tuple[int, ...]       # the whole tensor's shape

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of what `reshard` gives: this rank's shard of the whole, or the whole."""
        if self.own is None:
            return self.whole
        dim = self.own.dim
        return (*self.whole[:dim], self.whole[dim] // self.degree, *self.whole[dim + 1:])

    def reshard(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """This rank's tensor from the pieces (each shaped like a piece of `cut`)."""
        whole = pieces[0] if self.cut is None else unshard(pieces, self.cut)
        return whole if self.own is None else shard_tensor(whole, self.own, self.degree, self.lane)


def _cut(text: str, name: str, piece: tuple[int, ...], degree: int) -> ShardSpec:
    """A recorded cut (`cut_entries`) of pieces shaped `piece` of `degree`."""
    dim, interleave = (int(part) for part in text.split("/"))
    return ShardSpec(name=name, dim=dim, interleave=interleave,
                     shape=(*piece[:dim], piece[dim] * degree, *piece[dim + 1:]))


def saved_lanes(entries: Mapping[str, Any], prefix: str) -> dict[str, dict[int, set[int]]]:
    """Base name -> degree -> the lanes whose shards a checkpoint holds under `prefix` (read once per restore)."""
    out: dict[str, dict[int, set[int]]] = {}
    for key in entries:
        if key.startswith(prefix):
            base, lane, degree = split_name(key.removeprefix(prefix))
            if degree > 1:
                out.setdefault(base, {}).setdefault(degree, set()).add(lane)
    return out


def find_pieces(entries: Mapping[str, Any], prefix: str, lanes: Mapping[str, Mapping[int, set[int]]], name: str,
                own: ShardSpec | None, cuts: Mapping[str, str], folder: Path) -> Pieces | None:
    """Where the tensor saved as `name` by this rank lies in a checkpoint of another degree (`entries`: the
    checkpoint's metadata, `prefix`: model/, `lanes`: its `saved_lanes` under it, `own`: this rank's cut of
    it, `cuts`: the checkpoint's meta/tp/ entries); None where the checkpoint has no piece of it at any degree."""
    base, lane, degree = split_name(name)
    if prefix + base in entries:
        return Pieces(name, (prefix + base,), None, own, lane, degree, tuple(entries[prefix + base].size))
    whole = [t for t, seen in sorted(lanes.get(base, {}).items()) if seen == set(range(t))]
    if not whole:
        return None
    saved = whole[0]
    recorded = cuts.get(CUT + base)
    if isinstance(recorded, str):
        cut = _cut(recorded, base, tuple(entries[prefix + shard_name(base, 0, saved)].size), saved)
    elif own is not None:               # a checkpoint from before the cuts were recorded: the model's own
        cut = ShardSpec(base, own.dim, own.interleave, own.shape)
    else:
        raise CheckpointError(f"tensor {base} was saved in {saved} tensor-parallel shards without a record of "
                              "how they were cut (a checkpoint of an older program)", file=str(folder),
                              fix=f"resume with a plan of --tp {saved}")
    return Pieces(name, tuple(prefix + shard_name(base, j, saved) for j in range(saved)), cut, own, lane, degree,
                  cut.shape)


def wanted(pieces: Pieces, entries: Mapping[str, Any], optim_prefix: str | None) -> list[str]:
    """The checkpoint's names to load for `pieces`: each piece, and each piece's optimizer state where this
    rank holds state for it (`optim_prefix`; None: a rank that holds none of it)."""
    names = list(pieces.sources)
    for key in _state_keys(pieces, entries, optim_prefix):
        names.extend(full for saved in _saved(pieces) if (full := f"{optim_prefix}{saved}/{key}") in entries)
    return names


def put_together(pieces: Pieces, loaded: Mapping[str, Any], entries: Mapping[str, Any],
                 optim_prefix: str | None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The tensor this rank trains, and its optimizer state by key (its tensors resharded alike, its
    counters lane 0's), from `loaded`: at least the names `wanted` gave, as a DCP load filled them."""
    tensor = pieces.reshard([loaded[source] for source in pieces.sources])
    state: dict[str, Any] = {}
    for key in _state_keys(pieces, entries, optim_prefix):
        values = [loaded.get(f"{optim_prefix}{saved}/{key}") for saved in _saved(pieces)]
        if not (isinstance(values[0], torch.Tensor) and values[0].dim() > 0):
            state[key] = values[0]                      # a counter, alike on every lane
            continue
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if len(tensors) != len(values):
            raise CheckpointError(f"the optimizer state {key} of {split_name(pieces.name)[0]} lacks a lane's piece",
                                  fix="resume from another checkpoint (this one may be damaged)")
        state[key] = pieces.reshard(tensors)
    return tensor, state


def _saved(pieces: Pieces) -> list[str]:
    """The pieces' names as their ranks saved them (without the model/ prefix)."""
    return [source.split("/", 1)[1] for source in pieces.sources]


def _state_keys(pieces: Pieces, entries: Mapping[str, Any], optim_prefix: str | None) -> list[str]:
    """The optimizer state's keys of the first piece (exp_avg, step, ...); none without `optim_prefix`."""
    if optim_prefix is None:
        return []
    lane0 = f"{optim_prefix}{_saved(pieces)[0]}/"
    return sorted({key.removeprefix(lane0) for key in entries if key.startswith(lane0)})
