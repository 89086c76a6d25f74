"""Triton kernels (CPU interpreter) against their torch references, and the schemes' invariants."""

import os

# Before anything imports triton: run kernels in the CPU interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from backends.kernels import (  # noqa: E402
    HAS_TRITON,
    INTERPRETED,
    Impl,
    add_error_and_sqnorm,
    add_error_and_sqnorm_ref,
    dequantize_int8,
    dequantize_int8_ref,
    num_blocks,
    packed_nbytes,
    quantize_int8,
    quantize_int8_ref,
    sign_pack,
    sign_pack_ref,
    unpack_average,
    unpack_average_ref,
    unpack_signs_ref,
    use_triton,
)
from backends.kernels import _triton as triton_dispatch  # noqa: E402

SIZES = [1, 7, 8, 9, 1000, 4099]          # awkward: not multiples of any kernel block
QUANT_BLOCKS = [1, 3, 64, 100, 1024]
MAX_INTERPRETED_PROGRAMS = 400            # the interpreter runs programs one by one: keep grids small
QUANT_CASES = [(n, block) for n in SIZES for block in QUANT_BLOCKS
               if -(-n // block) <= MAX_INTERPRETED_PROGRAMS]
needs_triton = pytest.mark.skipif(
    not INTERPRETED,
    reason="triton is not installed" if not HAS_TRITON else
    "triton was imported before TRITON_INTERPRET=1 was set (another module imported it first)")


def _randn(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)


def _with_ties(y: torch.Tensor) -> torch.Tensor:
    """Put +0.0 and -0.0 into y: both count as non-negative (bit set, sign +1)."""
    y = y.clone()
    y[::5] = 0.0
    y[2::11] = -0.0
    return y


# ----------------------------------------------------------------------------- 1-bit: kernel == ref

@needs_triton
@pytest.mark.parametrize("n", SIZES)
def test_add_error_and_sqnorm_kernel_matches_reference(n: int) -> None:
    x, err = _randn(n, 1), _randn(n, 2) * 0.1
    y, sqnorm = add_error_and_sqnorm(x, err, impl="triton")
    y_ref, sqnorm_ref = add_error_and_sqnorm_ref(x, err)
    assert torch.equal(y, y_ref)
    # Partial sums are added in another order than torch's sum: equal to fp32 rounding.
    torch.testing.assert_close(sqnorm, sqnorm_ref, rtol=1e-5, atol=0.0)


@needs_triton
@pytest.mark.parametrize("n", SIZES)
def test_sign_pack_kernel_matches_reference(n: int) -> None:
    y = _with_ties(_randn(n, 3))
    scale = torch.tensor([0.75])
    packed, new_err = sign_pack(y, scale, impl="triton")
    packed_ref, new_err_ref = sign_pack_ref(y, scale)
    assert packed.dtype == torch.uint8 and packed.shape == (packed_nbytes(n),)
    assert torch.equal(packed, packed_ref)
    assert torch.equal(new_err, new_err_ref)


@needs_triton
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("workers", [1, 3, 4])
def test_unpack_average_kernel_matches_reference(n: int, workers: int) -> None:
    packed = torch.stack([sign_pack_ref(_randn(n, 10 + w), 1.0)[0] for w in range(workers)])
    scales = _randn(workers, 4).abs()
    out = unpack_average(packed, scales, n, impl="triton")
    assert out.dtype == torch.float32 and out.shape == (n,)
    assert torch.equal(out, unpack_average_ref(packed, scales, n))


# ----------------------------------------------------------------------------- 1-bit: semantics

def test_bit_order_is_little_endian_within_a_byte_and_padding_is_zero() -> None:
    y = torch.tensor([1.0, -1, -1, -1, -1, -1, -1, -1, 0.0, 2.0, -3.0])
    packed, _ = sign_pack_ref(y, 1.0)
    assert packed.tolist() == [0b0000_0001, 0b0000_0011]


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("n", SIZES)
def test_pack_unpack_roundtrip(impl: Impl, n: int) -> None:
    y = _with_ties(_randn(n, 5))
    packed, _ = sign_pack(y, 1.0, impl=impl)
    expected = torch.where(y >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs_ref(packed.view(1, -1), n)[0], expected)
    # One worker with scale 1 decodes to the signs themselves.
    assert torch.equal(unpack_average(packed.view(1, -1), torch.ones(1), n, impl=impl), expected)
    used_bits_in_last_byte = n - (packed_nbytes(n) - 1) * 8
    assert int(packed[-1]) < (1 << used_bits_in_last_byte)             # padding bits are zero


@pytest.mark.parametrize("n", SIZES)
def test_error_feedback_invariant_float64_reference(n: int) -> None:
    """x + old_err == scale * sign(y) + new_err, checked in float64 with the reference."""
    x, old_err = _randn(n, 6, torch.float64), _randn(n, 7, torch.float64) * 0.3
    y, sqnorm = add_error_and_sqnorm_ref(x, old_err)
    scale = torch.sqrt(sqnorm / n)
    packed, new_err = sign_pack_ref(y, scale)
    sign = unpack_signs_ref(packed.view(1, -1), n)[0].to(torch.float64)
    torch.testing.assert_close(scale * sign + new_err, x + old_err, rtol=0.0, atol=1e-12)
    torch.testing.assert_close(scale, x.add(old_err).norm() / n ** 0.5, rtol=1e-12, atol=0.0)


@needs_triton
@pytest.mark.parametrize("n", SIZES)
def test_error_feedback_invariant_float32_kernel(n: int) -> None:
    """Same invariant through the kernels (float32: the interpreter path has no float64)."""
    x, old_err = _randn(n, 8), _randn(n, 9) * 0.3
    y, sqnorm = add_error_and_sqnorm(x, old_err, impl="triton")
    scale = torch.sqrt(sqnorm / n).reshape(1)
    packed, new_err = sign_pack(y, scale, impl="triton")
    decoded = unpack_average(packed.view(1, -1), scale, n, impl="triton")
    exact = x.double() + old_err.double()
    torch.testing.assert_close((decoded.double() + new_err.double()), exact, rtol=0.0, atol=1e-6)


def test_all_zero_input_has_zero_scale_and_keeps_error() -> None:
    y, sqnorm = add_error_and_sqnorm_ref(torch.zeros(13), torch.zeros(13))
    packed, new_err = sign_pack_ref(y, torch.sqrt(sqnorm / 13))
    assert float(sqnorm) == 0.0 and torch.equal(new_err, torch.zeros(13))
    assert packed.tolist() == [0xFF, 0x1F]            # zeros are non-negative: bits set


@needs_triton
def test_empty_inputs() -> None:
    y, sqnorm = add_error_and_sqnorm(torch.zeros(0), torch.zeros(0), impl="triton")
    assert y.numel() == 0 and float(sqnorm) == 0.0
    packed, err = sign_pack(torch.zeros(0), 1.0, impl="triton")
    assert packed.numel() == 0 and err.numel() == 0
    q, scales = quantize_int8(torch.zeros(0), 8, impl="triton")
    assert q.numel() == 0 and scales.numel() == 0


# ----------------------------------------------------------------------------- int8 quantisation

@needs_triton
@pytest.mark.parametrize(("n", "block"), QUANT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_kernels_match_reference(n: int, block: int, dtype: torch.dtype) -> None:
    x = _randn(n, 11, dtype) * 3
    q, scales = quantize_int8(x, block, impl="triton")
    q_ref, scales_ref = quantize_int8_ref(x, block)
    assert q.dtype == torch.int8 and scales.shape == (num_blocks(n, block),)
    assert torch.equal(q, q_ref) and torch.equal(scales, scales_ref)
    out = dequantize_int8(q, scales, block, n, impl="triton")
    assert torch.equal(out, dequantize_int8_ref(q, scales, block, n))


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize(("n", "block"), [c for c in QUANT_CASES if c[1] in (3, 64, 1024)])
def test_dequantize_error_is_at_most_half_a_step(impl: Impl, n: int, block: int) -> None:
    x = _randn(n, 12) * torch.logspace(-3, 3, n, dtype=torch.float32)   # blocks of very different range
    q, scales = quantize_int8(x, block, impl=impl)
    out = dequantize_int8(q, scales, block, n, impl=impl)
    absmax = torch.nn.functional.pad(x.abs(), (0, num_blocks(n, block) * block - n)).view(-1, block).amax(1)
    torch.testing.assert_close(scales, absmax / 127, rtol=0.0, atol=0.0)
    half_step = (absmax / 127 / 2).repeat_interleave(block)[:n]
    rounding_slack = x.abs() * 2.0 ** -22                                # the fp32 product q * scale
    assert bool(((x - out).abs() <= half_step + rounding_slack).all())
    assert int(q.abs().max()) <= 127


def test_quantize_zero_block_and_any_shape() -> None:
    x = torch.zeros(2, 5)
    x[0, 4] = -2.0                                      # flat index 4: block 1 of [0-3, 4-7, 8-9]
    q, scales = quantize_int8_ref(x, 4)
    assert scales.tolist() == [0.0, torch.tensor(2.0 / 127).item(), 0.0]
    assert q.tolist() == [0, 0, 0, 0, -127, 0, 0, 0, 0, 0]
    assert torch.equal(dequantize_int8_ref(q, scales, 4, 10).view(2, 5), x)


# ----------------------------------------------------------------------------- dispatch

def test_dispatch_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(3)
    assert not use_triton(x, "torch")
    assert use_triton(x, "auto") == INTERPRETED                        # TRITON_INTERPRET=1 here
    assert not use_triton(x.double(), "auto", supported=False)          # float64: reference
    monkeypatch.setattr(triton_dispatch, "INTERPRETED", False)
    assert not use_triton(x, "auto")                                    # CPU tensor, compiled mode
    with pytest.raises(RuntimeError, match="needs triton"):
        use_triton(x, "triton")
    monkeypatch.setattr(triton_dispatch, "HAS_TRITON", False)
    assert not use_triton(x, "auto")
    with pytest.raises(ValueError, match="impl"):
        use_triton(x, "cuda")  # type: ignore[arg-type]


@needs_triton
def test_float64_auto_falls_back_to_reference_and_forced_triton_refuses() -> None:
    x = _randn(9, 13, torch.float64)
    y, _ = add_error_and_sqnorm(x, x)
    assert y.dtype == torch.float64
    with pytest.raises(TypeError, match="dtype"):
        sign_pack(x, 1.0, impl="triton")


def test_shape_checks() -> None:
    with pytest.raises(ValueError, match="1-D"):
        add_error_and_sqnorm(torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="bytes per worker"):
        unpack_average(torch.zeros(2, 3, dtype=torch.uint8), torch.ones(2), 30)
    with pytest.raises(ValueError, match="block"):
        quantize_int8(torch.zeros(4), 0)
