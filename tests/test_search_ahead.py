"""The variants' configurations and items built ahead on a worker thread (planner.search.ahead): the
same as built in turn, and no thread left behind."""

from __future__ import annotations

import threading

from planner.search import ahead, degrees, ilp
from planner.search.configs import build_configs
from planner.search.options import SearchOptions
from tests.test_degrees import instance


def variant_tables() -> list:
    """The variants' tables of the first random instance of the degree tests with three or more."""
    for seed in range(24):
        found = [at for _, _, at in degrees.variant_tables(instance(seed), SearchOptions())]
        if len(found) >= 3:
            return found
    raise AssertionError("no instance has three variants")


def test_builds_ahead_equal_the_builds_in_turn_and_leave_no_thread() -> None:
    variants = variant_tables()
    before = threading.active_count()
    with ahead.built_ahead(variants, build_configs, with_items=True) as builds:
        got = [f.result() for f in builds]
    assert threading.active_count() == before
    for at, built in zip(variants, got):
        configs = build_configs(at)
        assert built.configs == configs
        assert built.items == ilp.pareto_items(at, configs)
        assert built.configs_s > 0 and built.items_s >= 0


def test_a_build_that_fails_raises_in_the_search_and_the_rest_are_cancelled() -> None:
    variants = variant_tables()
    calls: list[int] = []

    def failing(at):
        calls.append(1)
        raise ValueError("no configurations")

    before = threading.active_count()
    try:
        with ahead.built_ahead(variants, failing, with_items=False) as builds:
            builds[0].result()
    except ValueError as exc:
        assert "no configurations" in str(exc)
    else:
        raise AssertionError("the worker's error did not reach the caller")
    assert threading.active_count() == before
    assert 1 <= len(calls) <= len(variants)
