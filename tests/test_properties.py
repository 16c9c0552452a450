"""Property tests (hypothesis) of every registered codec in its compressing phase, single process.

Every codec in ``available_codecs()`` has a case: its own in ``CASES`` (options, the phase to reach),
or by default the codec with its default options from its first compressing step. Each
case is warmed up once, through the hook's order of calls (:mod:`codec_driver`), until it really
compresses (gradiveq with a fitted basis, lgc with its autoencoder carrying the layer), then copied
for every example: one-element layers, odd lengths, fp32/fp16/bf16 gradients (upcast to fp32 as
the hook does), all zeros, huge (1e30) and tiny (1e-30) magnitudes. Checked: no crash, the right
shape, finite output wherever the codec's wire format can represent the input, what other ranks
decode from the payload equals the codec's own reconstruction, and the codec's stated error bound
(:meth:`Codec.error_bound`) holds.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from codec_driver import one_rank_group, round_trip, set_up, warm_up
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_gradcomp import available_codecs, make_codec
from lightning_gradcomp.codecs.base import BucketRouter, Codec
from lightning_gradcomp.registry import codec_class

torch.set_num_threads(1)

REGISTERED = set(available_codecs())  # before any test registers a codec of its own

_AE = {"warmup_steps": 2, "ae_train_steps": 3, "ratio": 0.5, "ae_width": 4, "ae_epochs": 1, "ae_samples": 3}
#: case -> (codec, options, whether the codec is in the phase this case is about at a step)
CASES: dict[str, tuple[str, dict, object]] = {
    "none": ("none", {}, None),  # never compresses in the hook: its identity code is tested directly
    "fp16": ("fp16", {}, None),
    "qsgd": ("qsgd", {}, None),
    "terngrad": ("terngrad", {}, None),
    "topk": ("topk", {}, None),
    "rangefloat": ("rangefloat", {}, None),
    "fft": ("fft", {}, None),
    "fft@layer": ("fft", {"selection": "layer"}, None),  # a sampled threshold over the whole layer
    "iwp": ("iwp", {}, None),
    "powersgd": ("powersgd", {"rank": 2}, None),
    "gradiveq": ("gradiveq", {}, None),
    "gradiveq@aggregate": ("gradiveq", {"basis_source": "aggregate", "warmup_steps": 3}, lambda c, s: c.fitted),
    "lgc": ("lgc", {**_AE, "max_recon_error": math.inf}, lambda c, s: c.stage(s) == 3 and c.ae_trained),
    "lgc@ps": ("lgc", {**_AE, "variant": "ps", "max_recon_error": math.inf}, lambda c, s: c.stage(s) == 3),
    "lgc@union": (
        "lgc",
        {**_AE, "support": "union", "max_recon_error": math.inf},
        lambda c, s: c.stage(s) == 3 and c.ae_trained,
    ),
}
# a codec without a case of its own is tested with its default options; a router (auto) encodes
# no layer itself: its arms are the codecs tested here, its routing is tested in test_auto.py
ROUTERS = {n for n in REGISTERED if issubclass(codec_class(n), BucketRouter)}
CASES.update({n: (n, {}, None) for n in REGISTERED - ROUTERS - {name for name, _, _ in CASES.values()}})
# how far a wire format reaches: fp16 overflows beyond 65504 (the hook catches that, see
# test_reliability::test_nonfinite_gradient_with_plain_ddp_zeroes_the_bucket_on_every_rank);
# everything else must stay finite at 1e30
FINITE_LIMIT = {"fp16": 6.0e4}
WARM_LAYER = 2048

lengths = st.one_of(st.just(1), st.integers(2, 40).map(lambda n: 2 * n + 1), st.integers(1000, 3000))
scales = st.sampled_from([0.0, 1e-30, 1e-8, 1.0, 1e4, 1e30])
dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


@functools.cache
def _warmed(case: str) -> tuple[Codec, int]:
    """The case's codec after its warm-up on a random layer, and the first step it compresses."""
    name, options, ready = CASES[case]
    codec = set_up(make_codec(name, **options))
    if name == "none":
        return codec, 2
    x = torch.randn(WARM_LAYER, generator=torch.Generator().manual_seed(1))
    step = warm_up(codec, x, "layer", torch.ones(WARM_LAYER), ready or (lambda c, s: True))
    return codec, step


