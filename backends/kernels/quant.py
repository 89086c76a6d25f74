"""Block-wise symmetric int8 quantisation, for activations sent over slow pipeline links.

A flat tensor of n elements is cut into blocks of `block` consecutive elements (the
last one may be short). Per block b:

    scale_b = absmax_b / 127                      (float32; 0 for an all-zero block)
    q_i     = round_half_away(x_i / scale_b)      (int8 in [-127, 127]; 0 where scale_b = 0)
    x'_i    = q_i * scale_b                       (dequantised, |x_i - x'_i| <= scale_b / 2)

Rounding is half away from zero (floor(|v| + 0.5) with the sign of v), the same in the
kernel and the reference, so they agree bit for bit in IEEE arithmetic. Wire size:
n + 4 * ceil(n / block) bytes instead of 4n (fp32) or 2n (fp16/bf16).

Kernel inputs may be float32, float16 or bfloat16 (upcast to float32 in registers);
the quantise kernel runs one program per block, so `block` is capped at MAX_BLOCK.
"""

from __future__ import annotations

import torch

from backends.kernels._triton import HAS_TRITON, Impl, cdiv, tl, triton, use_triton

INT8_MAX = 127
"""Largest magnitude of the symmetric int8 code (-128 is not used)."""
MAX_BLOCK = 1 << 16
"""Largest quantisation block: one program holds a whole block in registers."""
DEQUANT_BLOCK = 1024
"""Elements per program of the dequantise kernel (a power of two)."""
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def num_blocks(n: int, block: int) -> int:
    """How many quantisation blocks (and scales) n elements need."""
    return cdiv(n, block)


def _check_block(block: int) -> None:
    if not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"block must be in [1, {MAX_BLOCK}], got {block}")


# ----------------------------------------------------------------------------- references

def quantize_int8_ref(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `quantize_int8`: (q int8 [n], scales float32 [ceil(n/block)])."""
    n = x.numel()
    blocks = num_blocks(n, block)
    padded = torch.nn.functional.pad(x.reshape(-1).to(torch.float32), (0, blocks * block - n))
    xb = padded.view(blocks, block)
    scales = xb.abs().amax(dim=1) / INT8_MAX
    denom = torch.where(scales > 0, scales, torch.ones_like(scales))
    v = xb / denom[:, None]
    r = torch.floor(v.abs() + 0.5).clamp_max(INT8_MAX)
    q = torch.where(v < 0, -r, r).to(torch.int8)
    return q.reshape(-1)[:n], scales


def dequantize_int8_ref(q: torch.Tensor, scales: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Reference of `dequantize_int8`: float32 [n] = q * scales[i // block]."""
    return q[:n].to(torch.float32) * scales.repeat_interleave(block)[:n]


# ----------------------------------------------------------------------------- kernels

if HAS_TRITON:

    @triton.jit
    def _quantize_int8_kernel(x_ptr, q_ptr, scale_ptr, n, block, BLOCK_P2: tl.constexpr):
        pid = tl.program_id(0)                                 # one program per block
        local = tl.arange(0, BLOCK_P2)
        offs = pid.to(tl.int64) * block + local
        mask = (local < block) & (offs < n)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.max(tl.abs(x), axis=0) / 127.0
        denom = tl.where(scale > 0.0, scale, 1.0)              # all-zero block: q = 0
        v = x / denom
        r = tl.minimum(tl.floor(tl.abs(v) + 0.5), 127.0)
        q = tl.where(v < 0.0, -r, r)
        tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + pid, scale)

    @triton.jit
    def _dequantize_int8_kernel(q_ptr, scale_ptr, out_ptr, n, block, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
        scale = tl.load(scale_ptr + offs // block, mask=mask, other=0.0)
        tl.store(out_ptr + offs, q * scale, mask=mask)


# ----------------------------------------------------------------------------- entry points

def quantize_int8(x: torch.Tensor, block: int, *,
                  impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise x (any shape, read flat) to int8 with one float32 absmax scale per block.

    Returns (q int8 [n], scales float32 [ceil(n/block)]).
    """
    _check_block(block)
    if not use_triton(x, impl, supported=x.dtype in KERNEL_DTYPES):
        return quantize_int8_ref(x, block)
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    blocks = num_blocks(n, block)
    q = torch.empty(n, device=x.device, dtype=torch.int8)
    scales = torch.empty(blocks, device=x.device, dtype=torch.float32)
    if n:
        block_p2 = 1 << (block - 1).bit_length()
        _quantize_int8_kernel[(blocks,)](flat, q, scales, n, block, BLOCK_P2=block_p2)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block: int, n: int, *,
                    impl: Impl = "auto") -> torch.Tensor:
    """Invert `quantize_int8`: float32 [n] = q[i] * scales[i // block]."""
    _check_block(block)
    if q.dim() != 1 or q.dtype != torch.int8 or q.numel() < n:
        raise ValueError(f"q must be a 1-D int8 tensor of at least {n} elements, got "
                         f"{tuple(q.shape)} {q.dtype}")
    if scales.shape != (num_blocks(n, block),) or scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32 of shape ({num_blocks(n, block)},), got "
                         f"{tuple(scales.shape)} {scales.dtype}")
    if not use_triton(q, impl):
        return dequantize_int8_ref(q, scales, block, n)
    q = q.contiguous()
    out = torch.empty(n, device=q.device, dtype=torch.float32)
    if n:
        grid = (cdiv(n, DEQUANT_BLOCK),)
        _dequantize_int8_kernel[grid](q, scales.contiguous(), out, n, block, BLOCK=DEQUANT_BLOCK)
    return out
