"""A checkpoint of the training program written out as the model's weights, in safetensors files laid out
as Hugging Face's `save_pretrained` lays them out: one `model.safetensors`, or past `max_shard_bytes`
shards `model-0000k-of-0000n.safetensors` listed by `model.safetensors.index.json` (its `weight_map` and
`metadata.total_size`). `--weights`, `transformers`' loaders and `safetensors.torch.load_file` read them.

Every tensor of the model's state dict is written once, under the model's own name, whole: the checkpoint's
tensor-parallel shards put together (program/checkpoint_weights.py), a tied tensor under the first of its
names (the others are the same tensor: a loader ties them again, as `save_pretrained` leaves `lm_head`
out). The checkpoint is first checked against the model by its headers (program/weights.check_weights),
so a checkpoint of another model is one line before anything is read. One shard's tensors are in memory
at a time.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.torchdist.program import checkpoint_state, weights
from backends.torchdist.program.checkpoint_weights import TrainedModel
from planner.core.file_modes import plain_file_mode

SINGLE_FILE = weights.HF_SINGLE_FILE
INDEX_FILE = weights.HF_INDEX_FILE
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9         # save_pretrained's default, "5GB"


@dataclass(frozen=True)
class ExportedWeights:
    """What `export_weights` wrote."""

    checkpoint: Path             # the step_<N> folder read
    step: int                    # the steps trained when it was taken
    files: tuple[Path, ...]      # the safetensors files, in order
    tensors: int
    total_bytes: int             # of tensor data, as the index's metadata.total_size


def shard_names(count: int) -> list[str]:
    """The file names of `count` shards (save_pretrained's), or the one file's."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def cut_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """The names in order, cut into shards of at most `max_shard_bytes` each (a tensor larger alone is a
    shard of its own), as save_pretrained cuts them."""
    shards: list[list[str]] = [[]]
    held = 0
    for name, size in sizes.items():
        if shards[-1] and held + size > max_shard_bytes:
            shards.append([])
            held = 0
        shards[-1].append(name)
        held += size
    return shards


def export_weights(checkpoint: Path, module: torch.nn.Module, out_dir: Path, *,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: torch.dtype | None = None,
                   strip_prefix: str = "") -> ExportedWeights:
    """Write the model tensors of `checkpoint` (a step_<N> folder or a checkpoint root: its latest complete
    one) into `out_dir` (an existing, empty directory) as safetensors, in `module`'s state-dict order (the
    model built on meta), cast to `dtype` (None: as saved), each name without `strip_prefix` (a wrapper's
    `lm.`: the wrapped model's own names; every name must start with it)."""
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise weights.WeightsError("writing safetensors files needs safetensors",
                                   fix="pip install safetensors") from exc
    trained = TrainedModel(checkpoint)
    expected = weights.model_tensors(module)
    aliases = weights.tied_aliases(module)
    weights.check_weights(trained.folder, expected, aliases)
    saved = trained.tensors()
    canonical = checkpoint_state.canonical_names(module)
    found = weights.match_names(list(saved), list(expected), aliases)
    order = {name: found[name] for name in expected if canonical[name] == name}      # model name -> saved name
    outside = next((name for name in order if not name.startswith(strip_prefix)), None)
    if outside is not None:
        raise weights.WeightsError(f"tensor {outside} does not start with {strip_prefix!r}", field="--strip-prefix",
                                   fix="pass a prefix every name of the model starts with, or none")
    sizes = {name: math.prod(saved[source][0]) * (dtype or saved[source][1]).itemsize for name, source in order.items()}
    shards = cut_shards(sizes, max_shard_bytes)
    files = [out_dir / file for file in shard_names(len(shards))]
    for names, file in zip(shards, files):
        by_source = {order[name]: name.removeprefix(strip_prefix) for name in names}
        tensors = {by_source[source]: (tensor if dtype is None else tensor.to(dtype)).contiguous()
                   for source, tensor in trained.read(list(by_source))}
        save_file(tensors, str(file), metadata={"format": "pt"})
        os.chmod(file, plain_file_mode())     # save_file leaves 0600: other users could not read it
        del tensors
    total = sum(sizes.values())
    if len(files) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {name.removeprefix(strip_prefix): file.name
                                for names, file in zip(shards, files) for name in names}}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return ExportedWeights(trained.folder, trained.step, tuple(files), len(order), total)

