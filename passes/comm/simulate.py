"""Run every rank's stream to completion under the program's semantics (passes.comm.events) and refuse
what would hang or mismatch: a message received in another position than it was sent, a recv of another
shape, dtype, tag or codec than its send, members of a group issuing different collectives or in another
order, a rank issuing a collective of a group it is not in, a cycle of waits, a rank waiting for one that
has finished, a message nobody receives. Every error names the ranks and shows the rank x step grid
around the stall (`format_grid`).

Each rank runs until it blocks; a send, a receipt or a completed collective wakes the ranks it may
unblock. Work is linear in the number of events (collectives: in members per arrival); the opening
collectives every rank issues alike over all ranks (the set-up) are settled at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from passes.comm.events import COLLECTIVE, KINDS, RECV, SEND, WAIT, CommEvent
from planner.core.errors import PassError

Streams = Sequence[Sequence[CommEvent]]
GRID_CONTEXT = 3           # events shown either side of where a rank stopped
GRID_RANKS = 8             # rows shown at most
NAMED_RANKS = 8            # ranks named in a message at most


def check_streams(streams: Streams, what: str = "") -> None:
    """Raise PassError unless `streams` (index = rank) run to completion with every message and
    collective matched; `what` names the streams in messages (a run variant)."""
    _Run(streams, f" ({what})" if what else "").run()


class _Run:
    def __init__(self, streams: Streams, what: str) -> None:
        self.streams, self.what = streams, what
        self.n = len(streams)
        self.pos = [0] * self.n
        self.mailbox: dict[tuple[int, int], deque[int]] = {}       # (src, dst) -> positions of src's sends
        self.unreceived = [0] * self.n
        self.entered: dict[tuple[int, str], int] = {}              # (rank, group) -> collectives entered
        self.arrivals: dict[tuple[str, int], list[tuple[int, int]]] = {}   # (group, k) -> (rank, position)
        self.at: dict[int, tuple[str, int]] = {}                   # rank -> the collective it waits in
        self.member_sets: dict[int, tuple[tuple[int, ...], frozenset[int]]] = {}
        self.queue = deque(range(self.n))
        self.queued = [True] * self.n

    def run(self) -> None:
        for r, stream in enumerate(self.streams):
            for i, e in enumerate(stream):
                if e.rank != r or e.kind not in KINDS:
                    raise PassError(f"event {i} of rank {r}'s stream is `{e.kind}` of rank {e.rank}",
                                    fix="report this plan")
        self._settle_opening()
        while self.queue:
            r = self.queue.popleft()
            self.queued[r] = False
            self._advance(r)
        if any(p < len(s) for p, s in zip(self.pos, self.streams)):
            self._stalled()
        left = [(src, dst, box[0]) for (src, dst), box in sorted(self.mailbox.items()) if box]
        if left:
            src, dst, i = left[0]
            e = self.streams[src][i]
            raise PassError(f"unreceived messages{self.what}: rank {src} sends `{e.text()}` to rank {dst}, "
                            f"which never receives it ({len(left)} pair(s) left)\n"
                            + self.grid([(src, i), (dst, len(self.streams[dst]))]), fix="report this plan")

    def _settle_opening(self) -> None:
        """Complete at once the collectives every rank opens its stream with, the same on every rank and
        each over all ranks (the set-up: a group creation per group, in plan order). Each of them
        completes as soon as every rank reached it, so running them arrival by arrival would end in this
        very state: each rank past them, each group entered as often, nothing posted or waiting (and a
        1024-rank plan has some 10^5 such arrivals). A rank that differs ends the opening for all."""
        if not self.n or not self.streams[0]:
            return
        first = self.streams[0]
        everyone = frozenset(range(self.n))
        length = 0
        while (length < len(first) and first[length].kind == COLLECTIVE
               and self._members(first[length]) == everyone):
            length += 1
        expected = [e.signature() for e in first[:length]]
        for stream in self.streams[1:]:
            k, limit = 0, min(length, len(stream))
            while k < limit and stream[k].kind == COLLECTIVE and stream[k].signature() == expected[k]:
                k += 1
            length = k
            if not length:
                return
        entered: dict[str, int] = {}
        for e in first[:length]:
            entered[e.group] = entered.get(e.group, 0) + 1
        for r in range(self.n):
            self.pos[r] = length
            for group, k in entered.items():
                self.entered[r, group] = k

    def _wake(self, r: int) -> None:
        if not self.queued[r] and self.pos[r] < len(self.streams[r]):
            self.queued[r] = True
            self.queue.append(r)

    def _members(self, e: CommEvent) -> frozenset[int]:
        # by identity first: the derivation shares one tuple per group, and a 1024-rank tuple hashes slowly
        known = self.member_sets.get(id(e.members))
        if known is not None and known[0] is e.members:
            return known[1]
        found = frozenset(e.members)
        self.member_sets[id(e.members)] = (e.members, found)
        return found

    def _advance(self, r: int) -> None:
        # the hot loop of the verifier (10^6 events at 1024 ranks): position and tables held in locals
        streams, pos, mailbox, unreceived = self.streams, self.pos, self.mailbox, self.unreceived
        stream = streams[r]
        end = len(stream)
        i = pos[r]
        while i < end:
            e = stream[i]
            kind = e.kind
            if kind == SEND:
                peer = e.peer
                if not 0 <= peer < self.n or peer == r:
                    pos[r] = i
                    raise PassError(f"rank {r} sends `{e.text()}` to rank {peer}, which is not another rank "
                                    f"of the plan{self.what}\n" + self.grid([(r, i)]), fix="report this plan")
                box = mailbox.get((r, peer))
                if box is None:
                    box = mailbox[r, peer] = deque()
                box.append(i)
                unreceived[r] += 1
                i += 1
                self._wake(peer)
            elif kind == RECV:
                peer = e.peer
                box = mailbox.get((peer, r))
                if not box:
                    break
                j = box.popleft()
                sent = streams[peer][j]
                if (sent.tag != e.tag or sent.codec != e.codec or sent.shape != e.shape or sent.dtype != e.dtype
                        or sent.nbytes != e.nbytes):      # signature(): what both ends must agree on
                    pos[r] = i
                    raise PassError(
                        f"message mismatch{self.what}: rank {r} receives `{e.text()}` where rank {peer}'s "
                        f"next message to it is `{sent.text()}` (ranks {peer} and {r} must send and receive "
                        "in the same order, the same tag, shape and dtype)\n"
                        + self.grid([(peer, j), (r, i)]), fix="report this plan")
                unreceived[peer] -= 1
                if unreceived[peer] == 0:
                    self._wake(peer)
                i += 1
            elif kind == WAIT:
                if unreceived[r]:
                    break
                i += 1
            else:
                pos[r] = i
                if not self._collective(r, i, e):
                    return
                i = pos[r]
        pos[r] = i

    def _collective(self, r: int, i: int, e: CommEvent) -> bool:
        """Enter (once) the collective at position i; True when it completed, False while it waits."""
        members = self._members(e)
        if r not in members:
            raise PassError(f"rank {r} issues `{e.text()}` on a group it is not in{self.what}\n"
                            + self.grid([(r, i)]), fix="report this plan")
        if r not in self.at:
            k = self.entered.get((r, e.group), 0)
            self.entered[r, e.group] = k + 1
            arrived = self.arrivals.setdefault((e.group, k), [])
            if arrived:
                first_rank, first_i = arrived[0]
                first = self.streams[first_rank][first_i]
                if first.signature() != e.signature():
                    raise PassError(
                        f"collective mismatch{self.what}: rank {r} issues `{e.text()}` as collective {k} on "
                        f"{e.group} where rank {first_rank} issued `{first.text()}` (ranks {first_rank} and "
                        f"{r} must issue the same collectives on a group in the same order)\n"
                        + self.grid([(first_rank, first_i), (r, i)]), fix="report this plan")
            arrived.append((r, i))
            self.at[r] = (e.group, k)
        group, k = self.at[r]
        arrived = self.arrivals[group, k]
        if len(arrived) < len(members):
            return False
        del self.arrivals[group, k]
        for m, _ in arrived:
            del self.at[m]
            self.pos[m] += 1
            if m != r:
                self._wake(m)
        return True

    # ------------------------------------------------------------------ a stall: who waits for whom

    def _waits_for(self, r: int) -> tuple[list[int], str]:
        e = self.streams[r][self.pos[r]]
        if e.kind == RECV:
            return [e.peer], f"rank {r} waits at {e.label} for a message from rank {e.peer} (tag {e.tag})"
        if e.kind == WAIT:
            peers = sorted(dst for (src, dst), box in self.mailbox.items() if src == r and box)
            return peers, f"rank {r} waits at {e.label} until rank(s) {_names(peers)} receive its messages"
        group, k = self.at[r]
        arrived = {m for m, _ in self.arrivals[group, k]}
        missing = sorted(self._members(e) - arrived)
        return missing, f"rank {r} waits in {e.op} on {group} ({e.label}) for rank(s) {_names(missing)}"

    def _stalled(self) -> None:
        done = [p >= len(s) for p, s in zip(self.pos, self.streams)]
        waits = {r: self._waits_for(r) for r in range(self.n) if not done[r]}
        cycle = _find_cycle({r: [q for q in peers if not done[q]] for r, (peers, _) in waits.items()})
        if cycle:
            shown = cycle[:NAMED_RANKS]
            reasons = "; ".join(waits[r][1] for r in shown)
            head = (f"communication deadlock{self.what}: ranks {_names(cycle)} wait for each other in a cycle "
                    f"({' -> '.join(map(str, shown + [cycle[0]]))}): {reasons}")
            rows = cycle
        else:   # the waits end at ranks that have finished: what they wait for never comes
            stuck = [r for r, (peers, _) in waits.items() if any(done[q] for q in peers)] or sorted(waits)
            shown = stuck[:NAMED_RANKS]
            finished = sorted({q for r in shown for q in waits[r][0] if done[q]})
            reasons = "; ".join(waits[r][1] for r in shown)
            head = (f"communication stall{self.what}: rank(s) {_names(stuck)} wait for rank(s) {_names(finished)}, "
                    f"which finished their streams: {reasons}")
            rows = shown + finished
        raise PassError(head + "\n" + self.grid([(r, self.pos[r]) for r in rows[:GRID_RANKS]]),
                        fix="report this plan")

    # ------------------------------------------------------------------ the grid

    def grid(self, places: Iterable[tuple[int, int]]) -> str:
        return format_grid(self.streams, places)


def format_grid(streams: Streams, places: Iterable[tuple[int, int]]) -> str:
    """Rank x step grid: for each (rank, position) the events around it, the one at it in brackets
    (a position past the end: the rank finished)."""
    rows = []
    for r, i in places:
        stream = streams[r]
        start = max(0, i - GRID_CONTEXT)
        cells = [f"[{e.cell()}]" if k == i else f" {e.cell()} "
                 for k, e in enumerate(stream[start:i + GRID_CONTEXT + 1], start)]
        if i >= len(stream):
            cells.append("[done]")
        more = " ..." if i + GRID_CONTEXT + 1 < len(stream) else ""
        rows.append((f"rank {r} @{i}/{len(stream)}:", ("... " if start else "") + " ".join(cells) + more))
    width = max((len(h) for h, _ in rows), default=0)
    return "\n".join(f"{h.ljust(width)} {cells}" for h, cells in rows)


def _names(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:NAMED_RANKS]))
    return shown + (f" and {len(ranks) - NAMED_RANKS} more" if len(ranks) > NAMED_RANKS else "")


def _find_cycle(edges: dict[int, list[int]]) -> list[int]:
    """A cycle of the wait-for graph (ranks in order, from the first rank on it that the search from the
    lowest rank meets again), or []. Only a stalled check asks: networkx is imported here, not by every rank
    of the program that checks its streams at start (0.2 s of each rank's start-up)."""
    import networkx as nx

    graph = nx.DiGraph()
    graph.add_nodes_from(sorted(edges))
    graph.add_edges_from((r, q) for r in sorted(edges) for q in edges[r])
    try:
        return [r for r, _ in nx.find_cycle(graph, source=sorted(edges))]
    except nx.NetworkXNoCycle:
        return []
