"""``rangefloat``: a low-bit floating-point format whose exponent range is fitted to the data.

The range-based float of Wang et al. (HPDC'20, "FFT-based Gradient Sparsification for the
Distributed Training of Deep Neural Networks"): instead of IEEE's fixed exponent range, a message's
``bits``-bit floats use an exponent *bias* chosen from the largest magnitude in the message, so no
codes are spent on magnitudes that never occur. The bias (and the exponent width when it is chosen
automatically) travels in a 2-element int32 header.

Format (our choice of the concrete layout; the paper's exact bit layout is not public): a code is
``sign | E | f`` with ``e`` exponent bits and ``m = bits - 1 - e`` mantissa bits, decoded like IEEE
with gradual underflow:

* ``E = 0``: subnormal, ``|v| = 2^b * f / 2^m`` (``f = 0`` is zero);
* ``E >= 1``: normal, ``|v| = 2^(E - 1 + b) * (1 + f / 2^m)``.

The smallest normal is ``2^b`` and the largest value ``2^(2^e - 2 + b) * (2 - 2^-m)``. The bias is
``b = floor(log2 max|v|) - 2^e + 2``, so the largest magnitude falls in the top binade, and is clamped
to ``b >= -126`` so that every scale factor stays a normal fp32 number.

Worst-case error (exact for the arithmetic used here: every scaling is by a power of two):

* ``|v| >= 2^b`` (inside the represented range): relative error ``<= 2^-(m+1)`` with round-to-nearest
  and ``< 2^-m`` with stochastic rounding (which is unbiased). The largest magnitude never
  overflows: at worst it rounds down to the largest code, still within ``2^-(m+1)``.
* ``|v| < 2^b`` (below the range): subnormals, absolute error ``<= 2^(b-m-1)`` with round-to-nearest
  (``< 2^(b-m)`` stochastic), which is below the smallest normal ``2^b``. Values below ``2^(b-m-1)``
  flush to zero.

With ``exponent_bits=None`` (default) ``e`` is fitted to the message too: the smallest ``e`` (at most
``max_exponent_bits``) whose ``2^e - 1`` normal binades cover ``[min nonzero |v|, max |v|]``. Narrow
ranges (the coefficients kept after magnitude sparsification) then get more mantissa bits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.codecs.base import Codec, CodecOptions, EncodeResult, check_choice, check_seed
from lightning_gradcomp.codecs.bits import bits_to_hold, codes_nbytes, pack_codes, unpack_codes
from lightning_gradcomp.codecs.sampling import seeded_generator
from lightning_gradcomp.registry import register_codec

__all__ = [
    "RangeFloat",
    "rf_quantize",
    "rf_dequantize",
    "RangeFloatCodec",
    "ROUNDINGS",
]

ROUNDINGS = ("nearest", "stochastic")
_MIN_BIAS = -126  # keeps 2^-b and 2^b normal fp32 numbers


def _default_max_exponent_bits(bits: int) -> int:
    return max(1, min(bits - 2, 4 if bits <= 9 else 5))


def rf_quantize(
    values: Tensor,
    bits: int = 8,
    exponent_bits: int | None = None,
    max_exponent_bits: int | None = None,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Quantize ``values`` to range-based floats.

    Returns:
        ``(header, codes)``: header is int32 ``[b, e]``; codes are int32 in ``[0, 2^bits)``, the sign
        in the top bit. See the module docstring for the format and its error bound.

    On CUDA the range ``(b, e)`` is computed on the device (:func:`_rf_quantize_device`), so that
    quantizing a layer never waits for the GPU; on a CPU it is computed on the host. Both give
    the same codes with ``"nearest"``; stochastic rounding draws its noise differently.
    """
    if values.is_cuda:
        return _rf_quantize_device(values, bits, exponent_bits, max_exponent_bits, rounding, generator)
    v = values.reshape(-1).to(torch.float32).contiguous()
    # Work on the fp32 bit patterns: for non-negative floats the int32 order is the float order,
    # the exponent field is floor(log2 |v|) + 127, and scaling by 2^-b is subtracting b from it.
    ai = v.view(torch.int32) & 0x7FFFFFFF
    e_cap = _default_max_exponent_bits(bits) if max_exponent_bits is None else max_exponent_bits
    amax_bits = int(ai.max()) if ai.numel() else 0
    if amax_bits == 0 or amax_bits >= 0x7F800000:  # all zero (or non-finite: the hook discards it)
        b, e = 0, exponent_bits or e_cap
    else:
        top = math.frexp(torch.tensor(amax_bits, dtype=torch.int32).view(torch.float32).item())[1] - 1
        if exponent_bits is None:
            # smallest non-zero magnitude: zeros wrap to the largest int by the -1, & mask
            amin = float(((ai - 1) & 0x7FFFFFFF).min().add_(1).view(torch.float32))
            span = top - (math.frexp(amin)[1] - 1) + 1  # binades to cover as normals
            e = min(e_cap, bits_to_hold(span))  # exponent codes 0..span
        else:
            e = exponent_bits
        b = max(_MIN_BIAS, top - 2**e + 2)
    m = bits - 1 - e
    shift = 23 - m
    # normals (|v| >= 2^b): drop 23 - m mantissa bits with rounding; a carry out of the mantissa lands
    # on the next binade's first code. fp32 exponent field 127 + b + k (binade k) becomes E = k + 1.
    if rounding == "nearest":
        normal = ai + (1 << (shift - 1))
    else:
        normal = ai + torch.randint(0, 1 << shift, ai.shape, generator=generator, device=ai.device, dtype=torch.int32)
    normal = normal.bitwise_right_shift_(shift).sub_((126 + b) << m)
    # subnormals (|v| < 2^b): multiples of 2^(b-m)
    # 2^(m - b) leaves fp32's range when b is near -126 (inf from 2^128 on): scale in two exact halves
    half = (m - b) // 2
    sub = ai.view(torch.float32) * 2.0**half * 2.0 ** (m - b - half)
    if rounding == "nearest":
        sub = sub.round_()
    else:
        sub = sub.add_(torch.rand(sub.shape, generator=generator, device=sub.device)).floor_()
    mag = torch.where(ai >= ((127 + b) << 23), normal, sub.to(torch.int32))
    mag = mag.clamp_(max=(1 << (bits - 1)) - 1)  # saturate (only reachable by rounding up the largest value)
    sign = v.view(torch.int32).bitwise_right_shift(31).bitwise_and_(1 << (bits - 1))  # arithmetic shift
    codes = mag.bitwise_or_(sign)
    header = torch.tensor([b, e], dtype=torch.int32, device=v.device)
    return header, codes


