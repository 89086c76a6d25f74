"""A small ResNet-style CNN written by hand.

Stem (3x3 conv, GroupNorm, ReLU), then stages of basic residual blocks
(conv-GroupNorm-ReLU-conv-GroupNorm plus an identity skip, or a strided 1x1
conv + GroupNorm projection where the shape changes), global average pooling and a
linear classifier, plus a long skip: the stem's features go straight to the head (pooled and
projected), so they cross every pipeline cut between stem and head. GroupNorm rather than
BatchNorm: normalisation is per sample, so splitting a batch across replicas or micro-batches
computes exactly the same thing.

The data: each class has a fixed smooth random template (from a private generator);
an image is its class template plus Gaussian noise, so the label is learnable.

Example-model contract (read by the planner; no hetplan imports here):

- ``model(**sizes) -> nn.Module``, built on meta by the planner and the program; its initial
  values follow the program's init contract (README, "Initial values"): here torch's own ``reset_parameters``.
- ``batch(batch_size, step) -> ((images,), labels)``: deterministic, row ``r`` of step
  ``k`` depends only on ``(k, r)``.
- ``loss_fn(output, target)``: cross-entropy, mean over rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IMAGE_SIZE = 32
IN_CHANNELS = 3
N_CLASSES = 10
STAGE_WIDTHS = (16, 32, 64)  # one stage per width; stages after the first halve H and W
BLOCKS_PER_STAGE = 1
GROUPS = 4  # GroupNorm groups; must divide every width

_ROW_SEED_STRIDE = 1_000_003  # seed of row r at step k: k * stride + r
_TEMPLATE_SEED = 7_777
_TEMPLATE_GRID = 4  # templates are upsampled from a coarse grid, so they are smooth
_NOISE_STD = 1.0


def _conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = _conv3x3(c_in, c_out, stride)
        self.norm1 = nn.GroupNorm(groups, c_out)
        self.conv2 = _conv3x3(c_out, c_out)
        self.norm2 = nn.GroupNorm(groups, c_out)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, kernel_size=1, stride=stride, bias=False),
                nn.GroupNorm(groups, c_out),
            )

    def forward(self, x: Tensor) -> Tensor:
        y = self.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return self.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(
        self,
        in_channels: int = IN_CHANNELS,
        n_classes: int = N_CLASSES,
        stage_widths: tuple[int, ...] = STAGE_WIDTHS,
        blocks_per_stage: int = BLOCKS_PER_STAGE,
        groups: int = GROUPS,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            _conv3x3(in_channels, stage_widths[0]),
            nn.GroupNorm(groups, stage_widths[0]),
            nn.ReLU(),
        )
        blocks: list[nn.Module] = []
        c_in = stage_widths[0]
        for stage, width in enumerate(stage_widths):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(c_in, width, stride, groups))
                c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(c_in, n_classes)
        self.stem_head = nn.Linear(stage_widths[0], n_classes)

    def forward(self, images: Tensor) -> Tensor:
        stem = self.stem(images)
        x = self.blocks(stem)
        features = torch.flatten(self.pool(x), 1)
        skip = torch.flatten(self.pool(stem), 1)  # long skip: stem features straight to the head
        return self.classifier(features) + self.stem_head(skip)


def model(**sizes: Any) -> nn.Module:
    """The ResNet; keyword arguments override the module-level sizes."""
    return ResNet(**sizes)


def _class_templates() -> Tensor:
    generator = torch.Generator().manual_seed(_TEMPLATE_SEED)
    coarse = torch.randn(N_CLASSES, IN_CHANNELS, _TEMPLATE_GRID, _TEMPLATE_GRID, generator=generator)
    return F.interpolate(coarse, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)


def batch(batch_size: int, step: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """``batch_size`` noisy class templates (``IN_CHANNELS x IMAGE_SIZE x IMAGE_SIZE``)."""
    templates = _class_templates()
    images, labels = [], []
    for r in range(batch_size):
        generator = torch.Generator().manual_seed(_ROW_SEED_STRIDE * step + r)
        label = int(torch.randint(N_CLASSES, (), generator=generator))
        noise = torch.randn(IN_CHANNELS, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
        images.append(templates[label] + _NOISE_STD * noise)
        labels.append(label)
    return (torch.stack(images),), torch.tensor(labels, dtype=torch.long)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy, mean over rows."""
    return F.cross_entropy(output, target)
