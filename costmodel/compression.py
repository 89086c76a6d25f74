"""Compression costs: what each gradient or activation compressor puts on the wire, how long its
kernels take, what state it keeps, and which one a policy picks.

Gradient compressors (backends.compression), one per gradient group, over the group's R ranks, on
fp32 gradients cut into buckets of at most GRAD_BUCKET_CAP_BYTES (`none` is one flat all-reduce):

  name       payload per rank per bucket (bytes)  collectives         kernel bytes / elem  state (bytes)
  none       4 n                                  ring all-reduce     0                    0
  fp16/bf16  2 n                                  ring all-reduce     16                   0
  powersgd   4 (u + sum_i (n_i + m_i) r_i)        3 ring all-reduces  44                   4 (n + P + Q)
  onebit     ceil(n / 8) + 4                      ring all-gather     56 + (R + 3) / 8     8 n

(P + Q = sum_i (n_i + m_i) r_i: PowerSGD's low-rank factors, kept for warm start.)
"Payload" is what a rank hands to its collectives, the figure `GradientCompressor.last_wire_bytes`
measures; link time applies the algorithm's factor (ring all-reduce 2(R-1)/R of the payload, ring
all-gather (R-1) x the payload, since every rank receives every other rank's bytes). PowerSGD
compresses each gradient viewed as the matrix [shape[0], -1] (n_i x m_i) with rank
r_i = min(n_i, m_i, POWERSGD_RANK) when (n_i + m_i) r_i x POWERSGD_MIN_COMPRESSION_RATE < n_i m_i
(torch's `_should_compress`); the rest (u elements: vectors, small matrices) travels uncompressed.
Its figure is the steady state after POWERSGD_START_ITER vanilla steps. Parameters of unknown
shape are costed as vectors (PowerSGD leaves them uncompressed), the documented approximation.

Under AdamW (the program's default) a `onebit` group trains with 1-bit Adam: exact fp32 gradients
(the `none` figure) for the first ONEBIT_ADAM_WARMUP_FRACTION of the run, then momentum through the
same 1-bit compressor (the `onebit` figure: same payload, kernels, error buffers). Like PowerSGD's,
the figures are the steady state a plan's per-step estimate describes; over a whole run the 1-bit
payload averages 0.25 x 4n + 0.75 x (n/8 + 4) ~ 1.09n bytes (3.7x less than fp32, where PowerSGD
saves 9.6x on the bundled GPT). Under AdamW (`plan --optimizer`, the program's default) `auto` ranks
1-bit by that run average, the others by their steady state.

Kernel time = bytes the compressor's kernels read and write / achieved memory bandwidth (counted
pass by pass in the `_*_BYTES` constants) + its kernel launches x the device's per-op overhead
(costmodel.compute.op_overhead_s), so small messages are not worth compressing; `none` is the
reference (every method shares the flattening into buckets). State: error feedback is one fp32
copy of the gradient per error buffer.

Activation compressors on pipeline links are costed in costmodel.activation_compression.

The settings above (bucket size, PowerSGD's rank, minimum rate and start, 1-bit Adam's warm-up;
defaults in costmodel.constants) are priced as `settings_of(name)` gives them, and a plan records
that same record on each gradient group (planner.core.ir.CompressorSettings) for the program to run.

The search sees these figures as part of the costed problem: `CompressedCostTables` extends
`costmodel.tables.CostTables` with a `CompressionTable` (policies, parameter shapes per block,
kernel bandwidth per device class). A compressor with state is chosen only where its state fits
beside its members' memory (costmodel.compression_memory; `allowed` below).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, fields

from costmodel import constants as C
from costmodel.constants import GRAD_BUCKET_CAP_BYTES as GRAD_BUCKET_CAP_BYTES
from costmodel.constants import INT8_BLOCK_ELEMS as INT8_BLOCK_ELEMS
from costmodel.constants import ONEBIT_ADAM_WARMUP_FRACTION as ONEBIT_ADAM_WARMUP_FRACTION
from costmodel.constants import POWERSGD_MIN_COMPRESSION_RATE as POWERSGD_MIN_COMPRESSION_RATE
from costmodel.constants import POWERSGD_RANK as POWERSGD_RANK
from costmodel.constants import POWERSGD_START_ITER as POWERSGD_START_ITER
from costmodel.network import ring_allreduce_s
from costmodel.tables import CostTables
from planner.core.cluster import DeviceType, Link
from planner.core.plan_records import CompressorSettings
from planner.core.plan_records import bucket_ranges as bucket_ranges

Shape = tuple[int, ...]

GRADIENT_COMPRESSORS = ("none", "fp16", "bf16", "powersgd", "onebit")
ACTIVATION_COMPRESSORS = ("none", "fp16", "bf16", "int8")
AUTO = "auto"
GRADIENT_POLICIES = (GRADIENT_COMPRESSORS[0], AUTO, *GRADIENT_COMPRESSORS[1:])
ACTIVATION_POLICIES = (ACTIVATION_COMPRESSORS[0], AUTO, *ACTIVATION_COMPRESSORS[1:])

FP32_BYTES = 4
HALF_BYTES = 2
INT8_BYTES = 1
SCALE_BYTES = 4                      # one float32 scale (1-bit: per bucket; int8: per block)
BITS_PER_BYTE = 8


def onebit_adam_freeze_step(total_steps: int, warmup_fraction: float = ONEBIT_ADAM_WARMUP_FRACTION) -> int:
    """Exact AdamW steps before 1-bit Adam freezes the variance, in a run of `total_steps` steps."""
    return max(1, math.ceil(warmup_fraction * total_steps))


# Kernel bytes read + written per gradient element, pass by pass (backends.compression):
_CAST_BYTES = (4 + 2) + (2 + 2) + (2 + 4)     # cast to half, divide in place, cast back
_POWERSGD_BYTES = (12 + 8                      # add error feedback (r, r, w), clone for the error
                   + 4 + 4 + 4                 # M Q, M^T P (reads of M), P Q^T written into M
                   + 12)                       # new error = copy - approximation
_ONEBIT_BYTES = (12 + 8 + 4                    # worker: add error, sign pack (+ error), unpack out
                 + 12 + 8 + 4                  # server: the same on the average
                 + 8)                          # copy the result into the bucket
# Kernel launches (ops) per bucket, counted in backends.compression / backends.torchdist.activations:
_CAST_LAUNCHES = 3                  # cast, divide, cast back
_POWERSGD_BUCKET_LAUNCHES = 6       # add error, clone, cat uncompressed, copy back, new error, divide
_POWERSGD_MATRIX_LAUNCHES = 5       # per compressed matrix: M Q, orthogonalise, M^T P, P Q^T, divide
_ONEBIT_LAUNCHES = 10               # worker and server: add + norm, sqrt, pack, unpack; cat, copy


def gradient_options(policy: str) -> tuple[str, ...]:
    """Compressors a gradient policy allows: `auto` all of them, a name only itself."""
    if policy == AUTO:
        return GRADIENT_COMPRESSORS
    if policy in GRADIENT_COMPRESSORS:
        return (policy,)
    raise ValueError(f"unknown gradient compression {policy!r}; known: {', '.join(GRADIENT_POLICIES)}")


def kernel_bandwidth_bytes_s(device: DeviceType) -> float:
    """Achieved memory bandwidth of compression kernels on a device (streaming kernels)."""
    return device.memory_bandwidth_bytes_s * C.MEMORY_EFFICIENCY


def settings_of(name: str) -> CompressorSettings | None:
    """The runtime settings gradient compressor `name` is priced with and runs with (None: `none`,
    which has none: one flat all-reduce)."""
    if name == "none":
        return None
    base = CompressorSettings(bucket_cap_bytes=GRAD_BUCKET_CAP_BYTES)
    if name == "powersgd":
        return dataclasses.replace(base, rank=POWERSGD_RANK, min_compression_rate=POWERSGD_MIN_COMPRESSION_RATE,
                                   start_iter=POWERSGD_START_ITER)
    if name == "onebit":
        return dataclasses.replace(base, warmup_fraction=ONEBIT_ADAM_WARMUP_FRACTION)
    return base


# ----------------------------------------------------------------------------- gradients

def powersgd_elements(shape: Shape, rank: int = POWERSGD_RANK,
                      min_rate: float = POWERSGD_MIN_COMPRESSION_RATE) -> tuple[int, int, int]:
    """(uncompressed, P, Q) elements PowerSGD all-reduces for one gradient of `shape`."""
    numel = math.prod(shape)
    rows = shape[0] if shape else 1
    cols = numel // rows if rows else 0
    r = min(rows, cols, rank)
    if (rows + cols) * r * min_rate < numel:
        return 0, rows * r, cols * r
    return numel, 0, 0


@dataclass(frozen=True)
class GradVolume:
    """Gradients one rank synchronises: fp32 bytes (as the tables count them) and parameter shapes."""

    nbytes: float
    shapes: tuple[Shape, ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


@dataclass(frozen=True)
class CompressedVolume:
    """What one compressor makes of one volume, before the group size is known."""

    name: str
    collectives_bytes: tuple[float, ...]   # payload per collective call per rank
    algorithm: str                         # "ring" (all-reduce) | "allgather"
    kernel_bytes: float                    # read + written by its kernels, fixed part
    kernel_bytes_per_rank: float           # ... and the part that grows with the group (1-bit unpack)
    state_bytes: float                     # persistent buffers (error feedback, P/Q)
    kernel_launches: int = 0

    @property
    def payload_bytes(self) -> float:
        return sum(self.collectives_bytes)


@dataclass(frozen=True)
class GradientCost:
    """One compressor on one gradient group: payload, link time, kernel time, state."""

    name: str
    algorithm: str
    payload_bytes: float      # per rank per step, into collectives (what the counters measure)
    comm_s: float
    kernel_s: float
    state_bytes: float

    @property
    def time_s(self) -> float:
        return self.comm_s + self.kernel_s


def compress_volume(name: str, volume: GradVolume, settings: CompressorSettings | None = None) -> CompressedVolume:
    """The payload, kernel traffic and state of compressor `name` on `volume` (see module table), run
    with `settings` (default: `settings_of(name)`)."""
    if name == "none":
        return CompressedVolume(name, (volume.nbytes,), "ring", 0.0, 0.0, 0.0)
    settings = settings or settings_of(name)
    assert settings is not None
    numels = [math.prod(s) for s in volume.shapes]
    buckets = settings.bucket_ranges(numels)
    n = float(sum(numels))
    if name in ("fp16", "bf16"):
        payloads = tuple(float(sum(numels[a:b]) * HALF_BYTES) for a, b in buckets)
        return CompressedVolume(name, payloads, "ring", _CAST_BYTES * n, 0.0, 0.0,
                                _CAST_LAUNCHES * len(buckets))
    if name == "powersgd":
        payloads_list: list[float] = []
        pq_elems, launches = 0, 0
        for a, b in buckets:
            parts = [powersgd_elements(s, settings.rank, settings.min_compression_rate) for s in volume.shapes[a:b]]
            for column in range(3):   # uncompressed, P, Q: one all-reduce each
                elems = sum(p[column] for p in parts)
                if elems:
                    payloads_list.append(float(elems * FP32_BYTES))
            pq_elems += sum(p[1] + p[2] for p in parts)
            launches += _POWERSGD_BUCKET_LAUNCHES + _POWERSGD_MATRIX_LAUNCHES * sum(p[0] == 0 for p in parts)
        return CompressedVolume(name, tuple(payloads_list), "ring", _POWERSGD_BYTES * n, 0.0,
                                (n + pq_elems) * FP32_BYTES, launches)
    if name == "onebit":
        payloads = tuple(float(math.ceil(sum(numels[a:b]) / BITS_PER_BYTE) + SCALE_BYTES)
                         for a, b in buckets)
        return CompressedVolume(name, payloads, "allgather", (_ONEBIT_BYTES + 3 / BITS_PER_BYTE) * n,
                                n / BITS_PER_BYTE, 2 * n * FP32_BYTES, _ONEBIT_LAUNCHES * len(buckets))
    raise ValueError(f"unknown gradient compressor {name!r}; known: {', '.join(GRADIENT_COMPRESSORS)}")


def ring_allgather_s(payload_bytes: float, ranks: int, link: Link) -> float:
    """Ring all-gather: R-1 steps, each moving one rank's payload over the slowest link."""
    if ranks <= 1 or payload_bytes <= 0:
        return 0.0
    return (ranks - 1) * (link.latency_s + payload_bytes / link.bandwidth_bytes_s)


