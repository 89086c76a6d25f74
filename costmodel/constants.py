"""Named cost-model constants, each with its unit and where it comes from.

Defaults are typical published figures; `plan profile` measures the ones that matter on the
hardware at hand and the calibration file overrides them.
"""

# Achieved fraction of peak FLOP/s for large dense GEMMs / convolutions (cuBLAS/cuDNN on
# A100/H100 typically reach 70-80% of datasheet peak at transformer sizes).
MATMUL_EFFICIENCY = 0.7
# Achieved fraction of datasheet memory bandwidth for streaming elementwise kernels (STREAM-like).
MEMORY_EFFICIENCY = 0.8
# Fixed cost per executed op on an accelerator: kernel launch + framework dispatch, seconds.
GPU_OP_OVERHEAD_S = 8e-6
# Same on CPU: eager PyTorch dispatch per op, seconds (measured order on x86 servers).
CPU_OP_OVERHEAD_S = 4e-6
# Backward of a memory-bound op reads its saved inputs and the incoming gradient and writes
# the input gradient: about twice the forward traffic.
BACKWARD_BYTES_FACTOR = 2.0

# Training state per parameter for AdamW, bytes per parameter *byte* of fp32 weights:
# weight (1x) + gradient (1x) + exp_avg, exp_avg_sq (2x).
ADAMW_STATE_FACTOR = 4.0
# Mixed precision keeps an extra low-precision copy of the weights for compute (0.5x of fp32).
MIXED_PRECISION_WEIGHT_COPY_FACTOR = 0.5
# Memory the framework itself holds per process: CUDA context + allocator slack on GPUs,
# the torch runtime on CPU. Bytes.
GPU_FRAMEWORK_OVERHEAD_BYTES = 1 << 30
# CPU, measured (torch 2.13 CPU wheel, Python 3.11, Linux x86-64) as the process's own peak resident
# set (VmHWM in /proc/self/status; ru_maxrss would include the launcher's, inherited across exec):
# - after `import torch` and a gloo `init_process_group`: 220 MiB (`plan profile` re-measures this as
#   memory.torch_process_group_bytes);
# - the emitted program's own start-up on top: importing its runtime (torch.export, fx, sympy),
#   tracing and splitting the model, one training step and the metrics: 200 MiB, from peak RSS of
#   examples/mlp (0.3 MB of parameters) on 4 ranks (420 MiB per rank, with checkpointing, tensor
#   parallelism and ZeRO in the runtime) minus the figure above.
CPU_TORCH_PROCESS_GROUP_BYTES = 220 << 20
CPU_PROGRAM_RUNTIME_BYTES = 200 << 20
CPU_FRAMEWORK_OVERHEAD_BYTES = CPU_TORCH_PROCESS_GROUP_BYTES + CPU_PROGRAM_RUNTIME_BYTES
# What the program's training steps add on CPU beyond what `plan profile` measures as framework memory
# (its runtime imported and a small model traced): the autograd engine's and gloo's buffers, DDP's
# reducer, the optimizer's first step, the checkpoint stager and metrics. Measured on examples/mlp
# (0.3 MB of parameters, so nothing of it is the model's) on cpu-hetero-4: 26-27 MiB above the calibrated
# figure per rank at micro-batches 2 and 1024 (2026-12-02); the held-out models were not looked at.
CPU_PROGRAM_STEP_BYTES = 26 << 20
# Fraction of device memory a plan may use by default (the rest is margin for fragmentation).
DEFAULT_MEMORY_MARGIN = 0.1
# AdamW step reads/writes weight, grad, two moments: bytes moved per fp32 weight byte.
OPTIMIZER_BYTES_FACTOR = 7.0

BYTES_PER_ELEMENT = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}

# ---- compressors' runtime settings: the defaults a plan's compressors are priced with and run with
# (a plan records them per gradient group and edge, planner.core.ir.CompressorSettings / P2PEdge)

GRAD_BUCKET_CAP_BYTES = 25 * 2**20
"""Gradient bucket size: torch DDP's default `bucket_cap_mb=25`."""
POWERSGD_RANK = 4
"""PowerSGD matrix approximation rank. Vogels et al., "PowerSGD" (NeurIPS 2019), reach the accuracy
of uncompressed SGD with rank 2-4 on ResNet/LSTM; with rank 4 the bundled GPT ends 200 steps within
4% of the uncompressed loss under AdamW and SGD (benchmarks/convergence.py)."""
POWERSGD_MIN_COMPRESSION_RATE = 2.0
"""Compress a matrix only if it shrinks at least this much: torch `PowerSGDState` default."""
POWERSGD_START_ITER = 2
"""Vanilla all-reduce steps before PowerSGD starts (torch requires > 1 with error feedback and
warm start); the cost model gives the steady state after them."""
ONEBIT_ADAM_WARMUP_FRACTION = 0.25
"""1-bit Adam's exact AdamW warm-up, as a fraction of the run (backends.compression.onebit_adam).
DeepSpeed's 1-bit Adam tutorial suggests 15-25% of the training steps for its `freeze_step`: the
variance may be frozen only once it is stable. On the 200-step convergence benchmark the loss leaves
its initial plateau around step 30-40, when attention and embedding gradients grow 100x and more:
freezing at step 10 diverged (NaN), at 20 ended 53% above uncompressed, at 40, 50, 60 within 3%."""
INT8_BLOCK_ELEMS = 256
"""Elements per int8 quantisation block of activations (one float32 scale each): 1.6% overhead."""
