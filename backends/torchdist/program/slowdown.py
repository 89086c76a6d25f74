"""Emulated slow devices: a stage with `slowdown` s > 1 (spec `slowdown`) pads each compute step to s
times its measured time, so heterogeneity is real on one machine.

Only the compute is padded: time blocked on incoming messages is not slowed down. The padding is busy,
not asleep: an emulated slow device does s times the work, keeping its share of the host's cores for
all of it as a real device stays busy; asleep, it would hand that share to the other emulated devices
and make their speed depend on its schedule.

The factor may change from step to step (`begin_step`): `drift(step)` multiplies the planned one, as an
injected `slow:DEVICE=FACTOR@STEP` fault does (faults.Faults.slowdown), so a device can slow down in the
middle of a run. Each step also counts the rank's compute seconds, padding included (`step_compute_s`):
what the device spent computing, the figure rebalancing (rebalance.py) compares replicas by; and the wall
seconds the same compute took (`step_compute_wall_s`: on a CPU host shared by more processes than cores,
more than its CPU seconds). Both go into the step's metrics line, beside the plan's `busy_s` of the rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from .p2p import P2P


def no_drift(step: int) -> float:
    """The planned speed at every step."""
    return 1.0


class Slowdown:
    """Pads the compute of one rank by `planned` times `drift(step)` (1.0: nothing)."""

    def __init__(self, planned: float, device: torch.device, p2p: P2P,
                 drift: Callable[[int], float] = no_drift) -> None:
        self.planned, self.device, self.p2p, self.drift = planned, device, p2p, drift
        self.factor = planned
        self.step_compute_s = 0.0
        self.step_compute_wall_s = 0.0

    def begin_step(self, step: int) -> None:
        """Take step `step`'s factor and start counting its compute anew."""
        self.factor = self.planned * self.drift(step)
        self.step_compute_s = 0.0
        self.step_compute_wall_s = 0.0

    def work_clock(self) -> float:
        """Seconds of this rank's own work: CPU seconds on a CPU device (a blocked receive costs none, and
        a time slice lost to another process is not counted, so the padding does not multiply it); wall
        seconds less the time blocked in receives elsewhere."""
        if self.device.type == "cpu":
            return time.process_time()
        return time.perf_counter() - self.p2p.recv_wait_s

    @contextlib.contextmanager
    def padded(self) -> Iterator[None]:
        """Run the body, then stay busy for (factor - 1) times the work it did; count both."""
        start_s, start_wall_s = self.work_clock(), time.perf_counter()
        yield
        if self.factor > 1.0:
            work_s = self.work_clock() - start_s
            end_s = self.work_clock() + work_s * (self.factor - 1.0)
            while self.work_clock() < end_s:
                pass
        self.step_compute_s += self.work_clock() - start_s
        self.step_compute_wall_s += time.perf_counter() - start_wall_s
