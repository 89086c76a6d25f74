"""Pretrained weights: a rank's own tensors, read from a checkpoint without reading anyone else's.

`open_weights` recognises a `.safetensors` file, a Hugging Face model directory (`model.safetensors`, or
shards listed by `model.safetensors.index.json`) and a torch.distributed.checkpoint (DCP) directory
(`.metadata`, a pickle: DCP's own format, so open only checkpoints you trust), among them the training
program's own checkpoints (a `step_<N>` folder or its root: the model's tensors, whole, however many
tensor-parallel shards they were saved in; checkpoint_weights.py), reading headers only;
`load_into` reads the bytes of a rank's tensors only, from the files holding them only. A model file that
wraps the Hugging Face model adds a prefix (`lm.model.norm.weight`), a checkpoint may carry one the model
lacks (`transformer.`): `match_names` decides one prefix rewrite over all names, the same on every rank.
A tied parameter is satisfied by any of its aliases (`save_pretrained` leaves `lm_head.weight` out when it
is the input embedding). Dtypes may differ (cast on load), shapes may not: `check_weights` and `load_into`
raise a WeightsError naming the tensor, the file and the fix.
"""

from __future__ import annotations

import difflib
import json
import math
import pickle
import warnings
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from types import ModuleType

import torch

from planner.core.errors import HetplanError

from .weight_names import (  # noqa: F401  (the names are read as weights.<name>)
    PrefixRewrite,
    TensorInfo,
    choose_rewrite,
    match_names,
    model_tensors,
    tied_aliases,
)

SAFETENSORS_SUFFIX = ".safetensors"
HF_SINGLE_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
DCP_METADATA_FILE = ".metadata"
FORMATS = ("a .safetensors file, a Hugging Face model directory (model.safetensors or "
           "model.safetensors.index.json) or a torch.distributed.checkpoint directory (.metadata)")

# the safetensors format's dtype names (safetensors/src/tensor.rs `Dtype`) that torch has
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class WeightsError(HetplanError):
    """The weights checkpoint is missing, of no known format, or does not fit the model."""

    exit_code = 2


class WeightsSource(ABC):
    """A checkpoint opened by its headers: every tensor's name, shape and dtype, and reads of some of them."""

    def __init__(self, path: Path, listing: Path) -> None:
        self.path = path
        self.listing = listing          # the file that lists the names: an index, a metadata file, the one file

    @abstractmethod
    def tensor_names(self) -> list[str]:
        """Every tensor's name, from the cheapest header that lists them (a shard index: no shard opened)."""

    @abstractmethod
    def infos(self, names: Collection[str]) -> dict[str, TensorInfo]:
        """(shape, dtype) of each of `names`, reading only the headers of the files that hold them."""

    @abstractmethod
    def read_into(self, targets: Mapping[str, Sequence[torch.Tensor]]) -> int:
        """Copy each named checkpoint tensor into every tensor of its list (cast, any device); the bytes read."""

    def names(self) -> dict[str, TensorInfo]:
        """Every tensor of the checkpoint with its (shape, dtype); reads every header."""
        return self.infos(self.tensor_names())

    def file_of(self, name: str) -> Path:
        """The file a tensor is in (the listing for a name that is in none)."""
        return self.listing


