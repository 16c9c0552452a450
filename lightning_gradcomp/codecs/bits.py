"""Packing small unsigned integer codes into bytes, so a b-bit code costs b bits on the wire."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes"]


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
