"""How long a checkpoint holds up a training step: asynchronous (staging a CPU copy, then writing in the
background) against synchronous (writing within the step), measured in one run on one model.

The model is benchmarks/models/llama_350m.py's Llama with fewer layers (`--layers`, default 4: 117M
parameters), trained with AdamW for a step on CPU so the optimizer state is real; the state a rank
saves is the emitted program's (program/checkpoint_state.collect: parameters, AdamW moments, step
counters, generator state), saved by its Checkpointer (program/checkpoint_save.py) over a 1-rank gloo
group, `--repeats` times each way. A save's blocking time is what `Checkpointer.save` takes; an
asynchronous save's write time is until its background write has finished and rank 0 has marked it
complete.

    python benchmarks/checkpoint.py [--layers 4] [--repeats 3] [--out benchmarks/results/checkpoint.json]

Prints a table and writes JSON. Target: an asynchronous save blocks the step for at most a third of
what a synchronous one does.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common  # noqa: E402  (benchmarks/: puts the checkout on sys.path)
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from backends.torchdist.program import checkpoint, checkpoint_save, checkpoint_state  # noqa: E402

MODEL_FILE = REPO / "benchmarks" / "models" / "llama_350m.py"
ROWS = 1                      # one sequence of the model file's SEQ_LEN tokens per step
MAX_ASYNC_SHARE = 1 / 3       # target: async blocking <= this x sync blocking
MIB = 2**20


def _model_file() -> Any:
    spec = importlib.util.spec_from_file_location("llama_350m", MODEL_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trained(layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, float]:
    """The Llama with `layers` layers after one AdamW step; the step's time."""
    source = _model_file()
    from transformers import LlamaConfig

    torch.manual_seed(0)
    model = source.LlamaLogits(LlamaConfig(**{**source.CONFIG, "num_hidden_layers": layers}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    (inputs,), target = source.batch(ROWS, 0)
    start = time.perf_counter()
    source.loss_fn(model(inputs), target).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, time.perf_counter() - start


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> checkpoint_state.RankState:
    canonical = checkpoint_state.canonical_names(model)
    tensors = {canonical[name]: t for name, t in model.state_dict(keep_vars=True).items()}
    return checkpoint_state.RankState(tensors=tensors, optimizer=optimizer, compressors={}, scaler=None, rank=0,
                                      device=torch.device("cpu"), seed=0, optimizer_name="adamw",
                                      plan_digest="benchmark", plan_compresses=False)


def _saves(state: checkpoint_state.RankState, root: Path, *, synchronous: bool, repeats: int,
           ) -> list[dict[str, float]]:
    saver = checkpoint_save.Checkpointer(root, 1, rank=0, world_size=1, plan_digest="benchmark", keep=1,
                                         synchronous=synchronous)
    out = []
    for repeat in range(repeats):
        step = repeat + 1
        start = time.perf_counter()
        saver.save(step, checkpoint_state.collect(state, step))
        blocked_s = saver.blocked_s
        saver.wait()
        out.append({"blocked_s": blocked_s, "until_complete_s": time.perf_counter() - start})
        assert checkpoint.is_complete(checkpoint.step_folder(root, step))
    return out


def measure(layers: int, repeats: int, work: Path) -> dict[str, Any]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=300))
    try:
        model, optimizer, step_s = _trained(layers)
        state = _state(model, optimizer)
        state_bytes = sum(v.numel() * v.element_size() for v in checkpoint_state.collect(state, 0).values()
                          if isinstance(v, torch.Tensor))
        asynchronous = _saves(state, work / "async", synchronous=False, repeats=repeats)
        synchronous = _saves(state, work / "sync", synchronous=True, repeats=repeats)
    finally:
        dist.destroy_process_group()
    async_blocked = statistics.median(r["blocked_s"] for r in asynchronous)
    sync_blocked = statistics.median(r["blocked_s"] for r in synchronous)
    return {"model": f"{MODEL_FILE.relative_to(REPO)} with {layers} layers",
            "param_count": sum(p.numel() for p in model.parameters()), "state_bytes": state_bytes,
            "train_step_s": round(step_s, 3), "rows": ROWS, "repeats": repeats,
            "async": asynchronous, "sync": synchronous,
            "async_blocked_s": round(async_blocked, 3), "sync_blocked_s": round(sync_blocked, 3),
            "async_share_of_sync": round(async_blocked / sync_blocked, 3),
            "target": {"max_async_share_of_sync": round(MAX_ASYNC_SHARE, 3)},
            "meets_target": async_blocked <= MAX_ASYNC_SHARE * sync_blocked,
            "torch": torch.__version__, "machine": platform.machine(), "threads": torch.get_num_threads()}


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['model']}: {result['param_count']:,} parameters, checkpoint state "
             f"{result['state_bytes'] / MIB:,.0f} MiB, one training step {result['train_step_s']:.2f} s",
             f"{'save':>12}  {'repeat':>6}  {'blocks step s':>13}  {'until complete s':>16}"]
    for mode in ("async", "sync"):
        for i, r in enumerate(result[mode]):
            lines.append(f"{mode:>12}  {i:>6}  {r['blocked_s']:>13.3f}  {r['until_complete_s']:>16.3f}")
    lines.append(f"median blocking: async {result['async_blocked_s']:.3f} s, sync {result['sync_blocked_s']:.3f} s "
                 f"({result['async_share_of_sync']:.2f}x); target <= {MAX_ASYNC_SHARE:.2f}x: "
                 f"{'met' if result['meets_target'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--layers", type=int, default=4, help="Llama layers (4: 117M parameters)")
    p.add_argument("--repeats", type=int, default=3, help="saves of each kind")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "checkpoint.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="hetplan-checkpoint-") as work:
        result = measure(args.layers, args.repeats, Path(work))
    print(table(result))
    common.write_json_to(args.out, result)
    print(f"wrote {args.out}")
    return 0 if result["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
