"""The compute side of tensor parallelism on one device: a Llama-7B layer's column and row linears at the
shapes one shard runs at degree t, timed forward and backward, against the cost model's roofline for the
same op (costmodel.compute.op_time_s on the device's catalog entry).

costmodel.tensor_parallel charges a shard 1/t of the pairs' FLOPs; on a GPU a narrower matmul runs
further from peak, so the measured time of a shard falls by less than t. This prints, per linear and
degree, the measured and predicted times and the measured speed-up over t = 1 beside the modelled one.

    python3 benchmarks/tp_matmul.py --device cuda --catalog H200     # on a lent GPU (benchmarks/gpu_check.sh)
    python3 benchmarks/tp_matmul.py --device cpu --quick             # the same steps, small, on CPU
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import common
import torch

from costmodel import compute
from costmodel.catalog import load_catalog
from planner.core.blocks import OpCount

# Llama-7B: hidden 4096, 32 heads, MLP 11008 (q/k/v/o and gate/up/down), sequence 2048 rows per sample
LINEARS = (("qkv (column)", 4096, 3 * 4096, "column"), ("o (row)", 4096, 4096, "row"),
           ("gate+up (column)", 4096, 2 * 11008, "column"), ("down (row)", 11008, 4096, "row"))
QUICK_LINEARS = (("column", 256, 768, "column"), ("row", 768, 256, "row"))
DEGREES = (1, 2, 4, 8)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def shard_shape(in_features: int, out_features: int, kind: str, degree: int) -> tuple[int, int]:
    """(in, out) of one shard: a column linear splits its outputs, a row linear its inputs."""
    return (in_features, out_features // degree) if kind == "column" else (in_features // degree, out_features)


def measure_s(rows: int, in_f: int, out_f: int, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """Median seconds of one forward + backward of `linear` at (rows, in_f) x (in_f, out_f)."""
    x = torch.randn(rows, in_f, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(out_f, in_f, device=device, dtype=dtype, requires_grad=True)
    times = []
    for i in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.nn.functional.linear(x, w).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:                    # two warm-ups
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def predicted_s(rows: int, in_f: int, out_f: int, device_name: str, precision: str) -> float:
    """The cost model's forward + backward of the same linear (a matmul op of costmodel.ops' counts)."""
    dev = load_catalog()[device_name]
    flops = 2.0 * rows * in_f * out_f
    op = OpCount("matmul", flops, 2 * flops, 4.0 * (rows * in_f + in_f * out_f + rows * out_f), 4.0 * rows * out_f)
    return compute.op_time_s(op, dev, precision, False) + compute.op_time_s(op, dev, precision, True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--catalog", default=None, help="the device's catalog name (default: H200 on cuda, CPU on cpu)")
    p.add_argument("--precision", default=None, choices=sorted(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--rows", type=int, default=None, help="rows of a micro-batch (default: 2048, quick: 64)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=common.RESULTS / "tp_matmul.json")
    args = p.parse_args()
    device = torch.device(args.device)
    name = args.catalog or ("H200" if device.type == "cuda" else "CPU")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    rows = args.rows or (64 if args.quick else 2048)
    linears = QUICK_LINEARS if args.quick else LINEARS
    records = []
    for label, in_f, out_f, kind in linears:
        base = None
        for t in DEGREES:
            i, o = shard_shape(in_f, out_f, kind, t)
            measured = measure_s(rows, i, o, device, DTYPES[precision], args.repeats)
            base = base or measured
            records.append({"linear": label, "degree": t, "in": i, "out": o, "rows": rows,
                            "measured_s": measured, "predicted_s": predicted_s(rows, i, o, name, precision),
                            "speedup_measured": base / measured, "speedup_model": float(t)})
    header = ["linear", "t", "shard (in x out)", "measured", "predicted", "error", "speed-up", "model"]
    rows_out = [[r["linear"], str(r["degree"]), f"{r['in']} x {r['out']}", f"{r['measured_s'] * 1e3:.3f} ms",
                 f"{r['predicted_s'] * 1e3:.3f} ms", f"{(r['predicted_s'] - r['measured_s']) / r['measured_s']:+.0%}",
                 f"{r['speedup_measured']:.2f}x", f"{r['speedup_model']:.0f}x"] for r in records]
    print(f"tensor-parallel shards of a linear on {device} ({name}, {precision}), {rows} rows")
    print(common.table(header, rows_out))
    common.write_json_to(args.out, {"device": str(device), "catalog": name, "precision": precision, "rows": rows,
                                    "runs": records})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
