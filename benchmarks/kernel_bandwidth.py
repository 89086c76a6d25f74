"""Benchmark the compression kernels: Triton kernel vs torch reference, time and GB/s.

    python benchmarks/kernel_bandwidth.py                     # CUDA if present, else CPU
    TRITON_INTERPRET=1 python benchmarks/kernel_bandwidth.py  # CPU: also run the interpreted kernels

Prints a table and writes benchmarks/results/kernels.json. For every kernel and size it
first checks the kernel against its reference, then times both. "Bytes" is the
unavoidable memory traffic of the op (inputs read once, outputs written once), so GB/s
compares with the device's memory bandwidth; on CUDA the fraction of the datasheet
bandwidth (from costmodel/catalog/devices.yaml, e.g. H200: 4800 GB/s) is reported.
On CPU without TRITON_INTERPRET only the torch reference runs; interpreter timings
measure Python, not the kernel, and are reported only to show the path works.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from backends.kernels import (
    HAS_TRITON,
    INTERPRETED,
    Impl,
    add_error_and_sqnorm,
    dequantize_int8,
    packed_nbytes,
    quantize_int8,
    sign_pack,
    unpack_average,
)
from backends.kernels.quant import num_blocks

CUDA_SIZES = (1 << 20, 1 << 24)
CPU_SIZES = (1 << 18, 1 << 20)
INTERPRETER_SIZES = (1 << 12, 1 << 14)   # the interpreter runs each program in Python
WORKERS = 4                              # unpack_average: packed signs of 4 ranks
QUANT_BLOCK = 256
FP32, INT8 = 4, 1
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "kernels.json"


@dataclass(frozen=True)
class Case:
    """One kernel at one size: how to run it, and the bytes it must move."""

    kernel: str
    n: int
    bytes_moved: int
    run: Callable[[Impl], object]          # impl -> result
    check: Callable[[object, object], None]


@dataclass(frozen=True)
class Row:
    """One measurement (serialised to JSON as is)."""

    kernel: str
    n: int
    impl: str
    time_s: float
    bytes_moved: int
    gbyte_s: float
    fraction_of_peak: float | None


def _close(a: object, b: object) -> None:
    left = a if isinstance(a, tuple) else (a,)
    right = b if isinstance(b, tuple) else (b,)
    for x, y in zip(left, right, strict=True):
        assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        torch.testing.assert_close(x.float(), y.float(), rtol=1e-5, atol=1e-5)


def cases(n: int, device: torch.device) -> list[Case]:
    """The five kernels on n elements, inputs made once."""
    gen = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(n, device=device, generator=gen)
    err = torch.randn(n, device=device, generator=gen) * 0.1
    scale = torch.ones(1, device=device)
    nbytes = packed_nbytes(n)
    packed = torch.randint(0, 256, (WORKERS, nbytes), device=device, dtype=torch.uint8, generator=gen)
    scales = torch.rand(WORKERS, device=device, generator=gen)
    q, qscales = quantize_int8(x, QUANT_BLOCK, impl="torch")
    scale_bytes = num_blocks(n, QUANT_BLOCK) * FP32
    return [
        Case("add_error_and_sqnorm", n, 3 * n * FP32,
             lambda impl: add_error_and_sqnorm(x, err, impl=impl), _close),
        Case("sign_pack", n, 2 * n * FP32 + nbytes,
             lambda impl: sign_pack(x, scale, impl=impl), _close),
        Case(f"unpack_average(k={WORKERS})", n, WORKERS * nbytes + n * FP32,
             lambda impl: unpack_average(packed, scales, n, impl=impl), _close),
        Case(f"quantize_int8(block={QUANT_BLOCK})", n, n * FP32 + n * INT8 + scale_bytes,
             lambda impl: quantize_int8(x, QUANT_BLOCK, impl=impl), _close),
        Case(f"dequantize_int8(block={QUANT_BLOCK})", n, n * INT8 + scale_bytes + n * FP32,
             lambda impl: dequantize_int8(q, qscales, QUANT_BLOCK, n, impl=impl), _close),
    ]


def time_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of fn() over `repeats` runs, after one warm-up (compilation)."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def peak_bandwidth(device: torch.device) -> tuple[str, float] | None:
    """(catalog name, datasheet bytes/s) of the CUDA device, matched by name and memory size."""
    if device.type != "cuda":
        return None
    from costmodel.catalog import load_catalog

    name = torch.cuda.get_device_name(device).upper()
    memory = torch.cuda.get_device_properties(device).total_memory
    found = [t for key, t in load_catalog().items() if key.split("-")[0].upper() in name]
    if not found:
        return None
    best = min(found, key=lambda t: abs(t.memory_bytes - memory))
    return best.name, best.memory_bandwidth_bytes_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", help="element counts (default: per device)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per case")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        impls: list[Impl] = ["triton", "torch"] if HAS_TRITON else ["torch"]
        mode, sizes = "cuda", CUDA_SIZES
    elif INTERPRETED:
        mode, impls, sizes = "cpu-interpreter", ["triton", "torch"], INTERPRETER_SIZES
    else:
        mode, impls, sizes = "cpu-reference-only", ["torch"], CPU_SIZES
    sizes = tuple(args.sizes) if args.sizes else sizes
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    peak = peak_bandwidth(device)
    peak_bytes_s = peak[1] if peak else None

    print(f"device: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"mode: {mode}, triton installed: {HAS_TRITON}")
    if mode == "cpu-reference-only":
        print("no CUDA and TRITON_INTERPRET unset: timing the torch references only")
    if mode == "cpu-interpreter":
        print("Triton interpreter: kernel times measure Python interpretation, not the kernel")
    if peak:
        print(f"peak memory bandwidth: {peak[1] / 1e9:.0f} GB/s ({peak[0]}, datasheet)")

    rows: list[Row] = []
    for n in sizes:
        for case in cases(n, device):
            if "triton" in impls:
                case.check(case.run("triton"), case.run("torch"))
            for impl in impls:
                seconds = time_s(functools.partial(case.run, impl), device, repeats)
                gbyte_s = case.bytes_moved / seconds / 1e9
                fraction = case.bytes_moved / seconds / peak_bytes_s if peak_bytes_s else None
                rows.append(Row(case.kernel, n, impl, seconds, case.bytes_moved, gbyte_s, fraction))

    header = f"{'kernel':34} {'n':>10} {'impl':>7} {'time':>11} {'GB/s':>9} {'of peak':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        share = f"{r.fraction_of_peak:8.1%}" if r.fraction_of_peak is not None else f"{'-':>8}"
        print(f"{r.kernel:34} {r.n:>10} {r.impl:>7} {r.time_s * 1e6:9.1f}us {r.gbyte_s:9.2f} {share}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "mode": mode,
        "torch": torch.__version__,
        "triton_installed": HAS_TRITON,
        "peak_bandwidth_bytes_s": peak_bytes_s,
        "peak_bandwidth_source": peak[0] if peak else None,
        "repeats": repeats,
        "rows": [asdict(r) for r in rows],
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
