"""The per-channel position codes: exact sizes, lossless round trips, and where they beat one code."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.codecs.positions import (
    channel_code_nbytes,
    channel_counts,
    choose_encoding,
    counts_nbytes,
    decode_channel_positions,
    decode_counts,
    decode_positions,
    encode_channel_positions,
    encode_counts,
    encode_positions,
    encoded_nbytes,
    kernel_counts,
    kernel_fields,
    kernel_index_bits,
    kernel_positions,
    quotients_of,
    rice_fields,
    rice_low_bits,
    rice_positions,
    rice_widths,
    unary_bits,
)


def _support(channels: int, per: int, k: int, crowd: float, seed: int = 0) -> torch.Tensor:
    """``k`` sorted positions of a ``(channels, per)`` weight; ``crowd`` > 0 gathers them in a few
    channels, as a gradient's large values gather."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.rand(channels, generator=g).pow(crowd).repeat_interleave(per)
    score = torch.rand(channels * per, generator=g) * weight
    return torch.topk(score, k).indices.sort().values


@pytest.mark.parametrize(
    "channels, per, k, crowd",
    [
        (64, 576, 369, 0.0),  # sparse and even: every channel in Elias-Fano
        (64, 576, 5000, 8.0),  # crowded: full, dense (bitmap) and empty channels side by side
        (10, 512, 51, 2.0),
        (2, 3, 6, 0.0),  # every position
        (3, 4, 1, 0.0),
        (128, 9, 300, 3.0),  # short channels, as a 3x3 kernel's
        (16, 100, 0, 0.0),  # no position at all
    ],
)
def test_channel_code_round_trips_in_exactly_its_size(channels, per, k, crowd):
    pos = _support(channels, per, k, crowd)
    counts = channel_counts(pos, channels, per)
    assert counts.sum() == k and counts.numel() == channels
    header = encode_counts(counts, per)
    assert header.dtype == torch.uint8 and header.numel() == counts_nbytes(channels, per)
    assert torch.equal(decode_counts(header, channels, per), counts)
    code = encode_channel_positions(pos, counts, per)
    assert code.dtype == torch.uint8 and code.numel() == int(channel_code_nbytes(counts, per))
    assert torch.equal(decode_channel_positions(code, counts, per), pos)


