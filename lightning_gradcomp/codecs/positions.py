"""Compact codes for a sorted set of positions, shared by the codecs that broadcast an index set.

Elias-Fano (``"delta"``) or a bitmap, whichever is smaller (``"auto"``). Both sizes are functions of
``k`` (positions) and ``n`` (the range) alone, so a receiver knows the code's size without a header.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.codecs.bits import pack_mask, unpack_mask

__all__ = [
    "ENCODINGS",
    "choose_encoding",
    "decode_positions",
    "encode_positions",
    "encoded_nbytes",
    "positions_of_ones",
    "union_of",
]

ENCODINGS = ("auto", "delta", "bitmap")


def positions_of_ones(mask: Tensor, count: int) -> Tensor:
    """Positions (int64, ascending) of the ``count`` set entries of a flat 0/1 ``mask``.

    On CUDA ``torch.nonzero_static`` with the known count: ``torch.nonzero`` would wait for the
    GPU to learn the size. A mask with fewer set entries (a corrupt code) pads with -1 there; on
    a CPU the exact set is returned.
    """
    if mask.is_cuda:
        return torch.nonzero_static(mask, size=count, fill_value=-1).squeeze(1)
    return torch.nonzero(mask).squeeze(1)


def union_of(names: list[Tensor], n: int) -> tuple[Tensor, Tensor]:
    """The sorted union of several sets of distinct positions in ``[0, n)`` (each in any order),
    and an ``(len(names), U)`` mask, True where set ``r`` holds the union's position.

    One byte a position over ``[0, n)`` for every eight sets, set ``r`` marking bit ``r mod 8``,
    instead of sorting the concatenation (``torch.unique``) and testing membership (``torch.isin``):
    linear in ``n`` and the same result, two to four times faster on one CPU core for a layer."""
    device = names[0].device
    marks = [torch.zeros(n, dtype=torch.uint8, device=device) for _ in range(-(-len(names) // 8))]
    for r, pos in enumerate(names):
        marks[r // 8][pos] |= 1 << (r % 8)
    anywhere = marks[0] != 0
    for more in marks[1:]:
        anywhere |= more != 0
    support = torch.nonzero(anywhere).squeeze(1)
    at_support = [m[support] for m in marks]
    named = torch.stack([(at_support[r // 8] >> (r % 8)) & 1 for r in range(len(names))]).bool()
    return support, named


def _ef_low_bits(k: int, n: int) -> int:
    """Low-bit width of Elias-Fano for ``k`` positions in ``[0, n)``: ``floor(log2(n / k))``."""
    return max(0, (n // k).bit_length() - 1) if k > 0 else 0


def encoded_nbytes(encoding: str, k: int, n: int) -> int:
    """Bytes of the code for ``k`` sorted distinct positions in ``[0, n)`` (no header: the size is
    a function of ``k`` and ``n``). ``k == n`` needs no code at all (every position is kept)."""
    if k >= n:
        return 0
    if encoding == "bitmap":
        return -(-n // 8)
    if encoding == "delta":
        low = _ef_low_bits(k, n)
        upper_bits = k + ((n - 1) >> low) + 1
        return -(-k * low // 8) + -(-upper_bits // 8)
    raise ValueError(f"index_encoding must be one of {list(ENCODINGS[1:])}, got {encoding!r}")


def choose_encoding(mode: str, k: int, n: int) -> str:
    """``"delta"`` or ``"bitmap"``; ``"auto"`` takes the smaller (delta on a tie)."""
    if mode != "auto":
        return mode
    return "delta" if encoded_nbytes("delta", k, n) <= encoded_nbytes("bitmap", k, n) else "bitmap"


def encode_positions(pos: Tensor, n: int, encoding: str) -> Tensor:
    """Encode sorted distinct positions ``pos`` (int64) in ``[0, n)`` as a uint8 tensor of exactly
    :func:`encoded_nbytes` bytes.

    ``"bitmap"``: bit ``p`` is set for each kept position. ``"delta"`` (Elias-Fano): with
    ``l = floor(log2(n/k))``, the low ``l`` bits of every position are stored verbatim, and the high
    parts ``h_i = p_i >> l`` as a bit vector with bit ``h_i + i`` set; the number of zeros between
    consecutive ones is the gap ``h_i - h_{i-1}``, a unary delta code. About ``l + 2`` bits a position.
    """
    k = pos.numel()
    if k >= n:
        return torch.zeros(0, dtype=torch.uint8, device=pos.device)
    if encoding == "bitmap":
        bits = torch.zeros(n, dtype=torch.bool, device=pos.device)
        bits[pos] = True
        return pack_mask(bits)
    low = _ef_low_bits(k, n)
    upper_bits = k + ((n - 1) >> low) + 1
    upper = torch.zeros(upper_bits, dtype=torch.bool, device=pos.device)
    upper[(pos >> low) + torch.arange(k, device=pos.device)] = True
    parts = []
    if low:
        lows = pos & ((1 << low) - 1)
        lowbits = (lows.unsqueeze(1) >> torch.arange(low, device=pos.device)) & 1
        parts.append(pack_mask(lowbits.reshape(-1).bool()))
    parts.append(pack_mask(upper))
    return torch.cat(parts)


def decode_positions(data: Tensor, k: int, n: int, encoding: str) -> Tensor:
    """Inverse of :func:`encode_positions`: the ``k`` sorted positions as int64."""
    if k >= n:
        return torch.arange(n, device=data.device)
    if encoding == "bitmap":
        return positions_of_ones(unpack_mask(data, n), k)
    low = _ef_low_bits(k, n)
    low_nbytes = -(-k * low // 8)
    upper_bits = k + ((n - 1) >> low) + 1
    ones = positions_of_ones(unpack_mask(data[low_nbytes:], upper_bits), k)
    if ones.numel() != k:  # only a CPU can tell here without waiting; CUDA pads a corrupt code
        raise ValueError(f"corrupt position code: {ones.numel()} high parts for {k} positions")
    pos = (ones - torch.arange(k, device=data.device)) << low
    if low:
        bits = unpack_mask(data[:low_nbytes], k * low).view(k, low).long()
        pos |= (bits << torch.arange(low, device=data.device)).sum(1)
    return pos
