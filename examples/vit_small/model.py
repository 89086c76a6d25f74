"""A small Vision Transformer written by hand (a model the cost model was never tuned on).

ViT's shape: the image cut into ``PATCH x PATCH`` patches by a strided convolution, a learned class
token and learned position embeddings, ``N_LAYERS`` pre-LayerNorm encoder blocks (bidirectional
multi-head self-attention, GELU MLP), a final LayerNorm and a linear head on the class token.

Task: ``N_CLASSES`` fixed random templates (a private generator); a sample is its class's template
plus Gaussian noise, the label the class, so the model must recognise the pattern through the noise.

Example-model contract (read by the planner; no hetplan imports here):

- ``model(**sizes) -> nn.Module``, built on meta by the planner and the program; initial values come
  from torch's ``reset_parameters`` and ``init_weights`` (README, "Initial values");
- ``init_weights(module)``: the class token and position embeddings N(0, 0.02), as ViT's;
- ``batch(batch_size, step) -> ((images,), labels)``: deterministic, row ``r`` of step ``k`` depends only
  on ``(k, r)``;
- ``loss_fn(output, target)``: cross-entropy, mean over rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IMAGE = 32
CHANNELS = 3
PATCH = 4
D_MODEL = 64
N_HEADS = 4
N_LAYERS = 4
MLP_RATIO = 2
N_CLASSES = 10
INIT_STD = 0.02       # ViT's initialiser range for the class token and position embeddings
NOISE_STD = 1.0

_ROW_SEED_STRIDE = 1_000_003  # seed of row r at step k: k * stride + r
_TEMPLATE_SEED = 20_250_117


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, d_model = x.shape
        q, k, v = (t.view(batch, seq, self.n_heads, d_model // self.n_heads).transpose(1, 2)
                   for t in self.qkv(x).split(d_model, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class EncoderBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.ln_attn, self.attn = nn.LayerNorm(d_model), SelfAttention(d_model, n_heads)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class PatchEmbedding(nn.Module):
    """Patches by a strided convolution, then the class token in front and position embeddings added."""

    def __init__(self, image: int, channels: int, patch: int, d_model: int) -> None:
        super().__init__()
        if image % patch:
            raise ValueError(f"image={image} is not divisible by patch={patch}")
        self.conv = nn.Conv2d(channels, d_model, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model))
        self.position = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, d_model))

    def forward(self, images: Tensor) -> Tensor:
        x = self.conv(images).flatten(2).transpose(1, 2)                  # (batch, patches, d_model)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.position


class ViT(nn.Module):
    def __init__(self, image: int = IMAGE, channels: int = CHANNELS, patch: int = PATCH, d_model: int = D_MODEL,
                 n_heads: int = N_HEADS, n_layers: int = N_LAYERS, mlp_ratio: int = MLP_RATIO,
                 n_classes: int = N_CLASSES) -> None:
        super().__init__()
        self.embed = PatchEmbedding(image, channels, patch, d_model)
        self.blocks = nn.ModuleList(EncoderBlock(d_model, n_heads, mlp_ratio) for _ in range(n_layers))
        self.ln_final = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.embed(images)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x)[:, 0])


def model(**sizes: int) -> nn.Module:
    """The ViT; keyword arguments override the module-level sizes."""
    return ViT(**sizes)


def init_weights(module: nn.Module) -> None:
    """ViT's truncated-normal start for the class token and position embeddings (a plain normal here)."""
    if isinstance(module, PatchEmbedding):
        nn.init.normal_(module.cls_token, std=INIT_STD)
        nn.init.normal_(module.position, std=INIT_STD)


def _templates() -> Tensor:
    generator = torch.Generator().manual_seed(_TEMPLATE_SEED)
    return torch.randn(N_CLASSES, CHANNELS, IMAGE, IMAGE, generator=generator)


def batch(batch_size: int, step: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """``batch_size`` noisy templates and their classes."""
    templates = _templates()
    images, labels = [], []
    for r in range(batch_size):
        generator = torch.Generator().manual_seed(_ROW_SEED_STRIDE * step + r)
        label = int(torch.randint(N_CLASSES, (), generator=generator))
        images.append(templates[label] + NOISE_STD * torch.randn(CHANNELS, IMAGE, IMAGE, generator=generator))
        labels.append(label)
    return (torch.stack(images),), torch.tensor(labels, dtype=torch.long)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy, mean over rows."""
    return F.cross_entropy(output, target)
