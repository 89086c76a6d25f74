"""Calibration: what `plan profile` measured on a device, as a typed record the cost model reads.

The JSON file (written by `planner.profiling.calibrate`, read by `load_calibration`) carries units in its
keys. Loading validates every field and raises `CalibrationError` naming the file and the field, so
the costmodel functions only ever see a `Calibration` (never a path, never a dict).

Compute is fitted per op class as `time = overhead + work / rate`, forward and backward apart: work
is FLOPs for dense classes (matmul, conv, attention) and bytes for memory-bound ones (elementwise,
counted as the planner counts them: forward bytes, times `BACKWARD_BYTES_FACTOR` for backward);
views cost overhead only.

Compute, update and batch figures are measured in CPU seconds on a CPU device; the typed record holds
them as wall seconds of one process of a job of `priced_processes` processes sharing the host: times the
contention factor of that many (wall per CPU second; `costmodel.host_sharing` derives it from the one
the profile measured with its `concurrent_processes`, `host_sharing` in the file, and the host's cores).
Loaded, a calibration is priced for the profile's own count; `host_sharing.for_spec` re-prices it for a
plan's. The in-place factors (`in_situ`) scale the ring all-reduce and the update to what the model
training steps of the profile measured.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from planner.core.cluster import DeviceType, Link
from planner.core.errors import HetplanError

SCHEMA_VERSION = 2
DENSE_CLASSES = ("matmul", "conv", "attention")
MEMORY_CLASSES = ("elementwise",)
OP_CLASSES = (*DENSE_CLASSES, *MEMORY_CLASSES, "view")


class CalibrationError(HetplanError):
    """A calibration file is missing, malformed, or of another schema version."""


@dataclass(frozen=True)
class OpClassRates:
    """One op class on the device: `time = overhead_s + work / work_per_s`, forward and backward.

    `work_per_s` is FLOP/s for dense classes, bytes/s for memory-bound ones, and 0 for views
    (overhead only)."""

    fwd_overhead_s: float
    bwd_overhead_s: float
    fwd_work_per_s: float = 0.0
    bwd_work_per_s: float = 0.0


@dataclass(frozen=True)
class AlphaBeta:
    """A measured transfer: `time = latency_s + bytes / bandwidth_bytes_s`."""

    latency_s: float
    bandwidth_bytes_s: float

    def time_s(self, nbytes: float) -> float:
        """Seconds for `nbytes`."""
        return self.latency_s + nbytes / self.bandwidth_bytes_s if nbytes > 0 else 0.0


@dataclass(frozen=True)
class ModelTiming:
    """Whole-model training compute of one model (forward and backward with its loss), measured on real
    tensors, and the time of its data function.

    `key` identifies the traced model (`model_key`); times are per sample and per micro-batch (call)."""

    key: str
    path: str
    fwd_s_per_sample: float
    fwd_s_per_micro_batch: float
    bwd_s_per_sample: float
    bwd_s_per_micro_batch: float
    batch_s_per_sample: float = 0.0       # the model file's `batch()`: every rank builds the global batch
    batch_s_per_call: float = 0.0

    def batch_s(self, rows: int) -> float:
        """Seconds of `batch(rows, step)`."""
        return self.batch_s_per_call + rows * self.batch_s_per_sample


@dataclass(frozen=True)
class Calibration:
    """Everything measured on one device type (see the module docstring for the fits)."""

    source: str                                      # the file it was read from
    device_name: str                                 # catalog type it calibrates ("CPU", "H200")
    description: str                                 # the hardware as the OS / driver names it
    kind: str                                        # "cpu" | "cuda": where the benchmarks ran
    measured_at: str
    concurrent_processes: int                        # processes measuring at once on the host
    threads_per_process: int
    compute: Mapping[str, Mapping[str, OpClassRates]]  # precision -> op class -> rates
    optimizer_s_per_step: float                      # per-step update (grad-sync bookkeeping, AdamW,
    optimizer_s_per_tensor: float                    # zero_grad): fixed, per tensor, and
    optimizer_bytes_per_s: float                     # per fp32 parameter byte
    p2p: AlphaBeta                                   # one way, while the job computes (else idle ping-pong)
    allreduce_2: AlphaBeta                           # all-reduce over two processes, whole call
    ring: AlphaBeta                                  # per-hop latency and bandwidth of the ring model
    framework_bytes: float                           # process memory before any model (torch + group)
    models: Mapping[str, ModelTiming] = field(default_factory=dict)
    contention_factor: float = 1.0                   # wall per CPU second, already applied to compute
    priced_processes: int = 1                        # processes sharing the host that it is priced for
    profile_contention_factor: float = 1.0           # wall per CPU second the profile measured
    host_cores: float = 1.0                          # cores the profiled host gives its processes
    sync_factor: float = 1.0                         # in-situ factors already applied to the ring
    update_factor: float = 1.0                       # and to the update

    def matches(self, device: DeviceType) -> bool:
        """Whether `device` is the calibrated type: same name, or derived from it (`base:`)."""
        return self.device_name in (device.name, device.base)

    def rates(self, precision: str, op_class: str) -> OpClassRates | None:
        """Measured rates of `op_class` at `precision`, or None when not measured."""
        return self.compute.get(precision, {}).get(op_class)

    def overhead_rates(self, op_class: str) -> OpClassRates | None:
        """Per-op overheads of `op_class` (any measured precision: dispatch cost does not depend on it)."""
        for table in self.compute.values():
            if op_class in table:
                return table[op_class]
        return None

    @property
    def peak_flops_s(self) -> float:
        """Best achieved dense forward rate (FLOP/s) over precisions and classes."""
        return max(r.fwd_work_per_s for t in self.compute.values() for c, r in t.items() if c in DENSE_CLASSES)

    @property
    def memory_bandwidth_bytes_s(self) -> float:
        """Achieved forward bandwidth of memory-bound ops (bytes/s), fp32."""
        rates = self.rates("fp32", "elementwise")
        return rates.fwd_work_per_s if rates else 0.0

    def ring_link(self, kind: str) -> Link:
        """A link for `costmodel.network.ring_allreduce_s`: the ring model's latency per hop and bandwidth
        fitted to the all-reduces measured over two processes and over all profiling workers."""
        return Link(kind, self.ring.bandwidth_bytes_s, self.ring.latency_s)

    def call_ring_link(self, kind: str) -> Link:
        """The ring fit of the all-reduce microbenchmark itself, without the in-situ factor `ring_link`
        carries (`sync_factor`: the gradient sync measured inside the models' steps against that fit): the
        link of the small all-reduces a step issues between its ops, as tensor parallelism's pairs do."""
        return Link(kind, self.ring.bandwidth_bytes_s * self.sync_factor, self.ring.latency_s / self.sync_factor)

    def p2p_link(self, kind: str) -> Link:
        """A link with the measured one-way point-to-point latency and bandwidth: as a pipeline sees them, while
        the other processes of the job compute (`microbench.measure_p2p_in_place`), or, in a file without
        that, one way of a ping-pong between idle processes."""
        return Link(kind, self.p2p.bandwidth_bytes_s, self.p2p.latency_s)


def model_key(signatures: tuple[str, ...], fwd_flops: tuple[float, ...]) -> str:
    """Identity of a traced model for `Calibration.models`: its block signatures and FLOPs."""
    import hashlib

    text = repr((signatures, tuple(round(f) for f in fwd_flops)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- JSON: write and read, with a one-line error naming the field ------------------------------------
def to_json(data: dict[str, Any]) -> str:
    """Stable text of a calibration dict (sorted keys)."""
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration file written by `plan profile`."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        _fail(file, "", "file not found", "run `plan profile --out FILE` first, or check the path")
    except (OSError, UnicodeDecodeError) as exc:
        _fail(file, "", f"cannot read the file ({exc})", "pass the JSON file `plan profile` wrote")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        _fail(file, f"line {exc.lineno}", f"not valid JSON: {exc.msg}", "re-run `plan profile`")
    return parse_calibration(data, file)


def parse_calibration(data: Any, file: str = "<calibration>") -> Calibration:
    """Validate a decoded calibration document."""
    top = _Obj(file, data, "")
    version = top.get("schema_version")
    if version != SCHEMA_VERSION:
        top.fail("schema_version", f"is {version!r}, this hetplan reads {SCHEMA_VERSION}",
                 "re-run `plan profile` with this version")
    device = top.obj("device")
    comm = top.obj("comm")
    optimizer = top.obj("optimizer")
    compute: dict[str, dict[str, OpClassRates]] = {}
    per_precision = top.obj("compute")
    if not per_precision.data:
        per_precision.fail("", "no precision measured", "re-run `plan profile`")
    for precision in per_precision.data:
        classes = per_precision.obj(precision)
        compute[precision] = {name: _op_rates(classes.obj(name), name) for name in classes.data}
        if not any(c in compute[precision] for c in DENSE_CLASSES):
            classes.fail("", "no dense op class (matmul, conv, attention) measured", "re-run `plan profile`")
    # compute, update and batch were timed in CPU seconds: wall seconds at the host's share of a core
    sharing = top.obj("host_sharing")
    contention = sharing.number("contention_factor")
    # where the process may run (affinity), else every core of the machine (files before `usable_cores`)
    cores = sharing.number("usable_cores") if "usable_cores" in sharing.data else sharing.number("cores")
    compute = {precision: {name: _contended(rates, contention) for name, rates in classes.items()}
               for precision, classes in compute.items()}
    models = {}
    if "models" in top.data:
        section = top.obj("models")
        for key in section.data:
            m = section.obj(key)
            models[key] = ModelTiming(key, m.text("path"), *(m.number(f, positive=False) * contention for f in (
                "fwd_s_per_sample", "fwd_s_per_micro_batch", "bwd_s_per_sample", "bwd_s_per_micro_batch",
                "batch_s_per_sample", "batch_s_per_call")))
    # measured inside a model's training step, the sync and the update differ from their microbenchmarks
    in_situ = top.obj("in_situ") if "in_situ" in top.data else None
    sync = in_situ.number("sync_factor") if in_situ else 1.0
    update = (in_situ.number("update_factor") if in_situ else 1.0) * contention
    ring = _alpha_beta(comm.obj("allreduce_ring"))
    concurrent = int(device.number("concurrent_processes"))
    return Calibration(
        source=file, device_name=device.text("name"), description=device.text("description"),
        kind=device.choice("kind", ("cpu", "cuda")),
        measured_at=top.text("measured_at"), concurrent_processes=concurrent,
        threads_per_process=int(device.number("threads_per_process")), compute=compute,
        optimizer_s_per_step=optimizer.number("per_step_s", positive=False) * update,
        optimizer_s_per_tensor=optimizer.number("per_tensor_s", positive=False) * update,
        optimizer_bytes_per_s=optimizer.number("param_bytes_per_s") / update,
        p2p=_alpha_beta(comm.obj("p2p_in_place" if "p2p_in_place" in comm.data else "p2p")),
        allreduce_2=_alpha_beta(comm.obj("allreduce_2")),
        ring=AlphaBeta(ring.latency_s * sync, ring.bandwidth_bytes_s / sync),
        framework_bytes=top.obj("memory").number("framework_bytes"), models=models,
        contention_factor=contention, sync_factor=sync, update_factor=update / contention,
        priced_processes=concurrent, profile_contention_factor=contention, host_cores=cores)


def _contended(rates: OpClassRates, factor: float) -> OpClassRates:
    """`rates` of a process that gets 1 / `factor` of a core."""
    return OpClassRates(rates.fwd_overhead_s * factor, rates.bwd_overhead_s * factor,
                        rates.fwd_work_per_s / factor, rates.bwd_work_per_s / factor)


def _op_rates(obj: _Obj, name: str) -> OpClassRates:
    if name not in OP_CLASSES:
        obj.fail("", f"unknown op class {name!r}", f"use one of: {', '.join(OP_CLASSES)}")
    if name == "view":
        return OpClassRates(obj.number("fwd_overhead_s", positive=False),
                            obj.number("bwd_overhead_s", positive=False))
    unit = "flop" if name in DENSE_CLASSES else "byte"
    return OpClassRates(obj.number("fwd_overhead_s", positive=False), obj.number("bwd_overhead_s", positive=False),
                        obj.number(f"fwd_{unit}_per_s"), obj.number(f"bwd_{unit}_per_s"))


def _alpha_beta(obj: _Obj) -> AlphaBeta:
    return AlphaBeta(obj.number("latency_s", positive=False), obj.number("bandwidth_bytes_per_s"))


def _fail(file: str, field_path: str, message: str, fix: str) -> NoReturn:
    raise CalibrationError(message, file=file, field=field_path or None, fix=fix)


class _Obj:
    """One JSON object at `path` of `file`, read with type checks."""

    def __init__(self, file: str, data: Any, path: str) -> None:
        self.file, self.path = file, path
        if not isinstance(data, dict):
            _fail(file, path, f"expected an object, got {type(data).__name__}", "re-run `plan profile`")
        self.data: dict[str, Any] = data

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path and key else (key or self.path)

    def fail(self, key: str, message: str, fix: str) -> NoReturn:
        _fail(self.file, self.at(key), message, fix)

    def get(self, key: str) -> Any:
        if key not in self.data:
            self.fail(key, "missing required field", "re-run `plan profile` to write a complete file")
        return self.data[key]

    def obj(self, key: str) -> _Obj:
        return _Obj(self.file, self.get(key), self.at(key))

    def text(self, key: str) -> str:
        value = self.get(key)
        if not isinstance(value, str) or not value:
            self.fail(key, f"expected a non-empty string, got {value!r}", "re-run `plan profile`")
        return value

    def choice(self, key: str, options: tuple[str, ...]) -> str:
        value = self.text(key)
        if value not in options:
            self.fail(key, f"expected one of {', '.join(options)}, got {value!r}", "re-run `plan profile`")
        return value

    def number(self, key: str, *, positive: bool = True) -> float:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            self.fail(key, f"expected a finite number, got {value!r}", "re-run `plan profile`")
        if value <= 0 if positive else value < 0:
            self.fail(key, f"must be {'> 0' if positive else '>= 0'}, got {value!r}", "re-run `plan profile`")
        return float(value)
