"""Compact codes for a sorted set of positions, shared by the codecs that broadcast an index set.

Elias-Fano (``"delta"``) or a bitmap, whichever is smaller (``"auto"``). Both sizes are functions of
``k`` (positions) and ``n`` (the range) alone, so a receiver knows the code's size without a header.

The per-channel code (:func:`encode_channel_positions`) splits a weight's positions by output
channel: a header of each channel's count (:func:`encode_counts`), then per channel an Elias-Fano
code with its own low-bit width, or a bitmap of the channel where that is smaller. A gradient's
large values crowd into some channels and avoid others, so this takes fewer bits than one code over
the layer; its size follows from the counts, which a receiver reads first.

The gap codes (``lgc``'s union support): the Rice code of the gaps between a channel's positions
(:func:`rice_fields`), and for a convolution the kernel code (:func:`kernel_fields`), which names
the kernels holding positions and then which entries of each. Their sizes depend on the positions,
so a sender says its length. The Rice code takes within a few per cent of the least that a code
knowing only each channel's count can take; the kernel code less, where positions crowd in kernels.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from lightning_gradcomp.codecs.bits import pack_mask, unpack_mask

__all__ = [
    "ENCODINGS",
    "channel_code_nbytes",
    "channel_counts",
    "choose_encoding",
    "counts_nbytes",
    "decode_channel_positions",
    "decode_counts",
    "decode_positions",
    "encode_channel_positions",
    "encode_counts",
    "encode_positions",
    "encoded_nbytes",
    "positions_of_ones",
    "union_of",
    "union_slots",
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


def union_slots(names: list[Tensor], n: int, support: Tensor, named: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    """For ``support, named = union_of(names, n)``: per set, the
    indices into ``support`` of its positions, in the set's own order, and the ascending indices of
    the positions it does not hold.

    A layer's values are placed and read by these indices several times a step; indexing with a
    bool mask finds its ones each time (about four times slower on one CPU core at a light step's
    support), so they are found once: a set's own by a lookup from position to index, the rest
    from the mask."""
    slot = torch.empty(n, dtype=torch.long, device=support.device)
    slot[support] = torch.arange(support.numel(), device=support.device)
    return [slot[pos] for pos in names], [torch.nonzero(~row).squeeze(1) for row in named]


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


# The per-channel code. ``channels`` rows of ``per`` positions each (a weight's output channels, flat
# in row-major order). A channel holding ``c > 0`` of the positions has an Elias-Fano code with
# ``l_c = floor(log2(per / c))`` low bits, ``c * (l_c + 1) + (per - 1) >> l_c + 1`` bits, or a
# bitmap of ``per`` bits where that is not more; an empty channel has nothing. All channels' low
# bits come first, position by position, then each channel's high field (its unary high parts or
# its bitmap), channel by channel; the whole is one bit stream, packed once.


def _count_width(per: int) -> int:
    """Bits of one channel's count, which lies in ``[0, per]``."""
    return per.bit_length()