class SafetensorsSource(WeightsSource):
    """One safetensors file, or a Hugging Face directory's shards (`files`: tensor name -> its file)."""

    def __init__(self, path: Path, files: dict[str, Path], listing: Path) -> None:
        super().__init__(path, listing)
        self.files = files
        self._headers: dict[Path, dict[str, TensorInfo]] = {}

    def tensor_names(self) -> list[str]:
        return list(self.files)

    def file_of(self, name: str) -> Path:
        return self.files.get(name, self.listing)

    def infos(self, names: Collection[str]) -> dict[str, TensorInfo]:
        out = {}
        for name in names:
            file = self.files[name]
            if file not in self._headers:
                self._headers[file] = read_safetensors_header(file)
            header = self._headers[file]
            if name not in header:
                raise WeightsError(f"the index puts tensor {name} in this file, whose header lacks it",
                                   file=str(file), fix="save the checkpoint again")
            out[name] = header[name]
        return out

    def read_into(self, targets: Mapping[str, Sequence[torch.Tensor]]) -> int:
        safetensors = _safetensors()
        read_bytes = 0
        by_file: dict[Path, list[str]] = {}
        for name in targets:
            by_file.setdefault(self.files[name], []).append(name)
        for file, names in by_file.items():
            try:
                with safetensors.safe_open(str(file), framework="pt", device="cpu") as handle:
                    for name in names:
                        tensor = handle.get_tensor(name)
                        read_bytes += tensor.numel() * tensor.element_size()
                        _copy_into(tensor, targets[name])
            except (OSError, RuntimeError, ValueError, safetensors.SafetensorError) as exc:
                raise WeightsError(f"reading the tensors failed: {exc}", file=str(file),
                                   fix="check the file is whole (save or download it again)") from exc
        return read_bytes


class DcpSource(WeightsSource):
    """A torch.distributed.checkpoint directory, by its `.metadata` (tensor entries only)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, path / DCP_METADATA_FILE)
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        try:
            metadata = FileSystemReader(str(path)).read_metadata()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
            raise WeightsError(f"not a readable torch.distributed.checkpoint metadata file: {exc}",
                               file=str(self.listing), fix="save the checkpoint again") from exc
        self._infos: dict[str, TensorInfo] = {
            name: (tuple(entry.size), entry.properties.dtype)
            for name, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)}

    def tensor_names(self) -> list[str]:
        return list(self._infos)

    def infos(self, names: Collection[str]) -> dict[str, TensorInfo]:
        return {name: self._infos[name] for name in names}

    def read_into(self, targets: Mapping[str, Sequence[torch.Tensor]]) -> int:
        """Load through `torch.distributed.checkpoint.load(..., no_dist=True)`.

        In torch 2.13 `load` in a process with a group is collective (every rank's read plan gathered and
        scattered, an all-gather after the reads): it takes other names on each rank, but every rank must
        call it as often, outside the communication `plan` verified. With `no_dist=True` (its fallback
        without a group) each process plans and reads alone, any names, with or without a gloo group; the
        warning that it assumes one process is silenced. DCP reads each tensor's bytes from the file holding
        them into the given tensor (`copy_`: cast, any device).
        """
        import torch.distributed.checkpoint as dcp

        state: dict[str, torch.Tensor] = {}
        for name, tensors in targets.items():
            shape, dtype = self._infos[name]
            # one target is filled in place (cast by DCP's copy_); several share one read in the file's dtype
            state[name] = tensors[0] if len(tensors) == 1 else torch.empty(shape, dtype=dtype)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, storage_reader=dcp.FileSystemReader(str(self.path)), no_dist=True)
        except (OSError, RuntimeError, ValueError, pickle.UnpicklingError, EOFError) as exc:
            raise WeightsError(f"reading the tensors failed: {exc}", file=str(self.path),
                               fix="check the checkpoint directory is whole (save or copy it again)") from exc
        for name, tensors in targets.items():
            if state[name] is not tensors[0]:
                _copy_into(state[name], tensors)
        return sum(math.prod(self._infos[name][0]) * self._infos[name][1].itemsize for name in targets)


class ProgramCheckpointSource(WeightsSource):
    """A checkpoint of the training program (`plan run --checkpoint-every`): a step_<N> folder, or its root
    (the latest complete step), read as the whole model's tensors (checkpoint_weights.TrainedModel: the
    optimizer's entries left out, tensor-parallel shards put together)."""

    def __init__(self, path: Path) -> None:
        from .checkpoint import CheckpointError
        from .checkpoint_weights import TrainedModel

        try:
            self.model = TrainedModel(path)
        except CheckpointError as exc:
            raise WeightsError(exc.message, file=exc.file or str(path), fix=exc.fix) from exc
        super().__init__(path, self.model.folder)
        self._infos = self.model.tensors()

    def tensor_names(self) -> list[str]:
        return list(self._infos)

    def infos(self, names: Collection[str]) -> dict[str, TensorInfo]:
        return {name: self._infos[name] for name in names}

    def read_into(self, targets: Mapping[str, Sequence[torch.Tensor]]) -> int:
        from .checkpoint import CheckpointError

        read_bytes = 0
        try:
            for name, tensor in self.model.read(list(targets)):
                read_bytes += tensor.numel() * tensor.element_size()
                _copy_into(tensor, targets[name])
        except CheckpointError as exc:
            raise WeightsError(exc.message, file=exc.file or str(self.listing), fix=exc.fix) from exc
        return read_bytes


