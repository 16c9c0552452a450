"""Learned magnitude levels: ``lgc``'s code for the values on its shared support.

A value ``v`` of a message whose RMS is ``r`` travels as one sign bit and ``bits - 1`` bits that
pick one of ``2^(bits-1)`` magnitude levels ``c_j``; it decodes to ``sign(v) * r * c_j`` with
``c_j`` the level nearest to ``|v| / r``. The levels are fitted at ``lgc``'s switch, by
Lloyd-Max (one-dimensional k-means, which minimises the mean squared error of the decoded values)
on the stage-2 values of every rank, so they follow the distribution that the top-k values of this
model actually have: on ResNet-18/CIFAR-10 and PSPNet/CamVid that distribution is far from
uniform, and fitted levels halve the error of evenly spaced ones at 2 bits (docs/codecs/lgc.md).
In stage 3 they are fitted again on one rank's own messages (:func:`refit_rows`), so that they
follow the distribution as training moves on.

Each layer has two sets of levels, one per *role*: the leader's message holds its own largest
values (all of them above a threshold), another rank's holds its values at the leader's positions
(small ones among them), and the two are distributed very differently in units of their RMS.
Every rank knows its role at every step, so the split costs no byte on the wire; on ResNet-18 it
cut the error of the decoded mean at 2 bits from 0.275 to 0.172 (docs/codecs/lgc.md). On a *union*
support (``lgc``'s ``support="union"``: each rank names its own largest positions) every rank plays
both roles in each step: its values at the positions it named travel as a message on the leader's
row, its values at the positions the others named as a second message on the others' row. A
stage-2 sample then holds, instead of the leader's rank, an ``(N, K)`` mask of who named what
(:func:`role_parts`).

A message is ``[r (fp32), packed codes]``. Each rank's decoded values are known to that rank
exactly, and the sum of the decoded messages is what the all-gather delivers, so error feedback
keeps exactly what the code lost.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.codecs.bits import codes_nbytes, pack_codes, unpack_codes

__all__ = [
    "LEADER",
    "OTHERS",
    "aggregate_errors",
    "decode",
    "channel_rms",
    "decode_by_channel",
    "dequantize",
    "encode",
    "encode_at",
    "encode_by_channel",
    "fit_layers",
    "fit_levels",
    "fit_roles",
    "message_nbytes",
    "nearest",
    "normalize_by_channel",
    "normalize_sample",
    "quantize",
    "refit_rows",
    "relative_magnitudes",
    "role",
    "role_parts",
    "split_held_out",
    "table_bits",
]

#: the rows of a layer's levels: the leader's message, and every other rank's
LEADER, OTHERS = 0, 1


def role(rank: int, leader: int) -> int:
    """The row of the levels that ``rank``'s message uses when ``leader`` leads."""
    return LEADER if rank == leader else OTHERS


def role_parts(values: Tensor, lead: int | Tensor) -> list[tuple[int, int, Tensor | None]]:
    """The messages of a stage-2 sample ``values`` (``(N, K)``, every rank's values on the support)
    as ``(rank, role, columns)``: with ``lead`` a rank (the leader's support) each rank's row is
    one message of its role, ``columns`` None; with ``lead`` a boolean ``(N, K)`` mask (a union
    support, True where that rank named the position) each rank sends the columns it named on the
    leader's row and the rest, where there is any, on the others' row."""
    if not isinstance(lead, Tensor):
        return [(r, role(r, lead), None) for r in range(values.shape[0])]
    out: list[tuple[int, int, Tensor | None]] = []
    for r in range(values.shape[0]):
        mine = lead[r].to(values.device)
        out.append((r, LEADER, mine))
        if not bool(mine.all()):
            out.append((r, OTHERS, ~mine))
    return out


def lead_scale(values: Tensor, lead: int | Tensor) -> Tensor:
    """The RMS of the values that the leader's row codes in a sample: the leader's message, or on
    a union support every rank's values at the positions it named."""
    picked = values[lead] if not isinstance(lead, Tensor) else values[lead.to(values.device)]
    return picked.pow(2).mean().sqrt().clamp_min(1e-30)


def relative_magnitudes(values: Tensor) -> Tensor:
    """``|v| / RMS(v)`` of each row of ``values`` (a row is one message), flattened."""
    rms = values.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)
    return (values.abs() / rms).reshape(-1)


