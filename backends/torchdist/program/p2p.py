"""Point-to-point between pipeline stages: non-blocking sends, blocking receives, message tags.

Each value travels in the wire format of its edge's codec (activations.py: the plan's activation
compressor and its settings); both ends derive it from the value's traced shape and dtype, so no
handshake precedes a message.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from passes.comm.events import message_tag
from planner.core.errors import HetplanError

from . import activations


class PeerLost(HetplanError):
    """A message from another rank did not come within the process group's timeout: it hung or died."""

    exit_code = 1


# a message tag unique per (micro-batch, value, direction) within one step: the verifier's own formula, so
# the tags the program sends with are the ones passes.comm proved to match
tag = message_tag


class P2P:
    """Non-blocking sends (kept alive until `wait_sends`) and blocking receives.

    `bytes_sent` counts wire bytes; `recv_wait_s` the time blocked in receives (waiting, not computing).
    """

    def __init__(self) -> None:
        self._pending: list[tuple[dist.Work | None, torch.Tensor]] = []
        self.bytes_sent = 0
        self.recv_wait_s = 0.0

    def reset_counters(self) -> None:
        """Start a step's byte count (the wait time keeps accumulating: the slow-down clock reads it)."""
        self.bytes_sent = 0

    def send(self, tensor: torch.Tensor, dst: int, message_tag: int, *, dtype: torch.dtype | None = None,
             codec: activations.Codec = activations.NO_CODEC) -> None:
        """Send `tensor` (traced dtype `dtype`, default its own) encoded by `codec`."""
        buf = activations.encode(codec, tensor, dtype or tensor.dtype)
        self._pending.append((dist.isend(buf, dst, tag=message_tag), buf))
        self.bytes_sent += buf.numel() * buf.element_size()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, message_tag: int,
             device: torch.device, *, codec: activations.Codec = activations.NO_CODEC) -> torch.Tensor:
        """Receive a value of traced `shape` and `dtype` sent with the same `codec`."""
        fmt = activations.wire_format(codec, shape, dtype)
        buf = torch.empty(fmt.shape, dtype=fmt.dtype, device=device)
        start_s = time.perf_counter()
        work = dist.irecv(buf, src, tag=message_tag)
        try:
            if work is not None:      # None only for a rank outside the group
                work.wait()
        except RuntimeError as exc:   # gloo: a timeout, or the peer's connection closed
            first = (str(exc).strip().splitlines() or [""])[0]
            raise PeerLost(f"rank {dist.get_rank()}: no message from rank {src} after "
                           f"{time.perf_counter() - start_s:.0f} s ({first[-200:]})",
                           fix=f"rank {src} hung or died: see its log") from exc
        self.recv_wait_s += time.perf_counter() - start_s
        return activations.decode(codec, buf, shape, dtype)

    def wait_sends(self) -> None:
        """Wait for every pending send of the step (their buffers stay alive until then)."""
        for work, _ in self._pending:
            if work is not None:
                work.wait()
        self._pending.clear()
