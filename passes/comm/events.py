"""One rank's communication as data: `CommEvent`s in the order the program issues them, their text form
(`1F3 send >2 tag 9 float32[4,16] none`) and a digest of a stream.

Kinds, with the semantics of the program on gloo (sends are `isend`, everything else blocks):

  send        post a message to `peer`; returns at once
  recv        wait until `peer` posted its next message to this rank; it must be this one (same tag,
              shape, dtype, codec): messages between two ranks match in the order both issue them, as
              NCCL matches them, so an order gloo's tags would forgive is refused too
  wait        wait until every message this rank posted was received (the step's `wait_sends`)
  collective  wait until every member of the group reached its next collective on the group; all of
              them must issue the same one (op, members, shape, dtype)
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

SEND, RECV, WAIT, COLLECTIVE = "send", "recv", "wait", "collective"
KINDS = (SEND, RECV, WAIT, COLLECTIVE)
WORLD = "world"
DIGEST_CHARS = 16          # 64 bits: this guards against a derivation that drifted, not an adversary


def message_tag(micro: int, value_index: int, backward: bool, num_values: int) -> int:
    """A message tag unique per (micro-batch, value, direction) within one step (the program's p2p.tag is
    this function)."""
    return (micro % 2048) * 2 * max(num_values, 1) + 2 * value_index + int(backward)


class CommEvent(NamedTuple):
    """One communication call of one rank; fields a kind does not use keep their defaults. (A named
    tuple, not a dataclass: a 1024-rank plan derives some 10^6 of them, and tuples build 4x faster.)"""

    kind: str                         # send | recv | wait | collective
    rank: int
    label: str                        # what the program does: a schedule action `1F3`, `sync`, `loss`
    peer: int = -1                    # send / recv: the other rank
    tag: int = -1                     # send / recv
    codec: str = ""                   # send / recv: the edge's activation codec (`none`, `fp16`, `int8/64`)
    group: str = ""                   # collective: the process group, `world` or `grad<i>`
    members: tuple[int, ...] = ()     # collective: the group's ranks
    op: str = ""                      # collective: all_reduce, barrier, new_group grad<i>, a compressor
    shape: tuple[int, ...] = ()       # the value's traced shape (p2p), the payload's (collective)
    dtype: str = ""
    nbytes: int = 0                   # the value's bytes before its codec; a collective's payload

    def signature(self) -> tuple[object, ...]:
        """What both ends of a message, or all members of a collective, must agree on."""
        if self.kind == COLLECTIVE:
            return (self.group, self.members, self.op, self.shape, self.dtype, self.nbytes)
        return (self.tag, self.codec, self.shape, self.dtype, self.nbytes)

    def text(self) -> str:
        """The event in one line, without its rank (the stream's): also what the digest hashes."""
        payload = payload_text(self.dtype, self.shape)
        if self.kind == SEND:
            return f"{self.label} send >{self.peer} tag {self.tag} {payload} {self.codec}"
        if self.kind == RECV:
            return f"{self.label} recv <{self.peer} tag {self.tag} {payload} {self.codec}"
        if self.kind == WAIT:
            return f"{self.label} wait sends"
        return f"{self.label} {self.op} {self.group}{{{ranks_text(self.members)}}} {payload}"

    def cell(self) -> str:
        """A few characters for the rank x step grid: `1F3 >2`, `0B1 <1`, `loss world`."""
        if self.kind == SEND:
            return f"{self.label} >{self.peer}"
        if self.kind == RECV:
            return f"{self.label} <{self.peer}"
        if self.kind == WAIT:
            return f"{self.label} wait"
        return f"{self.label} {self.group}"


@functools.lru_cache(maxsize=4096)     # a plan has few value shapes, each sent thousands of times
def payload_text(dtype: str, shape: tuple[int, ...]) -> str:
    """A value's dtype and shape as the text form writes them: `float32[4,16]`."""
    return f"{dtype}[{','.join(map(str, shape))}]"


@functools.lru_cache(maxsize=4096)     # a plan has few groups, each named in every member's stream
def ranks_text(ranks: tuple[int, ...]) -> str:
    """Ranks in short: runs of consecutive ranks as `a-b` (`0-3,8,12-15`)."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)


def stream_text(events: Iterable[CommEvent]) -> str:
    return "\n".join(e.text() for e in events)


def section_text(name: str, events: Sequence[CommEvent]) -> str:
    """One section of what a digest hashes: a stream under its name."""
    return f"# {name}\n{stream_text(events)}\n"


def digest(sections: Iterable[tuple[str, Sequence[CommEvent]]]) -> str:
    """The digest of one rank's streams, each under its name (one per run variant)."""
    h = hashlib.sha256()
    for name, events in sections:
        h.update(section_text(name, events).encode())
    return h.hexdigest()[:DIGEST_CHARS]