def _copy_into(tensor: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    """Copy one checkpoint tensor into each target, cast to its dtype, on its device."""
    with torch.no_grad():
        for target in targets:
            target.copy_(tensor)


def _safetensors() -> ModuleType:
    """The safetensors package (a dependency of transformers, not of hetplan: only these checkpoints need it)."""
    try:
        import safetensors
    except ImportError as exc:
        raise WeightsError("reading a safetensors checkpoint needs safetensors", fix="pip install safetensors") from exc
    return safetensors


def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """The (shape, dtype) of every tensor of a safetensors file, from its header (safetensors' own parser,
    which checks every tensor's offsets against the file; the data is not read)."""
    safetensors = _safetensors()
    try:
        with safetensors.safe_open(str(file), framework="pt", device="cpu") as handle:
            slices = [(name, handle.get_slice(name)) for name in handle.keys()]
            out = {name: (tuple(piece.get_shape()), SAFETENSORS_DTYPES[piece.get_dtype()]) for name, piece in slices}
    except OSError as exc:
        raise WeightsError(f"cannot read the file: {exc.strerror or exc}", file=str(file),
                           fix="check the path and its permissions") from exc
    except safetensors.SafetensorError as exc:
        raise WeightsError(f"not a safetensors file: {exc}", file=str(file),
                           fix="pass a file written by safetensors (save or download it again)") from exc
    except KeyError as exc:
        raise WeightsError(f"a tensor of dtype {exc} torch does not have", file=str(file),
                           fix="save the checkpoint in a torch dtype (bf16, fp16, fp32)") from exc
    return out


def _hf_index(directory: Path) -> dict[str, Path]:
    """Tensor name -> shard file of a sharded Hugging Face directory (the shards are not opened)."""
    index_file = directory / HF_INDEX_FILE
    try:
        weight_map = dict(json.loads(index_file.read_text())["weight_map"])
        escaping = next((name for name, shard in weight_map.items()
                         if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", "..")), None)
    except OSError as exc:
        raise WeightsError(f"cannot read the file: {exc.strerror}", file=str(index_file),
                           fix="check the path and its permissions") from exc
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        raise WeightsError(f"not a safetensors index: no JSON object with a weight_map object ({exc})",
                           file=str(index_file), fix="save the model again with save_pretrained") from exc
    if escaping is not None:
        raise WeightsError(f"tensor {escaping}: shard {weight_map[escaping]!r} is not a file name inside the directory",
                           file=str(index_file), fix="save the model again with save_pretrained")
    return {name: directory / shard for name, shard in weight_map.items()}


def is_program_checkpoint(path: Path) -> bool:
    """Whether `path` is a checkpoint of the training program: a step_<N> folder (complete or not: reading
    an incomplete one is refused by name), or a folder holding complete ones."""
    from . import checkpoint

    named = checkpoint.is_step_folder(path) and (path / DCP_METADATA_FILE).is_file()
    return named or checkpoint.latest_complete(path) is not None


def open_weights(path: Path) -> WeightsSource:
    """The checkpoint at `path`, by its headers only; a WeightsError if it is none of the formats read."""
    path = Path(path)
    if path.is_file() and path.suffix == SAFETENSORS_SUFFIX:
        return SafetensorsSource(path, dict.fromkeys(read_safetensors_header(path), path), path)
    if path.is_dir():
        if is_program_checkpoint(path):
            return ProgramCheckpointSource(path)
        if (path / DCP_METADATA_FILE).is_file():
            return DcpSource(path)
        if (path / HF_INDEX_FILE).is_file():
            return SafetensorsSource(path, _hf_index(path), path / HF_INDEX_FILE)
        if (path / HF_SINGLE_FILE).is_file():
            file = path / HF_SINGLE_FILE
            return SafetensorsSource(path, dict.fromkeys(read_safetensors_header(file), file), file)
    what = "does not exist" if not path.exists() else "is a directory" if path.is_dir() else "is a file"
    is_bin = path.suffix == ".bin" or (path.is_dir() and any(path.glob("*.bin")))
    bin_hint = " (PyTorch .bin weights are not read: save them with safetensors)" if is_bin else ""
    raise WeightsError(f"{what}, not {FORMATS}{bin_hint}", file=str(path),
                       fix="pass --weights a safetensors file, a Hugging Face model directory or a DCP directory")


# ----------------------------------------------------------------------------- check and load


def _checked_matches(source: WeightsSource, expected: Mapping[str, TensorInfo], model_names: Collection[str],
                     aliases: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """Model name -> checkpoint name for `expected`, each present with the model's shape (else WeightsError)."""
    checkpoint_names = source.tensor_names()
    found = match_names(checkpoint_names, model_names, aliases)
    for name in expected:
        if name not in found:
            raise _missing(source, name, choose_rewrite(checkpoint_names, model_names, aliases), aliases)
    matches = {name: found[name] for name in expected}
    infos = source.infos(set(matches.values()))
    for name, match in matches.items():
        file_shape, model_shape = infos[match][0], tuple(expected[name][0])
        if file_shape != model_shape:
            as_name = "" if match == name else f" (as {match})"
            raise WeightsError(f"tensor {name}{as_name} has shape {list(file_shape)} in the file but "
                               f"{list(model_shape)} in the model", file=str(source.file_of(match)),
                               fix="pass the checkpoint of this model's configuration")
    return matches


def _missing(source: WeightsSource, name: str, rewrite: PrefixRewrite,
             aliases: Mapping[str, Sequence[str]]) -> WeightsError:
    """Model name `name` is in the checkpoint under none of its names: say so, with the closest name."""
    checkpoint_names = source.tensor_names()
    looked_up = sorted({n for n in map(rewrite, (name, *aliases.get(name, ()))) if n is not None})
    closest = difflib.get_close_matches(rewrite(name) or name, checkpoint_names, n=1, cutoff=0.0)
    as_names = "" if looked_up == [name] else f" (looked up as {', '.join(looked_up) or 'nothing'})"
    where = f"closest checkpoint name: {closest[0]}" if closest else "the checkpoint holds no tensors"
    return WeightsError(f"tensor {name}{as_names} is not in the checkpoint; {where}",
                        file=str(source.file_of(name)), fix="pass the checkpoint of this model")


def check_weights(path: Path, expected: Mapping[str, TensorInfo], aliases: Mapping[str, Sequence[str]]) -> None:
    """Check by the headers only that the checkpoint at `path` holds every tensor of `expected` (the whole
    model, `model_tensors`) under `match_names`' mapping with the model's shape; dtypes may differ
    (`load_into` casts). Run before any rank starts: a misfit is one line naming the tensor and the file."""
    _checked_matches(open_weights(path), expected, list(expected), aliases)


def load_into(path: Path, wanted: Mapping[str, torch.Tensor], aliases: Mapping[str, Sequence[str]], *,
              model_names: Collection[str]) -> int:
    """Copy each of this rank's tensors (`wanted`: model name -> tensor, any device and dtype) from the
    checkpoint at `path` in place, cast to its dtype; the bytes of tensor data read.

    `model_names` (the whole model's) makes the name mapping every rank's. Only the wanted tensors are read,
    from the files holding them only. `check_weights`' checks run for them before anything is copied.
    """
    unknown = sorted(set(wanted) - set(model_names))
    if unknown:
        raise ValueError(f"wanted tensors outside model_names: {', '.join(unknown[:5])}")
    source = open_weights(path)
    expected = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in wanted.items()}
    matches = _checked_matches(source, expected, model_names, aliases)
    targets: dict[str, list[torch.Tensor]] = {}
    for name, match in matches.items():
        targets.setdefault(match, []).append(wanted[name])
    return source.read_into(targets)

