"""A small Mixtral-style mixture-of-experts decoder written by hand (a model the cost model was never
tuned on).

Mixtral's shape, small: token embeddings, ``N_LAYERS`` pre-RMSNorm blocks of causal self-attention with
rotary position embeddings and a sparse mixture-of-experts feed-forward, a final RMSNorm and an untied
LM head; no biases. Each MoE layer has ``N_EXPERTS`` SwiGLU experts and a linear router; every token
goes to its top ``TOP_K`` (2) experts, weighted by the softmax of their router logits renormalised
over the chosen two, as Mixtral routes. No auxiliary load-balancing loss (``loss_fn`` is the language
model's alone).

The experts run densely: each expert computes every token and its output is weighted by the token's
gate, zero for experts not chosen. That is top-2 routing's result exactly, with shapes that do not
depend on the data (a data-dependent dispatch cannot be traced on meta tensors, where planning runs);
it costs ``N_EXPERTS / TOP_K`` times a sparse dispatch's expert FLOPs, and the cost model prices the
FLOPs that run.

Task: GPT's (examples/gpt): each row is ``x[t+1] = (a * x[t] + b) % VOCAB_SIZE`` with per-row ``a, b``;
the model predicts the next token.

Example-model contract (read by the planner; no hetplan imports here):

- ``model(**sizes) -> nn.Module``, built on meta by the planner and the program; initial values are
  torch's own ``reset_parameters`` and the RMSNorm constructor's ones (README, "Initial values");
- ``batch(batch_size, step) -> ((input_ids,), target)``: deterministic, row ``r`` of step ``k`` depends
  only on ``(k, r)``;
- ``loss_fn(output, target)``: next-token cross-entropy, mean over every token of every row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB_SIZE = 128
SEQ_LEN = 32
D_MODEL = 64
N_HEADS = 4
N_LAYERS = 2
N_EXPERTS = 4
TOP_K = 2
D_EXPERT = 96             # hidden width of one SwiGLU expert
ROPE_BASE = 10_000.0

_ROW_SEED_STRIDE = 1_000_003  # seed of row r at step k: k * stride + r
_MULTIPLIERS = (1, 3, 5, 7)
_MAX_OFFSET = 16


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: Tensor) -> Tensor:
    """Rotary position embedding of (batch, heads, seq, head_dim), computed from positions in the forward
    (no buffer: nothing to carry from the constructor)."""
    seq, head_dim = x.shape[-2], x.shape[-1]
    inv_freq = ROPE_BASE ** (-torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim)
    angles = torch.arange(seq, device=x.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, d_model = x.shape
        q, k, v = (t.view(batch, seq, self.n_heads, d_model // self.n_heads).transpose(1, 2)
                   for t in self.qkv(x).split(d_model, dim=-1))
        y = F.scaled_dot_product_attention(_rotate(q), _rotate(k), v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(batch, seq, d_model))


class Expert(nn.Module):
    """Mixtral's expert: SwiGLU, w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Top-k routing over experts (see the module docstring for the dense evaluation)."""

    def __init__(self, d_model: int, hidden: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        self.top_k = top_k
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, hidden) for _ in range(n_experts))

    def forward(self, x: Tensor) -> Tensor:
        logits = self.router(x)                                          # (batch, seq, experts)
        top, chosen = logits.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(logits).scatter(-1, chosen, F.softmax(top, dim=-1))
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + gates[..., e:e + 1] * expert(x)
        return out


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, hidden: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.ln_attn, self.attn = RMSNorm(d_model), Attention(d_model, n_heads)
        self.ln_moe, self.moe = RMSNorm(d_model), SparseMoE(d_model, hidden, n_experts, top_k)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.moe(self.ln_moe(x))


class MoEDecoder(nn.Module):
    def __init__(self, vocab_size: int = VOCAB_SIZE, d_model: int = D_MODEL, n_heads: int = N_HEADS,
                 n_layers: int = N_LAYERS, n_experts: int = N_EXPERTS, top_k: int = TOP_K,
                 d_expert: int = D_EXPERT) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, d_expert, n_experts, top_k) for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def model(**sizes: int) -> nn.Module:
    """The MoE decoder; keyword arguments override the module-level sizes."""
    return MoEDecoder(**sizes)


def _row(step: int, row: int) -> Tensor:
    generator = torch.Generator().manual_seed(_ROW_SEED_STRIDE * step + row)
    a = _MULTIPLIERS[int(torch.randint(len(_MULTIPLIERS), (), generator=generator))]
    b = int(torch.randint(_MAX_OFFSET, (), generator=generator))
    x = int(torch.randint(VOCAB_SIZE, (), generator=generator))
    tokens = [x]
    for _ in range(SEQ_LEN):
        x = (a * x + b) % VOCAB_SIZE
        tokens.append(x)
    return torch.tensor(tokens, dtype=torch.long)


def batch(batch_size: int, step: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """``batch_size`` rows of ``SEQ_LEN`` tokens; the target is the input shifted by one."""
    rows = torch.stack([_row(step, r) for r in range(batch_size)])
    return (rows[:, :-1],), rows[:, 1:]


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Next-token cross-entropy, mean over all tokens of all rows."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
