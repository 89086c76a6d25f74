"""A 374M-parameter Llama (Hugging Face ``LlamaForCausalLM`` from a config, nothing downloaded): the model
benchmarks/memory_scale.py plans in four stages and trains on CPU processes.

24 layers of hidden 1024 and MLP 2816, 16 heads, a 32000-token vocabulary with an untied head, sequences
of 128 tokens of random ids: big enough that weights, gradients and AdamW state dominate a rank's memory.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM

SEQ_LEN = 128
CONFIG: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "max_position_embeddings": SEQ_LEN,
    "tie_word_embeddings": False,
    "use_cache": False,
    "attn_implementation": "sdpa",
}
_ROW_SEED_STRIDE = 1_000_003


class LlamaLogits(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.lm = LlamaForCausalLM(config)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


def model() -> nn.Module:
    return LlamaLogits(LlamaConfig(**CONFIG))


def batch(batch_size: int, step: int) -> tuple[tuple[Tensor, ...], Tensor]:
    rows = [torch.randint(CONFIG["vocab_size"], (SEQ_LEN + 1,),
                          generator=torch.Generator().manual_seed(_ROW_SEED_STRIDE * step + r))
            for r in range(batch_size)]
    tokens = torch.stack(rows)
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
