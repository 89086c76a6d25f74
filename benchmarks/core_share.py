"""How much of a core a CPU rank keeps while it waits for a message: the figure a per-rank model of CPU
contention needs (costmodel.host_sharing prices every process of a host as busy all the time).

On a host of C cores, 2C gloo processes (one intra-op thread each): ranks 0..C-1 run the same CPU-bound
work (tanh of 256 x 256 matmuls) and record its wall seconds per CPU second. Beside them, ranks C..2C-1
either wait in `recv` for a message rank r - C sends when done ("waiting"), or run the work too
("computing"); a run of ranks 0..C-1 alone ("alone") is the reference. Each way `--repeats` times, in turn.

    python benchmarks/core_share.py [--repeats 3] [--out benchmarks/results/core_share.json]

Prints a table and writes JSON: per way the median wall per CPU second of the computing ranks, and the
share of a core each waiting rank keeps: C computing ranks beside C waiting ones that keep w each get
1 / (1 + w) of a core, so w = factor(waiting) / factor(alone) - 1 (clamped at 0); 0 when the waiting ranks
leave their cores to the computing ones, 1 when they stay as busy.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import common  # noqa: E402  (benchmarks/: puts the checkout on sys.path)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planner.profiling.calibrate import free_port, usable_cores

ITERATIONS = 400
WAYS = ("alone", "waiting", "computing")


def _work() -> None:
    a = torch.randn(256, 256)
    for _ in range(ITERATIONS):
        a = (a @ a).tanh()


def _rank(rank: int, world: int, cores: int, way: str, port: int, out: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    if rank < cores or way == "computing":
        cpu_s, wall_s = time.process_time(), time.perf_counter()
        _work()
        cpu_s, wall_s = time.process_time() - cpu_s, time.perf_counter() - wall_s
        if rank < cores:
            out.put(wall_s / cpu_s)
            if way == "waiting":
                dist.send(torch.zeros(1), dst=rank + cores)
    else:
        dist.recv(torch.zeros(1), src=rank - cores)
    dist.barrier()
    dist.destroy_process_group()


def _run(way: str, cores: int) -> list[float]:
    """The computing ranks' wall per CPU second of the work, run `way`."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    world = cores if way == "alone" else 2 * cores
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, cores, way, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a rank of the {way} run failed: exit codes {[p.exitcode for p in procs]}")
    return sorted(out.get() for _ in range(cores))


def measure(repeats: int) -> dict[str, Any]:
    cores = usable_cores()
    factors: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(repeats):
        for way in WAYS:
            factors[way].extend(_run(way, cores))
    median = {way: statistics.median(values) for way, values in factors.items()}
    kept = max(0.0, median["waiting"] / median["alone"] - 1.0)
    return {"date": datetime.date.today().isoformat(), "machine": platform.platform(), "cores": cores,
            "torch": torch.__version__, "iterations": ITERATIONS, "wall_per_cpu_s": factors,
            "median_wall_per_cpu_s": median, "waiting_core_share": kept}


def table(result: dict[str, Any]) -> str:
    lines = [f"the computing ranks' wall seconds per CPU second ({result['cores']} cores, as many ranks beside)",
             f"{'way':>10}  {'median':>7}  values"]
    for way in WAYS:
        values = " ".join(f"{v:.2f}" for v in result["wall_per_cpu_s"][way])
        lines.append(f"{way:>10}  {result['median_wall_per_cpu_s'][way]:>7.2f}  {values}")
    lines.append(f"share of a core a rank waiting in recv keeps: {result['waiting_core_share']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--repeats", type=int, default=3, help="runs of each way, in turn")
    p.add_argument("--out", type=Path, default=common.RESULTS / "core_share.json")
    args = p.parse_args(argv)
    result = measure(args.repeats)
    print(table(result))
    common.write_json_to(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
