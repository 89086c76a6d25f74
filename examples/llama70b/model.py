"""Llama-2-70B (Hugging Face ``LlamaForCausalLM``, real config) — for planning only.

Built from the published configuration, never downloaded and never run: the planner
builds it under ``torch.device("meta")`` (about 69e9 parameters, no storage) and traces
it with ``torch.export.export(..., strict=False)`` on meta inputs. Parameters are fp32
here; precision is the planner's decision. ``forward(input_ids)`` returns the logits.

Tracing notes: see ``examples/hf_llama/model.py`` (sdpa attention, ``use_cache=False``;
the traced graph materialises a ``batch x 1 x seq x seq`` bool causal mask).

``SEQ_LEN`` (default 4096, Llama-2's context) sets the sequence length of ``batch()``;
override it with the environment variable ``HETPLAN_SEQ_LEN`` (read at import) or the
``seq_len`` argument of ``batch()``. The tokens are random ids (cheap to make, not
learnable), the target is the input shifted by one.

Example-model contract: ``model(**config)``, ``batch(batch_size, step)`` (row ``r`` of
step ``k`` depends only on ``(k, r)``), ``loss_fn`` = mean next-token cross-entropy.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM

SEQ_LEN = int(os.environ.get("HETPLAN_SEQ_LEN", "4096"))
CONFIG: dict[str, Any] = {  # meta-llama/Llama-2-70b-hf config.json
    "vocab_size": 32000,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    # rope_theta: 10000, the LlamaConfig default (its spelling differs across transformers 4.x / 5.x)
    "tie_word_embeddings": False,
    "use_cache": False,
    "attn_implementation": "sdpa",
}

_ROW_SEED_STRIDE = 1_000_003  # seed of row r at step k: k * stride + r


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


def batch(batch_size: int, step: int, seq_len: int | None = None) -> tuple[tuple[Tensor, ...], Tensor]:
    """``batch_size`` rows of random token ids (``seq_len``, default ``SEQ_LEN``)."""
    seq_len = SEQ_LEN if seq_len is None else seq_len
    rows = [
        torch.randint(
            CONFIG["vocab_size"],
            (seq_len + 1,),
            generator=torch.Generator().manual_seed(_ROW_SEED_STRIDE * step + r),
        )
        for r in range(batch_size)
    ]
    tokens = torch.stack(rows)
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Next-token cross-entropy, mean over all tokens of all rows."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