def gradient_cost(volume: CompressedVolume, ranks: int, link: Link, bandwidth_bytes_s: float,
                  launch_s: float = 0.0) -> GradientCost:
    """Time of a compressed volume synchronised over `ranks` ranks on `link` (0 for one rank);
    kernels stream at `bandwidth_bytes_s` and cost `launch_s` per launch."""
    if ranks <= 1:
        return GradientCost(volume.name, volume.algorithm, 0.0, 0.0, 0.0, 0.0)
    if volume.algorithm == "allgather":
        comm = sum(ring_allgather_s(b, ranks, link) for b in volume.collectives_bytes)
    else:
        comm = sum(ring_allreduce_s(b, ranks, link) for b in volume.collectives_bytes)
    kernel = (volume.kernel_bytes + volume.kernel_bytes_per_rank * ranks) / bandwidth_bytes_s \
        + volume.kernel_launches * launch_s
    return GradientCost(volume.name, volume.algorithm, volume.payload_bytes, comm, kernel,
                        volume.state_bytes)


def applies(name: str, volume: GradVolume) -> bool:
    """Whether compressor `name` changes anything on `volume` (PowerSGD needs a compressible matrix)."""
    if name == "powersgd":
        return any(powersgd_elements(s)[0] == 0 for s in volume.shapes)
    return True