def counts_nbytes(channels: int, per: int) -> int:
    """Bytes of the counts header: ``channels`` counts of ``per.bit_length()`` bits."""
    return -(-channels * _count_width(per) // 8)


def output_channels(param: Tensor) -> int:
    """The channels a layer's flattened gradient splits into: a weight's output channels (its
    first dimension, each a contiguous run of ``numel // channels`` entries); a vector or a
    weight with one output channel is one channel."""
    return param.shape[0] if param.dim() >= 2 and param.shape[0] > 1 else 1


def channel_counts(pos: Tensor, channels: int, per: int) -> Tensor:
    """How many of the positions ``pos`` fall in each of the ``channels`` rows (int64)."""
    return torch.bincount(pos // per, minlength=channels)


def encode_counts(counts: Tensor, per: int) -> Tensor:
    """The counts as :func:`counts_nbytes` bytes (``per.bit_length()`` bits each, least
    significant first)."""
    w = _count_width(per)
    bits = (counts.unsqueeze(1) >> torch.arange(w, device=counts.device)) & 1
    return pack_mask(bits.reshape(-1).bool())


def decode_counts(data: Tensor, channels: int, per: int) -> Tensor:
    """Inverse of :func:`encode_counts`."""
    w = _count_width(per)
    bits = unpack_mask(data, channels * w).view(channels, w).long()
    return (bits << torch.arange(w, device=data.device)).sum(-1)


def _exclusive_cumsum(x: Tensor) -> Tensor:
    return torch.cumsum(x, 0) - x


def _bits_of(values: Tensor, widths: Tensor) -> Tensor:
    """Each value's low ``widths`` bits (bool), value by value, least significant first."""
    owner = torch.repeat_interleave(torch.arange(values.numel(), device=values.device), widths)
    bit = torch.arange(owner.numel(), device=values.device) - _exclusive_cumsum(widths)[owner]
    return ((values[owner] >> bit) & 1).bool()


def _values_of(bits: Tensor, widths: Tensor) -> Tensor:
    """Inverse of :func:`_bits_of`."""
    owner = torch.repeat_interleave(torch.arange(widths.numel(), device=bits.device), widths)
    bit = torch.arange(owner.numel(), device=bits.device) - _exclusive_cumsum(widths)[owner]
    return torch.zeros(widths.numel(), dtype=torch.long, device=bits.device).index_add(0, owner, bits.long() << bit)


def _channel_layout(counts: Tensor, per: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per channel (``counts`` may carry leading batch dimensions): whether it is Elias-Fano coded
    (else a bitmap, or nothing when empty), its low-bit width, and its low and high fields' bits."""
    c = counts.clamp(min=1)
    low = torch.floor(torch.log2(torch.div(per, c, rounding_mode="floor").double())).long().clamp(min=0)
    ef_bits = counts * (low + 1) + ((per - 1) >> low) + 1
    elias_fano = (counts > 0) & (ef_bits < per)
    low = torch.where(elias_fano, low, torch.zeros_like(low))
    low_len = counts * low
    high_len = torch.where(elias_fano, counts + ((per - 1) >> low) + 1, torch.where(counts > 0, per, 0))
    return elias_fano, low, low_len, high_len


def channel_code_nbytes(counts: Tensor, per: int) -> Tensor:
    """Bytes of :func:`encode_channel_positions` for these counts (the header not included), as a
    tensor: for ``(..., channels)`` counts, one size per leading index."""
    _, _, low_len, high_len = _channel_layout(counts, per)
    return torch.div((low_len + high_len).sum(-1) + 7, 8, rounding_mode="floor")


def encode_channel_positions(pos: Tensor, counts: Tensor, per: int) -> Tensor:
    """The sorted positions ``pos`` of a ``(len(counts), per)`` weight, channel by channel:
    :func:`channel_code_nbytes` bytes, to be read with the same ``counts``."""
    k = pos.numel()
    elias_fano, low, low_len, high_len = _channel_layout(counts, per)
    row = pos // per
    off = pos - row * per
    li = low[row]
    rank = torch.arange(k, device=pos.device) - _exclusive_cumsum(counts)[row]
    lows = _bits_of(off, li)  # in position order (sorted positions are grouped by channel already)
    # the high fields: an Elias-Fano channel sets bit h_i + rank_i of its field, a bitmap bit off_i
    high = torch.zeros(int(high_len.sum()), dtype=torch.bool, device=pos.device)
    high[_exclusive_cumsum(high_len)[row] + (off >> li) + rank * elias_fano[row]] = True
    return pack_mask(torch.cat([lows, high]))


def decode_channel_positions(data: Tensor, counts: Tensor, per: int) -> Tensor:
    """Inverse of :func:`encode_channel_positions`: the sorted positions as int64."""
    device = data.device
    k = int(counts.sum())
    elias_fano, low, low_len, high_len = _channel_layout(counts, per)
    n_low, n_high = int(low_len.sum()), int(high_len.sum())
    bits = unpack_mask(data, n_low + n_high)
    ones = positions_of_ones(bits[n_low:], k)
    if ones.numel() != k:  # only a CPU can tell here without waiting; CUDA pads a corrupt code
        raise ValueError(f"corrupt position code: {ones.numel()} high parts for {k} positions")
    row = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
    rank = torch.arange(k, device=device) - _exclusive_cumsum(counts)[row]
    li = low[row]
    off = (ones - _exclusive_cumsum(high_len)[row] - rank * elias_fano[row]) << li
    return row * per + off + _values_of(bits[:n_low], li)


# The Rice code of the gaps. A channel holding ``c`` positions stores each gap ``g`` (the entries
# skipped since the previous position of the channel, or since its start) as ``g >> b_c`` in unary
# and the low ``b_c`` bits of ``g`` verbatim, with ``b_c`` a function of ``c`` alone
# (:func:`rice_widths`). Elias-Fano stores the high parts of the positions instead, whose unary
# differences add up to the channel's length whatever the gaps are; the gaps' quotients drop each
# gap's remainder, about half a bit a position less at the densities ``lgc`` names. A message puts
# every layer's low bits first and one unary field of all its quotients after them: a receiver
# knows the low bits' length from the counts, and finds the quotients as the gaps between ones.


def rice_widths(counts: Tensor, per: int) -> Tensor:
    """The Rice parameter of each channel of ``per`` entries holding ``counts`` positions (int64).

    For gaps drawn geometrically with success probability ``p = c / per``, the best Rice parameter
    is ``1 + floor(log2(log(phi - 1) / log(1 - p)))`` (Kiely, 2004; ``phi`` the golden ratio), at
    least 0: about ``log2(0.48 / p) + 1``, ``3`` at 7 % and ``1`` at 25 %."""
    p = counts.double().clamp(min=1) / per
    width = 1 + torch.floor(torch.log2(0.48121182505960347 / -torch.log1p(-p.clamp(max=1 - 1e-12))))
    return width.clamp(min=0).long()


def rice_fields(pos: Tensor, counts: Tensor, per: int) -> tuple[Tensor, Tensor]:
    """The sorted positions ``pos`` of a ``(len(counts), per)`` weight as the Rice code's two fields:
    the low bits (bool, ``sum(counts * rice_widths)`` of them, position by position) and the gaps'
    quotients (int64, one a position), to be written in unary by :func:`unary_bits`."""
    k = pos.numel()
    width = rice_widths(counts, per)
    row = pos // per
    off = pos - row * per
    first = torch.arange(k, device=pos.device) == _exclusive_cumsum(counts)[row]
    previous = torch.cat([off.new_full((1,), -1), off[:-1]]) if k else off
    gap = off - torch.where(first, -1, previous) - 1
    wi = width[row]
    return _bits_of(gap, wi), gap >> wi


def rice_low_bits(counts: Tensor, per: int) -> int:
    """How many low bits :func:`rice_fields` writes for these counts (known to a receiver)."""
    return int((counts * rice_widths(counts, per)).sum())


def unary_bits(quotients: Tensor) -> Tensor:
    """``q`` zeros and a one for each quotient ``q``, in order (bool)."""
    ends = torch.cumsum(quotients + 1, 0) - 1
    bits = torch.zeros(int(ends[-1]) + 1 if ends.numel() else 0, dtype=torch.bool, device=quotients.device)
    bits[ends] = True
    return bits


def quotients_of(bits: Tensor, k: int) -> Tensor:
    """Inverse of :func:`unary_bits` for the first ``k`` quotients of ``bits`` (other bits may follow)."""
    ones = positions_of_ones(bits, k)[:k]
    if ones.numel() != k:  # only a CPU can tell here without waiting; CUDA pads a corrupt code
        raise ValueError(f"corrupt position code: {ones.numel()} gaps for {k} positions")
    return ones - torch.cat([ones.new_full((1,), -1), ones[:-1]]) - 1


def rice_positions(lows: Tensor, quotients: Tensor, counts: Tensor, per: int) -> Tensor:
    """Inverse of :func:`rice_fields`: the sorted positions (int64)."""
    device = quotients.device
    width = rice_widths(counts, per)
    row = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
    wi = width[row]
    gap = (quotients << wi) + _values_of(lows, wi)
    reach = torch.cumsum(gap + 1, 0)  # one past each position, counted from the first channel's start
    start = _exclusive_cumsum(counts)[row]
    before = torch.where(start > 0, reach[(start - 1).clamp(min=0)], 0)
    return row * per + reach - before - 1


# The kernel code. A convolution's names crowd not only into output channels but into kernels: where
# one entry of an (output, input) channel pair's 3x3 kernel is named, others mostly are too (on
# PSPNet's names at 7 %, a named kernel holds 2.9 of its 9 entries, and 22 % of the kernels hold
# any). So a weight with small kernels names its kernels instead (the Rice code of their gaps per
# output channel, the counts header counting kernels), and then says which entries of each: how
# many (``c``, in unary: ``c - 1`` zeros and a one) and which of the ``C(size, c)`` subsets
# (its index in ``ceil(log2 C(size, c))`` bits). A message puts these indices after the unary field.

#: the largest kernel (entries) named by the kernel code; its tables hold ``2 ** size`` patterns
MAX_KERNEL = 12


@functools.lru_cache(maxsize=None)
def _kernel_tables(size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """For the ``2 ** size`` patterns of a kernel (bit ``j`` for entry ``j``): each pattern's count
    of entries and index among the patterns of that count (in increasing order), the patterns
    sorted by (count, pattern), where each count's patterns start there, and each count's index
    width ``ceil(log2 C(size, c))``."""
    patterns = torch.arange(1 << size)
    count = ((patterns.unsqueeze(1) >> torch.arange(size)) & 1).sum(1)
    by_count = torch.argsort(count * (1 << size) + patterns)
    first = torch.cumsum(torch.bincount(count, minlength=size + 1), 0) - torch.bincount(count, minlength=size + 1)
    index = torch.empty_like(patterns)
    index[by_count] = torch.arange(1 << size) - first[count[by_count]]
    width = torch.tensor([(math.comb(size, c) - 1).bit_length() for c in range(size + 1)])
    return count, index, by_count, first, width


def kernel_counts(pos: Tensor, channels: int, per: int, size: int) -> Tensor:
    """How many kernels of ``size`` entries each of the ``channels`` rows (``per`` entries) names
    at least one entry of, for sorted positions ``pos`` (int64)."""
    return channel_counts(torch.unique_consecutive(pos // size), channels, per // size)


def kernel_fields(pos: Tensor, counts: Tensor, per: int, size: int) -> tuple[Tensor, Tensor, Tensor]:
    """The sorted positions ``pos`` of a ``(len(counts), per)`` weight whose rows are kernels of
    ``size`` entries, with ``counts`` from :func:`kernel_counts`: the low bits of the named
    kernels' gaps (bool), the unary values (int64: the kernels' gap quotients, then each named
    kernel's count of entries less one) and each kernel's index among the patterns of its count
    (bool, ``ceil(log2 C(size, c))`` bits a kernel)."""
    count_of, index_of, _, _, width = (t.to(pos.device) for t in _kernel_tables(size))
    of_kernel = pos // size
    kernel, inverse = torch.unique_consecutive(of_kernel, return_inverse=True)
    pattern = torch.zeros(kernel.numel(), dtype=torch.long, device=pos.device)
    pattern.index_add_(0, inverse, 1 << (pos - of_kernel * size))
    lows, quotients = rice_fields(kernel, counts, per // size)
    c = count_of[pattern]
    return lows, torch.cat([quotients, c - 1]), _bits_of(index_of[pattern], width[c])


def kernel_index_bits(entries: Tensor, size: int) -> Tensor:
    """The index bits of named kernels holding ``entries`` entries each (int64, a tensor)."""
    return _kernel_tables(size)[4].to(entries.device)[entries].sum()


def kernel_positions(lows: Tensor, unary: Tensor, index_bits: Tensor, counts: Tensor, per: int, size: int) -> Tensor:
    """Inverse of :func:`kernel_fields`: the sorted positions (int64)."""
    _, _, by_count, first, width = (t.to(unary.device) for t in _kernel_tables(size))
    named = unary.numel() // 2
    kernel = rice_positions(lows, unary[:named], counts, per // size)
    c = unary[named:] + 1
    pattern = by_count[first[c] + _values_of(index_bits, width[c])]
    entries = ((pattern.unsqueeze(1) >> torch.arange(size, device=unary.device)) & 1).bool()
    return (kernel.unsqueeze(1) * size + torch.arange(size, device=unary.device))[entries]
