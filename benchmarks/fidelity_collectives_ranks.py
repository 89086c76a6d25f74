"""The rank side of benchmarks/fidelity_collectives.py: spawned gloo processes that time and count the
collectives the program issues (TP all-reduces of a rewritten graph, ZeroRedundancyOptimizer's
parameter sync) and the all-reduces the link fit uses. Each rank writes its raw figures as JSON; the
benchmark prices them. What is measured and how is described there."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from statistics import median
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:   # importable by the spawned ranks from anywhere
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.fx as fx  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402

from backends.torchdist.program.stages import on_device  # noqa: E402
from passes.tensor_parallel import find_regions  # noqa: E402
from passes.tensor_parallel.costs import block_cost  # noqa: E402
from passes.tensor_parallel.rewrite import shard_graph  # noqa: E402
from planner import frontend  # noqa: E402
from planner.profiling.calibrate import free_port  # noqa: E402

EXAMPLES = REPO / "examples"
ZERO_TENSORS = 8                       # equal tensors: the greedy partition splits them evenly over 2 or 4
FIT_SIZES_BYTES = (4, 65536, 1 << 20, 4 << 20)
WARMUP_STEPS = 1                       # untimed steps before each case's timed ones
SPAWN_TIMEOUT_S = 600
GROUP_TIMEOUT_S = 120

@dataclass
class CollectiveTally:
    """The collectives one rank issued while `counting()`: calls, bytes and (synchronous ones) seconds."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    received_bytes: int = 0            # broadcasts: the bytes this rank was not the source of
    call_seconds: list[float] = field(default_factory=list)     # each all_reduce's, in issue order
    call_bytes: list[int] = field(default_factory=list)         # and its size

    @contextmanager
    def counting(self, rank: int) -> Iterator[CollectiveTally]:
        """Wrap `torch.distributed.all_reduce` and `broadcast` (looked up on the module at every call by
        passes.tensor_parallel.collectives and torch's ZeroRedundancyOptimizer) for the duration."""
        originals = dist.all_reduce, dist.broadcast

        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            work = originals[0](tensor, *args, **kwargs)
            self.call_seconds.append(time.perf_counter() - t0)
            self.seconds += self.call_seconds[-1]
            self.calls += 1
            self.call_bytes.append(tensor.numel() * tensor.element_size())
            self.bytes += self.call_bytes[-1]
            return work

        def broadcast(tensor: torch.Tensor, src: int, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            nbytes = tensor.numel() * tensor.element_size()
            self.bytes += nbytes
            self.received_bytes += 0 if src == rank else nbytes
            return originals[1](tensor, src, *args, **kwargs)

        dist.all_reduce, dist.broadcast = all_reduce, broadcast  # type: ignore[assignment]
        try:
            yield self
        finally:
            dist.all_reduce, dist.broadcast = originals


def _load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"fidelity_collectives_{name}", EXAMPLES / name / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def install_values(gm: fx.GraphModule, values: dict[str, torch.Tensor]) -> None:
    """Give every get_attr of `gm` its real value (copies; tied parameters stay one Parameter)."""
    copies: dict[int, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = values[str(node.target)]
        if id(value) not in copies:
            clone = value.detach().clone()
            copies[id(value)] = nn.Parameter(clone) if isinstance(value, nn.Parameter) else clone
        *path, leaf = str(node.target).split(".")
        owner: nn.Module = gm
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, leaf, copies[id(value)])
    on_device(gm, torch.device("cpu"))


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def _fit_samples(repeats: int) -> list[tuple[int, float]]:
    out = []
    for nbytes in FIT_SIZES_BYTES:
        buf = torch.zeros(max(nbytes // 4, 1))
        dist.all_reduce(buf)                                  # first call of a size sets up its buffers
        out.append((buf.numel() * 4, _median_s(functools.partial(dist.all_reduce, buf), repeats)))
    return out


def _tp_case(rank: int, world: int, name: str, rows: int, steps: int) -> dict[str, Any]:
    """Forward + backward of examples/`name` sharded, `steps` times after warm-up: per step this rank's tally."""
    example = _load_example(name)
    inputs, target = example.batch(rows, 0)
    torch.manual_seed(0)
    real = example.model()
    values = {**dict(real.named_parameters(remove_duplicate=False)),
              **dict(real.named_buffers(remove_duplicate=False))}
    with torch.device("meta"):
        meta_module = example.model()
    gm = frontend.trace(meta_module, tuple(i.to("meta") for i in inputs), replicate_repeated=True)
    reference = copy.deepcopy(gm)                           # unsharded: what the cost model reads
    layout = find_regions(gm)
    install_values(gm, values)
    shard_graph(gm, layout, world, rank, None)
    # the compute nodes (block_cost's matmul count indexes node.args[0], which placeholders lack)
    cost = block_cost(reference, layout, [n.name for n in reference.graph.nodes if n.op == "call_function"])
    per_step = []
    for step in range(WARMUP_STEPS + steps):
        fwd, bwd = CollectiveTally(), CollectiveTally()
        dist.barrier()
        with fwd.counting(rank):
            loss = example.loss_fn(gm(*inputs), target)
        with bwd.counting(rank):
            loss.backward()
        gm.zero_grad(set_to_none=True)
        if step >= WARMUP_STEPS:
            per_step.append({"fwd": asdict(fwd), "bwd": asdict(bwd)})
    # the same all-reduces back to back, with no compute between them (every rank waits in them at once):
    # what the link fit describes, so the gap to the in-graph figure is the ranks' compute in between
    last = per_step[-1]
    buffers = [torch.zeros(n // 4) for n in last["fwd"]["call_bytes"] + last["bwd"]["call_bytes"]]
    replay_s = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        for buf in buffers:
            dist.all_reduce(buf)
        replay_s.append(time.perf_counter() - t0)
    return {"model": name, "rows": rows, "pairs": sum(len(r.rows) for r in layout.regions), "replay_s": replay_s,
            "fwd_bytes_per_sample": cost.fwd_allreduce_bytes_per_sample,
            "bwd_bytes_per_sample": cost.bwd_allreduce_bytes_per_sample, "steps": per_step}


def _zero_case(rank: int, width: int, steps: int) -> dict[str, Any]:
    """ZeroRedundancyOptimizer(AdamW) over ZERO_TENSORS (width x width) weights: per step the local step's
    and the parameter sync's seconds, and the sync's broadcasts."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(width, width)) for _ in range(ZERO_TENSORS)]
    zero = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW)
    per_step = []
    for step in range(WARMUP_STEPS + steps):
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        tally = CollectiveTally()
        dist.barrier()
        t0 = time.perf_counter()
        # what ZeroRedundancyOptimizer.step runs (torch 2.x): its shard's step, then `_sync_params` (one
        # broadcast per parameter from its owner, all waited for); apart, so the sync is timed alone
        zero._local_step()
        local_s = time.perf_counter() - t0
        dist.barrier()
        with tally.counting(rank):
            t0 = time.perf_counter()
            zero._sync_params()  # type: ignore[attr-defined]   # present at runtime, absent from the typed view
            tally.seconds = time.perf_counter() - t0
        if step >= WARMUP_STEPS:
            per_step.append({"local_step_s": local_s, **asdict(tally)})
    return {"width": width, "tensors": ZERO_TENSORS, "param_bytes": ZERO_TENSORS * width * width * 4,
            "steps": per_step}


def _worker(rank: int, world: int, port: int, settings: dict[str, Any], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        result = {"fit": _fit_samples(settings["fit_repeats"]),
                  "tp": [_tp_case(rank, world, name, rows, settings["steps"])
                         for name in settings["tp_models"] for rows in settings["tp_rows"]],
                  "zero": [_zero_case(rank, width, settings["steps"]) for width in settings["zero_widths"]]}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def measure(world: int, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's raw measurements (`_worker`'s), from `world` spawned gloo processes."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_worker, args=(world, free_port(), settings, out_dir), nprocs=world,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world} gloo ranks did not finish in {SPAWN_TIMEOUT_S} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
