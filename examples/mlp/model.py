"""A plain MLP classifier on synthetic data labelled by a fixed random teacher.

Six ``Linear`` layers with GELU between them (32 -> 128 -> ... -> 10 by default).
The data: inputs ``x ~ N(0, I)``; the label is the arg-max of a fixed random teacher
network (a two-layer tanh net whose weights come from a private generator), so the
labels are a deterministic, learnable function of the input.

Example-model contract (read by the planner; no hetplan imports here):

- ``model(**sizes) -> nn.Module``, built on meta by the planner and the program; its initial
  values follow the program's init contract (README, "Initial values"): here torch's own ``reset_parameters``.
- ``batch(batch_size, step) -> ((x,), labels)``: deterministic, row ``r`` of step ``k``
  depends only on ``(k, r)``.
- ``loss_fn(output, target)``: cross-entropy, mean over rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IN_FEATURES = 32
HIDDEN = 128
N_LAYERS = 6  # Linear layers, counting the classifier
N_CLASSES = 10

_ROW_SEED_STRIDE = 1_000_003  # seed of row r at step k: k * stride + r
_TEACHER_SEED = 20_240_601
_TEACHER_HIDDEN = 64


class MLP(nn.Module):
    def __init__(
        self,
        in_features: int = IN_FEATURES,
        hidden: int = HIDDEN,
        n_layers: int = N_LAYERS,
        n_classes: int = N_CLASSES,
    ) -> None:
        super().__init__()
        if n_layers < 2:
            raise ValueError(f"n_layers must be >= 2, got {n_layers}")
        widths = [in_features] + [hidden] * (n_layers - 1)
        self.hidden_layers = nn.ModuleList(
            nn.Linear(w_in, w_out) for w_in, w_out in zip(widths[:-1], widths[1:], strict=True)
        )
        self.act = nn.GELU()
        self.classifier = nn.Linear(hidden, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.hidden_layers:
            x = self.act(layer(x))
        return self.classifier(x)


def model(**sizes: int) -> nn.Module:
    """The MLP; keyword arguments override the module-level sizes."""
    return MLP(**sizes)


def _teacher_labels(x: Tensor) -> Tensor:
    generator = torch.Generator().manual_seed(_TEACHER_SEED)
    w1 = torch.randn(IN_FEATURES, _TEACHER_HIDDEN, generator=generator) / IN_FEATURES**0.5
    w2 = torch.randn(_TEACHER_HIDDEN, N_CLASSES, generator=generator) / _TEACHER_HIDDEN**0.5
    return (torch.tanh(x @ w1) @ w2).argmax(dim=-1)


def batch(batch_size: int, step: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """``batch_size`` Gaussian inputs and their teacher labels."""
    rows = [
        torch.randn(IN_FEATURES, generator=torch.Generator().manual_seed(_ROW_SEED_STRIDE * step + r))
        for r in range(batch_size)
    ]
    x = torch.stack(rows)
    return (x,), _teacher_labels(x)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy, mean over rows."""
    return F.cross_entropy(output, target)
