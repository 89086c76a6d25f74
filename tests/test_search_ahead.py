"""The variants' configurations and items built ahead on a worker thread and in a forked child
(planner.search.ahead): the same as built in turn, and no thread or process left behind."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import pytest

from planner.core.forked import can_fork
from planner.search import ahead, degrees, ilp
from planner.search.configs import build_configs
from planner.search.options import SearchOptions
from tests.test_degrees import instance


def _children() -> set[int]:
    """This process's child processes (zombies included), from /proc."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:                          # gone meanwhile
            continue
        if int(fields[1]) == os.getpid():
            out.add(int(stat.parent.name))
    return out


def variant_tables() -> list:
    """The variants' tables of the first random instance of the degree tests with three or more."""
    for seed in range(24):
        found = [at for _, _, at in degrees.variant_tables(instance(seed), SearchOptions())]
        if len(found) >= 3:
            return found
    raise AssertionError("no instance has three variants")


@pytest.mark.parametrize("fork", [True, False])
def test_builds_ahead_equal_the_builds_in_turn_and_leave_no_thread(fork: bool) -> None:
    variants = variant_tables()
    before, children = threading.active_count(), _children()
    with ahead.built_ahead(variants, build_configs, with_items=True, fork=fork) as builds:
        got = [f.result() for f in builds]
    assert threading.active_count() == before
    assert _children() == children              # the child that built the later variants is reaped
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


@pytest.mark.skipif(not can_fork(), reason="fork, or a second core, is missing here")
def test_the_later_variants_are_built_in_another_process() -> None:
    variants = variant_tables()
    parent = os.getpid()

    def recorded(at):        # each configuration carries its builder's pid (less this one's) in a field
        return [dataclasses.replace(c, optimizer_s=c.optimizer_s + os.getpid() - parent) for c in build_configs(at)]

    with ahead.built_ahead(variants, recorded, with_items=False) as builds:
        got = [f.result() for f in builds]
    builders = [round(b.configs[0].optimizer_s - build_configs(at)[0].optimizer_s) for b, at in zip(got, variants)]
    head = (len(variants) + 2) // 3
    assert builders[:head] == [0] * head                        # the worker thread, in this process
    assert 0 not in builders[head:] and len(set(builders[head:])) == 1    # one child built all the rest
