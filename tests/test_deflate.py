"""The ``deflate`` harness option: messages on the CPU travel compressed without loss.

What every rank receives is unchanged to the bit, so a run with ``deflate`` takes the same steps as
one without; on the steps whose messages hold exact values it sends fewer bytes."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_gloo
from test_plain_dtype import _steps  # the same two-layer run, stage, gradients and bytes a step

from lightning_gradcomp.comm import deflate, inflate
from lightning_gradcomp.registry import make_codec

WARMUP, TRAIN, STEPS = 3, 4, 10  # lgc: steps 0-2 plain, 3-6 stage 2, 7-9 the learned levels
LGC = dict(code="levels", warmup_steps=WARMUP, ae_train_steps=TRAIN, ratio=0.1, min_numel=1000, dense_layers="none")


@pytest.mark.parametrize("word", [1, 2, 4])
@pytest.mark.parametrize("n", [0, 1, 7, 4096, 100_003])
def test_inflate_returns_the_bytes_deflate_was_given(n, word):
    gen = torch.Generator().manual_seed(n)
    msg = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    assert torch.equal(inflate(deflate(msg, word), n, word), msg)


def test_a_bfloat16_gradient_shrinks_by_its_exponent_planes():
    """Random bytes do not compress; the values of a gradient do, once their bytes are split into
    planes: a bfloat16 value's high byte (sign and exponent) is the predictable one."""
    gen = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (200_000,), dtype=torch.uint8, generator=gen)
    assert deflate(noise, 2).numel() > noise.numel()  # zlib's framing on incompressible bytes
    grad = (torch.randn(100_000, generator=gen) * 1e-3).to(torch.bfloat16).view(torch.uint8)
    planes, interleaved = deflate(grad, 2).numel(), deflate(grad, 1).numel()
    assert planes < 0.8 * grad.numel()
    assert planes < interleaved


def _gather_mixed(rank: int, world: int) -> list[torch.Tensor]:
    from lightning_gradcomp.comm import allgather_deflated_async

    gen = torch.Generator().manual_seed(rank)
    # rank 0's bytes do not compress and travel as they are; the others' shrink
    msg = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=gen) if rank == 0 else torch.full((5000,), rank)
    fut, nbytes = allgather_deflated_async(msg.to(torch.uint8), None, word=2)
    rows = fut.wait().rows()
    return [rows, torch.tensor(nbytes)]


def test_a_gather_mixes_raw_and_deflated_messages_and_every_rank_reads_every_one():
    out = run_gloo(_gather_mixed, 3)
    expected = torch.stack(
        [torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))]
        + [torch.full((5000,), r, dtype=torch.uint8) for r in (1, 2)]
    )
    for rows, nbytes in out:
        assert torch.equal(rows, expected)
        assert int(nbytes) == 5000 + 8  # the longest message (rank 0's, as it is) and the size


@pytest.mark.parametrize("world", [2, 3])
def test_deflated_messages_train_to_the_same_bits_with_fewer_bytes(world):
    """Every stage of ``lgc`` with and without ``deflate``: the same gradients on every rank and
    step, to the bit. With two ranks the plain steps of stage 1 are gathered compressed and summed
    as the all-reduce sums; with three they stay an all-reduce (the same bytes). Stage 2's exact
    values in bfloat16 travel in fewer bytes either way."""
    options = {on: dict(LGC, plain_dtype="bfloat16", deflate=on) for on in (False, True)}
    runs = {on: run_gloo(_steps, world, args=("lgc", options[on], STEPS)) for on in (False, True)}
    plain, deflated = runs[False], runs[True]
    assert [r["stage"] for r in plain[0]] == [1] * WARMUP + [2] * TRAIN + [3] * (STEPS - WARMUP - TRAIN)
    for step in range(STEPS):
        for rank in range(world):
            for name, g in plain[rank][step]["grads"].items():
                assert torch.equal(g, deflated[rank][step]["grads"][name]), (step, rank, name)
    for step, (p, d) in enumerate(zip(plain[0], deflated[0])):
        if p["stage"] == 1 and world > 2:
            assert d["bytes"] == p["bytes"]
        elif p["stage"] in (1, 2):
            assert d["bytes"] < p["bytes"], step


def test_deflate_is_checked_off_by_default_and_lossless_on_resume():
    with pytest.raises(ValueError, match="deflate must be True or False"):
        make_codec("lgc", deflate="yes")
    assert make_codec("lgc").harness.deflate is False
    assert make_codec("topk", deflate=True).harness.deflate is True
    for codec in ("lgc", "iwp", "topk"):
        assert "deflate" in make_codec(codec).lossless_options
