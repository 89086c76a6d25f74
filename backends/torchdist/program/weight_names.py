"""Which checkpoint name each model tensor is read from (weights.py's matching, by names alone).

A model file that wraps the Hugging Face model adds a prefix (`lm.model.norm.weight`), a checkpoint may
carry one the model lacks (`transformer.`): `match_names` decides one prefix rewrite over all names, the
same on every rank. A tied parameter is satisfied by any of its aliases (`save_pretrained` leaves
`lm_head.weight` out when it is the input embedding; the training program saves a tied tensor once).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

TensorInfo = tuple[tuple[int, ...], torch.dtype]     # (shape, dtype) of one tensor
MAX_PREFIX_PARTS = 3                         # a rewrite's prefix: at most this many leading name parts


@dataclass(frozen=True)
class PrefixRewrite:
    """Every model name is looked up with `checkpoint_prefix` in place of its `model_prefix`; one without it
    has no name (None): renaming only the names that match could turn a leaf into another (`lm_head.` ->
    `model.norm.`)."""

    model_prefix: str = ""
    checkpoint_prefix: str = ""

    def __call__(self, name: str) -> str | None:
        if not name.startswith(self.model_prefix):
            return None
        return self.checkpoint_prefix + name[len(self.model_prefix):]


def _prefixes(names: Collection[str]) -> set[str]:
    """The leading parts (`model.`, `model.model.`) of names, up to the first numbered part (a layer index)."""
    out = {""}
    for name in names:
        parts = name.split(".")[:-1]
        for count in range(1, min(len(parts), MAX_PREFIX_PARTS) + 1):
            if parts[count - 1].isdigit():
                break
            out.add(".".join(parts[:count]) + ".")
    return out


def _lookup(name: str, rewrite: PrefixRewrite, checkpoint: Collection[str],
            aliases: Mapping[str, Sequence[str]]) -> str | None:
    """The checkpoint name that satisfies model name `name`: its own, else its first alias present."""
    for candidate in (name, *aliases.get(name, ())):
        rewritten = rewrite(candidate)
        if rewritten is not None and rewritten in checkpoint:
            return rewritten
    return None


def choose_rewrite(checkpoint_names: Collection[str], model_names: Collection[str],
                   aliases: Mapping[str, Sequence[str]]) -> PrefixRewrite:
    """The one prefix rewrite under which most model names are found, of every pair of leading parts of a
    model and a checkpoint name; ties go to the shortest prefixes (so exact names, when they all are
    found), then the alphabet."""
    checkpoint = set(checkpoint_names)
    candidates = [PrefixRewrite(m, c) for m in sorted(_prefixes(model_names))
                  for c in sorted(_prefixes(checkpoint)) if m != c]

    def rank(rewrite: PrefixRewrite) -> tuple[int, int, str, str]:
        found = sum(1 for name in model_names if _lookup(name, rewrite, checkpoint, aliases))
        length = len(rewrite.model_prefix) + len(rewrite.checkpoint_prefix)
        return -found, length, rewrite.model_prefix, rewrite.checkpoint_prefix

    return min([PrefixRewrite(), *candidates], key=rank)


def match_names(checkpoint_names: Collection[str], model_names: Collection[str],
                aliases: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """Model name -> checkpoint name of every model name found under `choose_rewrite`'s rewrite (a name it
    lacks is found under none of its names). Both lists are whole (every tensor of the checkpoint, every
    one of the whole model), so every rank decides the same mapping."""
    rewrite, checkpoint = choose_rewrite(checkpoint_names, model_names, aliases), set(checkpoint_names)
    found = {name: _lookup(name, rewrite, checkpoint, aliases) for name in model_names}
    return {name: match for name, match in found.items() if match is not None}


def model_tensors(module: torch.nn.Module) -> dict[str, TensorInfo]:
    """(shape, dtype) of each tensor of `module`'s state dict (tied ones under every name); works on meta."""
    return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in module.state_dict(keep_vars=True).items()}


def tied_aliases(module: torch.nn.Module) -> dict[str, list[str]]:
    """Every tied tensor's other names (`lm_head.weight` -> [`model.embed_tokens.weight`]); works on meta."""
    groups: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return {name: [other for other in group if other != name]
            for group in groups.values() if len(group) > 1 for name in group}
