"""Convergence under gradient compression: the example GPT trained by the emitted program on 4 gloo
ranks, once per forced compressor and optimizer, final loss compared with uncompressed training.

    python benchmarks/convergence.py                  # 200 steps x {sgd, adamw} x 5 compressors, ~10 min
    python benchmarks/convergence.py --quick          # 40 steps (a smoke run)
    python benchmarks/convergence.py --optimizers sgd --compressors none onebit --steps 500

Each run plans examples/gpt/model.py on examples/clusters/cpu-hetero-4.yaml (2 fast + 2 three
times slower CPU processes) with `--stages 1 --use-all-devices` (4 replicas with uneven batch
shares, one gradient group over all 4 ranks) and `--compression NAME`, then runs the program with
`plan run` (same seed, same data). Final loss = mean of the last 10 steps' global-batch loss; a
compressor passes when it is within TOLERANCE of the uncompressed run's under the same optimizer.
Prints a table per optimizer, writes benchmarks/results/convergence.json; exit status 1 if any
compressor fails.

Two optimizers, because 1-bit sign compression with error feedback is an SGD method (Karimireddy et
al., "Error Feedback Fixes SignSGD", 2019): under SGD/momentum the program compresses the gradients.
Under AdamW it cannot (every element of a bucket arrives with the same magnitude and Adam's
per-element normalisation turns the sign noise into full-size updates: +20% final loss here), so a
`onebit` group trains with 1-bit Adam (Tang et al., 2021; backends.compression.onebit_adam): exact
AdamW for the first quarter of the run (costmodel.compression.ONEBIT_ADAM_WARMUP_FRACTION, 50 of 200
steps), then frozen variance and 1-bit compressed momentum. Its mean wire bytes per step include the
warm-up's uncompressed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:   # runnable as `python benchmarks/convergence.py` from anywhere
    sys.path.insert(0, str(REPO))

from backends.torchdist.program.metrics import read_metrics  # noqa: E402
from costmodel.compression import GRADIENT_COMPRESSORS, onebit_adam_freeze_step  # noqa: E402

MODEL = REPO / "examples" / "gpt" / "model.py"
CLUSTER = REPO / "examples" / "clusters" / "cpu-hetero-4.yaml"
RESULTS = REPO / "benchmarks" / "results"
TOLERANCE = 0.05          # final loss within 5% of uncompressed (the acceptance bar)
FINAL_WINDOW = 10         # final loss: mean over the last 10 steps
DEFAULT_STEPS, QUICK_STEPS = 200, 40
DEFAULT_LR = {"sgd": 0.1, "adamw": 3e-3}   # per optimizer: 200 steps move the loss well below ln(256)
OPTIMIZER_NAMES = {"sgd": "SGD (momentum 0.9)", "adamw": "AdamW"}
GLOBAL_BATCH = 16
COLLECTIVE_TIMEOUT_S = 120
RUN_TIMEOUT_S = 1800


@dataclass(frozen=True)
class RunResult:
    """One compressor's run: what the plan chose and what the program measured."""

    compressor: str
    plan_compressors: tuple[str, ...]      # per gradient group, as planned
    losses: tuple[float, ...]              # per step, global-batch loss
    final_loss: float
    grad_wire_bytes_per_step: float        # rank 0, mean over steps (measured)
    grad_bytes_per_step: float             # rank 0, uncompressed gradient bytes
    step_time_s: float                     # slowest rank, median over steps
    wall_s: float


def plan_program(out: Path, compression: str, *, stages: int = 1, extra: tuple[str, ...] = ()) -> None:
    """`plan` the GPT on cpu-hetero-4 into `out` with a forced gradient compressor."""
    cmd = [sys.executable, "-m", "planner.cli", str(MODEL), "--cluster", str(CLUSTER), "--global-batch",
           str(GLOBAL_BATCH), "--stages", str(stages), "--use-all-devices", "--compression", compression,
           "-o", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=RUN_TIMEOUT_S)
    if proc.returncode:
        raise RuntimeError(f"plan failed ({proc.returncode}): {proc.stderr[-2000:]}")


