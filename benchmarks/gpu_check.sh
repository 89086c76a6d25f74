#!/usr/bin/env bash
# The device checks of a GPU session, as one script (issue #4): a few minutes on one GPU, at most the sum
# of the step timeouts below (9.5 minutes: under the device session's 10 minutes per command).
#
#   bash benchmarks/gpu_check.sh                 # on a CUDA machine
#   bash benchmarks/gpu_check.sh --cpu-dry-run   # the same steps on CPU, small and quick (checks the script)
#
# Steps, each under its own timeout (one that fails or runs out leaves the others' results):
#   1. kernels       python benchmarks/kernel_bandwidth.py: Triton kernels against their torch references, GB/s
#   2. profile       plan profile --quick --device cuda (no model, one computing process)
#   3. single-device python benchmarks/fidelity.py --single-device --quick: ops and blocks of the example
#                    models predicted (datasheet; calibrated by step 2 where it succeeded) vs measured
#   4. tp-matmul     python benchmarks/tp_matmul.py: a Llama-7B layer's linears at each tensor-parallel
#                    degree's shard shapes, measured vs the cost model's compute estimate (the TP compute side)
#   5. plan, program plan examples/gpt on one GPU (benchmarks/clusters/gpu-1.yaml), with step 2's
#                    calibration where there is one, emit, `plan run` it for STEPS steps: estimate vs measured
# With $OUT set (the device machine's folder that comes back, at most 8 files), the steps write into a
# temporary folder and $OUT receives two files: gpu_check.txt (the summary table) and gpu_check.tar.gz
# (everything). Without it they write into benchmarks/results/ (--cpu-dry-run: a temporary folder).
#
# The device image lacks OR-Tools and reaches no registry: run benchmarks/gpu_wheels.sh here first and
# carry .whl; this script installs what it finds there (pip --target, first on PYTHONPATH).
#   device run: command "bash benchmarks/gpu_check.sh", carry [".whl"], timeout_s 600
set -u
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" != "--cpu-dry-run" ] && compgen -G ".whl/*.whl" > /dev/null; then   # the device image's python
    SITE="$(mktemp -d -t hetplan-site-XXXXXX)"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
        && export PYTHONPATH="$SITE:$PYTHONPATH"
fi

DRY_RUN=0
[ "${1:-}" = "--cpu-dry-run" ] && DRY_RUN=1
if [ "$DRY_RUN" = 1 ]; then
    DEVICE=cpu; CLUSTER=benchmarks/clusters/cpu-1.yaml; MODELS=mlp; STEPS=6
    KERNEL_ARGS=(--sizes 4096 --repeats 2)
    TP_ARGS=(--device cpu --quick --repeats 2)
    DEST="$(mktemp -d -t hetplan-gpu-check-XXXXXX)"
else
    DEVICE=cuda; CLUSTER=benchmarks/clusters/gpu-1.yaml; MODELS=gpt,mlp,resnet; STEPS=30
    KERNEL_ARGS=()
    TP_ARGS=(--device cuda --catalog H200)
    DEST="$REPO/benchmarks/results"
fi
[ -n "${OUT:-}" ] && DEST="$(mktemp -d -t hetplan-gpu-check-XXXXXX)"   # bundled into $OUT at the end
# seconds per step (the device session allows 10 minutes per command)
KERNELS_TIMEOUT_S=90
PROFILE_TIMEOUT_S=90
SINGLE_DEVICE_TIMEOUT_S=150
TP_MATMUL_TIMEOUT_S=60
PLAN_TIMEOUT_S=60
RUN_TIMEOUT_S=120
mkdir -p "$DEST"
SUMMARY="$DEST/gpu_check.txt"
PROGRAM="$DEST/gpu_program_gpt"
STATUS="$DEST/gpu_check_status.txt"
: > "$STATUS"

step() {   # step NAME TIMEOUT_S LOG COMMAND...: run it under its timeout, record status and seconds
    local name="$1" limit="$2" log="$3"; shift 3
    local start=$SECONDS
    echo "== $name (at most ${limit} s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    local rc=$?
    local state=ok
    if [ $rc = 124 ] || [ $rc = 137 ]; then state=timeout; elif [ $rc != 0 ]; then state="failed ($rc)"; fi
    echo "$name|$state|$((SECONDS - start))" >> "$STATUS"
    tail -n 3 "$log"
    return $rc
}

step kernels "$KERNELS_TIMEOUT_S" "$DEST/kernels_$DEVICE.log" \
    "$PYTHON" benchmarks/kernel_bandwidth.py --out "$DEST/kernels_$DEVICE.json" "${KERNEL_ARGS[@]}"

CALIBRATION="$DEST/calibration_$DEVICE.json"
CAL_ARGS=(--datasheet-only)
step profile "$PROFILE_TIMEOUT_S" "$DEST/calibration_$DEVICE.log" \
    "$PYTHON" -m planner.cli profile --quick --device "$DEVICE" --out "$CALIBRATION" \
    && CAL_ARGS=(--calibration "$CALIBRATION")

step single-device "$SINGLE_DEVICE_TIMEOUT_S" "$DEST/single_device_$DEVICE.log" \
    "$PYTHON" benchmarks/fidelity.py --single-device --device "$DEVICE" --quick --models "$MODELS" \
    "${CAL_ARGS[@]}" --out "$DEST/single_device_$DEVICE.json"

step tp-matmul "$TP_MATMUL_TIMEOUT_S" "$DEST/tp_matmul_$DEVICE.log" \
    "$PYTHON" benchmarks/tp_matmul.py "${TP_ARGS[@]}" --out "$DEST/tp_matmul_$DEVICE.json"

[ "${CAL_ARGS[0]}" = --datasheet-only ] && CAL_ARGS=()
if step plan "$PLAN_TIMEOUT_S" "$DEST/gpu_program_plan.log" \
    "$PYTHON" -m planner.cli examples/gpt/model.py --cluster "$CLUSTER" "${CAL_ARGS[@]}" --stages 1 \
    --micro-batch 32 --global-batch 256 --no-runners-up -o "$PROGRAM"; then
    step program "$RUN_TIMEOUT_S" "$DEST/gpu_program_run.log" \
        "$PYTHON" -m planner.cli run "$PROGRAM" --steps "$STEPS"
fi

"$PYTHON" - "$DEST" "$DEVICE" > "$SUMMARY" <<'EOF'
"""The summary table of this check: date, device, every step's status, and its headline figures."""
import datetime
import json
import statistics
import sys
from pathlib import Path

dest, device = Path(sys.argv[1]), sys.argv[2]
WARMUP_STEPS = 3   # as benchmarks/fidelity.py: step 0 traces the stage


def load(name):
    path = dest / name
    return json.loads(path.read_text()) if path.is_file() else None


def pct(value):
    return f"{value:.0%}" if value is not None else "-"


if device == "cuda":
    import torch
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
else:
    name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                "CPU")
print(f"gpu_check {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ} on {device}: {name}")
print(f"{'step':14s} {'status':12s} {'s':>5s}")
for line in (dest / "gpu_check_status.txt").read_text().splitlines():
    step, state, seconds = line.split("|")
    print(f"{step:14s} {state:12s} {seconds:>5s}")
kernels = load(f"kernels_{device}.json")
if kernels:
    for r in kernels["rows"]:
        share = f" ({r['fraction_of_peak']:.0%} of peak)" if r.get("fraction_of_peak") else ""
        print(f"kernel {r['kernel']:34s} n={r['n']:>9d} {r['impl']:>6s} {r['gbyte_s']:8.1f} GB/s{share}")
single = load(f"single_device_{device}.json")
if single:
    for flavour, s in single["summary"].items():
        levels = "  ".join(f"{k} {pct(v['total'])}" for k, v in s.items() if k != "op_class")
        print(f"single-device {flavour:10s} mean |error| of fwd+bwd: {levels}")
plan = load("gpu_program_gpt/plan.json")
metrics_path = dest / "gpu_program_gpt" / "run" / "metrics.jsonl"
if plan and metrics_path.is_file():
    from backends.torchdist.program.metrics import read_metrics   # an incomplete last line is skipped
    metrics = read_metrics(metrics_path)
    timed = [m["step_time_s"] for m in metrics if m["step"] >= WARMUP_STEPS]
    if timed:
        measured = statistics.median(timed)
        estimate = plan["estimates"]["iteration_s"]
        print(f"program gpt 1 device: estimate {estimate * 1e3:.2f} ms, measured {measured * 1e3:.2f} ms "
              f"(median of {len(timed)} steps), error {(estimate - measured) / measured:+.0%}")
        allocated = max(m["peak_memory_bytes"] for m in metrics)
        reserved = max(m.get("peak_reserved_bytes") or 0 for m in metrics)
        planned = plan["estimates"]["memory_bytes"][0]
        print(f"program gpt 1 device: memory estimate {planned / 2**20:.0f} MiB, allocator peak "
              f"{allocated / 2**20:.0f} MiB allocated, {reserved / 2**20:.0f} MiB reserved "
              f"(estimate vs reserved {(planned - reserved) / max(reserved, 1):+.0%})")
EOF
cat "$SUMMARY"
if [ -n "${OUT:-}" ]; then   # two files back instead of a tree
    cp "$SUMMARY" "$OUT/gpu_check.txt"
    tar czf "$OUT/gpu_check.tar.gz" -C "$DEST" .
    echo "results in $OUT/gpu_check.tar.gz"
else
    echo "results in $DEST"
fi
! grep -qv "|ok|" "$STATUS"
