"""Exact properties of the baseline codecs and the shared packing helpers (single process)."""

import math
from types import SimpleNamespace

import pytest
import torch
from codec_driver import LayerBucket, round_trip, set_up
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_gradcomp import CodecContext, make_codec
from lightning_gradcomp.codecs.base import RoundContext
from lightning_gradcomp.codecs.bits import (
    bits_to_hold,
    digits_nbytes,
    digits_per_byte,
    pack_bits,
    pack_digits,
    packed_nbytes,
    unpack_bits,
    unpack_digits,
)
from lightning_gradcomp.comm import pack, unpack, wire_bytes


def setup_codec(name, world=1, rank=0, **options):
    codec = make_codec(name, **options)
    codec.setup(CodecContext(rank, world, torch.device("cpu")))
    return codec


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 16), n=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_bit_packing_round_trips(bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.int32)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n, bits)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


@settings(max_examples=60, deadline=None)
@given(base=st.integers(2, 256), n=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_digit_packing_round_trips_in_the_fewest_whole_digits_a_byte(base, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, base, (n,), generator=g, dtype=torch.int32)
    packed = pack_digits(codes, base)
    per = digits_per_byte(base)
    assert base**per <= 256 < base ** (per + 1)  # as many digits as a byte holds, no more
    assert packed.dtype == torch.uint8 and packed.numel() == digits_nbytes(n, base) == -(-n // per)
    assert torch.equal(unpack_digits(packed, base, n), codes)
    if base in (2, 4, 16, 256):  # a power of two dividing 256: the bit fields' bytes exactly
        assert torch.equal(packed, pack_bits(codes, base.bit_length() - 1))


def test_a_field_holds_its_largest_value_in_the_fewest_bits():
    for largest in range(1, 5000):
        b = bits_to_hold(largest)
        assert 2 ** (b - 1) <= largest < 2**b, largest  # it fits, and one bit fewer would not
    assert bits_to_hold(0) == 1  # a field is never empty
    assert bits_to_hold(2**24 - 1) == 24 and bits_to_hold(2**24) == 25


def test_ternary_codes_pack_five_to_a_byte():
    assert digits_per_byte(3) == 5 and digits_nbytes(11_000_000, 3) == 2_200_000  # 1.6 bits, not 2
    assert digits_per_byte(5) == 3 and digits_per_byte(15) == 2 and digits_per_byte(17) == 1
    with pytest.raises(ValueError, match="base must be in"):
        digits_per_byte(1)


def test_pack_unpack_keeps_dtypes_and_shapes():
    parts = [
        torch.randn(3, 5),
        torch.arange(7, dtype=torch.int32),
        torch.tensor([1, 2], dtype=torch.uint8),
        torch.randn(4).half(),
        torch.zeros(0),
    ]
    buf, layout = pack(parts, torch.device("cpu"))
    assert buf.numel() % 8 == 0 and layout.payload_bytes == sum(p.numel() * p.element_size() for p in parts)
    for a, b in zip(parts, unpack(buf, layout)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_wire_bytes_follow_the_ring_algorithms():
    assert wire_bytes("allreduce", 1000, 2) == 1000
    assert wire_bytes("allreduce", 1000, 4) == 1500
    assert wire_bytes("allgather", 1000, 4) == 3000
    assert wire_bytes("broadcast", 1000, 8) == 1000


def test_topk_keeps_exactly_the_largest_entries():
    codec = setup_codec("topk", ratio=0.1)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    enc = codec.encode(x, "w", x, step=5)
    values, idx = enc.payload
    assert values.numel() == idx.numel() == 100
    threshold = x.abs().kthvalue(900).values
    assert set(idx.tolist()) == set(torch.nonzero(x.abs() > threshold).flatten().tolist())
    assert torch.equal(enc.local[idx.long()], x[idx.long()])
    assert torch.count_nonzero(enc.local) == 100
    # aggregate of several ranks' payloads is the sum of their decodes
    y = torch.randn(1000)
    enc_y = codec.encode(y, "w", y, step=5)
    total = codec.aggregate([enc.payload, enc_y.payload], None, 1000)
    assert torch.allclose(total, codec.decode(enc.payload, None, 1000, 1) + codec.decode(enc_y.payload, None, 1000, 1))


def test_fp16_error_is_within_half_precision():
    codec = setup_codec("fp16", world=4)
    x = torch.randn(10_000) * 10
    enc = codec.encode(x, "w", x, 3)
    assert enc.payload[0].dtype == torch.float16
    rel = (enc.local - x).abs() / x.abs().clamp_min(1e-3)
    assert float(rel.max()) <= 2**-11 + 1e-6
    # what travels is divided by the world size, so a sum over 4 ranks cannot overflow
    assert torch.allclose(codec.decode([enc.payload[0] * 4], None, x.numel(), 4), 4 * x, rtol=2e-3, atol=1e-2)


def test_fp16_bound_follows_the_world_size_and_compresses_every_layer():
    codec = setup_codec("fp16", world=4)
    assert codec.harness.min_numel == 0  # a small layer halves its bytes too
    # beyond 65504 on a rank, but within range once divided by the 4 ranks: bounded
    big = torch.tensor([131008.0, -1.0])
    assert math.isfinite(codec.error_bound(big))
    assert float((codec.encode(big, "w", big, 0).local - big).norm()) <= codec.error_bound(big)
    # below half of fp16's smallest step once divided by 4, so it rounds to zero: the floor of the
    # bound is that half step scaled back by the world size
    tiny = torch.tensor([3 * 2.0**-25])
    assert float(codec.encode(tiny, "w", tiny, 0).local[0]) == 0.0
    assert float(tiny[0]) <= codec.error_bound(tiny)


@pytest.mark.parametrize("levels, bits", [(1, 1.6), (2, 8 / 3), (3, 4), (7, 4), (8, 8), (127, 8)])
def test_qsgd_is_unbiased_and_bounded(levels, bits):
    codec = setup_codec("qsgd", levels=levels, chunk_size=64)
    assert codec.bits == bits  # the 2s + 1 signed levels as digits, as many to a byte as fit
    x = torch.randn(256, generator=torch.Generator().manual_seed(1))
    draws = torch.stack([codec.encode(x, "w", x, step).local for step in range(3000)])
    mean = draws.mean(0)
    assert torch.allclose(mean, x, atol=0.15 if levels <= 3 else 0.05)
    enc = codec.encode(x, "w", x, 0)
    norms, codes = enc.payload
    assert codes.numel() == math.ceil(256 * bits / 8) == digits_nbytes(256, 2 * levels + 1)
    decoded = codec.decode(enc.payload, None, 256, 1)
    assert torch.equal(decoded, enc.local)
    # each chunk travels with its L2 norm (not its largest magnitude: that scale is unbiased too,
    # but it is another method, with another variance)
    assert torch.allclose(norms, x.view(-1, 64).norm(dim=1))
    # each entry is a multiple of norm/levels, at most the chunk norm in magnitude
    chunk_norm = norms.repeat_interleave(64)
    assert torch.all(decoded.abs() <= chunk_norm + 1e-6)


@pytest.mark.parametrize("name", ["qsgd", "terngrad"])
def test_stochastic_draws_are_reproducible_per_step_rank_and_layer(name):
    # the same draws on every rank would round every rank's gradient the same way, and the average
    # over the ranks would keep their whole rounding error instead of 1/N of its variance
    a, b = setup_codec(name, rank=0), setup_codec(name, rank=1)
    x = torch.randn(5000)
    codes = a.encode(x, "w", x, 7).payload[1]
    assert torch.equal(codes, a.encode(x, "w", x, 7).payload[1])
    assert not torch.equal(codes, b.encode(x, "w", x, 7).payload[1])
    assert not torch.equal(codes, a.encode(x, "w", x, 8).payload[1])
    assert not torch.equal(codes, a.encode(x, "v", x, 7).payload[1])


def test_terngrad_is_ternary_and_unbiased_for_the_clipped_gradient():
    codec = setup_codec("terngrad", clip=2.5)
    x = torch.randn(512, generator=torch.Generator().manual_seed(2))
    bound = 2.5 * x.std()
    clipped = x.clamp(-bound, bound)
    enc = codec.encode(x, "w", x, 0)
    scale = float(enc.payload[0])
    assert math.isclose(scale, float(clipped.abs().max()), rel_tol=1e-6)
    assert set(torch.unique(enc.local / scale).tolist()) <= {-1.0, 0.0, 1.0}
    assert enc.payload[1].numel() == digits_nbytes(512, 3) == 103  # five to a byte: 1.6 bits a value
    assert torch.equal(codec.decode(enc.payload, None, 512, 1), enc.local)
    mean = torch.stack([codec.encode(x, "w", x, s).local for s in range(3000)]).mean(0)
    assert torch.allclose(mean, clipped, atol=0.12)


def test_terngrad_without_clipping_scales_by_the_largest_magnitude():
    x = torch.randn(512, generator=torch.Generator().manual_seed(2))
    for clip in (0.0, math.inf):  # 0 disables clipping, as an unbounded clip does
        enc = setup_codec("terngrad", clip=clip).encode(x, "w", x, 0)
        assert float(enc.payload[0]) == float(x.abs().max())


def test_randk_ranks_draw_the_same_positions_and_every_step_new_ones():
    # the positions never travel: every rank must draw the same ones for a step and layer, or the
    # all-reduce would add unrelated entries; and a new set each step, or what one step's draw left
    # out would wait in the residual for ever
    ranks = [setup_codec("randk", world=2, rank=r, ratio=0.1) for r in range(2)]
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    encs = [codec.encode(x, "w", x, 7) for codec, x in zip(ranks, xs)]
    idx = encs[0].ctx
    assert idx.numel() == 100 and torch.equal(idx, encs[1].ctx)
    for enc, x in zip(encs, xs):
        assert torch.equal(enc.payload[0], x[idx])
        assert torch.equal(enc.local, torch.zeros(1000).index_put_((idx,), x[idx]))
    total = ranks[0].decode([encs[0].payload[0] + encs[1].payload[0]], idx, 1000, 2)
    assert torch.equal(total, encs[0].local + encs[1].local)
    drawn = {tuple(sorted(ranks[0].encode(xs[0], "w", xs[0], step).ctx.tolist())) for step in range(150)}
    assert len(drawn) == 150
    assert set().union(*drawn) == set(range(1000))
    assert not torch.equal(ranks[0].encode(xs[0], "v", xs[0], 7).ctx, idx)  # each layer its own draw
    odd = torch.randn(1005)
    assert ranks[0].encode(odd, "w", odd, 7).ctx.numel() == 101  # ceil(ratio * n), as every sparsifier
    # what was not drawn waits in the residual, and momentum factor masking clears the sent positions
    assert ranks[0].harness.error_feedback and ranks[0].sparse_local


# --------------------------------------------------------------------------------------------------
# powersgd: the wrapper's own rules around torch's hook (its exchange is torch's, tested in
# test_hook_gloo and test_callback_threads)
def test_powersgd_compresses_the_matrices_torch_compresses():
    codec = make_codec("powersgd")  # rank 4, min_compression_rate 2
    assert codec.compresses_parameter("w", torch.zeros(64, 64))
    assert not codec.compresses_parameter("b", torch.zeros(10_000))  # vectors travel whole
    assert not codec.compresses_parameter("w", torch.zeros(4, 8))  # rank-4 factors are not 2x smaller
    # torch caps the rank at the smaller side: a 3 x 1000 matrix at rank 3 costs 3,009 for 3,000
    assert make_codec("powersgd", min_compression_rate=0.75).compresses_parameter("w", torch.zeros(3, 1000))
    grads = SimpleNamespace(gradients=lambda: [torch.zeros(64, 64), torch.zeros(64)])
    assert codec.payload_elements(grads) == (64 + 64) * 4 + 64  # the factors, and the bias whole


def test_powersgd_counts_the_non_finite_flag_and_a_new_rank_drops_p_and_q():
    codec = set_up(make_codec("powersgd", rank=2))
    grad, param = torch.randn(64 * 32, generator=torch.Generator().manual_seed(0)), torch.ones(64, 32)
    recorded: list[dict] = []
    round_trip(codec, grad, "w", param, 2, RoundContext(2, codec.context, record=lambda **s: recorded.append(s)))
    assert recorded[0]["payload_bytes"] == 4 * (64 + 32) * 2 + 4  # P and Q, and the 4-byte flag
    state = codec._torch_state
    assert state.q_memory_dict[0].numel() == 32 * 2  # torch keeps a bucket's Qs flat
    codec.set_level(0.0)  # rank 8: P and Q of rank 2 cannot be reused
    assert state.matrix_approximation_rank == 8 and not state.p_memory_dict and not state.q_memory_dict
    round_trip(codec, grad, "w", param, 3)
    assert state.q_memory_dict[0].numel() == 32 * 8


def test_powersgd_records_the_bytes_torchs_hook_all_reduces(monkeypatch):
    # the bytes in the statistics come from a formula (payload_elements); here they are checked
    # against what torch's hook hands to its all-reduces, on the gloo path, at both ranks in use:
    # a conv weight and a linear weight it compresses, a matrix too small to pay, a bias and a
    # vector that travel whole, on a first step (fresh Q) and a warm-started one
    from lightning_gradcomp.codecs import powersgd as powersgd_module

    codec = set_up(make_codec("powersgd", rank=2))
    shapes = [(16, 8, 3, 3), (16,), (40, 30), (3, 4), (7,)]
    sent: list[int] = []
    blocking_all_reduce = powersgd_module._BlockingCollectives.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return blocking_all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(powersgd_module._BlockingCollectives, "all_reduce", staticmethod(counting_all_reduce))
    for step, level in [(2, 1.0), (3, 1.0), (4, 0.0), (5, 0.0)]:
        codec.set_level(level)
        rank = codec.rank_in_use
        recorded: list[dict] = []
        sent.clear()
        params = [torch.ones(s) for s in shapes]
        grads = torch.randn(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(step))
        bucket = LayerBucket(grads, params)
        rc = RoundContext(step, codec.context, record=lambda **s: recorded.append(s))
        codec.communicate_bucket(bucket, [], torch.zeros(1), rc).wait()
        whole = 16 + 3 * 4 + 7  # the vectors, and the matrix whose factors would not be smaller
        if rank == 2:
            factors = (16 + 72) * 2 + (40 + 30) * 2
        else:  # rank 8: the conv's factors (88 x 8) are not twice smaller than its 1,152 values
            assert rank == 8
            whole, factors = whole + 16 * 72, (40 + 30) * 8
        assert sum(sent) == 4 * (whole + factors), (step, rank, sent)
        assert recorded[0]["payload_bytes"] == sum(sent) + 4  # and the 4-byte non-finite flag


def test_powersgd_refuses_what_would_double_torchs_own_state():
    with pytest.raises(ValueError, match="use use_error_feedback, not error_feedback"):
        make_codec("powersgd", error_feedback=True)
    with pytest.raises(ValueError, match="cannot take momentum correction"):
        make_codec("powersgd", momentum=0.9)
    assert make_codec("powersgd").harness.min_numel == 0  # torch's own rule picks the matrices


def test_powersgd_skipped_step_draws_the_same_fresh_q_again():
    # a first compressed step draws Q from torch's seeded generator; if the step is skipped (a NaN
    # on some rank), the generator goes back with P, Q and the error, so the next try draws alike
    codec = set_up(make_codec("powersgd", rank=2))
    state = codec._torch_state
    grad, param = torch.randn(64 * 32, generator=torch.Generator().manual_seed(0)), torch.ones(64, 32)

    def first_step() -> torch.Tensor:
        round_trip(codec, grad, "w", param, 2, RoundContext(2, codec.context, revertible=True))
        return state.q_memory_dict[0].clone()

    q = first_step()
    assert codec.end_step(discarded=True) == [0]
    assert not state.q_memory_dict and not state.error_dict
    assert torch.equal(first_step(), q)