def candidates(policy: str, volume: GradVolume, allowed: Collection[str] | None = None) -> list[CompressedVolume]:
    """The compressed volumes a policy lets the planner choose from, among `allowed` where given (the
    compressors whose state fits the members' memory, costmodel.compression_memory); never empty."""
    names = [n for n in gradient_options(policy) if applies(n, volume) and (allowed is None or n in allowed)]
    return [compress_volume(n, volume) for n in names or ["none"]]


def best_gradient(options: Sequence[CompressedVolume], ranks: int, link: Link, bandwidth_bytes_s: float,
                  launch_s: float = 0.0, optimizer: str = "sgd") -> GradientCost:
    """The fastest of `options` (ties: the earlier one, `none` first). Under AdamW, `onebit` is
    ranked by its average over a run: 1-bit Adam syncs exactly (`none`) for its warm-up fraction of
    the steps (the cost it reports stays the steady state, as every compressor's)."""
    costs = [gradient_cost(v, ranks, link, bandwidth_bytes_s, launch_s) for v in options]
    exact = next((c for c in costs if c.name == "none"), None)
    if optimizer != "adamw" or exact is None:
        return min(costs, key=lambda c: c.time_s)

    def ranked(c: GradientCost) -> float:
        if c.name != "onebit":
            return c.time_s
        return ONEBIT_ADAM_WARMUP_FRACTION * exact.time_s + (1 - ONEBIT_ADAM_WARMUP_FRACTION) * c.time_s
    return min(costs, key=ranked)


