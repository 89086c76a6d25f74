"""Each variant's configurations and CP-SAT items built ahead, on one worker thread and, on a host with a
spare core, in a forked child, while the search solves the variant before it.

CP-SAT releases the interpreter lock while it solves (single-threaded, planner.search.solver), so on a
host with two cores one thread solves a variant's model while the other builds the next variant's
configurations (planner.search.configs) and Pareto items (planner.search.ilp): pure Python that used to
wait for the solve. What is built is exactly what the sequential search builds, in the order it asks,
so the plan is the same; a variant the search then prunes without its configurations costs the worker
time it would otherwise have spent idle. At 1024 GPUs the solves (2.3 s) and the builds (2.7 s) of eight
variants overlap almost whole.

Once the search bounds most variants without solving them (planner.search.bounds.sync_bound_s), their
builds are what it waits for: the thread builds the first third of the variants in turn (the likeliest
winners, asked for first), and a forked child (core.forked) the other two thirds, sent back pickled at
once; they are there when the search reaches them. Both build at a lower priority than the solve, which
waits on neither. At 1024 GPUs the search took 4.1 s before, 3.1 s after (with the sync bound). Where the
host cannot fork, or the caller must not, the thread builds them all.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from costmodel.tables import CostTables
from planner.core.forked import Child, can_fork, forked
from planner.search import ilp
from planner.search.candidates import Config

BUILD_NICENESS = 10      # builds yield a core to the solve (CP-SAT, on the search's thread), which waits on none
CHILD_WAIT_S = 600.0     # a child silent this long is killed and its builds made here (core.forked)


@dataclass(frozen=True)
class Built:
    """A variant's configurations, its items (None where the search solves without them) and the worker's
    seconds for each."""

    configs: list[Config]
    items: list[ilp.Item] | None
    configs_s: float
    items_s: float


def build(tables: CostTables, make_configs: Callable[[CostTables], list[Config]], with_items: bool) -> Built:
    """What the search needs of one variant before it solves it."""
    t0 = time.perf_counter()
    configs = make_configs(tables)
    t1 = time.perf_counter()
    items = ilp.pareto_items(tables, configs) if with_items and configs else None
    return Built(configs, items, t1 - t0, time.perf_counter() - t1)


class Pending(Protocol):
    """A build under way (a thread's future, or one of the child's)."""

    def result(self) -> Built: ...

    def cancel(self) -> bool: ...


@contextmanager
def built_ahead(tables: Sequence[CostTables], make_configs: Callable[[CostTables], list[Config]],
                with_items: bool, fork: bool = True) -> Iterator[list[Pending]]:
    """One pending build per tables, in order: the first third built one after another on a worker thread,
    the rest in a forked child (`fork` and a spare core; else the thread builds all). On leaving, builds
    not yet started are cancelled, the one under way is waited for and a child still building is killed
    (no thread or process outlives the search)."""
    head = (len(tables) + 2) // 3 if fork and can_fork() else len(tables)
    tail = list(tables[head:])

    def build_tail() -> list[Built]:
        return [build(t, make_configs, with_items) for t in tail]

    with forked(build_tail, enabled=bool(tail), niceness=BUILD_NICENESS) as child:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetplan-build")
        try:
            from_child = _FromChild(child)
            pool.submit(_lower_priority)
            yield [*(pool.submit(build, t, make_configs, with_items) for t in tables[:head]),
                   *(_ChildBuild(from_child, i) for i in range(len(tail)))]
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


class _FromChild:
    """The child's builds, taken once."""

    def __init__(self, child: Child[list[Built]]) -> None:
        self._child = child
        self._built: list[Built] | None = None

    def get(self, i: int) -> Built:
        if self._built is None:
            self._built = self._child.result(CHILD_WAIT_S)
        return self._built[i]


class _ChildBuild:
    """The child's i-th build (cancel: the child builds on; leaving built_ahead stops it)."""

    def __init__(self, builds: _FromChild, i: int) -> None:
        self._builds, self._i = builds, i

    def result(self) -> Built:
        return self._builds.get(self._i)

    def cancel(self) -> bool:
        return False


def _lower_priority() -> None:
    """The worker thread's own scheduling priority lowered (Linux gives each thread its own)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + BUILD_NICENESS)
    except (AttributeError, OSError):    # elsewhere, or not allowed: the same builds, at the same priority
        pass
