"""The per-channel position code: exact sizes, lossless round trips, and where it beats one code."""

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
    encode_channel_positions,
    encode_counts,
    encoded_nbytes,
)


def _support(channels: int, per: int, k: int, crowd: float, seed: int = 0) -> torch.Tensor:
    """``k`` sorted positions of a ``(channels, per)`` weight; ``crowd`` > 0 gathers them in a few
    channels, as a gradient's top values gather."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.rand(channels, generator=g).pow(crowd).repeat_interleave(per)
    score = torch.rand(channels * per, generator=g) * weight
    return torch.topk(score, k).indices.sort().values


@pytest.mark.parametrize(
    "channels, per, k, crowd",
    [(64, 576, 369, 0.0), (64, 576, 369, 6.0), (10, 512, 51, 2.0), (2, 3, 6, 0.0), (3, 4, 1, 0.0), (128, 9, 100, 3.0)],
)
def test_channel_code_round_trips_in_exactly_its_size(channels, per, k, crowd):
    pos = _support(channels, per, k, crowd)
    counts = channel_counts(pos, channels, per)
    assert counts.sum() == k and counts.numel() == channels
    header = encode_counts(counts, per)
    assert header.dtype == torch.uint8 and header.numel() == counts_nbytes(channels, per)
    assert torch.equal(decode_counts(header, channels, per), counts)
    code = encode_channel_positions(pos, counts, per)
    assert code.numel() == channel_code_nbytes(counts.tolist(), per)
    assert torch.equal(decode_channel_positions(code, counts, per), pos)


def test_channel_code_size_is_elias_fano_per_channel():
    # channel 0 holds 3 of 64 positions: 4 low bits each and 3 + (63 >> 4) + 1 = 7 high bits;
    # channel 2 holds 1: 6 low bits, 1 + (63 >> 6) + 1 = 2 high bits; channel 1 none: nothing
    assert channel_code_nbytes([3, 0, 1], 64) == -(-(3 * 4 + 7 + 6 + 2) // 8)
    assert counts_nbytes(3, 64) == -(-3 * 7 // 8)  # counts in [0, 64]: 7 bits each


def test_crowded_support_costs_fewer_bytes_by_channel_and_a_spread_one_does_not():
    channels, per, k = 256, 576, 1475  # a 3x3 convolution's weight at 1 %
    n = channels * per
    layer = encoded_nbytes(choose_encoding("auto", k, n), k, n)
    crowded = _support(channels, per, k, crowd=8.0)
    spread = _support(channels, per, k, crowd=0.0)
    header = counts_nbytes(channels, per)
    crowded_total = header + channel_code_nbytes(channel_counts(crowded, channels, per).tolist(), per)
    spread_total = header + channel_code_nbytes(channel_counts(spread, channels, per).tolist(), per)
    assert crowded_total < 0.8 * layer < layer < spread_total


def test_a_corrupt_channel_code_is_refused_on_the_cpu():
    pos = _support(8, 64, 20, 2.0)
    counts = channel_counts(pos, 8, 64)
    code = encode_channel_positions(pos, counts, 64)
    with pytest.raises(ValueError, match="corrupt position code"):
        decode_channel_positions(torch.zeros_like(code), counts, 64)