# ----------------------------------------------------------------------------- tables

@dataclass(frozen=True)
class CompressionTable:
    """Compression inputs of the costed problem: policies, parameter shapes, kernel bandwidths."""

    gradient_policy: str = "none"
    activation_policy: str = "none"
    param_shapes: tuple[tuple[str, Shape], ...] = ()
    block_params: tuple[tuple[str, ...], ...] = ()      # per block: parameters it reads
    kernel_bandwidth_bytes_s: tuple[float, ...] = ()    # per device class, as CostTables.classes
    kernel_launch_s: tuple[float, ...] = ()             # per device class: overhead of one launch
    optimizer: str = "adamw"                            # the program's: adamw | sgd (1-bit Adam's warm-up)

    @property
    def compresses_gradients(self) -> bool:
        return gradient_options(self.gradient_policy) != ("none",)

    def tied_params(self) -> tuple[str, ...]:
        """Parameters read by more than one block, in the order of `CostTables.tied`."""
        readers: dict[str, int] = {}
        for params in self.block_params:
            for p in dict.fromkeys(params):
                readers[p] = readers.get(p, 0) + 1
        return tuple(sorted(p for p, n in readers.items() if n > 1))

    def volume(self, params: Iterable[str], nbytes: float) -> GradVolume:
        """The volume of `params` (unknown shapes: vectors of their share of `nbytes`)."""
        shapes = dict(self.param_shapes)
        names = list(dict.fromkeys(params))
        known = [shapes[p] for p in names if p in shapes]
        missing = len(names) - len(known)
        rest = nbytes - sum(math.prod(s) for s in known) * FP32_BYTES
        if missing and rest > 0:
            known.extend([(max(1, round(rest / FP32_BYTES / missing)),)] * missing)
        return GradVolume(nbytes, tuple(known))

    def blocks_volume(self, blocks: range, grad_bytes: Sequence[float]) -> GradVolume:
        """The volume of a stage covering `blocks` (bytes as the tables count them)."""
        params = [p for b in blocks for p in self.block_params[b]] if self.block_params else []
        return self.volume(params, sum(grad_bytes[b] for b in blocks))


