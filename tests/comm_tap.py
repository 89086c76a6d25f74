"""Run an emitted program with every torch.distributed call it makes recorded (tests/test_verify_comm.py):

    torchrun ... tests/comm_tap.py OUT_DIR PROGRAM_DIR/train.py [train.py's arguments]

Each rank writes OUT_DIR/rank<r>.json: its calls in the order it made them, each as a list
[kind, peer or group ranks, tag, shape, dtype] (kinds: send, recv, all_reduce, barrier, new_group: what
a program without gradient compression calls), to compare with the streams passes.comm derives.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

calls: list[list[Any]] = []
rank: list[int] = []


def _ranks(group: Any) -> list[int]:
    return list(range(dist.get_world_size())) if group is None else list(dist.get_process_group_ranks(group))


def _payload(t: torch.Tensor) -> list[Any]:
    return [list(t.shape), str(t.dtype).removeprefix("torch.")]


RECORDS = {
    "isend": lambda tensor, dst=None, group=None, tag=0, **_: ["send", dst, tag, *_payload(tensor)],
    "irecv": lambda tensor, src=None, group=None, tag=0, **_: ["recv", src, tag, *_payload(tensor)],
    "all_reduce": lambda tensor, op=None, group=None, **_: ["all_reduce", _ranks(group), -1, *_payload(tensor)],
    "barrier": lambda group=None, **_: ["barrier", _ranks(group), -1, [], ""],
    "new_group": lambda ranks=None, **_: ["new_group", sorted(ranks or []), -1, [], ""],
}


def _tap(name: str) -> None:
    original = getattr(dist, name)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        if not rank:
            rank.append(dist.get_rank())
        calls.append(RECORDS[name](*args, **kwargs))
        return original(*args, **kwargs)

    setattr(dist, name, recorded)


def main() -> None:
    out, train, rest = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    for name in RECORDS:     # before the program imports anything that binds them (backends.compression)
        _tap(name)
    sys.argv = [train, *rest]
    try:
        runpy.run_path(train, run_name="__main__")
    finally:
        if rank:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{rank[0]}.json").write_text(json.dumps(calls))


if __name__ == "__main__":
    main()
