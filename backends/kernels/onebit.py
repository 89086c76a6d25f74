"""Kernels of 1-bit Adam's compressed all-reduce: error feedback, sign packing, unpack + average.

One worker's step (Tang et al., "1-bit Adam", 2021), for a gradient bucket g of n elements:

    y, ||y||^2       = add_error_and_sqnorm(g, err)        # y = g + err
    scale            = ||y||_2 / sqrt(n)
    packed, err      = sign_pack(y, scale)                 # 1 bit per element, new error
    ... all-gather `packed` and `scale` from k workers ...
    avg              = unpack_average(packed[k], scales[k], n)

Conventions shared by kernel and reference:
  * sign(v) = +1 for v >= 0 (zero included) and -1 otherwise (NaN counts as negative);
  * bit i of the packed stream is bit (i % 8) of byte i // 8 (little-endian within a
    byte); a bit is set iff y_i >= 0; the bits past n in the last byte are zero;
  * new_err = y - scale * sign(y), so y == scale * sign(y) + new_err up to one rounding.

Each entry point checks shapes, allocates, then launches the Triton kernel (CUDA, or
the CPU interpreter, see `_triton.py`; float32 only) or runs the torch reference
`*_ref` (any floating dtype, float64 included). Partial sums of squares are reduced on
the host side by torch, so no atomics are needed and the result is deterministic.
"""

from __future__ import annotations

import torch

from backends.kernels._triton import HAS_TRITON, Impl, cdiv, tl, triton, use_triton

ELEMENTWISE_BLOCK = 1024
"""Elements per program of the elementwise kernels (a power of two)."""
PACK_BLOCK_BYTES = 128
"""Packed bytes per program of `sign_pack` (8x as many elements)."""
BITS_PER_BYTE = 8


def packed_nbytes(n: int) -> int:
    """Bytes that hold n signs, 8 per byte (the last one zero-padded)."""
    return cdiv(n, BITS_PER_BYTE)


def _check_flat(name: str, t: torch.Tensor) -> None:
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")