def run_program(out: Path, steps: int, *, lr: float, optimizer: str = "adamw", seed: int = 0) -> list[dict]:
    """`plan run OUT`; returns the metrics lines (one per rank and step)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "planner.cli", "run", str(out), "--steps", str(steps), "--seed", str(seed),
           "--lr", str(lr), "--optimizer", optimizer, "--timeout", str(COLLECTIVE_TIMEOUT_S)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=RUN_TIMEOUT_S,
                          start_new_session=True)
    if proc.returncode:
        raise RuntimeError(f"run failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return read_metrics(out / "run" / "metrics.jsonl")


def train(compressor: str, steps: int, lr: float, optimizer: str, workdir: Path) -> RunResult:
    """Plan with `compressor` forced, train `steps` steps, summarise."""
    from planner.core.ir import Plan

    start = time.perf_counter()
    out = workdir / f"{optimizer}-{compressor}"
    plan_program(out, compressor)
    plan = Plan.load(out)
    metrics = run_program(out, steps, lr=lr, optimizer=optimizer)
    rank0 = sorted((m for m in metrics if m["rank"] == 0), key=lambda m: m["step"])
    losses = tuple(m["loss"] for m in rank0)
    step_times = [max(m["step_time_s"] for m in metrics if m["step"] == s) for s in range(steps)]
    return RunResult(
        compressor=compressor, plan_compressors=tuple(g.compressor for g in plan.grad_groups),
        losses=losses, final_loss=statistics.fmean(losses[-FINAL_WINDOW:]),
        grad_wire_bytes_per_step=statistics.fmean(m["grad_wire_bytes"] for m in rank0),
        grad_bytes_per_step=statistics.fmean(m["grad_bytes"] for m in rank0),
        step_time_s=statistics.median(step_times), wall_s=time.perf_counter() - start)


def table(header: list[str], rows: list[list[str]]) -> str:
    """Right-aligned text table (first column left-aligned)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def report(results: list[RunResult]) -> tuple[str, bool]:
    """The table, and whether every compressor is within TOLERANCE of `none`."""
    base = next(r for r in results if r.compressor == "none")
    rows, ok = [], True
    for r in results:
        rel = r.final_loss / base.final_loss - 1.0
        saving = r.grad_bytes_per_step / max(r.grad_wire_bytes_per_step, 1)
        passed = abs(rel) <= TOLERANCE
        ok &= passed
        rows.append([r.compressor, ",".join(sorted(set(r.plan_compressors))), f"{r.losses[0]:.4f}",
                     f"{r.final_loss:.4f}", f"{rel:+.2%}", "yes" if passed else "NO",
                     f"{r.grad_wire_bytes_per_step:,.0f}", f"{saving:.1f}x",
                     f"{r.step_time_s * 1e3:.0f} ms", f"{r.wall_s:.0f} s"])
    header = ["compressor", "planned", "first loss", f"final loss (last {FINAL_WINDOW})", "vs none",
              f"within {TOLERANCE:.0%}", "wire B/step (rank 0)", "saving", "step (median)", "wall"]
    return table(header, rows), ok


def run_optimizer(optimizer: str, names: list[str], steps: int, lr: float) -> tuple[list[RunResult], str, bool]:
    """Every compressor under one optimizer: results, table text, all within tolerance."""
    results = []
    with tempfile.TemporaryDirectory(prefix="hetplan-convergence-") as tmp:
        for name in names:
            results.append(train(name, steps, lr, optimizer, Path(tmp)))
            print(f"{optimizer} {name}: final loss {results[-1].final_loss:.4f} ({results[-1].wall_s:.0f} s)",
                  flush=True)
    text, ok = report(results)
    return results, text, ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help=f"training steps (default {DEFAULT_STEPS})")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps unless --steps is given")
    p.add_argument("--optimizers", nargs="+", default=list(DEFAULT_LR), choices=list(DEFAULT_LR))
    p.add_argument("--lr", type=float, default=None, help="learning rate for every optimizer "
                   f"(default {', '.join(f'{k} {v}' for k, v in DEFAULT_LR.items())})")
    p.add_argument("--compressors", nargs="+", default=list(GRADIENT_COMPRESSORS),
                   choices=list(GRADIENT_COMPRESSORS))
    p.add_argument("--out", type=Path, default=RESULTS / "convergence.json")
    args = p.parse_args(argv)
    steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    if steps < FINAL_WINDOW:
        p.error(f"--steps must be at least {FINAL_WINDOW}")
    names = ["none", *[c for c in args.compressors if c != "none"]]
    summary: dict[str, object] = {}
    texts, all_ok = [], True
    for optimizer in args.optimizers:
        lr = args.lr if args.lr is not None else DEFAULT_LR[optimizer]
        results, text, ok = run_optimizer(optimizer, names, steps, lr)
        all_ok &= ok
        texts.append(f"{OPTIMIZER_NAMES[optimizer]}, lr {lr}:\n\n{text}")
        summary[optimizer] = {"lr": lr, "all_within_tolerance": ok, "runs": [asdict(r) for r in results]}
    print(f"\nGPT on cpu-hetero-4 (4 gloo ranks, 1 stage x 4 replicas), global batch {GLOBAL_BATCH}, "
          f"{steps} steps (AdamW + onebit: 1-bit Adam, {onebit_adam_freeze_step(steps)} exact warm-up steps)"
          f"\n\n" + "\n\n".join(texts) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": str(MODEL.relative_to(REPO)), "cluster": str(CLUSTER.relative_to(REPO)),
        "global_batch": GLOBAL_BATCH, "steps": steps, "tolerance": TOLERANCE, "final_window": FINAL_WINDOW,
        "onebit_adam_freeze_step": onebit_adam_freeze_step(steps),
        "all_within_tolerance": all_ok, "optimizers": summary}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