def fit_levels(magnitudes: Tensor, count: int, iters: int = 30, max_samples: int = 200_000, seed: int = 0) -> Tensor:
    """``count`` magnitude levels, sorted, fitted by Lloyd-Max to ``magnitudes``.

    The levels start at evenly spaced quantiles; each iteration assigns every magnitude to its
    nearest level and moves the level to the mean of what it was assigned (an empty level stays).
    At most ``max_samples`` magnitudes are used, drawn with a seeded generator, so the fit is
    deterministic. Computed in float64 on the CPU.

    The magnitudes are sorted once, so a level's share is the run between the midpoints to its
    neighbours (a magnitude on a midpoint goes to the lower level, as the nearest-level rule's
    first index does): an iteration costs ``count`` binary searches and one pass of segment sums
    instead of a table of every magnitude against every level, and gives the same levels.
    """
    m = magnitudes.detach().reshape(-1).double().cpu()
    if m.numel() > max_samples:
        m = m[torch.randperm(m.numel(), generator=torch.Generator().manual_seed(seed))[:max_samples]]
    if m.numel() == 0:
        return torch.ones(count, dtype=torch.float32)
    q = torch.linspace(0.5 / count, 1 - 0.5 / count, count, dtype=torch.float64)
    centers = torch.quantile(m, q)
    m = m.sort().values
    first, last = torch.zeros(1, dtype=torch.long), torch.full((1,), m.numel(), dtype=torch.long)
    for _ in range(iters):
        # Lloyd keeps the levels in order; argsort makes that an invariant, not an assumption
        order = centers.argsort(stable=True)
        ordered = centers[order]
        ends = torch.searchsorted(m, (ordered[1:] + ordered[:-1]) / 2, right=True)
        counts = torch.cat([first, ends, last]).diff()
        sums = torch.segment_reduce(m, "sum", lengths=counts)
        means = torch.where(counts > 0, sums / counts.clamp_min(1), ordered)
        centers = torch.empty_like(centers).index_put_((order,), means)
    return centers.sort().values.float()


#: up to this many midpoints (codes of up to 4 bits) :func:`nearest` counts them instead of a
#: binary search per value (``torch.bucketize``), which on a CPU is the slower up to about 8
MAX_COUNTED_MIDPOINTS = 7


def nearest(magnitudes: Tensor, levels: Tensor) -> Tensor:
    """The index of the level nearest to each of ``magnitudes`` (``levels`` sorted ascending)."""
    # the levels are sorted, so the nearest one is found by the midpoints between them: no
    # (values x levels) distance table on the hot path; a tie goes to the lower level
    midpoints = (levels[1:] + levels[:-1]) / 2
    if midpoints.numel() <= MAX_COUNTED_MIDPOINTS:
        # the number of midpoints a magnitude is not at or below: what bucketize returns (NaN
        # included, past the last), in half the time or less for these few
        return (magnitudes.unsqueeze(-1) <= midpoints).logical_not_().sum(-1)
    return torch.bucketize(magnitudes, midpoints)


def quantize(values: Tensor, levels: Tensor) -> tuple[Tensor, Tensor]:
    """``(r, codes)``: the RMS of ``values`` (a 1-element fp32 tensor) and one int32 code per value,
    ``sign bit << log2(len(levels)) | index of the nearest level``; ``levels`` sorted ascending,
    as :func:`fit_levels` returns them."""
    rms = values.pow(2).mean().sqrt().reshape(1).float()
    levels = levels.to(values.device)
    index = nearest(values.abs() / rms.clamp_min(1e-30), levels).to(torch.int32)
    sign = (values < 0).to(torch.int32) << (levels.numel().bit_length() - 1)
    return rms, sign | index


def dequantize(rms: Tensor, codes: Tensor, levels: Tensor) -> Tensor:
    """Inverse of :func:`quantize` up to the levels: ``sign * r * level``.

    A code is ``sign * len(levels) + index``, so it indexes the table ``[levels, -levels] * r``
    directly: the same products (``(-l) * r == -(l * r)`` exactly), made once a level instead of
    once a value, and one gather, about five times faster on a CPU than masking the code's fields
    apart."""
    levels = levels.to(codes.device)
    return torch.take(torch.cat([levels, -levels]) * rms.to(levels.dtype), codes.long())


def table_bits(levels: Tensor) -> int:
    """Bits a value takes on ``levels`` (its last dimension, ``2^(bits-1)`` magnitudes): one sign
    bit and ``bits - 1`` of magnitude."""
    return levels.shape[-1].bit_length()


def encode(values: Tensor, levels: Tensor) -> tuple[list[Tensor], Tensor]:
    """``([r, packed codes], decoded values)``: the message and what it decodes to, in
    :func:`table_bits` bits a value."""
    rms, codes = quantize(values, levels)
    return [rms, pack_codes(codes, table_bits(levels))], dequantize(rms, codes, levels)


