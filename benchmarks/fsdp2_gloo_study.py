"""Does FSDP2 (`torch.distributed.fsdp.fully_shard`) run on gloo on CPU, with the installed torch?

    python benchmarks/fsdp2_gloo_study.py              # 4 cases x 2 gloo processes, ~1 min on 2 cores

Each case spawns 2 gloo processes that build the same nn.Sequential of Linear layers (seeded), call
`fully_shard` on each Linear and then on the root, and train STEPS steps of AdamW, each rank on its
half of a global batch (FSDP2 averages the gradients over the ranks, so the update is that of the whole
batch). Beside it, the single-process reference trains the same model on the whole batch. Recorded per
case and phase (fully_shard, forward, backward, optimizer step): whether it ran, and the first line of
the error where it did not; where it ran, how much of each parameter, gradient and AdamW moment a rank
holds locally (DTensor.to_local numel over the full numel: 1/2 when really sharded), and the largest
difference from the reference after the last step.

Cases: fp32 with layer widths that divide by 2; fp32 with odd widths (FSDP2 pads the shards); bf16
parameters with fp32 gradient reduction (MixedPrecisionPolicy); bf16 parameters and bf16 reduction
(gloo has no bf16 reductions on CPU in some builds: the case says what this one does). Prints a
table and writes benchmarks/results/fsdp2_gloo_study.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:   # runnable as `python benchmarks/fsdp2_gloo_study.py` from anywhere
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

from benchmarks.common import RESULTS, table, write_json_to  # noqa: E402

WORLD = 2
STEPS = 5
ROWS_PER_RANK = 8
LR = 1e-2
SEED = 0
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)
CASE_DEADLINE_S = 90.0
CASES: dict[str, dict[str, Any]] = {
    "fp32": {"widths": (16, 32, 32, 8), "param_dtype": None, "reduce_dtype": None},
    "fp32, odd widths": {"widths": (15, 33, 17, 7), "param_dtype": None, "reduce_dtype": None},
    "bf16 params, fp32 reduce": {"widths": (16, 32, 32, 8), "param_dtype": "bfloat16", "reduce_dtype": "float32"},
    "bf16 params, bf16 reduce": {"widths": (16, 32, 32, 8), "param_dtype": "bfloat16", "reduce_dtype": "bfloat16"},
}
PHASES = ("fully_shard", "forward", "backward", "step")
TAPPED = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
          "all_reduce", "broadcast")
"""torch.distributed calls whose kind, dtype and size the study records for one step (FSDP2 calls them
through the module, so wrapping the attribute sees them)."""


def _model(widths: tuple[int, ...]) -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])


def _batch(step: int, widths: tuple[int, ...]) -> torch.Tensor:
    """The global batch of `step`; rank r trains on rows [r x ROWS_PER_RANK, (r + 1) x ROWS_PER_RANK)."""
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * ROWS_PER_RANK, widths[0], generator=generator)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def _reference(widths: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Single-process AdamW on the whole batch: the parameters after STEPS steps."""
    model = _model(widths)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        _loss(model, _batch(step, widths)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _local_fraction(tensors: list[torch.Tensor]) -> float:
    """Elements this rank holds over the full tensors' elements (DTensor: to_local; else all of it)."""
    local = sum(t.to_local().numel() if hasattr(t, "to_local") else t.numel() for t in tensors)
    full = sum(t.numel() for t in tensors)          # a DTensor's numel is its global size
    return local / full if full else 0.0


class _CollectiveTap:
    """Inside the `with`: each TAPPED call as [kind, dtype, reduce op, input elements]."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []
        self._originals = {name: getattr(dist, name) for name in TAPPED if hasattr(dist, name)}

    def __enter__(self) -> _CollectiveTap:
        for name, original in self._originals.items():
            setattr(dist, name, self._recorded(name, original))
        return self

    def _recorded(self, name: str, original: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
            source = kwargs.get("input", tensors[-1] if tensors else None)
            op = kwargs.get("op")
            self.calls.append([name, str(source.dtype).removeprefix("torch.") if source is not None else "",
                               str(op) if op is not None else "", source.numel() if source is not None else 0])
            return original(*args, **kwargs)
        return recorded

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _run_case(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    widths = tuple(spec["widths"])
    result: dict[str, Any] = {"phases": {}, "error": None}
    phase = PHASES[0]
    try:
        model = _model(widths)
        dtypes = {k: getattr(torch, spec[k]) if spec[k] else None for k in ("param_dtype", "reduce_dtype")}
        policy = MixedPrecisionPolicy(**dtypes) if dtypes["param_dtype"] else MixedPrecisionPolicy()
        for layer in model:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        result["phases"][phase] = "ok"
        params = list(model.parameters())
        result["param_local_fraction"] = _local_fraction(params)
        optimizer = torch.optim.AdamW(params, lr=LR)
        rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        start = time.perf_counter()
        tap = _CollectiveTap()
        for step in range(STEPS):
            phase = "forward"
            with tap if step == 1 else _nothing():      # the collectives of one steady step
                loss = _loss(model, _batch(step, widths)[rows])
                result["phases"][phase] = "ok"
                phase = "backward"
                loss.backward()
            result["phases"][phase] = "ok"
            if step == 0:
                result["grad_local_fraction"] = _local_fraction([p.grad for p in params if p.grad is not None])
            phase = "step"
            optimizer.step()
            optimizer.zero_grad()
            result["phases"][phase] = "ok"
        result["step_s"] = (time.perf_counter() - start) / STEPS
        result["collectives_one_step"] = tap.calls
        moments = [optimizer.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
        result["adam_state_local_fraction"] = _local_fraction(moments)
        reference = _reference(widths)
        full = {name: p.full_tensor() if hasattr(p, "full_tensor") else p for name, p in model.named_parameters()}
        result["max_abs_diff"] = max((full[n].detach().float() - reference[n]).abs().max().item() for n in reference)
    except Exception as exc:     # the study records what stops FSDP2 here: any error, in the phase it met
        result["phases"][phase] = "failed"
        result["error"] = _first_line(exc)
        result["traceback_tail"] = traceback.format_exc().strip().splitlines()[-3:]
    return result


def _worker(rank: int, store_port: int, name: str, folder: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT)
    try:
        result = _run_case(rank, CASES[name])
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_case(name: str) -> dict[str, Any]:
    """One case on WORLD fresh gloo processes; every child reaped, a hang recorded as such."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(_worker, args=(store.port, name, folder), nprocs=WORLD, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + CASE_DEADLINE_S
        outcome = "finished"
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    outcome = f"hung (no end within {CASE_DEADLINE_S:g} s)"
                    break
        except mp.ProcessRaisedException as exc:
            outcome = f"a process raised: {_first_line(exc)}"
        except mp.ProcessExitedException as exc:
            outcome = f"a process died: {_first_line(exc)}"
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        ranks = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("rank*.json"))]
    return {"case": name, **CASES[name], "outcome": outcome, "ranks": ranks}


