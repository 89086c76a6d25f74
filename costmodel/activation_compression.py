"""Activation compression on pipeline links: what each compressor puts on the wire and costs.

`fp16`/`bf16` casts (only where activations are wider than 2 bytes) and block-wise `int8` (one fp32
scale per `block_elems` elements, INT8_BLOCK_ELEMS by default, backends.torchdist.activations); both
the forward activations and the backward gradients travel compressed. Kernel time is the bytes the
encode and decode kernels read and write over the achieved memory bandwidth plus their launches.

The search prices every cut of a pipeline with the compressor the policy picks on it (`CutCodec`,
`cut_transfer`: planner.search.split's per-micro-batch transfer), assembly records that choice on
the plan's edge, and the simulator costs the recorded compressor the same way (`activation_cost`).
"""

from __future__ import annotations

import functools
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


def activation_wire_bytes(name: str, nbytes: float, element_bytes: int, block_elems: int = INT8_BLOCK_ELEMS) -> float:
    """Bytes on the wire for `nbytes` of activations of `element_bytes`-byte elements."""
    n = nbytes / element_bytes
    if name in ("fp16", "bf16") and element_bytes > HALF_BYTES:
        return n * HALF_BYTES
    if name == "int8" and element_bytes > INT8_BYTES:
        return n * INT8_BYTES + math.ceil(n / block_elems) * SCALE_BYTES
    return nbytes


def activation_applies(name: str, element_bytes: int) -> bool:
    """Casts apply to activations wider than 2 bytes; int8 to any wider than 1 byte."""
    if name in ("fp16", "bf16"):
        return element_bytes > HALF_BYTES
    if name == "int8":
        return element_bytes > INT8_BYTES
    return True


def activation_cost(name: str, nbytes: float, element_bytes: int, link: Link, bandwidth_bytes_s: float,
                    launch_s: float = 0.0, block_elems: int = INT8_BLOCK_ELEMS) -> ActivationCost:
    """Compressor `name` on `nbytes` per micro-batch over `link`, its kernels streaming at
    `bandwidth_bytes_s` and costing `launch_s` per launch."""
    wire = activation_wire_bytes(name, nbytes, element_bytes, block_elems)
    kernel = _KERNEL_BYTES[name] * nbytes / element_bytes / bandwidth_bytes_s + _LAUNCHES[name] * launch_s
    return ActivationCost(name, wire, 2 * (link.transfer_s(wire) + kernel))


def choose_activation(policy: str, nbytes: float, element_bytes: int, link: Link,
                      bandwidth_bytes_s: float, launch_s: float = 0.0) -> ActivationCost:
    """The fastest compressor the policy allows for `nbytes` per micro-batch on `link`."""
    names = [n for n in activation_options(policy) if activation_applies(n, element_bytes)] or ["none"]
    costs = [activation_cost(name, nbytes, element_bytes, link, bandwidth_bytes_s, launch_s) for name in names]
    return min(costs, key=lambda c: c.time_s)


@dataclass(frozen=True)
class CutCodec:
    """Activation compression on one pipeline cut: the policy, and the kernel figures of the cut's
    slower end (least bandwidth, most launch overhead of the two stages' devices)."""

    policy: str
    kernel_bandwidth_bytes_s: float
    launch_s: float


@functools.lru_cache(maxsize=1 << 16)
def cut_transfer(codec: CutCodec, bandwidth_bytes_s: float, latency_s: float, nbytes: float,
                 element_bytes: int) -> ActivationCost:
    """What the policy picks for one micro-batch of `nbytes` over a cut of this link (cached: the
    split's dynamic programme asks for every block at every cut)."""
    link = Link("cut", bandwidth_bytes_s, latency_s)
    return choose_activation(codec.policy, nbytes, element_bytes, link, codec.kernel_bandwidth_bytes_s, codec.launch_s)
