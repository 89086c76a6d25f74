"""Generator seeds derived from the run's seed: one hash for every random stream the program draws.

A stream (a module's initialisation, an epoch's data order) is named by a text that holds the run's seed
and what the stream is for; its seed is the first 8 bytes of that text's SHA-256, kept to 63 bits
(torch.Generator.manual_seed takes a non-negative 64-bit integer). Neighbouring seeds, epochs or names
give unrelated streams, where seed * stride + k would collide.
"""

from __future__ import annotations

import hashlib

SEED_BITS = 63


def derived_seed(text: str) -> int:
    """The generator seed of the stream named `text`."""
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << SEED_BITS) - 1)