def summary_row(result: dict[str, Any]) -> list[str]:
    ranks = result["ranks"]
    if not ranks:
        return [result["case"], result["outcome"], "-", "-", "-", "-", "-", "-"]
    first = ranks[0]
    error = next((r["error"] for r in ranks if r["error"]), None)
    ran = [p for p in PHASES if all(r["phases"].get(p) == "ok" for r in ranks)]

    def fraction(key: str) -> str:
        return "/".join(f"{r[key]:.3f}" for r in ranks) if all(key in r for r in ranks) else "-"

    diff = max(r["max_abs_diff"] for r in ranks) if all("max_abs_diff" in r for r in ranks) else None
    kinds: dict[str, int] = {}
    for kind, dtype, op, _ in first.get("collectives_one_step", []):
        op = op.removeprefix("ReduceOp.").removeprefix("RedOpType.")
        label = " ".join(part for part in (kind, dtype, op) if part)
        kinds[label] = kinds.get(label, 0) + 1
    collectives = ", ".join(f"{count}x {label}" for label, count in kinds.items()) or "-"
    return [result["case"], "works" if error is None and len(ran) == len(PHASES) else (error or result["outcome"]),
            fraction("param_local_fraction"), fraction("grad_local_fraction"), fraction("adam_state_local_fraction"),
            "-" if diff is None else f"{diff:.2e}", f"{first['step_s'] * 1e3:.1f}" if "step_s" in first else "-",
            collectives]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "fsdp2_gloo_study.json")
    args = parser.parse_args()
    results = [run_case(name) for name in CASES]
    header = ["case", "outcome", "params local", "grads local", "AdamW state local", "max |diff|", "step ms",
              "rank 0's collectives, one forward+backward"]
    print(f"FSDP2 fully_shard on {WORLD} gloo processes, torch {torch.__version__}, {STEPS} AdamW steps "
          "(local: fraction of the elements each rank holds, rank 0/rank 1; diff: against single-process training)")
    print(table(header, [summary_row(r) for r in results]))
    path = write_json_to(args.out, {"torch": torch.__version__, "world": WORLD, "steps": STEPS, "cases": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