def _as_scale(scale: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """`scale` as a one-element tensor on `like`'s device and dtype (no host sync for tensors)."""
    out = torch.as_tensor(scale, device=like.device, dtype=like.dtype).reshape(1)
    if out.numel() != 1:
        raise ValueError(f"scale must hold one number, got shape {tuple(out.shape)}")
    return out


# ----------------------------------------------------------------------------- references

def add_error_and_sqnorm_ref(x: torch.Tensor, err: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `add_error_and_sqnorm`: y = x + err and sum(y^2) (0-d, in y's dtype)."""
    y = x + err
    return y, (y * y).sum()


def sign_pack_ref(y: torch.Tensor, scale: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `sign_pack`: (packed uint8 signs, y - scale * sign(y))."""
    s = _as_scale(scale, y)
    positive = y >= 0
    sign = torch.where(positive, 1.0, -1.0).to(y.dtype)
    new_err = y - s * sign
    pad = packed_nbytes(y.numel()) * BITS_PER_BYTE - y.numel()
    bits = torch.nn.functional.pad(positive.to(torch.uint8), (0, pad)).view(-1, BITS_PER_BYTE)
    weights = torch.arange(BITS_PER_BYTE, device=y.device, dtype=torch.uint8)
    packed = (bits << weights).sum(dim=1).to(torch.uint8)
    return packed, new_err


def unpack_signs_ref(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Decode packed signs [..., nbytes] to +1/-1 float32 [..., n]."""
    weights = torch.arange(BITS_PER_BYTE, device=packed.device, dtype=torch.uint8)
    bits = (packed.unsqueeze(-1) >> weights) & 1
    bits = bits.reshape(*packed.shape[:-1], -1)[..., :n]
    return bits.to(torch.float32) * 2.0 - 1.0


def unpack_average_ref(packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """Reference of `unpack_average`: mean over workers of scales[w] * signs[w] (float32).

    Workers are summed in order 0..k-1 and the sum divided by k, exactly as the kernel does.
    """
    signs = unpack_signs_ref(packed, n)
    acc = torch.zeros(n, device=packed.device, dtype=torch.float32)
    for w in range(packed.shape[0]):
        acc = acc + scales[w].to(torch.float32) * signs[w]
    return acc / packed.shape[0]


# ----------------------------------------------------------------------------- kernels

if HAS_TRITON:

    @triton.jit
    def _add_error_sqnorm_kernel(x_ptr, err_ptr, y_ptr, partial_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        e = tl.load(err_ptr + offs, mask=mask, other=0.0)
        y = x + e
        tl.store(y_ptr + offs, y, mask=mask)
        # Masked lanes hold 0 + 0, so they add nothing to the partial sum.
        tl.store(partial_ptr + pid, tl.sum(y * y, axis=0))

    @triton.jit
    def _sign_pack_kernel(y_ptr, scale_ptr, packed_ptr, err_ptr, n, nbytes,
                          BLOCK_BYTES: tl.constexpr):
        pid = tl.program_id(0)
        byte_offs = pid.to(tl.int64) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
        bit = tl.arange(0, 8)
        offs = byte_offs[:, None] * 8 + bit[None, :]          # [BLOCK_BYTES, 8] elements
        mask = offs < n
        y = tl.load(y_ptr + offs, mask=mask, other=-1.0)       # padding decodes as bit 0
        scale = tl.load(scale_ptr)
        positive = y >= 0.0
        bits = tl.where(positive & mask, 1, 0) << bit[None, :]
        packed = tl.sum(bits, axis=1)
        tl.store(packed_ptr + byte_offs, packed.to(tl.uint8), mask=byte_offs < nbytes)
        sign = tl.where(positive, 1.0, -1.0)
        tl.store(err_ptr + offs, y - scale * sign, mask=mask)

    @triton.jit
    def _unpack_average_kernel(packed_ptr, scales_ptr, out_ptr, n, nbytes, workers,
                               BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        byte_idx = offs // 8
        shift = (offs % 8).to(tl.int32)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for w in range(workers):
            byte = tl.load(packed_ptr + w * nbytes + byte_idx, mask=mask, other=0).to(tl.int32)
            sign = ((byte >> shift) & 1).to(tl.float32) * 2.0 - 1.0
            acc += tl.load(scales_ptr + w) * sign
        tl.store(out_ptr + offs, acc / workers, mask=mask)


# ----------------------------------------------------------------------------- entry points

def add_error_and_sqnorm(x: torch.Tensor, err: torch.Tensor, *,
                         impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Fused error feedback: y = x + err, and ||y||^2 as a 0-d tensor (no host sync).

    The kernel writes one partial sum of squares per program; torch adds them up.
    """
    _check_flat("x", x)
    _check_flat("err", err)
    if err.shape != x.shape or err.dtype != x.dtype or err.device != x.device:
        raise ValueError(f"err must match x: {tuple(err.shape)}/{err.dtype}/{err.device} vs "
                         f"{tuple(x.shape)}/{x.dtype}/{x.device}")
    if not use_triton(x, impl, supported=x.dtype == torch.float32):
        return add_error_and_sqnorm_ref(x, err)
    n = x.numel()
    grid = cdiv(n, ELEMENTWISE_BLOCK)
    y = torch.empty_like(x)
    partials = torch.zeros(max(grid, 1), device=x.device, dtype=torch.float32)
    if n:
        _add_error_sqnorm_kernel[(grid,)](x, err, y, partials, n, BLOCK=ELEMENTWISE_BLOCK)
    return y, partials.sum()


def sign_pack(y: torch.Tensor, scale: torch.Tensor | float, *,
              impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Pack sign(y) to bits and return the compression error.

    Returns (packed uint8 [ceil(n/8)], new_err = y - scale * sign(y) in y's dtype). `scale`
    may be a one-element tensor (kept on the device, so no host sync) or a float.
    """
    _check_flat("y", y)
    if not use_triton(y, impl, supported=y.dtype == torch.float32):
        return sign_pack_ref(y, scale)
    n = y.numel()
    nbytes = packed_nbytes(n)
    s = _as_scale(scale, y)
    packed = torch.empty(nbytes, device=y.device, dtype=torch.uint8)
    new_err = torch.empty_like(y)
    if n:
        grid = (cdiv(nbytes, PACK_BLOCK_BYTES),)
        _sign_pack_kernel[grid](y, s, packed, new_err, n, nbytes, BLOCK_BYTES=PACK_BLOCK_BYTES)
    return packed, new_err


def unpack_average(packed: torch.Tensor, scales: torch.Tensor, n: int, *,
                   impl: Impl = "auto") -> torch.Tensor:
    """Decode k workers' packed signs and average them: out = mean_w scales[w] * sign_w (float32).

    `packed` is [k, ceil(n/8)] uint8 (e.g. the output of an all-gather), `scales` is [k].
    """
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a [k, nbytes] uint8 tensor, got {tuple(packed.shape)} "
                         f"{packed.dtype}")
    workers, nbytes = packed.shape
    if nbytes != packed_nbytes(n):
        raise ValueError(f"{n} signs need {packed_nbytes(n)} bytes per worker, got {nbytes}")
    if scales.shape != (workers,):
        raise ValueError(f"scales must have shape ({workers},), got {tuple(scales.shape)}")
    if workers == 0:
        raise ValueError("unpack_average needs at least one worker")
    if not use_triton(packed, impl, supported=scales.dtype == torch.float32):
        return unpack_average_ref(packed, scales, n)
    packed = packed.contiguous()
    scales = scales.contiguous()
    out = torch.empty(n, device=packed.device, dtype=torch.float32)
    if n:
        grid = (cdiv(n, ELEMENTWISE_BLOCK),)
        _unpack_average_kernel[grid](packed, scales, out, n, nbytes, workers,
                                          BLOCK=ELEMENTWISE_BLOCK)
    return out
