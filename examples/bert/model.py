"""A small Hugging Face ``BertForMaskedLM`` (built from a config, nothing downloaded).

The ``transformers`` model is wrapped in :class:`BertLogits`, whose ``forward(input_ids)`` returns the
logits tensor only (no ``ModelOutput``), which is what the planner and the loss function expect.
Dropout is 0 so that a traced graph is deterministic (the tensor-parallel tests compare runs exactly);
attention is ``"sdpa"``, and without an attention mask every position attends to every other.

Task: the affine recurrence of ``examples/gpt`` (``x[t+1] = (a*x[t] + b) % vocab`` with per-row
``a, b``) with every ``MASK_EVERY``-th token replaced by ``MASK_ID``; the model predicts the masked
tokens from both sides, so the loss falls when trained.

Example-model contract (read by the planner; no hetplan imports here):

- ``model(**config) -> nn.Module``, built on meta by the planner and the program; its initial values
  follow the program's init contract (README, "Initial values"): here the Hugging Face model's ``_init_weights``.
- ``batch(batch_size, step) -> ((input_ids,), target)``: deterministic, row ``r`` of step ``k``
  depends only on ``(k, r)``; the target is the original token at masked positions, ``IGNORE`` elsewhere.
- ``loss_fn(output, target)``: cross-entropy over the masked positions, mean over them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import BertConfig, BertForMaskedLM

SEQ_LEN = 32
VOCAB_SIZE = 256
MASK_ID = VOCAB_SIZE - 1          # a token id the recurrence can produce too; the task stays learnable
MASK_EVERY = 4                    # positions 3, 7, 11, ... are masked
IGNORE = -100                     # cross_entropy's ignore_index: unmasked positions
CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "type_vocab_size": 1,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "attn_implementation": "sdpa",
}

_ROW_SEED_STRIDE = 1_000_003  # seed of row r at step k: k * stride + r
_MULTIPLIERS = (1, 3, 5, 7)
_MAX_OFFSET = 16


class BertLogits(nn.Module):
    """``BertForMaskedLM`` whose forward takes token ids and returns only the logits."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.mlm = BertForMaskedLM(config)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.mlm(input_ids=input_ids).logits


def model(**config: Any) -> nn.Module:
    """The wrapped BERT; keyword arguments override entries of ``CONFIG``."""
    return BertLogits(BertConfig(**{**CONFIG, **config}))


def _row(step: int, row: int) -> Tensor:
    generator = torch.Generator().manual_seed(_ROW_SEED_STRIDE * step + row)
    a = _MULTIPLIERS[int(torch.randint(len(_MULTIPLIERS), (), generator=generator))]
    b = int(torch.randint(_MAX_OFFSET, (), generator=generator))
    x = int(torch.randint(VOCAB_SIZE, (), generator=generator))
    tokens = [x]
    for _ in range(SEQ_LEN - 1):
        x = (a * x + b) % VOCAB_SIZE
        tokens.append(x)
    return torch.tensor(tokens, dtype=torch.long)


def batch(batch_size: int, step: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """``batch_size`` rows of ``SEQ_LEN`` tokens, every ``MASK_EVERY``-th one masked."""
    tokens = torch.stack([_row(step, r) for r in range(batch_size)])
    masked = torch.arange(SEQ_LEN) % MASK_EVERY == MASK_EVERY - 1
    inputs = tokens.masked_fill(masked, MASK_ID)
    target = tokens.masked_fill(~masked, IGNORE)
    return (inputs,), target


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy over the masked positions, mean over them."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1), ignore_index=IGNORE)
