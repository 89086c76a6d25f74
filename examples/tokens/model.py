"""A small GPT-style language model trained on a real token file (memory-mapped, nanoGPT's layout).

The data: `tokens.bin`, the flat array of token ids `prepare.py` writes (byte-level tokens of
`corpus.txt`; np.memmap, uint16 for a vocabulary of at most 65536 ids, else uint32), described by
`tokens.json` beside it (`dtype`, `vocab`). Sample i of `dataset()` is the window of SEQ_LEN tokens
starting at token i * SEQ_LEN and its next-token target, the same window one token later:
`(tokens[s:s+T], tokens[s+1:s+T+1])`, windows side by side (Megatron's samples), so an epoch reads the
text once.

Where the token file is found: the path in the environment variable HETPLAN_DATA (a tokens.bin, or a
folder holding one), else `tokens.bin` beside this file. The program runs a copy of this file from
`out/program/`, so a run names the file with HETPLAN_DATA (planning in examples/tokens finds it beside).
Prepare it first: `python examples/tokens/prepare.py`.

Before the first step, `dataset()` checks the file against tokens.json and the model: the dtype is uint16
or uint32 and holds the vocabulary, the file is a whole number of tokens, every id is below the
vocabulary, and the vocabulary fits the model's embedding; otherwise it raises one sentence naming the
file and the fix.

Model-file contract (read by the planner; no hetplan imports here):

- ``model(**sizes) -> nn.Module``: token + position embeddings, pre-LayerNorm blocks (causal attention,
  GELU MLP), a final LayerNorm and an LM head tied to the token embedding;
- ``init_weights(module)``: GPT-2's initialisation of one module;
- ``dataset()``: the token windows above, rows ``(input_ids, target)`` of SEQ_LEN int64 ids each;
- ``batch(batch_size, step) -> ((input_ids,), target)``: synthetic rows of the same dtypes and shapes,
  for planning (row r of step k depends only on (k, r));
- ``loss_fn(output, target)``: next-token cross-entropy, mean over rows and tokens.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

VOCAB_SIZE = 256        # the model's embedding rows: byte-level tokens (tokens.json's vocab must fit)
SEQ_LEN = 32
D_MODEL = 64
N_HEADS = 4
N_LAYERS = 2
MLP_RATIO = 4
INIT_STD = 0.02         # GPT-2's initialiser range

DATA_ENV = "HETPLAN_DATA"          # path of the token file (or its folder) for a run
TOKEN_FILE = "tokens.bin"
TOKEN_DTYPES = ("uint16", "uint32")
UINT16_VOCAB = 1 << 16             # the largest vocabulary whose ids fit uint16
SCAN_TOKENS = 1 << 22              # ids checked per block when scanning the file (16 MiB of uint32)
_ROW_SEED_STRIDE = 1_000_003       # seed of batch()'s row r at step k: k * stride + r


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)   # a key bias would get a zero gradient
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, d_model = x.shape
        head_dim = d_model // self.n_heads
        q, k, v = self.qkv(x).split(d_model, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_heads, head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.fc_in = nn.Linear(d_model, mlp_ratio * d_model)
        self.act = nn.GELU()
        self.fc_out = nn.Linear(mlp_ratio * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.fc_out(self.act(self.fc_in(self.ln_mlp(x))))


class TokenGPT(nn.Module):
    def __init__(self, vocab_size: int = VOCAB_SIZE, max_seq_len: int = SEQ_LEN, d_model: int = D_MODEL,
                 n_heads: int = N_HEADS, n_layers: int = N_LAYERS, mlp_ratio: int = MLP_RATIO) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_seq_len, d_model)
        blocks = [Block(d_model, n_heads, mlp_ratio) for _ in range(n_layers)]
        for block in blocks:   # GPT-2: projections into the residual stream start smaller, by depth
            for residual_out in (block.attn.proj, block.fc_out):
                residual_out.init_std = INIT_STD / math.sqrt(2 * n_layers)   # type: ignore[assignment]
        self.blocks = nn.ModuleList(blocks)
        self.ln_final = nn.LayerNorm(d_model)

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_final(x), self.token_embedding.weight)   # tied LM head


def model(**sizes: int) -> nn.Module:
    """The decoder; keyword arguments override the module-level sizes."""
    return TokenGPT(**sizes)


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: linear and embedding weights N(0, 0.02) (residual projections smaller),
    biases zero; LayerNorms keep torch's ones and zeros."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=getattr(module, "init_std", INIT_STD))
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def token_file() -> Path:
    """The token file a run reads: $HETPLAN_DATA (a file, or a folder holding tokens.bin), else the one
    beside this model file."""
    named = os.environ.get(DATA_ENV)
    if not named:
        return Path(__file__).resolve().parent / TOKEN_FILE
    path = Path(named)
    return path / TOKEN_FILE if path.is_dir() else path


def _read_meta(path: Path) -> tuple[np.dtype, int]:
    """(dtype, vocab) from the tokens.json beside `path`, checked: the dtype holds every id of the vocab."""
    meta_path = path.with_suffix(".json")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no token file; run `python examples/tokens/prepare.py` and name its "
                                f"tokens.bin with `plan run --data FILE` (or {DATA_ENV}=FILE)")
    try:
        meta = json.loads(meta_path.read_text())
        dtype_name, vocab = meta["dtype"], meta["vocab"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{meta_path}: cannot read dtype and vocab ({type(exc).__name__}: {exc}); write it "
                         f"with prepare.py beside {path.name}") from exc
    if dtype_name not in TOKEN_DTYPES:
        raise ValueError(f"{meta_path}: dtype {str(dtype_name)[:20]!r} is not one of {', '.join(TOKEN_DTYPES)}; "
                         f"write the tokens as uint16, or uint32 for a vocab over {UINT16_VOCAB}")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ValueError(f"{meta_path}: vocab {str(vocab)[:20]!r} is not a positive integer; give the "
                         f"tokenizer's vocabulary size")
    dtype = np.dtype(dtype_name)
    if vocab > np.iinfo(dtype).max + 1:
        raise ValueError(f"{meta_path}: dtype {dtype_name} cannot hold the ids of vocab {vocab}; write the "
                         f"tokens as uint32")
    if vocab > VOCAB_SIZE:
        raise ValueError(f"{meta_path}: vocab {vocab} is larger than the model's VOCAB_SIZE {VOCAB_SIZE}; "
                         f"raise VOCAB_SIZE, or tokenise with the byte-level prepare.py")
    return dtype, vocab


def _check_ids(path: Path, tokens: np.ndarray, vocab: int) -> None:
    """Every id below `vocab`: a file written with another dtype or tokenizer than tokens.json says fails."""
    for start in range(0, tokens.size, SCAN_TOKENS):
        block = np.asarray(tokens[start:start + SCAN_TOKENS])
        if block.size and int(block.max()) >= vocab:
            where = start + int(np.argmax(block >= vocab))
            raise ValueError(f"{path}: token id {int(tokens[where])} at position {where} is not below vocab {vocab} "
                             f"of {path.with_suffix('.json').name}; write the file with the dtype and "
                             f"tokenizer tokens.json names, e.g. with prepare.py")


class TokenWindows(Dataset):
    """Windows of SEQ_LEN + 1 tokens side by side in a token file: sample i is (ids, next ids) of the window
    at token i * SEQ_LEN, as int64. The file is memory-mapped lazily in each process that reads (the
    program's loader workers included) and only the windows read are paged in."""

    def __init__(self, path: Path, seq_len: int = SEQ_LEN) -> None:
        self.path, self.seq_len = path, seq_len
        self.dtype, self.vocab = _read_meta(path)
        size_bytes = path.stat().st_size
        if size_bytes % self.dtype.itemsize:
            raise ValueError(f"{path}: {size_bytes} bytes is not a whole number of {self.dtype.name} tokens; "
                             f"write it with the dtype {path.with_suffix('.json').name} names")
        self.count = size_bytes // self.dtype.itemsize
        self._tokens: np.ndarray | None = None
        _check_ids(path, self.tokens, self.vocab)

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.count,))
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:     # a copy in another process maps the file itself
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return max(0, (self.count - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        start = index * self.seq_len
        window = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


def dataset() -> TokenWindows:
    """The token windows of the token file (token_file()), checked against tokens.json and the model."""
    return TokenWindows(token_file())


def batch(batch_size: int, step: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """Synthetic rows shaped like the dataset's: SEQ_LEN + 1 random ids per row, seeded per (step, row)."""
    rows = torch.stack([torch.randint(VOCAB_SIZE, (SEQ_LEN + 1,),
                                      generator=torch.Generator().manual_seed(_ROW_SEED_STRIDE * step + r))
                        for r in range(batch_size)])
    return (rows[:, :-1],), rows[:, 1:]


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Next-token cross-entropy, mean over all tokens of all rows."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
