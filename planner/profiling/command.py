"""`plan profile`: measure this machine's device and write a calibration file for `plan --calibration`.

    plan profile [--out calibration.json] [--model model.py ...] [--quick] [--concurrency N]

Compute rates and per-op overheads per op class, optimizer cost, the share of a core each of the
`--concurrency` processes gets, gloo point-to-point (also while the other processes compute) and
all-reduce between local processes, and the framework's memory; with `--model`, the whole model's
forward and backward time on real tensors (the cost model then scales its per-block estimates of that
model to the measured totals). Load from other processes meanwhile is recorded, with a warning when it
was high. See `planner.profiling.calibrate` for the method and `costmodel.calibration` for the file.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from planner.core.errors import HetplanError
from planner.core.output_file import check_output_file

# Other processes' average load (cores) above which the profile's figures are flagged as measured on a busy host.
BUSY_HOST_CORES = 0.25


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plan profile", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="calibration.json", help="calibration file to write")
    p.add_argument("--model", action="append", default=[], metavar="MODEL.py",
                   help="also time this model's forward/backward (repeatable)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (seconds, noisier)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="processes measuring at once: the ranks that will share this host (CPU programs "
                        "run one single-threaded process per device)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="what to measure: auto is cuda when present, else cpu")
    p.add_argument("--device-name", default=None,
                   help="catalog device type the figures calibrate (default: CPU, or the catalog GPU "
                        "whose name the driver reports)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before the workers are stopped")
    p.add_argument("--force", action="store_true",
                   help="replace --out even when it is not a calibration file plan profile wrote")
    return p


def is_calibration(head: bytes) -> bool:
    """Whether a file's bytes are a calibration file `plan profile` wrote (one it may replace)."""
    try:
        doc = json.loads(head)
    except ValueError:
        return False
    return isinstance(doc, dict) and {"schema_version", "measured_at", "method"} <= doc.keys()


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """The headline figures of a calibration document, one per line."""
    sharing = doc["host_sharing"]
    lines = [f"device {doc['device']['name']} ({doc['device']['description']}), "
             f"{doc['device']['concurrent_processes']} concurrent process(es), "
             f"{doc['device']['threads_per_process']} thread(s) each, on {sharing['cores']} core(s): "
             f"{sharing['contention_factor']:.2f} wall s per CPU s (compute below in CPU s)"]
    for precision, classes in doc["compute"].items():
        for name, r in sorted(classes.items()):
            rate = r.get("fwd_flop_per_s") or r.get("fwd_byte_per_s")
            unit = "GFLOP/s" if "fwd_flop_per_s" in r else "GB/s"
            rate_text = f"{rate / 1e9:8.1f} {unit:7s}" if rate else " " * 16
            lines.append(f"  {precision} {name:12s} {rate_text} overhead fwd {r['fwd_overhead_s'] * 1e6:6.1f} us"
                         f" bwd {r['bwd_overhead_s'] * 1e6:6.1f} us")
    opt, comm = doc["optimizer"], doc["comm"]
    lines.append(f"  update (grad-sync bookkeeping + AdamW + zero_grad) {opt['per_step_s'] * 1e6:.0f} us/step + "
                 f"{opt['per_tensor_s'] * 1e6:.1f} us/tensor + bytes / {opt['param_bytes_per_s'] / 1e9:.2f} GB/s")
    for kind in ("p2p", "p2p_in_place", "allreduce_2"):
        if kind not in comm:
            continue
        c = comm[kind]
        lines.append(f"  gloo {kind:12s} {c['latency_s'] * 1e6:7.1f} us + bytes / "
                     f"{c['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
    if "in_situ" in doc:
        lines.append(f"  in place: gradient sync x{doc['in_situ']['sync_factor']:.2f} of the ring fit, "
                     f"update x{doc['in_situ']['update_factor']:.2f} of its fit")
    lines.append(f"  framework memory {doc['memory']['framework_bytes'] / 2**20:.0f} MiB "
                 f"(torch + process group {doc['memory']['torch_process_group_bytes'] / 2**20:.0f} MiB)")
    for key, m in doc.get("models", {}).items():
        lines.append(f"  model {Path(m['path']).parent.name}/{Path(m['path']).name} [{key}]: fwd "
                     f"{m['fwd_s_per_micro_batch'] * 1e3:.2f} ms + {m['fwd_s_per_sample'] * 1e3:.3f} ms/sample, bwd "
                     f"{m['bwd_s_per_micro_batch'] * 1e3:.2f} ms + {m['bwd_s_per_sample'] * 1e3:.3f} ms/sample")
    return lines


def cmd_profile(argv: list[str]) -> int:
    """Entry of `plan profile`; errors are `HetplanError`s, turned into one line by the CLI."""
    from backends.report.progress import Progress
    from planner.profiling.calibrate import profile, write_calibration

    args = _parser().parse_args(argv)
    if args.concurrency < 1:
        raise HetplanError(f"--concurrency {args.concurrency} must be at least 1", field="--concurrency",
                           fix="pass the number of processes that will share this host")
    for model in args.model:
        if not Path(model).is_file():
            raise HetplanError("model file not found", file=model, field="--model", fix="check the path")
    check_output_file(Path(args.out), option="--out", is_ours=is_calibration, inputs=args.model, force=args.force,
                      example="calibration.json")       # before minutes of measuring, not after
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    out = Path(args.out)
    with Progress("plan profile") as progress:   # on a terminal only, on stderr
        progress.phase(f"measuring {device}" + (" and the models" if args.model else "")
                       + f" ({max(args.concurrency, 2)} processes)")
        doc = profile(quick=args.quick, concurrency=args.concurrency, device=device, device_name=args.device_name,
                      models=tuple(args.model), timeout_s=args.timeout)
        progress.phase(f"writing {out}")
        write_calibration(doc, out)
    print("\n".join(summary_lines(doc)))
    other = doc["host_load"]["other_cores_during"]
    if other is not None and other > BUSY_HOST_CORES:
        print(f"warning: other processes kept {other:.1f} cores busy while profiling: the figures are slower than "
              "this host; profile again when it is quiet")
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s (use: plan MODEL --cluster SPEC --calibration {out})")
    return 0
