"""Optional Triton, and the one rule that picks Triton kernel or torch reference.

Triton is an optional dependency (`pip install hetplan[kernels]`): this module imports
without it, and every kernel in the package then runs its pure-torch reference.

CPU interpreter: `TRITON_INTERPRET=1` must be set *before triton is first imported*.
triton decides per `@triton.jit` function, at decoration time, whether it is compiled or
interpreted, and its own library functions (`tl.sum`, `tl.max`, ...) are decorated when
`triton.language` is imported; setting the variable later leaves those compiled-mode
and the interpreter fails ("Cannot call @triton.jit'd outside of the scope of a kernel").
So the mode is read once, here, when triton is imported, and `INTERPRETED` records it.
"""

from __future__ import annotations

import os
from typing import Literal

import torch


def _env_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


try:  # Triton is optional: without it every kernel runs its torch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

Impl = Literal["auto", "triton", "torch"]
"""Which implementation a kernel entry point runs: `auto` follows `use_triton`."""

HAS_TRITON: bool = triton is not None


def _library_interpreted() -> bool:
    """Whether triton's own jit functions were decorated for the interpreter (at its import)."""
    return HAS_TRITON and type(tl.sum).__name__ == "InterpretedFunction"


INTERPRETED: bool = HAS_TRITON and _env_interpret() and _library_interpreted()
"""Whether this process's Triton kernels run in the CPU interpreter (fixed at import): the
variable is set now and was set when triton was imported (else kernels cannot run on CPU)."""


def use_triton(tensor: torch.Tensor, impl: Impl = "auto", *, supported: bool = True) -> bool:
    """Whether a kernel entry point launches its Triton kernel for `tensor`.

    `auto`: Triton when it imports and either the tensor is on CUDA (compiled kernels) or
    the CPU interpreter is on (`INTERPRETED`), and the kernel `supported` the input
    (e.g. its dtype); otherwise the torch reference. `triton`: Triton, or an error saying
    why not. `torch`: always the reference.
    """
    if impl == "torch":
        return False
    if impl not in ("auto", "triton"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', not {impl!r}")
    runnable = HAS_TRITON and (INTERPRETED or tensor.is_cuda)
    if impl == "auto":
        return runnable and supported
    if not runnable:
        raise RuntimeError(
            "impl='triton' needs triton installed and a CUDA tensor, or TRITON_INTERPRET=1 set "
            f"before triton is imported (triton installed: {HAS_TRITON}, interpreter: "
            f"{INTERPRETED}, device: {tensor.device})")
    if not supported:
        raise TypeError(f"the Triton kernel does not support dtype {tensor.dtype}")
    return True


def cdiv(a: int, b: int) -> int:
    """Ceiling division for grid sizes."""
    return -(-a // b)
