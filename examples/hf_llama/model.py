"""A small Hugging Face ``LlamaForCausalLM`` (built from a config, nothing downloaded).

The ``transformers`` model is wrapped in :class:`LlamaLogits`, whose ``forward(input_ids)``
returns the logits tensor only (no ``ModelOutput``, no KV cache), which is what the
planner and the loss function expect.

Tracing notes (torch 2.13, transformers 5.x): ``torch.export.export(..., strict=False)``
traces this model on meta tensors with ``attn_implementation="sdpa"`` and
``use_cache=False`` (``"eager"`` traces too); RoPE needs no special flags. Because the
mask checks are data-dependent, the traced graph builds the causal mask explicitly
(a ``batch x 1 x seq x seq`` bool tensor from ``position_ids``) instead of relying on
``is_causal``, and it hard-codes the tracing device in ``arange``/``to`` calls. The
rotary ``inv_freq`` buffers are non-persistent and computed in ``__init__``: the program,
which builds the model with its parameters on meta, keeps buffers as the constructor made them.

Task: the same affine recurrence as ``examples/gpt`` (``x[t+1] = (a*x[t] + b) % vocab``
with per-row ``a, b``), so the loss falls when trained.

Example-model contract (read by the planner; no hetplan imports here):

- ``model(**config) -> nn.Module``, built on meta by the planner and the program; its initial
  values follow the program's init contract (README, "Initial values"): here the Hugging Face model's ``_init_weights``.
- ``batch(batch_size, step) -> ((input_ids,), target)``: deterministic, row ``r`` of
  step ``k`` depends only on ``(k, r)``.
- ``loss_fn(output, target)``: next-token cross-entropy, mean over all tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM

SEQ_LEN = 32
CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "use_cache": False,
    "attn_implementation": "sdpa",
}

_ROW_SEED_STRIDE = 1_000_003  # seed of row r at step k: k * stride + r
_MULTIPLIERS = (1, 3, 5, 7)
_MAX_OFFSET = 16


class LlamaLogits(nn.Module):
    """``LlamaForCausalLM`` whose forward takes token ids and returns only the logits."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.lm = LlamaForCausalLM(config)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


def model(**config: Any) -> nn.Module:
    """The wrapped Llama; keyword arguments override entries of ``CONFIG``."""
    return LlamaLogits(LlamaConfig(**{**CONFIG, **config}))


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
    rows = torch.stack([_row(step, r, SEQ_LEN, CONFIG["vocab_size"]) for r in range(batch_size)])
    return (rows[:, :-1],), rows[:, 1:]


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Next-token cross-entropy, mean over all tokens of all rows."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
