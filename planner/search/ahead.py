"""Each variant's configurations and CP-SAT items built ahead, on one worker thread, while the search
solves the variant before it.

CP-SAT releases the interpreter lock while it solves (single-threaded, planner.search.solver), so on a
host with two cores one thread solves a variant's model while the other builds the next variant's
configurations (planner.search.configs) and Pareto items (planner.search.ilp): pure Python that used to
wait for the solve. What is built is exactly what the sequential search builds, in the order it asks,
so the plan is the same; a variant the search then prunes without its configurations costs the worker
time it would otherwise have spent idle. At 1024 GPUs the solves (2.3 s) and the builds (2.7 s) of eight
variants overlap almost whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from costmodel.tables import CostTables
from planner.search import ilp
from planner.search.candidates import Config


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


@contextmanager
def built_ahead(tables: Sequence[CostTables], make_configs: Callable[[CostTables], list[Config]],
                with_items: bool) -> Iterator[list[Future[Built]]]:
    """One future per tables, in order, built one after another on a worker thread. On leaving, builds not
    yet started are cancelled and the one under way is waited for (no thread outlives the search)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetplan-build")
    try:
        yield [pool.submit(build, t, make_configs, with_items) for t in tables]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