def _fresh(case: str) -> tuple[Codec, int]:
    codec, step = _warmed(case)
    codec = copy.deepcopy(codec)
    if codec.collective == "custom":  # torch's PowerSGD state holds the process group: made anew
        one_rank_group()  # conftest destroys the group after every test, the cached codec outlives it
        codec.setup(codec.context)
    return codec, step


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=lengths, scale=scales, dtype=dtypes, seed=st.integers(0, 2**16))
def test_every_codec_round_trips_within_its_stated_bound(
    case: str, n: int, scale: float, dtype: torch.dtype, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    grad = (torch.randn(n, generator=g) * scale).to(dtype)
    assume(bool(torch.isfinite(grad).all()))  # a non-finite gradient is the hook's business
    x = grad.float()  # the hook upcasts every layer to fp32
    param = torch.ones(n, dtype=dtype)
    codec, step = _fresh(case)
    if case != "none":
        assert codec.is_compressing(step), f"{case}: not in its compressing phase at step {step}"
    enc, remote = round_trip(codec, x, "layer", param, step)
    local = remote if enc is None else enc.local if enc.local is not None else codec.decode(enc.payload, enc.ctx, n, 1)
    assert local.shape == (n,) and local.dtype == torch.float32
    assert remote.shape == (n,)
    limit = FINITE_LIMIT.get(case, math.inf)
    if float(x.abs().max()) <= limit:
        assert bool(torch.isfinite(local).all()), f"{case}: non-finite reconstruction at scale {scale}"
        assert bool(torch.isfinite(remote).all())
        # deterministic codecs reconstruct the same on every rank as locally
        torch.testing.assert_close(remote, local, rtol=1e-5, atol=1e-30 + 1e-6 * float(local.abs().max()))
    if scale == 0.0:
        assert float(local.abs().max()) == 0.0, f"{case}: zero gradient decodes to non-zero"
    bound = codec.error_bound(x)
    if bound is not None and math.isfinite(bound):
        err = float((x.double() - local.double()).norm())
        assert err <= bound, f"{case}: error {err} above its stated bound {bound} (n={n}, scale={scale})"


@pytest.mark.parametrize("case", sorted(CASES))
def test_encoding_leaves_the_global_generator_alone(case: str) -> None:
    # a codec draws from generators of its own (seeded by seed, rank, step and layer): the user's
    # random stream (dropout, augmentation, each rank's data) must not depend on the codec. The
    # layer is large enough for every sampled selection to sample (1 % of at least 102,400
    # entries: fft@layer selects among its 200,000 coefficients)
    codec, step = _fresh(case)
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(3))
    before = torch.get_rng_state()
    round_trip(codec, x, "layer", torch.ones(400_000), step)
    assert torch.equal(torch.get_rng_state(), before), f"{case} drew from torch's global generator"


def test_stated_bounds_are_tight_enough() -> None:
    """The bounds mean something: topk's is exact and fp16's is 2^-11 relative."""
    x = torch.randn(4001, generator=torch.Generator().manual_seed(0))
    topk = set_up(make_codec("topk"))
    enc = topk.encode(x, "w", x, 2)
    err = float((x - enc.local).double().norm())
    assert abs(topk.error_bound(x) - err) <= 1e-6 * err
    fp16 = set_up(make_codec("fp16"))
    assert fp16.error_bound(x) <= 2.0**-10 * float(x.norm())
    assert fp16.error_bound(x * 1e6) == math.inf  # beyond fp16's range: no bound is claimed
    assert set_up(make_codec("qsgd")).error_bound(x) is None  # codecs that state nothing


def test_property_test_covers_exactly_the_registered_codecs() -> None:
    assert {name for name, _, _ in CASES.values()} | ROUTERS == REGISTERED


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=50),
    bad=st.sampled_from([math.nan, math.inf, -math.inf, None]),
    where=st.integers(min_value=0, max_value=49),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_the_hooks_nonfinite_check_never_misses_a_nan_or_inf(values, bad, where, dtype) -> None:
    """``holds_nonfinite`` (one summing pass) finds every NaN and Inf, as ``isfinite().all()``
    does, and raises no false alarm on finite values far from fp32's overflow."""
    from lightning_gradcomp.hook.encode import holds_nonfinite

    t = torch.tensor(values, dtype=torch.float32).to(dtype)
    if bad is not None:
        t[where % t.numel()] = bad
    exact = not bool(torch.isfinite(t).all())
    fast = bool(holds_nonfinite(t))
    assert fast or not exact  # never misses
    if not exact and max(abs(float(v)) for v in t.float()) < 1e30:  # far from overflow: no false alarm
        assert not fast
