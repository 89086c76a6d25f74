"""Join the process group as this process's plan rank, and create the plan's gradient groups.

The rank passed to `init_process_group` is the plan's (placement.resolve), whatever torchrun numbered the
process: over torchrun's store any permutation of ranks forms the same group. Where the store lives:

  HETPLAN_STORE=host:port   `plan run`'s own store, bound to 127.0.0.1 only (a torch TCPStore server
                            listens on every interface unless handed a bound socket); used as a client
  MASTER_ADDR / MASTER_PORT torchrun's store, as launch.sh starts it on a cluster, keyed under the
                            launcher's attempt (TORCHELASTIC_RESTART_COUNT): it outlives a restart
  neither, one process      an in-process store: `python -m program.train` of a one-device plan

The timeout (train.py --timeout) bounds every collective and receive, so a hung or dead peer ends the
run within it instead of torch's default 30 minutes.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from passes.comm.derive import tp_groups
from planner.core.ir import Plan, ReplicaPlan, StagePlan

from .placement import LaunchError, Placement, uses_cuda

STORE_ENV = "HETPLAN_STORE"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"   # torchrun's attempt, 0 first
# A rank that stops because another rank failed exits with FOR_PEER_EXIT_CODE, and only after
# FOR_PEER_EXIT_DELAY_S: torchrun names the first failure it observes (to the second), and this rank
# seeing its peer gone, a lost connection, is often quicker than torchrun seeing the peer's end. The
# delay lets the launcher see the rank that failed first, and stop this one with SIGTERM meanwhile.
FOR_PEER_EXIT_CODE = 5
FOR_PEER_EXIT_DELAY_S = 2.0


@dataclass
class Context:
    """Who this process is in the plan: `stage` is the first of its stages, `stages` all of them (more than
    one under interleaved 1F1B, planner.core.ir.ReplicaPlan.stages_with)."""

    rank: int
    world_size: int
    replica: ReplicaPlan
    stage: StagePlan
    device: torch.device
    grad_groups: dict[int, dist.ProcessGroup | None]   # plan group index -> process group (members only)
    lane: int = 0                                       # this rank's tensor-parallel shard of its stage
    tp_group: dist.ProcessGroup | None = None           # the stage's shards (None: no tensor parallelism)

    @property
    def stages(self) -> tuple[StagePlan, ...]:
        return self.replica.stages_with(self.stage)

    @property
    def num_stages(self) -> int:
        return len(self.replica.stages)

    @property
    def is_first(self) -> bool:
        """This rank runs the replica's first stage."""
        return self.stage.index == 0

    @property
    def is_last(self) -> bool:
        """This rank runs the replica's last stage."""
        return self.stages[-1].index == self.num_stages - 1


    def rank_of_stage(self, stage: int) -> int:
        """The rank of stage `stage` this rank exchanges activations with: the same shard lane's."""
        return self.replica.stages[stage].ranks[self.lane]


def _store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The store to rendezvous over: `plan run`'s, torchrun's under a prefix of its attempt, an in-process one
    for a one-process plan run by hand; None for env:// outside torchrun."""
    address = os.environ.get(STORE_ENV, "")
    if address:
        host, _, port = address.rpartition(":")
        client = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        attempt = os.environ.get(RESTART_ENV, "0")
        return dist.PrefixStore(f"hetplan/{run}/{attempt}/", client)
    if "MASTER_ADDR" not in os.environ:
        if world != 1:
            raise LaunchError(f"the plan runs {world} processes and this one was not started by torchrun",
                              file="train.py", fix="start it with ./launch.sh or `plan run PLAN_DIR`")
        return dist.HashStore()
    if RESTART_ENV not in os.environ:
        return None
    # torchrun's store outlives a restart of the group (its agent's, shared with the workers), and env://
    # keys it without the attempt: a restarted group would read the addresses of the dead one's ranks
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout, multi_tenant=True)
    return dist.PrefixStore(f"hetplan/attempt/{os.environ[RESTART_ENV]}/", store)


def init(plan: Plan, placement: Placement, timeout_s: float) -> Context:
    """Join the default group as `placement.rank` and create every gradient group (each rank creates
    all of them, in plan order); raises LaunchError when the group does not form within the timeout."""
    replica, stage = plan.stage_of_rank(placement.rank)
    use_cuda = uses_cuda(stage)
    if use_cuda:
        device = torch.device("cuda", placement.device_index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        store = _store(placement.rank, plan.world_size, timeout)
        try:
            dist.init_process_group("nccl" if use_cuda else "gloo", rank=placement.rank,
                                    world_size=plan.world_size, timeout=timeout, store=store)
        except (dist.DistError, RuntimeError) as exc:
            raise LaunchError(f"rank {placement.rank}: the process group did not form within {timeout_s:g} s "
                              f"({type(exc).__name__})", file="train.py",
                              fix="start every node of the plan (`NODE_RANK=k ./launch.sh` on node k), or "
                                  "raise --timeout") from exc
    groups: dict[int, dist.ProcessGroup | None] = {}
    for g in plan.grad_groups:
        pg = dist.new_group(list(g.ranks), timeout=timeout)
        if placement.rank in g.ranks:
            groups[g.index] = pg
    tp_group = None
    for _, ranks in tp_groups(plan):         # then each stage's shards (passes.comm derives this order)
        pg = dist.new_group(list(ranks), timeout=timeout)
        if placement.rank in ranks:
            tp_group = pg
    return Context(placement.rank, plan.world_size, replica, stage, device, groups,
                   lane=stage.ranks.index(placement.rank), tp_group=tp_group)
