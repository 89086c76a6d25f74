"""A small T5-style encoder-decoder written by hand (a model the cost model was never tuned on).

T5's shape: a shared token embedding (also the LM head, scaled by ``d_model ** -0.5``), an encoder of
``N_ENCODER`` blocks (bidirectional self-attention, gated-GELU feed-forward) and a decoder of
``N_DECODER`` blocks (causal self-attention, cross-attention over the encoder's output, feed-forward),
RMS normalisation before every sub-layer and at the end of both stacks, no biases, and a learned
relative-position bias on the self-attention scores. Two simplifications against T5: relative
distances are clipped to ``±MAX_DISTANCE`` rather than log-bucketed, and every self-attention layer
has its own bias table (T5 computes it in the first layer and reuses it), so no tensor but the
encoder's output lives across layers.

Task: reverse the source sequence. Row ``r`` of step ``k`` is a random sequence of ``SEQ_LEN`` tokens
(ids ``1..VOCAB_SIZE-1``; 0 starts the decoder); the decoder reads ``[0, y0, ..., y(n-2)]`` and predicts
``y = reversed(source)``, which needs the cross-attention.

Example-model contract (read by the planner; no hetplan imports here):

- ``model(**sizes) -> nn.Module``, built on meta by the planner and the program; initial values are
  torch's own ``reset_parameters`` (README, "Initial values");
- ``batch(batch_size, step) -> ((source_ids, decoder_ids), target)``: deterministic, row ``r`` of step ``k``
  depends only on ``(k, r)``;
- ``loss_fn(output, target)``: cross-entropy, mean over every target token of every row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB_SIZE = 64
SEQ_LEN = 16
D_MODEL = 64
N_HEADS = 4
D_FF = 128
N_ENCODER = 2
N_DECODER = 2
MAX_DISTANCE = 8          # relative distances beyond this share the last bias
START_TOKEN = 0

_ROW_SEED_STRIDE = 1_000_003  # seed of row r at step k: k * stride + r


class RMSNorm(nn.Module):
    """T5's layer norm: scale only, no mean subtraction, no bias."""

    def __init__(self, d_model: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Multi-head attention without biases; self-attention adds a learned relative-position bias."""

    def __init__(self, d_model: int, n_heads: int, relative: bool, causal: bool = False) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads, self.causal = n_heads, causal
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.kv = nn.Linear(d_model, 2 * d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.relative_bias = nn.Embedding(2 * MAX_DISTANCE + 1, n_heads) if relative else None

    def _heads(self, t: Tensor) -> Tensor:
        batch, seq, d_model = t.shape
        return t.view(batch, seq, self.n_heads, d_model // self.n_heads).transpose(1, 2)

    def _bias(self, q_len: int, k_len: int, like: Tensor) -> Tensor | None:
        if self.relative_bias is None:
            return None
        distance = torch.arange(k_len, device=like.device)[None, :] - torch.arange(q_len, device=like.device)[:, None]
        bias = self.relative_bias(distance.clamp(-MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE)  # (q, k, heads)
        bias = bias.permute(2, 0, 1).unsqueeze(0)                                             # (1, heads, q, k)
        if self.causal:
            future = torch.ones(q_len, k_len, dtype=torch.bool, device=like.device).triu(1)
            bias = bias.masked_fill(future, float("-inf"))
        return bias

    def forward(self, x: Tensor, memory: Tensor | None = None) -> Tensor:
        batch, seq, d_model = x.shape
        source = x if memory is None else memory
        k, v = self.kv(source).split(d_model, dim=-1)
        q, k, v = self._heads(self.q(x)), self._heads(k), self._heads(v)
        # T5 does not scale scores by 1/sqrt(head_dim) (its initialisation does); SDPA's default scale is kept
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self._bias(seq, source.shape[1], x))
        return self.o(y.transpose(1, 2).reshape(batch, seq, d_model))


class GatedFeedForward(nn.Module):
    """T5 v1.1's feed-forward: GELU(x W0) * (x W1), then W_out; no biases."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.wi_0 = nn.Linear(d_model, d_ff, bias=False)
        self.wi_1 = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.wo(F.gelu(self.wi_0(x)) * self.wi_1(x))


class EncoderBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.ln_attn, self.attn = RMSNorm(d_model), Attention(d_model, n_heads, relative=True)
        self.ln_ff, self.ff = RMSNorm(d_model), GatedFeedForward(d_model, d_ff)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.ff(self.ln_ff(x))


class DecoderBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.ln_self, self.self_attn = RMSNorm(d_model), Attention(d_model, n_heads, relative=True, causal=True)
        self.ln_cross, self.cross_attn = RMSNorm(d_model), Attention(d_model, n_heads, relative=False)
        self.ln_ff, self.ff = RMSNorm(d_model), GatedFeedForward(d_model, d_ff)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        x = x + self.self_attn(self.ln_self(x))
        x = x + self.cross_attn(self.ln_cross(x), memory)
        return x + self.ff(self.ln_ff(x))


class T5(nn.Module):
    def __init__(self, vocab_size: int = VOCAB_SIZE, d_model: int = D_MODEL, n_heads: int = N_HEADS,
                 d_ff: int = D_FF, n_encoder: int = N_ENCODER, n_decoder: int = N_DECODER) -> None:
        super().__init__()
        self.d_model = d_model
        self.shared = nn.Embedding(vocab_size, d_model)
        self.encoder = nn.ModuleList(EncoderBlock(d_model, n_heads, d_ff) for _ in range(n_encoder))
        self.encoder_norm = RMSNorm(d_model)
        self.decoder = nn.ModuleList(DecoderBlock(d_model, n_heads, d_ff) for _ in range(n_decoder))
        self.decoder_norm = RMSNorm(d_model)

    def forward(self, source_ids: Tensor, decoder_ids: Tensor) -> Tensor:
        memory = self.shared(source_ids)
        for block in self.encoder:
            memory = block(memory)
        memory = self.encoder_norm(memory)
        x = self.shared(decoder_ids)
        for block in self.decoder:
            x = block(x, memory)
        # tied LM head, scaled as T5 scales it
        return F.linear(self.decoder_norm(x) * self.d_model**-0.5, self.shared.weight)


def model(**sizes: int) -> nn.Module:
    """The encoder-decoder; keyword arguments override the module-level sizes."""
    return T5(**sizes)


def _row(step: int, row: int) -> Tensor:
    generator = torch.Generator().manual_seed(_ROW_SEED_STRIDE * step + row)
    return torch.randint(1, VOCAB_SIZE, (SEQ_LEN,), generator=generator)


def batch(batch_size: int, step: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """``batch_size`` source rows; the target is each row reversed, the decoder input the target shifted
    right behind the start token."""
    source = torch.stack([_row(step, r) for r in range(batch_size)])
    target = source.flip(1)
    start = torch.full((batch_size, 1), START_TOKEN, dtype=torch.long)
    return (source, torch.cat([start, target[:, :-1]], dim=1)), target


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy, mean over all target tokens of all rows."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
