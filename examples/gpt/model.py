"""A small GPT-style decoder written by hand.

Token + learned position embeddings, ``N`` pre-LayerNorm blocks (causal multi-head
self-attention via ``scaled_dot_product_attention(is_causal=True)``, GELU MLP), a final
LayerNorm and an LM head whose weight is the token embedding (tied: one parameter,
used at both ends of the network).

Task: each row is an affine recurrence ``x[t+1] = (a * x[t] + b) % VOCAB_SIZE`` with
per-row ``a`` (odd, small) and ``b``; the model predicts the next token, so it can
learn to infer ``a, b`` from the context and the loss falls well below ``ln(vocab)``.

Example-model contract (read by the planner; no hetplan imports here):

- ``model(**sizes) -> nn.Module``, built on meta by the planner and by the program, which then
  gives each rank's tensors their values module by module (README, "Initial values");
- ``init_weights(module)``: GPT-2's initialisation of one module (the program calls it for every
  module holding parameters, after torch's own ``reset_parameters``).
- ``batch(batch_size, step) -> ((input_ids,), target)``: deterministic, row ``r`` of
  step ``k`` depends only on ``(k, r)``.
- ``loss_fn(output, target)``: mean over rows (and tokens; every row has ``SEQ_LEN``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB_SIZE = 256
SEQ_LEN = 32
D_MODEL = 64
N_HEADS = 4
N_LAYERS = 4
MLP_RATIO = 4
INIT_STD = 0.02  # GPT-2's initialiser range

_ROW_SEED_STRIDE = 1_000_003  # seed of row r at step k: k * stride + r
_MULTIPLIERS = (1, 3, 5, 7)  # odd, so x -> a*x + b is a bijection mod 2^n
_MAX_OFFSET = 16


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        # no bias: a key bias shifts every score of a query equally, so softmax ignores it and its
        # gradient is exactly zero; AdamW would then amplify float noise into updates
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, d_model = x.shape
        head_dim = d_model // self.n_heads
        q, k, v = self.qkv(x).split(d_model, dim=-1)
        # (batch, seq, d_model) -> (batch, heads, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.n_heads, head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(d_model, hidden)
        self.act = nn.GELU()
        self.fc_out = nn.Linear(hidden, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, mlp_ratio * d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        max_seq_len: int = SEQ_LEN,
        d_model: int = D_MODEL,
        n_heads: int = N_HEADS,
        n_layers: int = N_LAYERS,
        mlp_ratio: int = MLP_RATIO,
    ) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mlp_ratio) for _ in range(n_layers))
        self.ln_final = nn.LayerNorm(d_model)
        # GPT-2: the projections that write into the residual stream start smaller, by depth
        for block in self.blocks:
            for residual_out in (block.attn.proj, block.mlp.fc_out):
                residual_out.init_std = INIT_STD / math.sqrt(2 * n_layers)

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        # Tied LM head: logits against the token embedding table.
        return F.linear(self.ln_final(x), self.token_embedding.weight)


def model(**sizes: int) -> nn.Module:
    """The GPT decoder; keyword arguments override the module-level sizes."""
    return GPT(**sizes)


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: linear and embedding weights N(0, 0.02) (residual projections smaller),
    biases zero; LayerNorms keep torch's ones and zeros."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=getattr(module, "init_std", INIT_STD))
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _row(step: int, row: int, seq_len: int, vocab_size: int) -> Tensor:
    generator = torch.Generator().manual_seed(_ROW_SEED_STRIDE * step + row)
    a = _MULTIPLIERS[int(torch.randint(len(_MULTIPLIERS), (), generator=generator))]
    b = int(torch.randint(_MAX_OFFSET, (), generator=generator))
    x = int(torch.randint(vocab_size, (), generator=generator))
    tokens = [x]
    for _ in range(seq_len):
        x = (a * x + b) % vocab_size
        tokens.append(x)
    return torch.tensor(tokens, dtype=torch.long)


def batch(batch_size: int, step: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """``batch_size`` rows of ``SEQ_LEN`` tokens; the target is the input shifted by one."""
    rows = torch.stack([_row(step, r, SEQ_LEN, VOCAB_SIZE) for r in range(batch_size)])
    return (rows[:, :-1],), rows[:, 1:]


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Next-token cross-entropy, mean over all tokens of all rows."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
