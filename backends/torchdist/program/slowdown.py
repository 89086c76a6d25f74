"""Emulated slow devices: a stage with `slowdown` s > 1 (spec `slowdown`) pads each compute step to s
times its measured time, so heterogeneity is real on one machine.

Only the compute is padded: time blocked on incoming messages is not slowed down. The padding is busy,
not asleep: an emulated slow device does s times the work, keeping its share of the host's cores for
all of it as a real device stays busy; asleep, it would hand that share to the other emulated devices
and make their speed depend on its schedule.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from .p2p import P2P


class Slowdown:
    """Pads the compute of one rank by `factor` (1.0: nothing)."""

    def __init__(self, factor: float, device: torch.device, p2p: P2P) -> None:
        self.factor, self.device, self.p2p = factor, device, p2p

    def work_clock(self) -> float:
        """Seconds of this rank's own work: CPU seconds on a CPU device (a blocked receive costs none, and
        a time slice lost to another process is not counted, so the padding does not multiply it); wall
        seconds less the time blocked in receives elsewhere."""
        if self.device.type == "cpu":
            return time.process_time()
        return time.perf_counter() - self.p2p.recv_wait_s

    @contextlib.contextmanager
    def padded(self) -> Iterator[None]:
        """Run the body, then stay busy for (factor - 1) times the work it did."""
        start_s = self.work_clock()
        yield
        if self.factor > 1.0:
            work_s = self.work_clock() - start_s
            end_s = self.work_clock() + work_s * (self.factor - 1.0)
            while self.work_clock() < end_s:
                pass
