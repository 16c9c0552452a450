"""Range-based float: the stated error bound on random and heavy-tailed data, the format, the codec."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lightning_gradcomp import make_codec
from lightning_gradcomp.codecs.bits import codes_nbytes, pack_codes, unpack_codes
from lightning_gradcomp.codecs.rangefloat import RangeFloat, rf_quantize

FORMATS = [RangeFloat(bits, rounding=r) for bits in (8, 10, 16) for r in ("nearest", "stochastic")] + [
    RangeFloat(8, exponent_bits=3),
    RangeFloat(12, exponent_bits=2),
]


def assert_within_bound(fmt: RangeFloat, x: torch.Tensor) -> None:
    """The docstring's guarantee: relative error <= 2^-(m+1) (nearest; < 2^-m stochastic) at or above the
    smallest normal 2^b, absolute error <= 2^(b-m-1) (nearest; < 2^(b-m) stochastic) below it."""
    payload = fmt.encode(x, torch.Generator().manual_seed(1))
    y = fmt.decode(payload, x.numel())
    b, e = (int(v) for v in payload[0])
    m = fmt.bits - 1 - e
    assert payload[1].numel() == codes_nbytes(x.numel(), fmt.bits)  # fixed size: depends on n only
    xd, yd = x.double(), y.double()
    err = (yd - xd).abs()
    normal = xd.abs() >= 2.0**b
    rel_bound = fmt.max_relative_error(payload[0])
    abs_bound = 2.0 ** (b - m - 1) if fmt.rounding == "nearest" else 2.0 ** (b - m)
    assert rel_bound <= fmt.max_relative_error()  # the per-message bound never exceeds the format's
    if normal.any():
        rel = (err[normal] / xd.abs()[normal]).max().item()
        assert rel <= rel_bound, (rel, rel_bound)
    if (~normal).any():
        assert err[~normal].max().item() <= abs_bound
    # the sign never flips and zero stays zero
    assert bool(((yd * xd) >= 0).all())
    assert bool((y[x == 0] == 0).all())


finite32 = st.floats(min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=arrays(np.float32, st.integers(1, 300), elements=finite32), fmt=st.sampled_from(FORMATS))
def test_bound_on_arbitrary_floats(data, fmt):
    assert_within_bound(fmt, torch.from_numpy(data.copy()))


@pytest.mark.parametrize("fmt", FORMATS)
def test_bound_on_fp32_subnormals(fmt):
    # a layer of tiny values puts the range at its floor (b = -126), where the scale 2^(m - b)
    # leaves fp32's range: found by the property test above on [9.09817e-40]
    for values in ([9.09817e-40], [1e-45, -3e-39, 1.1e-38], [2.0**-126, 2.0**-140]):
        assert_within_bound(fmt, torch.tensor(values, dtype=torch.float32))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    dist=st.sampled_from(["normal", "cauchy", "lognormal", "student2"]),
    scale=st.floats(1e-12, 1e6),
    fmt=st.sampled_from(FORMATS),
)
def test_bound_on_random_and_heavy_tailed_data(seed, dist, scale, fmt):
    g = torch.Generator().manual_seed(seed)
    n = 3000
    z = torch.randn(n, generator=g)
    if dist == "cauchy":  # ratio of normals: infinite variance, huge dynamic range
        x = z / torch.randn(n, generator=g)
    elif dist == "lognormal":
        x = torch.exp(2.0 * z) * torch.sign(torch.randn(n, generator=g))
    elif dist == "student2":
        x = z / torch.sqrt((torch.randn(n, generator=g) ** 2 + torch.randn(n, generator=g) ** 2) / 2)
    else:
        x = z
    assert_within_bound(fmt, (x * scale).float())


def test_heavy_tail_flushes_only_far_below_the_largest_value():
    # Cauchy samples span ~20 binades; an 8-bit format with 4 exponent bits covers 15 normal binades
    # below the largest value plus subnormals, and everything below that becomes zero (abs bound)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g) / torch.randn(100_000, generator=g)
    fmt = RangeFloat(8)
    payload = fmt.encode(x)
    b, e = (int(v) for v in payload[0])
    assert e == 4 and b == math.frexp(float(x.abs().max()))[1] - 1 - 2**e + 2
    y = fmt.decode(payload, x.numel())
    assert bool((y[x.abs() < 2.0 ** (b - 4)] == 0).all())
    assert_within_bound(fmt, x)


def test_exactly_representable_values_round_trip():
    fmt = RangeFloat(10, exponent_bits=4)  # m = 5
    m = 5
    mant = torch.arange(2**m, dtype=torch.float32)
    values = torch.cat([(1 + mant / 2**m) * 2.0**k for k in range(-6, 8)] + [mant * 2.0 ** (-6 - m)])
    x = torch.cat([values, -values])
    x = x[x.abs() <= x.abs().max()]
    assert torch.equal(fmt.decode(fmt.encode(x), x.numel()), x)


@pytest.mark.parametrize(
    "x", [torch.zeros(10), torch.full((7,), -3.25), torch.tensor([1e-40, 0.0, -1e-39]), torch.zeros(0)]
)
def test_empty_constant_and_tiny_inputs_decode_exactly_or_to_zero(x):
    fmt = RangeFloat(8)
    y = fmt.decode(fmt.encode(x), x.numel())
    assert y.shape == x.shape
    if x.numel() and bool((x == x[0]).all()) and float(x[0]) != 0:
        assert torch.equal(y, x)  # a constant is the top of its own range: exact when representable
    else:
        assert float((y - x).abs().max()) <= 1e-38 if x.numel() else True


def test_auto_exponent_gives_narrow_ranges_more_mantissa():
    narrow = torch.linspace(1.0, 1.9, 100)
    h, _ = rf_quantize(narrow, bits=8)
    assert int(h[1]) == 1  # one binade: e = 1, m = 6
    wide = torch.logspace(-6, 6, 100)
    h, _ = rf_quantize(wide, bits=8)
    assert int(h[1]) == 4  # capped at 4 exponent bits for 8-bit codes


def test_stochastic_rounding_is_unbiased():
    x = torch.full((200_000,), 1.0 + 1.0 / 3.0)  # between two 8-bit codes
    x[0] = 1.9  # sets the top binade
    fmt = RangeFloat(8, rounding="stochastic")
    y = fmt.decode(fmt.encode(x, torch.Generator().manual_seed(0)), x.numel())
    assert len(torch.unique(y[1:])) == 2
    assert abs(float(y[1:].double().mean()) - 4.0 / 3.0) < 1e-3
    nearest = RangeFloat(8).decode(RangeFloat(8).encode(x), x.numel())
    assert abs(float(nearest[1:].double().mean()) - 4.0 / 3.0) > 5e-3  # biased, for contrast


@pytest.mark.parametrize("bits", [4, 7, 8, 9, 10, 12, 16, 21, 24])
def test_code_packing_round_trips(bits):
    codes = torch.randint(0, 2**bits, (1001,), dtype=torch.int32)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == codes_nbytes(1001, bits)
    assert packed.numel() <= math.ceil(1001 * bits / 8) + 1
    assert torch.equal(unpack_codes(packed, bits, 1001), codes)


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"bits": 3}, "bits"),
        ({"bits": 17}, "bits"),
        ({"exponent_bits": 7}, "exponent_bits"),
        ({"rounding": "up"}, "rounding"),
    ],
)
def test_invalid_options_name_the_option(kwargs, option):
    with pytest.raises(ValueError, match=option):
        make_codec("rangefloat", **kwargs)


def test_codec_payload_local_and_aggregate():
    codec = make_codec("rangefloat", bits=10)
    assert codec.collective == "allgather" and codec.harness.error_feedback
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4096, generator=g) * s for s in (1.0, 1e-3)]
    encs = [codec.encode(x, "w", x, 5) for x in xs]
    for x, enc in zip(xs, encs):
        dec = codec.decode(enc.payload, enc.ctx, x.numel(), 1)
        assert torch.equal(dec, enc.local)
        assert float((dec - x).norm() / x.norm()) < codec.format.max_relative_error()
        assert sum(p.numel() * p.element_size() for p in enc.payload) == 8 + codes_nbytes(4096, 10)
    total = codec.aggregate([e.payload for e in encs], None, 4096)
    assert torch.allclose(total, encs[0].local + encs[1].local)
