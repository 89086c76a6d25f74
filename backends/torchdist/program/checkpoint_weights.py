"""A checkpoint of the program read as the whole model: each tensor under the model's own name at its whole
shape, put together from its tensor-parallel shards where it was saved as shards (checkpoint_reshard.py).

What `--weights CKPT` reads (weights.ProgramCheckpointSource: a fresh optimizer on trained weights) and
what `plan export --safetensors` writes out. The optimizer, compressor, scaler and generator entries are
not the model's and are left out; a tied tensor is saved under one of its names (checkpoint_state.
canonical_names), which the readers' alias matching accepts for the others. The tensors asked for at once
are read in one DCP load, each from the files holding it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from . import checkpoint, checkpoint_reshard
from .checkpoint import CheckpointError
from .checkpoint_state import META, MODEL, empty_like_entry, load_entries, read_metadata


class TrainedModel:
    """The model tensors of one complete checkpoint (`path`: a step_<N> folder, or a checkpoint root whose
    latest complete one is read)."""

    def __init__(self, path: Path) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        try:
            self.folder = checkpoint.resolve(Path(path))
        except CheckpointError as exc:      # resolve's fix speaks of resuming
            raise CheckpointError(exc.message, file=exc.file,
                                  fix="pass a checkpoint root holding complete step_<N> folders (`plan run "
                                      "--checkpoint-every` writes them), or one of them") from exc
        self._entries: dict[str, Any] = dict(read_metadata(self.folder).state_dict_metadata)
        if META + "step" not in self._entries:
            raise CheckpointError(f"the checkpoint lacks {META}step: not one the training program wrote",
                                  file=str(self.folder), fix="pass a checkpoint of `plan run --checkpoint-every`")
        meta: dict[str, Any] = {key: None for key in self._entries
                                if key.startswith(checkpoint_reshard.CUT) or key == META + "step"}
        load_entries(self.folder, meta)                      # plain values: DCP puts them in place of None
        self.step = int(meta.pop(META + "step"))
        self._cuts = meta
        lanes = checkpoint_reshard.saved_lanes(self._entries, MODEL)
        self._pieces: dict[str, checkpoint_reshard.Pieces] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        for key, entry in self._entries.items():
            if not (key.startswith(MODEL) and isinstance(entry, TensorStorageMetadata)):
                continue
            base = checkpoint_reshard.split_name(key.removeprefix(MODEL))[0]
            if base not in self._pieces:
                self._pieces[base] = self._find(base, lanes)
                self._dtypes[base] = entry.properties.dtype

    def _find(self, base: str, lanes: dict[str, dict[int, set[int]]]) -> checkpoint_reshard.Pieces:
        try:
            pieces = checkpoint_reshard.find_pieces(self._entries, MODEL, lanes, base, None, self._cuts, self.folder)
        except CheckpointError as exc:       # shards without a recorded cut: only a plan of their degree reads them
            raise CheckpointError(f"{exc.message}; it cannot be put together whole", file=str(self.folder),
                                  fix=f"{exc.fix}, save a checkpoint with this program, and read that") from exc
        if pieces is None:
            degrees = {t: sorted(seen) for t, seen in lanes.get(base, {}).items()}
            raise CheckpointError(f"tensor {base} lacks shards: of its tensor-parallel lanes the checkpoint holds "
                                  f"only {degrees}", file=str(self.folder),
                                  fix="read another checkpoint (this one may be damaged)")
        return pieces

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every model tensor's (whole shape, dtype) by the model's name, without reading any data."""
        return {name: (pieces.whole, self._dtypes[name]) for name, pieces in self._pieces.items()}

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each of `names`' whole tensor, in the order given (CPU, the saved dtype), all their pieces read
        in one DCP load (each load costs ~20 ms beside its bytes: one per tensor would be 15 s for
        Llama-2-70B's 723 tensors); the caller bounds the memory by the names it asks for at once."""
        request = {source: empty_like_entry(self._entries[source])
                   for name in names for source in self._pieces[name].sources}
        load_entries(self.folder, request)
        for name in names:
            pieces = self._pieces[name]
            yield name, pieces.reshard([request.pop(source) for source in pieces.sources])