def decode(message: list[Tensor], levels: Tensor, n: int) -> Tensor:
    """The ``n`` values of a message of :func:`encode`."""
    rms, packed = message
    return dequantize(rms.float(), unpack_codes(packed, table_bits(levels), n), levels)


def message_nbytes(n: int, bits: int) -> int:
    """Bytes of a message of ``n`` values: 4 for the RMS and the packed codes."""
    return 4 + codes_nbytes(n, bits)


def channel_rms(values: Tensor, channels: Tensor, count: int) -> Tensor:
    """The RMS of the ``values`` in each of ``count`` channels (``channels``: each value's channel),
    rounded to bfloat16 as it travels, at least ``1e-30`` (an empty or all-zero channel divides
    nothing by it, and its values decode to at most 1e-30 times a level)."""
    sums = torch.zeros(count, dtype=torch.float32, device=values.device)
    sums.index_add_(0, channels, values.float().square())
    sizes = torch.bincount(channels, minlength=count).clamp_min(1).to(torch.float32)
    return (sums / sizes).sqrt_().clamp_min_(1e-30).to(torch.bfloat16)


def normalize_by_channel(values: Tensor, channels: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """``(values / s[channel], s)``: the values in units of their channel's RMS ``s``
    (:func:`channel_rms`, as it travels)."""
    scales = channel_rms(values, channels, count)
    return values / scales.float().index_select(0, channels), scales


def encode_by_channel(values: Tensor, levels: Tensor, channels: Tensor, count: int) -> tuple[list[Tensor], Tensor]:
    """:func:`encode` of the values in units of their channel's RMS: the message is
    ``[the channels' RMS (bfloat16), r, packed codes]`` and a value decodes to
    ``sign(v) * s_channel * r * c_j``. Where a layer's channels differ in scale (a convolution's
    output channels do), one scale a message leaves the small channels' values on the lowest
    level and the large ones' beyond the highest; a scale a channel takes that spread out, for 2
    bytes a channel."""
    scales = channel_rms(values, channels, count)
    per_value = scales.float().index_select(0, channels)  # gathered once: to divide and to decode
    message, decoded = encode(values / per_value, levels)
    return [scales, *message], decoded * per_value


def encode_at(values: Tensor, levels: Tensor, positions: Tensor, numel: int, per: int) -> tuple[list[Tensor], Tensor]:
    """The message of a layer's ``values`` at ``positions`` (of its ``numel`` entries):
    :func:`encode_by_channel` when the layer's messages scale by channel of ``per`` entries, else
    (``per`` 0) :func:`encode`, one scale a message."""
    if per:
        return encode_by_channel(values, levels, positions // per, numel // per)
    return encode(values, levels)


def decode_by_channel(message: list[Tensor], levels: Tensor, channels: Tensor) -> Tensor:
    """The values of a message of :func:`encode_by_channel` (``channels``: each value's channel)."""
    scales, *rest = message
    return decode(rest, levels, channels.numel()) * scales.float().index_select(0, channels)


def normalize_sample(values: Tensor, named: Tensor | None, channels: Tensor, count: int) -> Tensor:
    """A stage-2 sample (``(N, K)`` values, ``channels`` each position's channel) as its messages of
    :func:`encode_by_channel` see it, in units of their channel's RMS within each message: each
    rank's row (the leader's support, ``named`` None) or, on a union support (``named`` who named
    what), each rank's values at the positions it named and at the rest."""
    out = torch.empty_like(values, dtype=torch.float32)
    for r in range(values.shape[0]):
        mine = named[r].to(values.device) if named is not None else torch.ones_like(channels, dtype=torch.bool)
        for part in (mine, ~mine):
            columns = part.nonzero().reshape(-1)
            if columns.numel():
                out[r, columns] = normalize_by_channel(values[r, columns].float(), channels[columns], count)[0]
    return out


def fit_layers(
    train: list, val: list, keys: list[str], fitted: Tensor, seed: int = 0
) -> tuple[float, dict[str, tuple[float, float]]]:
    """``lgc``'s switch: fit the levels of each layer in ``keys`` on the stage-2 samples ``train``
    (``(key, step, leader, numel, (N, K) values)``, every rank's messages) into ``fitted``, of shape
    ``(len(keys), 2, count)``: row :data:`LEADER` on the leaders' messages, row :data:`OTHERS` on
    the other ranks' (the leader's where there were none, on one rank). Return the relative error of
    the decoded aggregate on ``train`` and, per layer, its squared error and squared norm on
    ``val``, in units of the leader's RMS (as for the autoencoder, so the gate reads both alike)."""
    fit_roles(train, keys, fitted, seed)
    by_key = {k: fitted[i] for i, k in enumerate(keys)}
    train_errors = aggregate_errors(train, by_key).values()
    error = (sum(e for e, _ in train_errors) / max(sum(r for _, r in train_errors), 1e-30)) ** 0.5
    return error, aggregate_errors(val, by_key)


def fit_roles(train: list, keys: list[str], fitted: Tensor, seed: int = 0) -> None:
    """The fit of :func:`fit_layers` alone, without its errors: each layer's row :data:`LEADER` on
    the leaders' messages of ``train`` and row :data:`OTHERS` on the other ranks', into
    ``fitted`` (``(len(keys), 2, count)``); a layer without samples keeps its rows."""
    count = fitted.shape[-1]
    for i, key in enumerate(keys):
        samples = [(smp[2], smp[4].float().cpu()) for smp in train if smp[0] == key]
        if not samples:  # no sample of this layer: its rows keep what they held
            continue
        by_role: tuple[list[Tensor], list[Tensor]] = ([], [])
        for ld, v in samples:
            for r, rl, cols in role_parts(v, ld):
                by_role[rl].append(relative_magnitudes(v[r] if cols is None else v[r][cols]))
        lead = torch.cat(by_role[LEADER])
        others = torch.cat(by_role[OTHERS]) if by_role[OTHERS] else torch.empty(0)
        lead_row = fitted[i, LEADER] = fit_levels(lead, count, seed=seed + i).to(fitted.device)
        # on one rank there is no other message, and the leader's levels stand in
        fitted[i, OTHERS] = fit_levels(others, count, seed=seed + i).to(fitted.device) if others.numel() else lead_row


def aggregate_errors(samples: list, tables: dict[str, Tensor]) -> dict[str, tuple[float, float]]:
    """Per layer of ``samples`` (as :func:`fit_layers` takes them), the squared error of the decoded
    aggregate ``mean_i v_i`` with each rank's message coded on its role's row of ``tables[key]``,
    and the aggregate's squared norm, both in units of the leader's RMS."""
    out: dict[str, tuple[float, float]] = {}
    for key, _, lead, _, v in samples:
        v = v.float()
        scale = lead_scale(v, lead)
        table = tables[key].to(v.device)
        decoded = torch.empty_like(v)
        for r, rl, cols in role_parts(v, lead):
            if cols is None:
                decoded[r] = dequantize(*quantize(v[r], table[rl]), table[rl])
            else:
                decoded[r, cols] = dequantize(*quantize(v[r, cols], table[rl]), table[rl])
        e, r = out.get(key, (0.0, 0.0))
        out[key] = (
            e + float((decoded.mean(0) - v.mean(0)).div(scale).pow(2).sum()),
            r + float(v.mean(0).div(scale).pow(2).sum()),
        )
    return out


def refit_rows(samples: list, rows: Tensor, count: int, seed: int = 0) -> float | None:
    """``lgc``'s refit in stage 3: fit the rows of one layer's levels (``rows``, ``(2, count)``,
    written in place) again on one rank's own messages ``samples``, as ``(key, step, role, denser,
    relative magnitudes)``, and return the relative error of those messages on the held-out steps
    (the most recent eighth), or None without samples.

    A role's row is fitted again only from at least two steps of that role; otherwise it stays.
    The error is that of the kept magnitudes, which in units of each message's RMS is the error of
    its values (a value decodes to ``sign(v) r c_j``)."""
    if not samples:
        return None
    train, val = split_held_out(samples)
    for r in (LEADER, OTHERS):
        mine = [smp for smp in train if smp[2] == r]
        if len({smp[1] for smp in mine}) >= 2:
            magnitudes = torch.cat([smp[4].cpu() for smp in mine])
            rows[r] = fit_levels(magnitudes, count, seed=seed).to(rows.device)
    err = ref = 0.0
    for _, _, r, _, m in val:
        table = rows[r].to(m.device)
        err += float((m - table[nearest(m, table)]).pow(2).sum())
        ref += float(m.pow(2).sum())
    return (err / ref) ** 0.5 if ref > 0 else None


def split_held_out(samples: list) -> tuple[list, list]:
    """Training and held-out samples of ``samples`` (tuples whose second entry is the step): the
    most recent eighth of the steps is held out; with fewer than eight steps both are all of them."""
    steps = sorted({smp[1] for smp in samples})
    n_val = len(steps) // 8
    held = set(steps[len(steps) - n_val :]) if n_val else set()
    train = [smp for smp in samples if smp[1] not in held] or samples
    val = [smp for smp in samples if smp[1] in held] or samples
    return train, val
