"""How the ranks of lgc's union support tell one another their names: exact round trips in one process.

The two-rank runs in ``test_levels.py`` check the same exchange inside training; here each rank's
messages are built by the functions themselves and the all-gather is played by hand, so a wrong
offset, length or padding shows as a wrong name rather than as a different run.
"""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.codecs.lgc_names import (
    gap_code,
    gap_layout,
    gather_channel_names,
    gather_gap_names,
    read_gap_code,
)
from lightning_gradcomp.codecs.positions import (
    channel_counts,
    choose_encoding,
    encode_counts,
    encoded_nbytes,
    kernel_counts,
)

# a convolution with 3x3 kernels, a linear weight, a vector, a layer whose every position is named
PARAMS = [torch.zeros(8, 4, 3, 3), torch.zeros(10, 30), torch.zeros(50), torch.zeros(6, 2)]
NAMED = [29, 40, 7, 12]


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


def _counts(names: list[torch.Tensor], layouts: list) -> list[torch.Tensor | None]:
    """What a rank counts for the first message: kernels a channel for the kernel code, names a
    channel for the Rice code of a weight, nothing for a one-channel or a fully named layer."""
    counts: list[torch.Tensor | None] = []
    for idx, lay in zip(names, layouts):
        if lay is None or lay[0] == 1:
            counts.append(None)
        elif lay[2] > 1:
            counts.append(kernel_counts(idx, *lay))
        else:
            counts.append(channel_counts(idx, lay[0], lay[1]))
    return counts


def test_layouts_name_kernels_channels_and_a_vector():
    assert _layouts(kernels=True) == [(8, 36, 9), (10, 30, 1), (1, 50, 1), None]
    assert _layouts(kernels=False)[0] == (8, 36, 1)


@pytest.mark.parametrize("kernels", [True, False])
def test_the_gap_code_of_several_layers_reads_back_exactly_past_its_padding(kernels):
    layouts, names = _layouts(kernels), _names(0)
    counts = _counts(names, layouts)
    bits = torch.cat([gap_code(names, layouts, counts), torch.zeros(13, dtype=torch.bool)])
    # a receiver knows a one-channel layer's count: the named size
    read_counts = [torch.tensor([m]) if c is None else c for c, m in zip(counts, NAMED)]
    decoded = read_gap_code(bits, layouts, read_counts, names)
    assert sorted(decoded) == [0, 1, 2]
    for i in range(3):
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
    counts = [_counts(n, layouts) for n in names]
    codes = [gap_code(n, layouts, c) for n, c in zip(names, counts)]
    assert codes[0].numel() != codes[1].numel()  # the shorter one is padded
    firsts = [
        torch.cat(
            [encode_counts(c, lay[1] // lay[2]) for c, lay in zip(cs, layouts) if c is not None]
            + [torch.tensor([code.numel()], dtype=torch.int32).view(torch.uint8)]
        )
        for cs, code in zip(counts, codes)
    ]
    got, second = _two_ranks(
        firsts,
        lambda gather, rows, rank: gather_gap_names(gather, rows, 0, rank, names[rank], layouts, codes[rank]),
    )
    assert second == -(-max(c.numel() for c in codes) // 8)
    for i, full in enumerate(NAMED[3:], start=3):  # every position named: no code
        assert torch.equal(got[i][0], torch.arange(full))
    for i in range(3):
        assert torch.equal(got[i][0], names[0][i]) and got[i][1] is names[1][i]


def test_a_rank_learns_the_other_ranks_channel_coded_names():
    names = [_names(0), _names(1)]
    numels = [p.numel() for p in PARAMS]
    encodings = [choose_encoding("auto", m, n) for m, n in zip(NAMED, numels)]
    code_bytes = [encoded_nbytes(e, m, n) for e, m, n in zip(encodings, NAMED, numels)]
    channels = [(8, 36), (10, 30), None, None]  # the weights; the vector and the full layer one code
    counts = [[None if ch is None else channel_counts(idx, *ch) for idx, ch in zip(n, channels)] for n in names]
    firsts = [torch.cat([encode_counts(c, ch[1]) for c, ch in zip(cs, channels) if ch is not None]) for cs in counts]
    got, _ = _two_ranks(
        firsts,
        lambda gather, rows, rank: gather_channel_names(
            gather, rows, 0, rank, names[rank], channels, counts[rank], encodings, code_bytes, numels
        ),
    )
    for i in range(len(PARAMS)):
        assert torch.equal(got[i][0], names[0][i]) and got[i][1] is names[1][i]
