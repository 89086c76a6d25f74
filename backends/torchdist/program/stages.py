"""The model built exactly like one process, and this rank's stage of it, traced and split like the plan.

Stages are re-traced here for each micro-batch size (replicas of one plan have different sizes, and a
traced graph carries its shapes) and cut at the plan's node names by the same lowering pass the planner
verified (passes.split); a few seconds at start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from passes.split import StageSplit, split_stages
from planner import frontend


def build_model(model_file: frontend.ModelFile, seed: int) -> nn.Module:
    """The full model with exactly the values of `torch.manual_seed(seed); model()` on one process."""
    torch.manual_seed(seed)
    return model_file.build()


class StageGraphs:
    """The model's stage graphs at each micro-batch size met so far, split after `last_nodes`."""

    def __init__(self, model: nn.Module, model_file: frontend.ModelFile, last_nodes: list[str]) -> None:
        self.model, self.model_file, self.last_nodes = model, model_file, last_nodes
        self._splits: dict[int, StageSplit] = {}

    def split_for(self, micro_inputs: tuple[Any, ...]) -> StageSplit:
        """Trace the model at this micro-batch size (once per size) and split it like the plan."""
        rows = int(micro_inputs[0].shape[0])
        if rows not in self._splits:
            gm = frontend.trace(self.model, micro_inputs, file=str(self.model_file.path))
            self._splits[rows] = split_stages(gm, self.last_nodes)
        return self._splits[rows]


def save_parameters(params: dict[str, nn.Parameter], path: Path) -> Path:
    """Write a rank's parameters (on CPU) to `path`, e.g. out/run/final/rank{r}.pt."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({name: p.detach().cpu() for name, p in params.items()}, path)
    return path
