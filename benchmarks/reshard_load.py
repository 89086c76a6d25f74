"""How long a rank takes to resume from a checkpoint of another tensor-parallel degree: its tensors' pieces
read in one DCP load per tensor against loads of up to `checkpoint_state.RESHARD_LOAD_BYTES`, measured in
one run on the same files.

The checkpoint is written as the program writes one (program/checkpoint_state.collect) by the two lanes of a
TP 2 plan: `--tensors` parameters of 256 x 256 fp32, each cut by rows, with their AdamW state. A rank of
degree 1 then restores it (program/checkpoint_state.restore: every tensor put together from both lanes'
pieces, its moments too), `--repeats` times each way, in turn. The per-tensor way is the same code with a
bound of one byte, which puts each tensor in a load of its own (what the program did before).

    python benchmarks/reshard_load.py [--tensors 100] [--repeats 3] [--out benchmarks/results/reshard_load.json]

Prints a table and writes JSON. Target: the batched restore takes at most half the per-tensor one.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common  # noqa: E402  (benchmarks/: puts the checkout on sys.path)
import torch
import torch.distributed.checkpoint as dcp

from backends.torchdist.program import checkpoint_state
from backends.torchdist.program.checkpoint_reshard import shard_name
from passes.tensor_parallel import ShardSpec, shard_tensor

REPO = Path(__file__).resolve().parents[1]
SHAPE = (256, 256)
STEP = 3
MAX_SHARE = 0.5


def _rank_state(degree: int, lane: int, values: dict[str, torch.Tensor],
                cuts: dict[str, ShardSpec]) -> checkpoint_state.RankState:
    params = {name: torch.nn.Parameter(t) for name, t in values.items()}
    return checkpoint_state.RankState(
        tensors=dict(params), optimizer=torch.optim.AdamW(params.values()), compressors={}, scaler=None, rank=lane,
        device=torch.device("cpu"), seed=5, optimizer_name="adamw", plan_digest=f"tp{degree}", plan_compresses=False,
        cuts=dict(cuts) if degree > 1 else {})


def _write(folder: Path, whole: dict[str, torch.Tensor], cuts: dict[str, ShardSpec]) -> None:
    entries: dict[str, Any] = {}
    for lane in range(2):
        state = _rank_state(2, lane, {shard_name(n, lane, 2): shard_tensor(t, cuts[n], 2, lane)
                                      for n, t in whole.items()}, cuts)
        for p in state.tensors.values():
            state.optimizer.state[p] = {"step": torch.tensor(float(STEP)), "exp_avg": torch.randn(p.shape),
                                        "exp_avg_sq": torch.rand(p.shape)}
        entries.update(checkpoint_state.collect(state, STEP))
    dcp.save(entries, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)


def measure(tensors: int, repeats: int, work: Path) -> dict[str, Any]:
    cuts = {f"layers.{i}.weight": ShardSpec(f"layers.{i}.weight", 0, 1, SHAPE) for i in range(tensors)}
    whole = {name: torch.randn(SHAPE) for name in cuts}
    folder = work / f"step_{STEP}"
    _write(folder, whole, cuts)
    batched_bytes = checkpoint_state.RESHARD_LOAD_BYTES
    times: dict[str, list[float]] = {"per_tensor": [], "batched": []}
    try:
        for _ in range(repeats):
            for way, limit in (("per_tensor", 1), ("batched", batched_bytes)):
                checkpoint_state.RESHARD_LOAD_BYTES = limit
                reader = _rank_state(1, 0, {n: torch.zeros_like(t) for n, t in whole.items()}, cuts)
                start = time.perf_counter()
                checkpoint_state.restore(folder, reader)
                times[way].append(time.perf_counter() - start)
                assert all(torch.equal(reader.tensors[n], whole[n]) for n in whole), way
    finally:
        checkpoint_state.RESHARD_LOAD_BYTES = batched_bytes
    per_tensor, batched = statistics.median(times["per_tensor"]), statistics.median(times["batched"])
    return {"date": datetime.date.today().isoformat(), "machine": platform.platform(), "torch": torch.__version__,
            "tensors": tensors, "shape": list(SHAPE), "load_bytes": batched_bytes, "times_s": times,
            "per_tensor_s": per_tensor, "batched_s": batched, "batched_share": batched / per_tensor,
            "meets_target": batched / per_tensor <= MAX_SHARE}


def table(result: dict[str, Any]) -> str:
    lines = [f"restore of {result['tensors']} tensors saved at TP 2, read at TP 1 (AdamW state included)",
             f"{'way':>10}  {'run':>3}  {'seconds':>8}"]
    for way in ("per_tensor", "batched"):
        lines += [f"{way:>10}  {i:>3}  {t:>8.3f}" for i, t in enumerate(result["times_s"][way])]
    lines.append(f"median: per tensor {result['per_tensor_s']:.3f} s, batched {result['batched_s']:.3f} s "
                 f"({result['batched_share']:.2f}x); target <= {MAX_SHARE:.2f}x: "
                 f"{'met' if result['meets_target'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--tensors", type=int, default=100, help="parameters of 256 x 256 in the checkpoint")
    p.add_argument("--repeats", type=int, default=3, help="restores of each way")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "reshard_load.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="hetplan-reshard-") as work:
        result = measure(args.tensors, args.repeats, Path(work))
    print(table(result))
    common.write_json_to(args.out, result)
    print(f"wrote {args.out}")
    return 0 if result["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
