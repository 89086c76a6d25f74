"""Metis' GPT example ("GPT 1.5B" of SamsungLabs/Metis, `scripts/cost_het_cluster.sh`), written by hand.

The model Metis' public planner is run on in its own example, so `benchmarks/vs_metis.py` can plan
the same network with `plan`: a Megatron-style GPT with hidden size 4096, 32 attention heads, 8
pre-LayerNorm blocks (Metis counts 10 layers: the embedding, the 8 blocks and the head), sequence
length 1024 and a 51,200-token vocabulary; global batch 128 in the benchmark. Token + learned
position embeddings, causal multi-head self-attention through
``scaled_dot_product_attention(is_causal=True)``, a 4x GELU MLP, a final LayerNorm and an LM head
tied to the token embedding (as Megatron ties them). About 1.8e9 parameters: for planning; the
planner builds it on meta and never allocates its weights. No code of Metis is used here; only the
sizes above, which its script states.

Example-model contract (read by the planner; no hetplan imports here):

- ``model(**sizes) -> nn.Module``: the GPT; keyword arguments override the module-level sizes;
- ``init_weights(module)``: GPT-2's initialisation of one module;
- ``batch(batch_size, step) -> ((input_ids,), target)``: random token ids, deterministic: row ``r``
  of step ``k`` depends only on ``(k, r)``; the target is the input shifted by one;
- ``loss_fn(output, target)``: next-token cross-entropy, mean over rows and tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

HIDDEN_SIZE = 4096       # Metis' cost_het_cluster.sh, GPT 1.5B: HIDDEN_SIZE
N_HEADS = 32             # ATTENTION_HEAD_SIZE there (it is the head count: 4096 / 32 = 128 per head)
N_BLOCKS = 8             # NUM_LAYERS=10 there, less the embedding and the head
SEQ_LEN = 1024           # SEQUENCE_LENGTH
VOCAB_SIZE = 51200       # VOCAB_SIZE
MLP_RATIO = 4            # Megatron's ffn_hidden_size = 4 x hidden_size
INIT_STD = 0.02          # GPT-2's initialiser range

_ROW_SEED_STRIDE = 1_000_003  # seed of row r at step k: k * stride + r


class ResidualProjection(nn.Linear):
    """A linear layer that writes into the residual stream: GPT-2 starts it smaller, by depth."""

    init_std: float

    def __init__(self, in_features: int, out_features: int, init_std: float) -> None:
        super().__init__(in_features, out_features)
        self.init_std = init_std


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, n_heads: int, residual_std: float) -> None:
        super().__init__()
        if hidden % n_heads:
            raise ValueError(f"hidden={hidden} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = ResidualProjection(hidden, hidden, residual_std)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, hidden = x.shape
        head_dim = hidden // self.n_heads
        q, k, v = self.qkv(x).split(hidden, dim=-1)
        # (batch, seq, hidden) -> (batch, heads, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.n_heads, head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, hidden))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int, residual_std: float) -> None:
        super().__init__()
        self.fc_in = nn.Linear(hidden, ffn_hidden)
        self.act = nn.GELU()
        self.fc_out = ResidualProjection(ffn_hidden, hidden, residual_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, n_heads: int, mlp_ratio: int, residual_std: float) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, n_heads, residual_std)
        self.ln_mlp = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, mlp_ratio * hidden, residual_std)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        max_seq_len: int = SEQ_LEN,
        hidden: int = HIDDEN_SIZE,
        n_heads: int = N_HEADS,
        n_blocks: int = N_BLOCKS,
        mlp_ratio: int = MLP_RATIO,
    ) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, hidden)
        self.position_embedding = nn.Embedding(max_seq_len, hidden)
        residual_std = INIT_STD / math.sqrt(2 * n_blocks)
        self.blocks = nn.ModuleList(Block(hidden, n_heads, mlp_ratio, residual_std) for _ in range(n_blocks))
        self.ln_final = nn.LayerNorm(hidden)

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        # Tied LM head: logits against the token embedding table.
        return F.linear(self.ln_final(x), self.token_embedding.weight)


def model(**sizes: int) -> nn.Module:
    """The GPT of Metis' example; keyword arguments override the module-level sizes."""
    return GPT(**sizes)


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: linear and embedding weights N(0, 0.02) (residual projections smaller),
    biases zero; LayerNorms keep torch's ones and zeros."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        std = module.init_std if isinstance(module, ResidualProjection) else INIT_STD
        nn.init.normal_(module.weight, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def batch(batch_size: int, step: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """``batch_size`` rows of ``SEQ_LEN`` random token ids; the target is the input shifted by one."""
    rows = [torch.randint(VOCAB_SIZE, (SEQ_LEN + 1,),
                          generator=torch.Generator().manual_seed(_ROW_SEED_STRIDE * step + r))
            for r in range(batch_size)]
    tokens = torch.stack(rows)
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Next-token cross-entropy, mean over all tokens of all rows."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
