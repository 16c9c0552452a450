"""How the ranks of ``lgc``'s union support tell one another the positions they name.

With ``support="union"`` every rank names the largest positions of its own layer, and every rank
must learn every other rank's names (:meth:`~lightning_gradcomp.codecs.lgc_union.UnionSupport._prepare_union`).
The names travel in one of three ways (``position_code``):

``"layer"``
    one code over each layer (:func:`~lightning_gradcomp.codecs.positions.encode_positions`), in
    the first all-gather; its size follows from the count alone (:func:`names_in`).
``"channel"``
    the first all-gather carries each weight's output-channel counts, which fix every rank's code
    sizes; a second carries the names, per weight in the smaller of the channel code and the layer
    code (:func:`gather_channel_names`).
``"rice"`` and ``"kernel"`` (the gap codes)
    the first all-gather carries the counts and each rank's code length in bits; a second carries
    one bit stream a rank: every layer's low bits, one unary field, then the kernel code's indices
    (:func:`gap_code`, :func:`gather_gap_names`, :func:`read_gap_code`).

:func:`first_names` builds a rank's part of the first all-gather. An all-gather moves equal sizes,
so every second message is padded to the longest. Each reading function takes the gathered
``rows`` (one a rank) and the byte ``offset`` where the names' part of a row begins, and returns
the names per layer and rank, this rank's own as they were.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from lightning_gradcomp.codecs.bits import pack_mask, unpack_mask
from lightning_gradcomp.codecs.positions import (
    MAX_KERNEL,
    channel_code_nbytes,
    channel_counts,
    counts_nbytes,
    decode_channel_positions,
    decode_counts,
    decode_positions,
    encode_channel_positions,
    encode_counts,
    encode_positions,
    kernel_counts,
    kernel_fields,
    kernel_index_bits,
    kernel_positions,
    output_channels,
    quotients_of,
    rice_fields,
    rice_low_bits,
    rice_positions,
    unary_bits,
)

__all__ = [
    "first_names",
    "gap_code",
    "gap_layout",
    "gather_channel_names",
    "gather_gap_names",
    "names_in",
    "read_gap_code",
]

Layout = tuple[int, int, int]
AllGather = Callable[[Tensor], Tensor]


def names_in(
    rows: Tensor,
    offset: int,
    rank: int,
    mine: list[Tensor],
    encodings: list[str],
    code_bytes: list[int],
    numels: list[int],
) -> list[list[Tensor]]:
    """Every rank's names from its gathered row of one code over each layer (the layer code,
    ``code_bytes`` a layer), starting at byte ``offset``."""
    names = []
    for idx, e, b, n in zip(mine, encodings, code_bytes, numels):
        names.append(
            [
                idx if r == rank else decode_positions(rows[r, offset : offset + b], idx.numel(), n, e)
                for r in range(rows.shape[0])
            ]
        )
        offset += b
    return names


def gather_channel_names(
    all_gather: AllGather,
    rows: Tensor,
    offset: int,
    rank: int,
    mine: list[Tensor],
    channels: list[tuple[int, int] | None],
    counts: list[Tensor | None],
    encodings: list[str],
    code_bytes: list[int],
    numels: list[int],
) -> tuple[list[list[Tensor]], int]:
    """``position_code="channel"``: every rank's counts (read from the first all-gather) fix its
    code sizes; a weight's names travel in the channel code where that is smaller than the layer
    code (``code_bytes``). ``channels`` holds ``(channels, entries a channel)`` of the weights
    whose names travel per channel (``None``: one code over the layer) and ``counts`` this rank's
    counts of them. Returns the names per layer and rank, and the bytes of the second all-gather
    (this rank's message, padded to the longest)."""
    world, device = rows.shape[0], rows.device
    all_counts: list[Tensor | None] = []
    sizes = []
    for ch in channels:
        if ch is None:
            all_counts.append(None)
            continue
        b = counts_nbytes(*ch)
        gathered = torch.stack([decode_counts(rows[r, offset : offset + b], *ch) for r in range(world)])
        all_counts.append(gathered)
        sizes.append(channel_code_nbytes(gathered, ch[1]))
        offset += b
    channel_sizes = iter(torch.stack(sizes).tolist() if sizes else [])  # (weights, ranks): one host read
    # per layer and rank: the code's bytes, and whether it is the channel code
    plan: list[list[tuple[int, bool]]] = [
        [(lb, False)] * world if ch is None else [(cb, True) if cb < lb else (lb, False) for cb in next(channel_sizes)]
        for ch, lb in zip(channels, code_bytes)
    ]
    longest = max(sum(p[r][0] for p in plan) for r in range(world))
    parts = []
    for i, (idx, ch, e, n) in enumerate(zip(mine, channels, encodings, numels)):
        size, per_channel = plan[i][rank]
        if size:
            parts.append(
                encode_channel_positions(idx, counts[i], ch[1]) if per_channel else encode_positions(idx, n, e)
            )
    mine_nbytes = sum(p[rank][0] for p in plan)
    parts.append(torch.zeros(longest - mine_nbytes, dtype=torch.uint8, device=device))
    msg = torch.cat(parts) if longest else torch.empty(0, dtype=torch.uint8, device=device)
    rows2 = all_gather(msg)
    names: list[list[Tensor]] = [[] for _ in mine]
    for r in range(world):
        off = 0
        for i, (ch, e, n) in enumerate(zip(channels, encodings, numels)):
            size, per_channel = plan[i][r]
            if r == rank:
                names[i].append(mine[i])
            elif per_channel:
                names[i].append(decode_channel_positions(rows2[r, off : off + size], all_counts[i][r], ch[1]))
            else:
                names[i].append(decode_positions(rows2[r, off : off + size], mine[i].numel(), n, e))
            off += size
    return names, longest


def first_names(
    mine: list[Tensor],
    channels: list[tuple[int, int] | None],
    layouts: list[Layout | None],
    encodings: list[str],
    numels: list[int],
    by_channel: bool,
    gapped: bool,
) -> tuple[list[Tensor], list[Tensor | None], Tensor | None]:
    """This rank's part of the first all-gather, per layer: the kernel code's counts of kernels
    a channel, a channel code's counts of names, or (no code by channel: ``"layer"``) the layer
    code of its names; with the gap codes (``gapped``) then the length in bits of its code, as
    one int32, last. Returns the parts (uint8), the counts per layer (``None`` where none travel)
    and this rank's gap code (``None`` without one), which the second all-gather carries."""
    parts: list[Tensor] = []
    counts: list[Tensor | None] = [None] * len(mine)
    for i, (idx, ch, lay, e, n) in enumerate(zip(mine, channels, layouts, encodings, numels)):
        if lay is not None and lay[2] > 1:  # the kernel code counts kernels
            counts[i] = kernel_counts(idx, *lay)
            parts.append(encode_counts(counts[i], lay[1] // lay[2]))
        elif ch is not None:
            counts[i] = channel_counts(idx, *ch)
            parts.append(encode_counts(counts[i], ch[1]))
        elif not by_channel:
            parts.append(encode_positions(idx, n, e))
    own_code = None
    if gapped:  # the names are coded now: their length travels last
        own_code = gap_code(mine, layouts, counts)
        parts.append(torch.tensor([own_code.numel()], dtype=torch.int32, device=mine[0].device).view(torch.uint8))
    return parts, counts, own_code


def gap_layout(param: Tensor, n: int, m: int, kernels: bool) -> Layout | None:
    """How a layer's ``m`` names of ``n`` travel in the gap codes (``position_code`` ``"rice"``
    or ``"kernel"``): ``(channels, entries a channel, entries a kernel)``. A weight names per
    output channel, with ``kernels`` a convolution of at most :data:`MAX_KERNEL` entries a
    kernel names its kernels; a vector or a one-channel weight is one channel, whose count is
    ``m`` (no header); ``None`` where every position is named (no code)."""
    if m >= n:
        return None
    channels = output_channels(param)
    if channels == 1:
        return 1, n, 1
    size = math.prod(param.shape[2:]) if param.dim() > 2 else 1
    return channels, n // channels, size if kernels and 2 <= size <= MAX_KERNEL else 1


def _gap_fields(idx: Tensor, layout: Layout, counts: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """One layer's names as the gap code's low bits, unary values and kernel index bits."""
    channels, per, size = layout
    if channels == 1:
        counts = idx.new_full((1,), idx.numel())
    if size > 1:
        return kernel_fields(idx, counts, per, size)
    lows, quotients = rice_fields(idx, counts, per)
    return lows, quotients, lows[:0]


def gap_code(mine: list[Tensor], layouts: list[Layout | None], counts: list[Tensor | None]) -> Tensor:
    """This rank's names in the gap codes as one bit stream (bool): every layer's low bits, then
    one unary field of every layer's unary values, then the kernel code's indices."""
    fields = [_gap_fields(idx, lay, cnt) for idx, lay, cnt in zip(mine, layouts, counts) if lay is not None]
    if not fields:
        return torch.zeros(0, dtype=torch.bool, device=mine[0].device)
    lows, unary, index = zip(*fields)
    return torch.cat([*lows, unary_bits(torch.cat(unary)), *index])


def gather_gap_names(
    all_gather: AllGather,
    rows: Tensor,
    offset: int,
    rank: int,
    mine: list[Tensor],
    layouts: list[Layout | None],
    own_code: Tensor,
) -> tuple[list[list[Tensor]], int]:
    """``position_code`` ``"rice"`` or ``"kernel"``: every rank's counts and code length (read
    from the first all-gather) tell where its layers' low bits end and how many unary values
    follow; the unary values give the kernels' index widths. The second all-gather carries the
    codes (``own_code``: :func:`gap_code`), every rank's padded to the longest. Returns the names
    per layer and rank, and the bytes of the second all-gather."""
    world, device = rows.shape[0], rows.device
    all_counts: list[Tensor | None] = []  # per layer, (world, channels)
    for idx, lay in zip(mine, layouts):
        if lay is None:
            all_counts.append(None)
        elif lay[0] > 1:
            unit = lay[1] // lay[2]  # what a count counts in a channel: its entries, or its kernels
            b = counts_nbytes(lay[0], unit)
            all_counts.append(
                torch.stack([decode_counts(rows[r, offset : offset + b], lay[0], unit) for r in range(world)])
            )
            offset += b
        else:
            all_counts.append(torch.full((world, 1), idx.numel(), dtype=torch.long, device=device))
    lengths = rows[:, offset : offset + 4].contiguous().view(torch.int32).reshape(-1).tolist()
    longest = -(-max(lengths) // 8)
    msg = pack_mask(own_code) if own_code.numel() else own_code.to(torch.uint8)
    msg = torch.cat([msg, torch.zeros(longest - msg.numel(), dtype=torch.uint8, device=device)])
    rows2 = all_gather(msg) if longest else None
    names: list[list[Tensor]] = [[] for _ in mine]
    for r in range(world):
        decoded: dict[int, Tensor] = {}
        if r != rank and rows2 is not None:
            counts_r = [None if c is None else c[r] for c in all_counts]
            decoded = read_gap_code(unpack_mask(rows2[r], lengths[r]), layouts, counts_r, mine)
        for i, idx in enumerate(mine):
            if r == rank:
                names[i].append(idx)
            elif i in decoded:
                names[i].append(decoded[i])
            else:  # every position named
                names[i].append(torch.arange(idx.numel(), device=device))
    return names, longest


def read_gap_code(
    bits: Tensor, layouts: list[Layout | None], counts: list[Tensor | None], mine: list[Tensor]
) -> dict[int, Tensor]:
    """Inverse of :func:`gap_code` for one rank's ``bits``, given its ``counts``: the names of
    every coded layer, by layer index. Each layer's low bits and unary values are functions of the
    counts (a one-channel layer's count is the named size, that of this rank's own names); the
    kernels' indices follow the unary field, their widths read from it."""
    coded = [i for i, lay in enumerate(layouts) if lay is not None]
    low_bits = [rice_low_bits(counts[i], layouts[i][1] // layouts[i][2]) for i in coded]
    n_unary = [mine[i].numel() if layouts[i][2] == 1 else 2 * int(counts[i].sum()) for i in coded]
    n_low = sum(low_bits)
    quotients = quotients_of(bits[n_low:], sum(n_unary))
    lows, unary = bits[:n_low].split(low_bits), quotients.split(n_unary)
    kernel_layers = [j for j, i in enumerate(coded) if layouts[i][2] > 1]
    index: dict[int, Tensor] = {}
    if kernel_layers:
        unary_end = n_low + int((quotients + 1).sum())
        widths = [kernel_index_bits(unary[j][n_unary[j] // 2 :] + 1, layouts[coded[j]][2]) for j in kernel_layers]
        index_bits = torch.stack(widths).tolist()
        fields = bits[unary_end : unary_end + sum(index_bits)].split(index_bits)
        index = dict(zip(kernel_layers, fields, strict=True))
    decoded = {}
    for j, i in enumerate(coded):
        _, per, size = layouts[i]
        if size > 1:
            decoded[i] = kernel_positions(lows[j], unary[j], index[j], counts[i], per, size)
        else:
            decoded[i] = rice_positions(lows[j], unary[j], counts[i], per)
    return decoded
