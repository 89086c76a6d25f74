"""Alpha-beta link costs: point-to-point and collectives, costed on the slowest link of a group."""

from __future__ import annotations

from planner.core.cluster import Link


def p2p_s(nbytes: float, link: Link) -> float:
    return link.transfer_s(nbytes)


def ring_allreduce_s(nbytes: float, ranks: int, link: Link) -> float:
    """Ring all-reduce: 2(n-1)/n of the buffer over the slowest link, 2(n-1) latency hops."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * link.latency_s + steps / ranks * nbytes / link.bandwidth_bytes_s


def hierarchical_allreduce_s(nbytes: float, nodes: int, per_node: int, intra: Link,
                             inter: Link) -> float:
    """Reduce-scatter inside nodes, all-reduce of the shards across nodes, all-gather inside."""
    if nodes <= 1:
        return ring_allreduce_s(nbytes, per_node, intra)
    inside = ring_allreduce_s(nbytes, per_node, intra)          # RS + AG inside, same volume
    across = ring_allreduce_s(nbytes / max(per_node, 1), nodes, inter)
    return inside + across
