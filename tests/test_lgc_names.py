"""How the ranks of lgc's union support tell one another their names: exact round trips in one process.

The two-rank runs in ``test_levels.py`` check the same exchange inside training; here each rank's
messages are built by the functions themselves and the all-gather is played by hand, so a wrong
offset, length or padding shows as a wrong name rather than as a different run.
"""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.codecs.lgc_names import (
    first_names,
    gap_layout,
    gather_channel_names,
    gather_gap_names,
    names_in,
    read_gap_code,
)
from lightning_gradcomp.codecs.positions import channel_code_nbytes, choose_encoding, encoded_nbytes

# a convolution with 3x3 kernels, a linear weight, a vector, a layer whose every position is
# named, a 1-D convolution with kernels of 2 (the kernel code's smallest)
PARAMS = [torch.zeros(8, 4, 3, 3), torch.zeros(10, 30), torch.zeros(50), torch.zeros(6, 2), torch.zeros(4, 3, 2)]
NAMED = [29, 40, 7, 12, 5]
# (channels, entries a channel) of the weights whose names travel per channel, as lgc sets them
CHANNELS = [(8, 36), (10, 30), None, None, (4, 6)]
CODED = [0, 1, 2, 4]  # the layers with a gap code: all but the fully named one
NUMELS = [p.numel() for p in PARAMS]
ENCODINGS = [choose_encoding("auto", m, n) for m, n in zip(NAMED, NUMELS)]
CODE_BYTES = [encoded_nbytes(e, m, n) for e, m, n in zip(ENCODINGS, NAMED, NUMELS)]


def _names(seed: int) -> list[torch.Tensor]:
    """One rank's names: ``NAMED`` sorted positions a layer, drawn with more weight on a few
    channels, as a gradient's large values crowd."""
    g = torch.Generator().manual_seed(seed)
    names = []
    for p, m in zip(PARAMS, NAMED):
        rows = p.shape[0] if p.dim() > 1 else 1
        weight = torch.rand(rows, generator=g).pow(3.0).repeat_interleave(p.numel() // rows)
        names.append(torch.topk(torch.rand(p.numel(), generator=g) * weight, m).indices.sort().values)
    return names


def _layouts(kernels: bool) -> list:
    return [gap_layout(p, p.numel(), m, kernels) for p, m in zip(PARAMS, NAMED)]


def _first(
    names: list[torch.Tensor], layouts: list, gapped: bool, by_channel: bool = True
) -> tuple[torch.Tensor, list, torch.Tensor | None]:
    """A rank's first message for its names, its counts and its gap code."""
    channels = CHANNELS if by_channel else [None] * len(PARAMS)
    parts, counts, code = first_names(names, channels, layouts, ENCODINGS, NUMELS, by_channel, gapped)
    return torch.cat(parts), counts, code


def test_layouts_name_kernels_channels_and_a_vector():
    assert _layouts(kernels=True) == [(8, 36, 9), (10, 30, 1), (1, 50, 1), None, (4, 6, 2)]
    assert _layouts(kernels=False)[0] == (8, 36, 1) and _layouts(kernels=False)[4] == (4, 6, 1)


@pytest.mark.parametrize("kernels", [True, False])
def test_the_gap_code_of_several_layers_reads_back_exactly_past_its_padding(kernels):
    layouts, names = _layouts(kernels), _names(0)
    _, counts, code = _first(names, layouts, gapped=True)
    assert counts[0].numel() == 8 and counts[2] is None and counts[3] is None
    assert code.numel() > 0
    bits = torch.cat([code, torch.zeros(13, dtype=torch.bool)])
    # a receiver knows a one-channel layer's count: the named size
    read_counts = [torch.tensor([m]) if c is None else c for c, m in zip(counts, NAMED)]
    decoded = read_gap_code(bits, layouts, read_counts, names)
    assert sorted(decoded) == CODED
    for i in CODED:
        assert torch.equal(decoded[i], names[i])


class _Sent(Exception):
    """Stops rank 0 once its second message is built."""


def _two_ranks(first_messages: list[torch.Tensor], exchange) -> list:
    """Play a two-rank exchange in one process: rank 0 runs up to its second all-gather and its
    message is kept; rank 1 then receives both. Returns what rank 1 decoded."""
    rows = torch.stack(first_messages)
    sent: list[torch.Tensor] = []

    def gather_as_rank_0(msg: torch.Tensor) -> torch.Tensor:
        sent.append(msg)
        raise _Sent

    def gather_as_rank_1(msg: torch.Tensor) -> torch.Tensor:
        assert msg.numel() == sent[0].numel()  # both padded to the longest
        return torch.stack([sent[0], msg])

    with pytest.raises(_Sent):
        exchange(gather_as_rank_0, rows, 0)
    return exchange(gather_as_rank_1, rows, 1)


@pytest.mark.parametrize("kernels", [True, False])
def test_a_rank_learns_the_other_ranks_gap_coded_names(kernels):
    layouts = _layouts(kernels)
    names = [_names(0), _names(1)]
    firsts, _, codes = zip(*(_first(n, layouts, gapped=True) for n in names))
    assert codes[0].numel() != codes[1].numel()  # the shorter one is padded
    got, second = _two_ranks(
        firsts,
        lambda gather, rows, rank: gather_gap_names(gather, rows, 0, rank, names[rank], layouts, codes[rank]),
    )
    assert second == -(-max(c.numel() for c in codes) // 8)
    assert torch.equal(got[3][0], torch.arange(NAMED[3]))  # every position named: no code
    for i in CODED:
        assert torch.equal(got[i][0], names[0][i]) and got[i][1] is names[1][i]


def test_a_rank_learns_the_other_ranks_channel_coded_names():
    names = [_names(0), _names(1)]
    no_gaps = [None] * len(PARAMS)
    firsts, counts, codes = zip(*(_first(n, no_gaps, gapped=False) for n in names))
    assert codes == (None, None)
    got, second = _two_ranks(
        firsts,
        lambda gather, rows, rank: gather_channel_names(
            gather, rows, 0, rank, names[rank], CHANNELS, counts[rank], ENCODINGS, CODE_BYTES, NUMELS
        ),
    )
    for i in range(len(PARAMS)):
        assert torch.equal(got[i][0], names[0][i]) and got[i][1] is names[1][i]
    # each weight in the smaller of its two codes, every rank's message padded to the longest
    per_rank = [
        sum(
            b if c is None else min(b, int(channel_code_nbytes(c[None], ch[1])))
            for c, ch, b in zip(cs, CHANNELS, CODE_BYTES)
        )
        for cs in counts
    ]
    assert second == max(per_rank) < sum(CODE_BYTES)


def test_a_rank_reads_the_other_ranks_layer_coded_names_from_the_first_message():
    names = [_names(0), _names(1)]
    no_gaps = [None] * len(PARAMS)
    firsts, counts, _ = zip(*(_first(n, no_gaps, gapped=False, by_channel=False) for n in names))
    assert all(c is None for c in counts[0])
    assert firsts[0].numel() == sum(CODE_BYTES)  # one code a layer, its size known from the count
    got = names_in(torch.stack(firsts), 0, 1, names[1], ENCODINGS, CODE_BYTES, NUMELS)
    for i in range(len(PARAMS)):
        assert torch.equal(got[i][0], names[0][i]) and got[i][1] is names[1][i]