@pytest.mark.parametrize("per", [1, 4, 9, 64])
def test_channel_counts_round_trip_from_an_empty_to_a_full_channel(per):
    # a count lies in [0, per]: a full channel needs per.bit_length() bits (3 for per = 4)
    counts = torch.tensor([0, per, 1, per - 1, per])
    data = encode_counts(counts, per)
    assert data.numel() == counts_nbytes(5, per) == -(-5 * per.bit_length() // 8)
    assert torch.equal(decode_counts(data, 5, per), counts)


def test_channel_sizes_come_per_rank_from_stacked_counts():
    """Every rank computes every rank's code size from the gathered counts, in one call."""
    per = 576
    counts = torch.stack([channel_counts(_support(64, per, 900, c, seed=c), 64, per) for c in (0, 4, 8)])
    sizes = channel_code_nbytes(counts, per)
    assert sizes.shape == (3,)
    assert sizes.tolist() == [int(channel_code_nbytes(row, per)) for row in counts]


def test_a_dense_channel_travels_as_its_bitmap():
    """A channel holding most of its positions costs its width in bits, not an Elias-Fano code's
    ``count + width`` (and the round trip still holds)."""
    per = 64
    pos = torch.cat([torch.arange(0, 60), torch.tensor([64 + 5])])  # 60 of channel 0, 1 of channel 1
    counts = channel_counts(pos, 2, per)
    bitmap_bits, ef_bits = per, 1 * (6 + 1) + ((per - 1) >> 6) + 1
    assert int(channel_code_nbytes(counts, per)) == -(-(bitmap_bits + ef_bits) // 8)
    assert torch.equal(decode_channel_positions(encode_channel_positions(pos, counts, per), counts, per), pos)


def test_crowded_channels_take_fewer_bytes_than_one_code_over_the_layer():
    channels, per, k = 64, 576, 2580  # 7 % of a 3x3 conv with 64 input channels
    crowded = _support(channels, per, k, crowd=6.0)
    even = _support(channels, per, k, crowd=0.0)
    layer = encoded_nbytes(choose_encoding("auto", k, channels * per), k, channels * per)
    header = counts_nbytes(channels, per)
    assert header + int(channel_code_nbytes(channel_counts(crowded, channels, per), per)) < 0.9 * layer
    # spread evenly there is nothing to gain: the counts' header is then a cost
    assert header + int(channel_code_nbytes(channel_counts(even, channels, per), per)) > layer


def test_a_corrupt_channel_code_is_refused():
    """A code with fewer high parts than its counts promise raises instead of decoding positions
    that were never sent."""
    pos = _support(8, 100, 40, crowd=2.0)
    counts = channel_counts(pos, 8, 100)
    code = encode_channel_positions(pos, counts, 100)
    with pytest.raises(ValueError, match="corrupt position code"):
        decode_channel_positions(torch.zeros_like(code), counts, 100)


def test_a_corrupt_layer_code_is_refused():
    # the one code over a layer (iwp's, lgc's leader): fewer high parts than positions
    pos = torch.tensor([3, 17, 40, 41, 90])
    code = encode_positions(pos, 100, "delta")
    with pytest.raises(ValueError, match="corrupt position code: 0 high parts for 5 positions"):
        decode_positions(torch.zeros_like(code), 5, 100, "delta")


def test_layer_code_sizes_at_known_points():
    # Elias-Fano's low bits are floor(log2(n / k)): 3 positions of 100 take 5 (n / k = 33.3), so
    # 15 low bits and 3 + (99 >> 5) + 1 = 7 high ones, 2 + 1 bytes
    assert encoded_nbytes("delta", 3, 100) == 3 == encode_positions(torch.tensor([1, 50, 99]), 100, "delta").numel()
    # where the two codes take the same bytes, the choice is Elias-Fano
    ties = [
        (k, n)
        for n in range(8, 120)
        for k in range(1, n)
        if encoded_nbytes("delta", k, n) == encoded_nbytes("bitmap", k, n)
    ]
    assert ties and all(choose_encoding("auto", k, n) == "delta" for k, n in ties)


def test_a_channel_takes_its_bitmap_as_soon_as_elias_fano_is_not_shorter():
    # 64 entries: 20 positions in Elias-Fano take 20 * 2 + (63 >> 1) + 1 = 72 bits, 16 take
    # 16 * 3 + 15 + 1 = 64: both go as the 64-bit bitmap; 2 take 2 * 6 + 1 + 1 = 14 bits
    assert [int(channel_code_nbytes(torch.tensor([c]), 64)) for c in (20, 16, 2)] == [8, 8, 2]


# The Rice code of the gaps (position_code="rice", lgc's default on a union support).


def _rice_round_trip(layers: list[tuple[torch.Tensor, torch.Tensor, int]]) -> list[torch.Tensor]:
    """Several layers' names in one message, as ``lgc`` sends them: every layer's low bits, then
    one unary field of every quotient, then the zeros that pad a message to the longest rank's."""
    fields = [rice_fields(pos, counts, per) for pos, counts, per in layers]
    bits = torch.cat([low for low, _ in fields] + [unary_bits(torch.cat([q for _, q in fields]))])
    bits = torch.cat([bits, torch.zeros(21, dtype=torch.bool)])
    low_bits = [rice_low_bits(counts, per) for _, counts, per in layers]
    assert low_bits == [low.numel() for low, _ in fields]
    k_all = [pos.numel() for pos, _, _ in layers]
    quotients = quotients_of(bits[sum(low_bits) :], sum(k_all)).split(k_all)
    lows = bits[: sum(low_bits)].split(low_bits)
    return [rice_positions(low, q, counts, per) for low, q, (_, counts, per) in zip(lows, quotients, layers)]


@pytest.mark.parametrize(
    "channels, per, k, crowd",
    [
        (64, 576, 369, 0.0),
        (64, 576, 5000, 8.0),  # full, dense and empty channels side by side
        (10, 512, 51, 2.0),
        (3, 4, 1, 0.0),
        (128, 9, 300, 3.0),
        (16, 100, 0, 0.0),  # no position at all
        (1, 3000, 1000, 0.0),  # a vector: one channel
    ],
)
def test_rice_code_of_several_layers_round_trips(channels, per, k, crowd):
    pos = _support(channels, per, k, crowd)
    other = _support(7, 50, 20, 1.0, seed=3)
    layers = [(pos, channel_counts(pos, channels, per), per), (other, channel_counts(other, 7, 50), 50)]
    back = _rice_round_trip(layers)
    assert torch.equal(back[0], pos) and torch.equal(back[1], other)


def test_rice_widths_follow_the_density():
    """About ``log2(0.48 / p) + 1`` bits of each gap verbatim: 3 at the heavy steps' 7 %, 1 at the
    light steps' 25 %, none for a channel named mostly, whose code then costs at most its width."""
    per = 1000
    assert rice_widths(torch.tensor([70, 250, 500, 1000]), per).tolist() == [3, 1, 0, 0]
    pos = torch.arange(0, 1000, 2)  # half of one channel
    low, quotients = rice_fields(pos, torch.tensor([500]), per)
    assert low.numel() == 0 and int((quotients + 1).sum()) <= per


def test_rice_takes_fewer_bits_than_elias_fano_and_nearly_the_entropy():
    """On names spread evenly over 3x3-kernel channels, at the heavy and the light steps' density,
    the Rice code of the gaps takes fewer bits than Elias-Fano per channel, and no more than 3 %
    above the binary entropy of each channel's count (the least any code of the set can take)."""
    channels, per = 128, 576
    for fraction in (0.07, 0.25):
        k = int(fraction * channels * per)
        pos = _support(channels, per, k, crowd=0.0, seed=1)
        counts = channel_counts(pos, channels, per)
        low, quotients = rice_fields(pos, counts, per)
        rice = low.numel() + int((quotients + 1).sum())
        elias_fano = 8 * int(channel_code_nbytes(counts, per))
        p = counts.double() / per
        entropy = float((-(p * p.log2() + (1 - p) * (1 - p).log2()) * per).sum())
        assert rice < 0.95 * elias_fano and rice < 1.03 * entropy, (fraction, rice, elias_fano, entropy)


def test_a_corrupt_rice_code_is_refused():
    with pytest.raises(ValueError, match="corrupt position code"):
        quotients_of(torch.zeros(40, dtype=torch.bool), 5)


# The kernel code (position_code="kernel", lgc's default on a union support).


@pytest.mark.parametrize("size", [2, 4, 9, 12])
@pytest.mark.parametrize("fraction, crowd", [(0.07, 0.0), (0.07, 6.0), (0.25, 2.0), (0.9, 0.0), (0.0, 0.0)])
def test_kernel_code_round_trips_in_one_message_with_a_rice_coded_layer(size, fraction, crowd):
    channels, kernels = 12, 10
    per = kernels * size
    pos = _support(channels, per, int(fraction * channels * per), crowd)
    counts = kernel_counts(pos, channels, per, size)
    assert counts.numel() == channels and bool((counts <= kernels).all())
    other = _support(5, 40, 9, 1.0, seed=4)
    other_counts = channel_counts(other, 5, 40)
    lows, unary, index = kernel_fields(pos, counts, per, size)
    other_lows, other_q = rice_fields(other, other_counts, 40)
    padding = torch.zeros(9, dtype=torch.bool)
    bits = torch.cat([lows, other_lows, unary_bits(torch.cat([unary, other_q])), index, padding])
    # what a receiver reads: the low bits' lengths from the counts, then the unary values, whose
    # second half (the kernels' entries) fixes the index widths
    n_low = rice_low_bits(counts, kernels)
    assert n_low == lows.numel()
    named = int(counts.sum())
    values = quotients_of(bits[n_low + other_lows.numel() :], 2 * named + other.numel())
    unary_end = n_low + other_lows.numel() + int((values + 1).sum())
    n_index = int(kernel_index_bits(values[named : 2 * named] + 1, size))
    assert n_index == index.numel()
    back = kernel_positions(lows, values[: 2 * named], bits[unary_end : unary_end + n_index], counts, per, size)
    assert torch.equal(back, pos)
    assert torch.equal(rice_positions(other_lows, values[2 * named :], other_counts, 40), other)


def test_a_kernels_entries_travel_as_their_count_and_the_index_of_their_pattern():
    """A 3x3 kernel with ``c`` named entries costs ``c`` unary bits and ``ceil(log2 C(9, c))``
    index bits: 4 for one entry, 7 for four, none for all nine."""
    entries = torch.tensor([1, 4, 9, 2])
    assert int(kernel_index_bits(entries, 9)) == 4 + 7 + 0 + 6
    pos = torch.tensor([3, 9, 10, 14, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26])  # kernels 0, 1 (4 entries), 2 (all)
    counts = kernel_counts(pos, 1, 27, 9)
    lows, unary, index = kernel_fields(pos, counts, 27, 9)
    assert counts.tolist() == [3] and unary[3:].tolist() == [0, 3, 8] and index.numel() == 4 + 7 + 0
    assert torch.equal(kernel_positions(lows, unary, index, counts, 27, 9), pos)


def test_crowded_kernels_take_fewer_bits_than_the_gaps_of_their_entries():
    """Names crowded into a fifth of a 3x3 convolution's kernels (as a gradient's are): the kernel
    code takes at least 10 % fewer bits than the Rice code of the entries' gaps; spread evenly,
    one entry a kernel, it takes more (the counts and indices then cost what they save)."""
    g = torch.Generator().manual_seed(0)
    channels, kernels, size = 64, 64, 9
    per = kernels * size
    score = torch.rand(channels, kernels, 1, generator=g).lt(0.2) * 3 + torch.rand(channels, kernels, size, generator=g)
    crowded = torch.topk(score.reshape(-1), int(0.07 * channels * per)).indices.sort().values
    spread = (torch.arange(0, channels * kernels, 2) * size + 4).sort().values  # one entry of every other kernel
    for pos, kernel_wins in ((crowded, True), (spread, False)):
        lows, unary, index = kernel_fields(pos, kernel_counts(pos, channels, per, size), per, size)
        kernel = lows.numel() + int((unary + 1).sum()) + index.numel()
        rice_lows, quotients = rice_fields(pos, channel_counts(pos, channels, per), per)
        rice = rice_lows.numel() + int((quotients + 1).sum())
        assert (kernel < 0.9 * rice) if kernel_wins else (kernel > rice), (kernel, rice)