@dataclass(frozen=True)
class CompressedCostTables(CostTables):
    """`CostTables` plus the compression table the search and assembly read."""

    compression: CompressionTable = field(default_factory=CompressionTable)


def with_compression(tables: CostTables, compression: CompressionTable) -> CompressedCostTables:
    """`tables` with `compression` attached (the cost tables themselves unchanged)."""
    values = {f.name: getattr(tables, f.name) for f in fields(CostTables)}
    return CompressedCostTables(**values, compression=compression)


def compression_of(tables: CostTables) -> CompressionTable:
    """The compression table of `tables` (no compression for plain CostTables)."""
    return tables.compression if isinstance(tables, CompressedCostTables) else CompressionTable()


def group_sync_s(tables: CostTables, cls: int, params: Sequence[str], nbytes: float, replica_counts: Sequence[int],
                 link: Link, allowed: Collection[str] | None = None) -> list[float]:
    """Sync time of one gradient group of `params` (`nbytes`) over each of `replica_counts` ranks on
    `link`, on class `cls`'s kernels: what `choose_gradient` picks for it, priced the same way (the
    ILP's sync staircase). Without compression: a ring all-reduce of `nbytes`."""
    table = compression_of(tables)
    if not table.compresses_gradients:
        return [ring_allreduce_s(nbytes, r, link) for r in replica_counts]
    bandwidth = table.kernel_bandwidth_bytes_s[cls]
    launch = table.kernel_launch_s[cls] if table.kernel_launch_s else 0.0
    options = candidates(table.gradient_policy, table.volume(params, nbytes), allowed)
    return [best_gradient(options, r, link, bandwidth, launch, table.optimizer).time_s for r in replica_counts]


def choose_gradient(table: CompressionTable, params: Sequence[str], nbytes: float, ranks: int,
                    link: Link, bandwidth_bytes_s: float, launch_s: float = 0.0,
                    allowed: Collection[str] | None = None) -> GradientCost:
    """The compressor of one gradient group under the table's policy, among `allowed` where given (the
    compressors whose state fits every member's memory), with its cost."""
    if not table.compresses_gradients:
        return GradientCost("none", "ring", nbytes, ring_allreduce_s(nbytes, ranks, link), 0.0, 0.0)
    options = candidates(table.gradient_policy, table.volume(params, nbytes), allowed)
    return best_gradient(options, ranks, link, bandwidth_bytes_s, launch_s, table.optimizer)
