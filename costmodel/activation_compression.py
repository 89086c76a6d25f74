"""Activation compression on pipeline links: what each compressor puts on the wire and costs.

`fp16`/`bf16` casts (only where activations are wider than 2 bytes) and block-wise `int8` (one fp32
scale per INT8_BLOCK_ELEMS elements, backends.torchdist.activations); both the forward activations
and the backward gradients travel compressed. Kernel time is the bytes the encode and decode
kernels read and write over the achieved memory bandwidth plus their launches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from costmodel.compression import (
    ACTIVATION_COMPRESSORS,
    ACTIVATION_POLICIES,
    AUTO,
    HALF_BYTES,
    INT8_BLOCK_ELEMS,
    INT8_BYTES,
    SCALE_BYTES,
)
from planner.core.cluster import Link

# bytes read + written per element: encode on the sender + decode on the receiver
_KERNEL_BYTES = {"none": 0, "fp16": (4 + 2) + (2 + 4), "bf16": (4 + 2) + (2 + 4), "int8": (4 + 1) + (1 + 4)}
_LAUNCHES = {"none": 0, "fp16": 2, "bf16": 2, "int8": 4}   # sender + receiver


def activation_options(policy: str) -> tuple[str, ...]:
    """Compressors an activation policy allows: `auto` all of them, a name only itself."""
    if policy == AUTO:
        return ACTIVATION_COMPRESSORS
    if policy in ACTIVATION_COMPRESSORS:
        return (policy,)
    raise ValueError(f"unknown activation compression {policy!r}; known: {', '.join(ACTIVATION_POLICIES)}")


@dataclass(frozen=True)
class ActivationCost:
    """One compressor on one pipeline edge, per micro-batch, forward and backward together."""

    name: str
    wire_bytes: float         # one direction
    time_s: float             # both directions: link time + encode/decode kernels


def activation_wire_bytes(name: str, nbytes: float, element_bytes: int) -> float:
    """Bytes on the wire for `nbytes` of activations of `element_bytes`-byte elements."""
    n = nbytes / element_bytes
    if name in ("fp16", "bf16") and element_bytes > HALF_BYTES:
        return n * HALF_BYTES
    if name == "int8" and element_bytes > INT8_BYTES:
        return n * INT8_BYTES + math.ceil(n / INT8_BLOCK_ELEMS) * SCALE_BYTES
    return nbytes


def activation_applies(name: str, element_bytes: int) -> bool:
    """Casts apply to activations wider than 2 bytes; int8 to any wider than 1 byte."""
    if name in ("fp16", "bf16"):
        return element_bytes > HALF_BYTES
    if name == "int8":
        return element_bytes > INT8_BYTES
    return True


def choose_activation(policy: str, nbytes: float, element_bytes: int, link: Link,
                      bandwidth_bytes_s: float, launch_s: float = 0.0) -> ActivationCost:
    """The fastest compressor the policy allows for `nbytes` per micro-batch on `link`."""
    names = [n for n in activation_options(policy) if activation_applies(n, element_bytes)] or ["none"]
    costs = []
    for name in names:
        wire = activation_wire_bytes(name, nbytes, element_bytes)
        kernel = _KERNEL_BYTES[name] * nbytes / element_bytes / bandwidth_bytes_s \
            + _LAUNCHES[name] * launch_s
        costs.append(ActivationCost(name, wire, 2 * (link.transfer_s(wire) + kernel)))
    return min(costs, key=lambda c: c.time_s)
