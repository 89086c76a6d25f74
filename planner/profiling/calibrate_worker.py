"""One `plan profile` worker process: `python -m planner.profiling.calibrate_worker --rank R --world W ...`.

Joins a gloo group on localhost, records its memory after start-up, runs the benchmarks of
`planner.profiling.microbench` in step with the other workers (a barrier before each point), and writes its
raw measurements to `DIR/rank{R}.json` for the parent (`planner.profiling.calibrate`) to fit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Kept light: the first memory figure is taken after `import torch` and the process group only;
# hetplan's own modules are imported after it.
WORKER_COLLECTIVE_TIMEOUT_S = 30.0  # a collective slower than this is a hang, not a measurement

# Precisions measured per device kind (the CPU program always trains in fp32).
PRECISIONS = {"cpu": ("fp32",), "cuda": ("fp32", "bf16")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="calibrate_worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model", action="append", default=[])
    return p.parse_args(argv)


def describe(device: torch.device) -> tuple[str, str]:
    """(catalog name guess, hardware description) of the device measured."""
    if device.type == "cuda":
        from costmodel.catalog import load_catalog

        description = torch.cuda.get_device_name(device)
        names = [n for n in load_catalog() if n.split("-")[0].lower() in description.lower()]
        total = torch.cuda.get_device_properties(device).total_memory
        best = min(names, key=lambda n: abs(load_catalog()[n].memory_bytes - total)) if names else description
        return best, description
    description = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            description = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                               description)
    except OSError:
        pass
    return "CPU", description


def _framework_bytes() -> float:
    """Peak memory after what every emitted program does before its model: import the runtime (its entry,
    train, and with it every unit it may run: checkpoints, tensor parallelism, ZeRO) and trace
    (torch.export) a model; a small one here, so the figure is the framework's own."""
    from backends.torchdist.program import train  # noqa: F401  (the import is the measurement)
    from planner import frontend

    small = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    frontend.trace(small, (torch.randn(2, 8),))
    return _peak_rss_bytes()


def _peak_rss_bytes() -> float:
    """This process's own peak resident set (VmHWM; `ru_maxrss` would include the parent's across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def worker_main(argv: list[str]) -> int:
    args = _parse(argv)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=WORKER_COLLECTIVE_TIMEOUT_S))
    result: dict[str, Any] = {"torch_process_group_bytes": _peak_rss_bytes()}
    from planner.profiling import microbench as mb
    from planner.profiling.calibrate import (
        CONTENTION_WINDOW_S,
        CONTENTION_WINDOWS,
        FULL_REPEATS,
        MODEL_MICRO_BATCHES,
        QUICK_CONTENTION_WINDOWS,
        QUICK_REPEATS,
    )

    result["framework_bytes"] = _framework_bytes()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    name, description = describe(device)
    result.update(device_name=name, description=description, torch_version=torch.__version__,
                  threads_per_process=torch.get_num_threads())
    repeats = QUICK_REPEATS if args.quick else FULL_REPEATS
    computes = args.rank < args.concurrency

    def in_step(fn: Any) -> Any:
        dist.barrier()
        return fn() if computes else None

    result["compute"] = {}
    for precision in PRECISIONS[args.device]:
        dtype = DTYPES[precision]
        points = [in_step(lambda c=case, dt=dtype: mb.measure_case(c, device, dt, repeats))
                  for case in mb.compute_cases(args.quick)]
        result["compute"][precision] = points
    if args.device == "cpu":     # compute above is in CPU seconds: the share of a core converts it to wall
        windows = QUICK_CONTENTION_WINDOWS if args.quick else CONTENTION_WINDOWS
        result["contention"] = [in_step(lambda: mb.measure_contention(CONTENTION_WINDOW_S)) for _ in range(windows)]
    solo = [dist.new_group([r]) for r in range(args.world)][args.rank]   # new_group is collective
    result["optimizer"] = in_step(lambda: mb.measure_update(device, args.quick, repeats, solo))
    from planner.profiling.modelbench import computing_group, measure_model

    group, ranks = computing_group(args.world, args.concurrency)
    result["models"] = [in_step(lambda m=m: measure_model(m, device, repeats, MODEL_MICRO_BATCHES, group, ranks))
                        for m in args.model]
    dist.barrier()
    result["comm"] = mb.measure_comm(args.rank, args.world, args.quick, repeats)
    result["comm"]["p2p_in_place"] = mb.measure_p2p_in_place(args.rank, args.world, args.quick, repeats)
    dist.barrier()
    dist.destroy_process_group()
    (args.dir / f"rank{args.rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(worker_main(__import__("sys").argv[1:]))
