"""The plan's record of the communication passes.comm verified (Plan.comm): the stage splits and gradient
groups' parameters it derived every rank's streams from, and their digests. planner.core.ir re-exports them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommValue:
    """A value of a stage split as the communication verifier saw it (passes.split.ValueInfo)."""

    name: str
    producer: int                 # stage; -1: a model input
    consumers: tuple[int, ...]    # stages; the number of stages stands for the model's output
    shape: tuple[int, ...]
    dtype: str                    # torch's name without `torch.`: float32, int64
    needs_grad: bool


@dataclass(frozen=True)
class CommSplit:
    """One replica split at one micro-batch size: what its stages receive and send, in their order."""

    replicas: tuple[int, ...]                 # the replicas cut this way
    rows: int                                 # micro-batch size
    values: tuple[CommValue, ...]             # every value of the split (tags number them all)
    stage_inputs: tuple[tuple[str, ...], ...]
    stage_outputs: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class CommRecord:
    """What passes.comm derived every rank's communication from and proved free of deadlock: the stage
    splits and gradient-group parameters beside the plan, and a digest of each rank's streams. The
    program derives its own from its split and refuses to run a stream with another digest."""

    splits: tuple[CommSplit, ...]
    params: tuple[tuple[str, int, str], ...]   # gradient groups' parameters: name, elements, dtype
    digests: tuple[str, ...]                   # per rank


