"""Tokenise a text into a memory-mapped token file: `tokens.bin` and its `tokens.json`.

    python examples/tokens/prepare.py                     # corpus.txt beside this file -> tokens.bin beside it
    python examples/tokens/prepare.py --text T --out DIR  # any UTF-8 text -> DIR/tokens.bin

The tokenizer is byte-level: a token is one byte of the text's UTF-8 encoding, so the vocabulary is the
256 byte values and any text tokenises without a learned table. `tokens.bin` is the flat array of token
ids in text order, with no header: the layout nanoGPT's `prepare.py` and Megatron's `.bin` write, read
back with `np.memmap(path, dtype, mode="r")`; ids are uint16 for a vocabulary of at most 65536 ids,
uint32 above. `tokens.json` says how to read it: `{"dtype": "uint16", "vocab": 256, "tokens": N,
"tokenizer": "utf-8 bytes"}`. Both files are written to temporary names and renamed, so an interrupted
run leaves no half-written token file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
BYTE_VOCAB = 256                  # one token per byte value
UINT16_VOCAB = 1 << 16            # the largest vocabulary whose ids fit uint16
TOKENIZER = "utf-8 bytes"


def token_dtype(vocab: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a `vocab`-token vocabulary (nanoGPT's rule)."""
    return np.dtype(np.uint16 if vocab <= UINT16_VOCAB else np.uint32)


def encode(text: str) -> np.ndarray:
    """The byte-level tokens of `text`: its UTF-8 bytes as ids 0..255."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def decode(tokens: np.ndarray) -> str:
    """The text of byte-level tokens (a sequence cut inside a character decodes with a replacement mark)."""
    return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")


def write_token_file(tokens: np.ndarray, vocab: int, folder: Path, name: str = "tokens") -> Path:
    """Write `tokens` as `folder/name.bin` (np.memmap of token_dtype(vocab)) and `folder/name.json`;
    returns the .bin path."""
    if tokens.size and int(tokens.max()) >= vocab:
        raise ValueError(f"token id {int(tokens.max())} does not fit a vocabulary of {vocab}")
    dtype = token_dtype(vocab)
    folder.mkdir(parents=True, exist_ok=True)
    binary, meta = folder / f"{name}.bin", folder / f"{name}.json"
    partial_bin, partial_meta = binary.with_suffix(".bin.partial"), meta.with_suffix(".json.partial")
    out = np.memmap(partial_bin, dtype=dtype, mode="w+", shape=(tokens.size,))
    out[:] = tokens
    out.flush()
    del out
    partial_meta.write_text(json.dumps({"dtype": dtype.name, "vocab": vocab, "tokens": int(tokens.size),
                                        "tokenizer": TOKENIZER}, indent=2) + "\n")
    os.replace(partial_bin, binary)
    os.replace(partial_meta, meta)
    return binary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--text", type=Path, default=HERE / "corpus.txt", help="UTF-8 text to tokenise")
    p.add_argument("--out", type=Path, default=HERE, help="folder for tokens.bin and tokens.json")
    args = p.parse_args(argv)
    try:
        text = args.text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"prepare.py: {args.text}: cannot read it as UTF-8 text: {exc}", file=sys.stderr)
        return 2
    path = write_token_file(encode(text), BYTE_VOCAB, args.out)
    print(f"wrote {path} ({len(text.encode('utf-8'))} tokens, vocab {BYTE_VOCAB}) and {path.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
