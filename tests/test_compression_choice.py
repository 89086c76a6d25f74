"""`--compression auto` under AdamW: 1-bit is 1-bit Adam, whose exact warm-up counts in its ranking."""

from __future__ import annotations

from costmodel import compression as c
from planner.core.cluster import Link

VECTOR = c.GradVolume(4 * (1 << 24), ((1 << 24,),))     # a 16M-element vector: PowerSGD does not apply
FAST_LINK = Link("ib", 400e9 / 8, 2e-5)
SLOW_LINK = Link("tcp", 10e9 / 8, 2e-5)
BANDWIDTH, LAUNCH_S = 1e12, 5e-6


def test_adamw_ranks_onebit_by_its_run_average():
    options = c.candidates("auto", VECTOR)
    costs = {o.name: c.gradient_cost(o, 8, FAST_LINK, BANDWIDTH, LAUNCH_S).time_s for o in options}
    assert c.best_gradient(options, 8, FAST_LINK, BANDWIDTH, LAUNCH_S, "sgd").name == "onebit"
    # a quarter of the steps at the exact all-reduce's cost makes 1-bit slower than fp16 on average
    average = c.ONEBIT_ADAM_WARMUP_FRACTION * costs["none"] + (1 - c.ONEBIT_ADAM_WARMUP_FRACTION) * costs["onebit"]
    assert costs["onebit"] < costs["fp16"] < average
    chosen = c.best_gradient(options, 8, FAST_LINK, BANDWIDTH, LAUNCH_S, "adamw")
    assert chosen.name == "fp16" and chosen.time_s == costs["fp16"]


def test_adamw_keeps_onebit_where_it_wins_over_the_run():
    options = c.candidates("auto", VECTOR)
    assert c.best_gradient(options, 8, SLOW_LINK, BANDWIDTH, LAUNCH_S, "adamw").name == "onebit"


def test_a_forced_method_is_not_second_guessed():
    options = c.candidates("onebit", VECTOR)
    assert c.best_gradient(options, 8, FAST_LINK, BANDWIDTH, LAUNCH_S, "adamw").name == "onebit"