def _floor_log2(bits_pattern: Tensor) -> Tensor:
    """``floor(log2 |x|)`` (int64) of positive finite fp32 numbers given by their bit patterns,
    exactly as ``math.frexp(x)[1] - 1`` (fp32 to fp64 is exact, and so is frexp)."""
    return torch.frexp(bits_pattern.to(torch.int32).view(torch.float32).to(torch.float64)).exponent.to(torch.int64) - 1


def _rf_quantize_device(
    values: Tensor,
    bits: int,
    exponent_bits: int | None,
    max_exponent_bits: int | None,
    rounding: str,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """:func:`rf_quantize` with the range kept in 0-d tensors: no host sync (for CUDA tensors).

    The same arithmetic as the host path, step by step, so ``"nearest"`` gives the same codes.
    Stochastic rounding draws ``23`` random bits and keeps the ``23 - m`` it needs (the host path
    draws exactly that many, which needs ``m`` on the host).
    """
    v = values.reshape(-1).to(torch.float32).contiguous()
    ai = v.view(torch.int32) & 0x7FFFFFFF
    e_cap = _default_max_exponent_bits(bits) if max_exponent_bits is None else max_exponent_bits
    amax = ai.max().to(torch.int64) if ai.numel() else torch.zeros((), dtype=torch.int64, device=v.device)
    degenerate = (amax == 0) | (amax >= 0x7F800000)
    safe_max = torch.where(degenerate, torch.ones_like(amax), amax)
    top = _floor_log2(safe_max)
    if exponent_bits is None:
        if ai.numel():
            amin = ((ai - 1) & 0x7FFFFFFF).min().add_(1)
        else:
            amin = torch.ones((), dtype=torch.int32, device=v.device)
        amin = torch.where(degenerate, torch.ones_like(amin), amin)
        span = top - _floor_log2(amin) + 1
        # ceil(log2(span + 1)) is the bit length of span, which frexp gives exactly
        e = torch.frexp(span.to(torch.float64)).exponent.to(torch.int64).clamp(1, e_cap)
    else:
        e = torch.full((), exponent_bits, dtype=torch.int64, device=v.device)
    b = (top - torch.pow(2, e) + 2).clamp_min(_MIN_BIAS)
    b = torch.where(degenerate, torch.zeros_like(b), b)
    e = torch.where(degenerate, torch.full_like(e, exponent_bits or e_cap), e)
    m = bits - 1 - e
    shift = 23 - m
    if rounding == "nearest":
        normal = ai + torch.pow(2, shift - 1).to(torch.int32)
    else:
        noise = torch.randint(0, 1 << 23, ai.shape, generator=generator, device=ai.device, dtype=torch.int32)
        normal = ai + noise.bitwise_right_shift_(m.to(torch.int32))
    normal = normal.bitwise_right_shift_(shift.to(torch.int32)).sub_(((126 + b) * torch.pow(2, m)).to(torch.int32))
    half = torch.div(m - b, 2, rounding_mode="floor")  # two exact halves, as on the host
    sub = ai.view(torch.float32) * torch.exp2(half.to(torch.float32)) * torch.exp2((m - b - half).to(torch.float32))
    if rounding == "nearest":
        sub = sub.round_()
    else:
        sub = sub.add_(torch.rand(sub.shape, generator=generator, device=sub.device)).floor_()
    mag = torch.where(ai >= ((127 + b) * (1 << 23)).to(torch.int32), normal, sub.to(torch.int32))
    mag = mag.clamp_(max=(1 << (bits - 1)) - 1)
    sign = v.view(torch.int32).bitwise_right_shift(31).bitwise_and_(1 << (bits - 1))
    codes = mag.bitwise_or_(sign)
    header = torch.stack([b, e]).to(torch.int32)
    return header, codes


def rf_dequantize(header: Tensor, codes: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`rf_quantize`: fp32 values from ``(header, codes)``."""
    if codes.is_cuda:
        return _rf_dequantize_device(header, codes, bits)
    b, e = (int(x) for x in header.tolist())
    m = bits - 1 - e
    codes = codes.to(torch.int32)
    mag = codes & ((1 << (bits - 1)) - 1)
    # normals back to an fp32 bit pattern (E = k + 1 -> exponent field 127 + b + k), subnormals f 2^(b-m)
    normal = (mag + ((126 + b) << m)).bitwise_left_shift_(23 - m)
    sub = (mag.to(torch.float32) * 2.0 ** (b - m)).view(torch.int32)
    out = torch.where(mag >= (1 << m), normal, sub)
    out.bitwise_or_(codes.bitwise_right_shift(bits - 1).bitwise_left_shift_(31))
    return out.view(torch.float32)


@dataclass(frozen=True)
class RangeFloat:
    """A range-based float format: ``encode`` packs values into ``[header, bytes]``.

    Args:
        bits: total bits per value (sign + exponent + mantissa), 4..16.
        exponent_bits: fixed exponent width ``e`` (1..bits-2), or ``None`` to fit it per message.
        max_exponent_bits: upper bound of the fitted ``e`` (default 4 for ``bits <= 9``, else 5).
        rounding: ``"nearest"`` or ``"stochastic"`` (unbiased inside the range).
    """

    bits: int = 8
    exponent_bits: int | None = None
    max_exponent_bits: int | None = None
    rounding: str = "nearest"

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 4 <= self.bits <= 16:
            raise ValueError(f"bits must be an integer in [4, 16], got {self.bits!r}")
        for name in ("exponent_bits", "max_exponent_bits"):
            val = getattr(self, name)
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or not 1 <= val <= self.bits - 2):
                raise ValueError(
                    f"{name} must be None or an integer in [1, {self.bits - 2}] for bits={self.bits}, got {val!r}"
                )
        check_choice("rounding", self.rounding, ROUNDINGS)

    @property
    def worst_exponent_bits(self) -> int:
        if self.exponent_bits is not None:
            return self.exponent_bits
        return self.max_exponent_bits or _default_max_exponent_bits(self.bits)

    def max_relative_error(self, header: Tensor | None = None) -> float:
        """Bound on ``|q(v) - v| / |v|`` for ``|v| >= 2^b``: ``2^-(m+1)`` (nearest) or ``2^-m``
        (stochastic); with a header, for that message's ``m``, else the worst case over messages."""
        e = int(header[1]) if header is not None else self.worst_exponent_bits
        m = self.bits - 1 - e
        return 2.0 ** -(m + 1) if self.rounding == "nearest" else 2.0**-m

    def nbytes(self, n: int) -> int:
        """Bytes of the packed codes of ``n`` values (the header adds 8)."""
        return codes_nbytes(n, self.bits)

    def quantize(self, values: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        return rf_quantize(values, self.bits, self.exponent_bits, self.max_exponent_bits, self.rounding, generator)

    def dequantize(self, header: Tensor, codes: Tensor) -> Tensor:
        return rf_dequantize(header, codes, self.bits)

    def encode(self, values: Tensor, generator: torch.Generator | None = None) -> list[Tensor]:
        """``[header (int32, 2), packed codes (uint8)]``; sizes depend only on ``values.numel()``."""
        header, codes = self.quantize(values, generator)
        return [header, pack_codes(codes, self.bits)]

    def decode(self, payload: Sequence[Tensor], n: int) -> Tensor:
        return rf_dequantize(payload[0], unpack_codes(payload[1], self.bits, n), self.bits)


@dataclass(frozen=True)
class RangeFloatOptions(CodecOptions):
    bits: int = 8
    exponent_bits: int | None = None
    max_exponent_bits: int | None = None
    rounding: str = "nearest"
    seed: int = 0

    def check(self) -> None:
        self._set("seed", check_seed("seed", self.seed))
        self.format()  # validates bits, exponent widths and rounding

    def format(self) -> RangeFloat:
        return range_float(self.bits, self.exponent_bits, self.max_exponent_bits, self.rounding)


@functools.lru_cache(maxsize=64)
def range_float(bits: int, exponent_bits: int | None, max_exponent_bits: int | None, rounding: str) -> RangeFloat:
    """A :class:`RangeFloat`, made once per setting (codecs ask for it on every call)."""
    return RangeFloat(bits, exponent_bits, max_exponent_bits, rounding)


@register_codec("rangefloat")
class RangeFloatCodec(Codec):
    """Every compressed layer sent as ``bits``-bit range-based floats (see the module docstring).

    Each layer gets its own range (header). Compression ``32 / bits`` (4x at 8 bits), and relative
    error at most ``2^-(m+1)`` for every value at or above the layer's smallest normal.

    Collective: all-gather. Every rank fits the range to its own values, so codes of different
    ranks mean different numbers and cannot be summed; each rank decodes every rank's message.

    Args:
        bits: bits per value, 4..16 (e.g. 8, 10, 16).
        exponent_bits: fixed exponent width, or ``None`` (default) to fit it per layer and step.
        max_exponent_bits: cap of the fitted exponent width.
        rounding: ``"nearest"`` (default) or ``"stochastic"`` (unbiased).
        seed: seed of stochastic rounding (streams depend on seed, rank, step and layer).
        **kwargs: the common codec options; error feedback is on by default (round-to-nearest is
            biased, and values far below a layer's largest one flush to zero).
    """

    collective = "allgather"
    Options = RangeFloatOptions
    harness_defaults = {"error_feedback": True}

    @property
    def format(self) -> RangeFloat:
        return self.options.format()

    def encode(self, x: Tensor, key: str, param: Tensor, step: int) -> EncodeResult:
        o = self.options
        gen = seeded_generator(o.seed, self.rank, step, key, x.device) if o.rounding == "stochastic" else None
        header, codes = self.format.quantize(x, gen)
        local = self.format.dequantize(header, codes)
        return EncodeResult([header, pack_codes(codes, o.bits)], local=local)

    def decode(self, payload: list[Tensor], ctx: Any, numel: int, count: int) -> Tensor:
        return self.format.decode(payload, numel)


def _rf_dequantize_device(header: Tensor, codes: Tensor, bits: int) -> Tensor:
    """:func:`rf_dequantize` with the header kept on the device: no host sync (for CUDA tensors)."""
    h = header.to(device=codes.device, dtype=torch.int64)
    b, e = h[0], h[1]
    m = bits - 1 - e
    codes = codes.to(torch.int32)
    mag = codes & ((1 << (bits - 1)) - 1)
    normal = (mag + ((126 + b) * torch.pow(2, m)).to(torch.int32)).bitwise_left_shift_((23 - m).to(torch.int32))
    sub = (mag.to(torch.float32) * torch.exp2((b - m).to(torch.float64)).to(torch.float32)).view(torch.int32)
    out = torch.where(mag >= torch.pow(2, m).to(torch.int32), normal, sub)
    out.bitwise_or_(codes.bitwise_right_shift(bits - 1).bitwise_left_shift_(31))
    return out.view(torch.float32)
