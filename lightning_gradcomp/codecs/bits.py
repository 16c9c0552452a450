"""Packing small unsigned integer codes into bytes, so a b-bit code costs b bits on the wire.

Every packer here writes the least significant bit first, so a bitmap packed with
:func:`pack_mask` is byte for byte ``pack_bits(mask, 1)``. A code whose number of symbols is not a
power of two packs denser as digits (:func:`pack_digits`): a ternary code 5 to a byte. The one home
of bit packing: codecs and position codes use these functions, never their own.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = [
    "bits_to_hold",
    "pack_bits",
    "unpack_bits",
    "packed_nbytes",
    "pack_mask",
    "unpack_mask",
    "pack_codes",
    "unpack_codes",
    "codes_nbytes",
    "digits_per_byte",
    "pack_digits",
    "unpack_digits",
    "digits_nbytes",
]


def bits_to_hold(largest: int) -> int:
    """Bits of an unsigned field that holds every integer ``0..largest`` (at least one)."""
    return max(1, int(largest).bit_length())


def packed_nbytes(n: int, bits: int) -> int:
    return -(-n * bits // 8)


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack a 1-D tensor of integers in ``[0, 2**bits)`` into a uint8 tensor of
    ``ceil(n * bits / 8)`` bytes (little-endian bit order)."""
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in [1, 16], got {bits}")
    n = codes.numel()
    codes = codes.reshape(-1).to(torch.int32)
    if 8 % bits == 0:
        per = 8 // bits
        pad = (-n) % per
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad)])
        shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
        return (codes.view(-1, per) << shifts).sum(1).to(torch.uint8)
    # general widths: spell out the bits, then pack eight to a byte
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    bitmat = ((codes.unsqueeze(1) >> shifts) & 1).reshape(-1)
    pad = (-bitmat.numel()) % 8
    if pad:
        bitmat = torch.cat([bitmat, bitmat.new_zeros(pad)])
    weights = torch.arange(8, device=codes.device, dtype=torch.int32)
    return (bitmat.view(-1, 8) << weights).sum(1).to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes as int32."""
    packed = packed.reshape(-1).to(torch.int32)
    if 8 % bits == 0:
        per = 8 // bits
        shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
        return ((packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n]
    weights = torch.arange(8, device=packed.device, dtype=torch.int32)
    bitmat = ((packed.unsqueeze(1) >> weights) & 1).reshape(-1)[: n * bits].view(n, bits)
    shifts = torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (bitmat << shifts).sum(1)


@functools.lru_cache(maxsize=None)
def _shifts(device: torch.device) -> Tensor:
    """``[0, 1, ..., 7]`` as uint8 on ``device``, made once per device (a copy to a GPU waits)."""
    return torch.arange(8, dtype=torch.uint8, device=device)


def pack_mask(mask: Tensor) -> Tensor:
    """A flat bool or 0/1 uint8 mask, eight entries to a byte, without int32 copies."""
    pad = (-mask.numel()) % 8
    if pad:
        mask = torch.cat([mask, mask.new_zeros(pad)])
    return (mask.view(-1, 8).to(torch.uint8) << _shifts(mask.device)).sum(1, dtype=torch.uint8)


def unpack_mask(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_mask`: the first ``n`` entries as bool."""
    return ((packed.unsqueeze(1) >> _shifts(packed.device)) & 1).reshape(-1)[:n].bool()


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack ``bits``-bit codes into ``codes_nbytes(n, bits)`` bytes.

    Widths above 8 (up to 31) are split into planes (our choice, for speed): the low byte of every
    code, then the high ``bits - 8`` bits packed the same way (bytes, then
    :func:`~lightning_gradcomp.codecs.bits.pack_bits` for the last plane). The size is at most a few
    bytes above the dense ``ceil(n bits / 8)``.
    """
    if not 1 <= bits <= 31:
        raise ValueError(f"bits must be in [1, 31], got {bits}")
    if bits <= 8:
        return pack_bits(codes, bits)
    codes = codes.reshape(-1).to(torch.int32)
    low = (codes & 0xFF).to(torch.uint8)
    return torch.cat([low, pack_codes(codes >> 8, bits - 8)])


def unpack_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_codes`: ``n`` codes as int32."""
    if bits <= 8:
        return unpack_bits(packed, bits, n)
    low = packed[:n].to(torch.int32)
    return low | (unpack_codes(packed[n:], bits - 8, n) << 8)


def codes_nbytes(n: int, bits: int) -> int:
    return packed_nbytes(n, bits) if bits <= 8 else n + codes_nbytes(n, bits - 8)


def digits_per_byte(base: int) -> int:
    """How many base-``base`` digits one byte holds: the largest ``d`` with ``base**d <= 256``."""
    if not 2 <= base <= 256:
        raise ValueError(f"base must be in [2, 256], got {base}")
    d = 1
    while base ** (d + 1) <= 256:
        d += 1
    return d


def digits_nbytes(n: int, base: int) -> int:
    return -(-n // digits_per_byte(base))


@functools.lru_cache(maxsize=None)
def _powers(base: int, device: torch.device) -> Tensor:
    """``[1, base, base**2, ...]``, one a digit of a byte, as int32 on ``device``, made once."""
    return torch.tensor([base**j for j in range(digits_per_byte(base))], dtype=torch.int32, device=device)


def pack_digits(codes: Tensor, base: int) -> Tensor:
    """Pack a 1-D tensor of integers in ``[0, base)`` :func:`digits_per_byte` to a byte, the
    byte holding ``sum_j c_j * base**j`` (the first code in the lowest digit): ``digits_nbytes(n,
    base)`` bytes.

    A ternary code (TernGrad's ``{-1, 0, 1}``, QSGD's one level a sign) takes 5 to a byte, 1.6 bits
    a value against 2 in a bit field (``log2(3) = 1.585`` is the least any code of the symbols
    alone can take); five symbols take 3 to a byte, 2.67 bits against 3. Where ``base`` is a power
    of two that divides 256 the bytes are :func:`pack_bits`'s."""
    per = digits_per_byte(base)
    n = codes.numel()
    codes = codes.reshape(-1).to(torch.int32)
    pad = (-n) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    return (codes.view(-1, per) * _powers(base, codes.device)).sum(1).to(torch.uint8)


@functools.lru_cache(maxsize=None)
def _digits_of_bytes(base: int, device: torch.device) -> Tensor:
    """Row ``b``: the base-``base`` digits byte ``b`` holds, lowest first (int32, 256 rows), so
    unpacking is one gather instead of a division and a remainder for every digit."""
    byte = torch.arange(256, dtype=torch.int32, device=device).unsqueeze(1)
    return (byte // _powers(base, device)) % base


def unpack_digits(packed: Tensor, base: int, n: int) -> Tensor:
    """Inverse of :func:`pack_digits`: the first ``n`` codes as int32."""
    rows = _digits_of_bytes(base, packed.device).index_select(0, packed.reshape(-1).long())
    return rows.reshape(-1)[:n]
