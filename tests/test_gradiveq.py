"""GradiVeQ: option checks, exact PCA properties, and real 2-process gloo runs (plain DDP and Lightning)."""

import io
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from codec_driver import set_up
from dist_utils import run_gloo
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import make_comm_hook
from lightning_gradcomp.codecs.base import CodecContext, RoundContext
from lightning_gradcomp.codecs.gradiveq import GradiVeQCodec, _max_magnitude, _pack, _SharedScale, fit_pca
from lightning_gradcomp.hook.encode import local_reconstruction
from lightning_gradcomp.registry import make_codec


def fitted_codec(world: int = 1, n: int = 2000, steps: int = 3, **opts) -> tuple[GradiVeQCodec, torch.Generator]:
    """A codec fitted on low-rank-plus-noise 'gradients' of one layer called 'w'."""
    opts = {
        "slice_dim": 8,
        "num_components": 3,
        "warmup_steps": steps,
        "refresh_every": 0,
        "min_numel": 0,
        "quant_levels": 0,
        **opts,
    }
    codec = make_codec("gradiveq", **{"basis_source": "aggregate", **opts})
    codec.setup(CodecContext(0, world, torch.device("cpu")))
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        codec.observe_dense("w", torch.randn(n, generator=g), step)
    codec.on_step_end(steps - 1)
    return codec, g


# --------------------------------------------------------------------------------------------------
# options
@pytest.mark.parametrize(
    "opts, name",
    [
        ({"slice_dim": 1}, "slice_dim"),
        ({"slice_dim": 0}, "slice_dim"),
        ({"slice_dim": 8, "num_components": 9}, "num_components"),
        ({"num_components": 0}, "num_components"),
        ({"variance_target": 0.0}, "variance_target"),
        ({"variance_target": 1.5}, "variance_target"),
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"refresh_every": -1}, "refresh_every"),
        ({"refresh_window": 0}, "refresh_window"),
        ({"max_samples": 0}, "max_samples"),
        ({"basis": "global"}, "basis"),
        ({"quant_levels": -1}, "quant_levels"),
        ({"quant_levels": 2**22}, r"quant_levels must be in \[0, 4194303\]"),  # one past the largest
        ({"quant_scale": "tensor"}, "quant_scale"),
        ({"quant_rounding": "up"}, "quant_rounding"),
        ({"min_numel": -5}, "min_numel"),
    ],
)
def test_bad_options_raise_naming_the_option(opts, name):
    with pytest.raises(ValueError, match=name):
        make_codec("gradiveq", **{"basis_source": "aggregate", **opts})


def test_quant_levels_too_large_for_the_world_raise_at_setup():
    codec = make_codec("gradiveq", quant_levels=2**21)
    codec.setup(CodecContext(0, 2, torch.device("cpu")))  # 2*2*2^21 = 2^23 fits 24 bits
    codec = make_codec("gradiveq", quant_levels=2**21)
    with pytest.raises(ValueError, match="quant_levels"):
        codec.setup(CodecContext(0, 4, torch.device("cpu")))


def test_callback_options_are_checked():
    from lightning_gradcomp.callbacks import PCAWarmup

    PCAWarmup()  # constructible with no arguments
    with pytest.raises(ValueError, match="warmup_steps"):
        PCAWarmup(warmup_steps=0)
    with pytest.raises(ValueError, match="refresh_window"):
        PCAWarmup(refresh_window=0)
    with pytest.raises(ValueError, match="refresh_every"):
        PCAWarmup(refresh_every=-1)
    assert PCAWarmup(refresh_every=0).refresh_every == 0  # documented: never refit
    # what the codec takes, the callback takes: its default warm-up is a fraction of the run
    assert PCAWarmup(warmup_steps=0.1).overrides() == {"warmup_steps": 0.1}
    with pytest.raises(ValueError, match="warmup_steps must be an integer >= 0 .steps. or a float in .0, 1."):
        PCAWarmup(warmup_steps=1.5)
    with pytest.raises(ValueError, match="refresh_every must be an integer >= 0, got 0.5"):
        PCAWarmup(refresh_every=0.5)


# --------------------------------------------------------------------------------------------------
# the fit
def test_fit_pca_is_orthonormal_signed_deterministic_and_exact_on_low_rank_data():
    g = torch.Generator().manual_seed(1)
    basis = torch.linalg.qr(torch.randn(16, 3, generator=g, dtype=torch.float64))[0]
    x = torch.randn(500, 3, generator=g, dtype=torch.float64) @ basis.T
    u, mu, ev = fit_pca(x, 3, None, center=False)
    assert u.dtype == torch.float64 and u.shape == (16, 3)
    torch.testing.assert_close(u.T @ u, torch.eye(3, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(mu, torch.zeros(16, dtype=torch.float64))
    assert float(ev) == pytest.approx(1.0, abs=1e-12)
    torch.testing.assert_close(x @ u @ u.T, x, atol=1e-10, rtol=0)  # the span is recovered exactly
    assert (u[u.abs().argmax(0), torch.arange(3)] > 0).all()  # sign convention
    u2, _, _ = fit_pca(x.clone(), 3, None, center=False)
    assert torch.equal(u, u2)
    # a variance target picks the smallest k that reaches it: 3 here, never more
    u3, _, _ = fit_pca(x, 16, 0.999, center=False)
    assert u3.shape[1] == 3
    u1, _, ev1 = fit_pca(x, 16, 1e-6, center=False)
    assert u1.shape[1] == 1 and 0 < float(ev1) < 1
    # a layer whose samples are all zero loses nothing: its basis explains all of it
    u0, _, ev0 = fit_pca(torch.zeros(10, 16), 2, None, center=False)
    assert float(ev0) == 1.0 and u0.shape == (16, 2)


def test_components_never_exceed_the_slice_at_any_level():
    assert make_codec("gradiveq", slice_dim=2).configured_components == 2  # the default 4 capped at d
    codec = make_codec("gradiveq")
    codec.set_level(0.0)
    assert codec.num_components == 16  # four times the configured 4 at the light level
    codec = make_codec("gradiveq", num_components=32)
    codec.set_level(0.0)
    assert codec.num_components == 64  # four times 32 capped at the slice's 64
    codec.set_level(1.0)
    assert codec.num_components == 32


def test_every_rank_samples_the_same_slices_of_the_aggregated_gradient():
    # the aggregate is the same on every rank, and so must be the rows kept of it, or the bases
    # would differ; a window of 4 steps keeps ceil(102 / 4) = 26 of each step's 1,000 slices
    g = torch.randn(64 * 1000, generator=torch.Generator().manual_seed(0))
    kept = []
    for rank in (0, 1):
        codec = make_codec("gradiveq", basis_source="aggregate", warmup_steps=4, max_samples=102)
        codec.setup(CodecContext(rank, 2, torch.device("cpu")))
        codec.observe_dense("w", g, 0)
        kept.append(codec.state_dict()["samples"]["w"][0])
    assert kept[0].shape == (26, 64) and torch.equal(kept[0], kept[1])


def test_the_leader_refits_every_refit_every_steps_from_the_first_compressed_one():
    codec = set_up(make_codec("gradiveq", refit_every=3))
    x = torch.randn(64 * 50, generator=torch.Generator().manual_seed(0))
    fits = []
    for step in range(2, 10):
        prepared = codec.prepare_bucket([("w", x, x)], RoundContext(step, codec.context))
        assert prepared.nbytes == 0  # one rank sends neither bases nor scales
        fits.append(codec.fits)
    assert fits == [1, 1, 1, 2, 2, 2, 3, 3]  # steps 2, 5 and 8


def test_a_skipped_step_puts_back_the_bases_its_fit_replaced_and_a_kept_one_keeps_them():
    codec = set_up(make_codec("gradiveq"))
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(64 * 50, generator=g), torch.randn(64 * 50, generator=g)
    codec.prepare_bucket([("w", x1, x1)], RoundContext(2, codec.context, revertible=True))
    codec.end_step(discarded=False)
    first = codec.state_dict()["bases"]["w"]
    codec.prepare_bucket([("w", x2, x2)], RoundContext(3, codec.context, revertible=True))
    codec.end_step(discarded=False)  # a step that was applied keeps its fit
    second = codec.state_dict()["bases"]["w"]
    assert codec.fits == 2 and not torch.equal(first, second)
    codec.prepare_bucket([("w", x1, x1)], RoundContext(4, codec.context, revertible=True))
    codec.end_step(discarded=True)  # a skipped step's fit is undone
    assert codec.fits == 2 and torch.equal(codec.state_dict()["bases"]["w"], second)


def test_schedule_windows_and_refits():
    codec = make_codec(
        "gradiveq",
        basis_source="aggregate",
        slice_dim=4,
        num_components=2,
        warmup_steps=3,
        refresh_every=4,
        refresh_window=2,
        min_numel=0,
    )
    phases = [codec.phase_at(s) for s in range(12)]
    assert phases == ["warmup"] * 3 + ["compress"] * 4 + ["refresh"] * 2 + ["compress"] * 3
    assert not codec.is_compressing(3)  # never before a basis exists
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        if not codec.is_compressing(step):
            codec.observe_dense("w", torch.randn(64, generator=g), step)
        codec.on_step_end(step)
        if step == 2:
            assert codec.fits == 1 and codec.is_compressing(3) and codec.k == 2
        if step in (3, 7):
            assert not codec.is_compressing(7) and not codec.is_compressing(8)
    assert codec.fits == 2 and codec.state_dict()["last_fit_step"] == 8


def test_pca_sample_stays_within_max_samples():
    codec = make_codec(
        "gradiveq",
        basis_source="aggregate",
        slice_dim=8,
        num_components=2,
        warmup_steps=4,
        max_samples=100,
        min_numel=0,
    )
    g = torch.Generator().manual_seed(0)
    for step in [0, 1, 2, 3, 0, 1, 2]:  # more rows than max_samples arrive: 25 a step
        codec.observe_dense("w", torch.randn(8 * 1000, generator=g), step)
        assert sum(t.shape[0] for t in codec._samples["w"]) <= 100 + 25
    assert sum(t.shape[0] for t in codec._samples["w"]) >= 100
    codec.on_step_end(3)
    assert codec.fitted and codec._samples == {}


# --------------------------------------------------------------------------------------------------
# encode / decode
@pytest.mark.parametrize("center", [False, True])
def test_round_trip_with_k_equal_d_is_exact_including_the_tail(center):
    codec, g = fitted_codec(num_components=8, center=center)
    x = torch.randn(8 * 50 + 5, generator=g)
    enc = codec.encode(x, "w", None, 5)
    assert [t.numel() for t in enc.payload] == [400, 5]
    torch.testing.assert_close(codec.decode(enc.payload, enc.ctx, x.numel(), 1), x, atol=1e-5, rtol=0)
    # and the decode of a SUM over 3 ranks is the sum (the mean is added back count times)
    xs = [torch.randn(405, generator=g) for _ in range(3)]
    encs = [codec.encode(v, "w", None, 5) for v in xs]
    summed = [sum(e.payload[i] for e in encs) for i in range(2)]
    torch.testing.assert_close(codec.decode(summed, encs[0].ctx, 405, 3), sum(xs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("center", [False, True])
def test_decode_is_the_projection_and_is_idempotent(center):
    codec, g = fitted_codec(center=center)
    u = codec._bases["w"]
    mu = codec._means["w"]
    x = torch.randn(8 * 30, generator=g)
    enc = codec.encode(x, "w", None, 5)
    assert enc.payload[0].numel() == 30 * 3 and enc.payload[1].numel() == 0
    expect = ((x.double().view(30, 8) - mu) @ u @ u.T + mu).reshape(-1).float()
    local = local_reconstruction(codec, enc, x.numel())
    torch.testing.assert_close(local, expect, atol=1e-5, rtol=0)
    again = local_reconstruction(codec, codec.encode(local, "w", None, 6), x.numel())
    torch.testing.assert_close(again, local, atol=1e-5, rtol=0)


def _shared_scale(codec: GradiVeQCodec, xs: list[torch.Tensor]) -> torch.Tensor:
    """What prepare_bucket's all-reduce(MAX) of every rank's scales would give."""
    return torch.stack([codec._local_scale(codec._coefficients(v, "w")) for v in xs]).amax(0)


@pytest.mark.parametrize(
    ("world", "quant_levels", "bits", "fields"),
    # a field holds the sum over the ranks, 2*N*s + 1 values: three levels pack six a word with two
    # ranks where seven pack four, the same four with four ranks, and four against three with eight
    [(2, 7, 5, 12), (2, 3, 4, 15), (4, 7, 6, 10), (4, 3, 5, 12), (8, 7, 7, 9), (8, 3, 6, 10)],
)
def test_field_width_follows_the_levels_and_the_world_size(world, quant_levels, bits, fields):
    codec = make_codec("gradiveq", quant_levels=quant_levels, quant_fill=False)
    codec.setup(CodecContext(0, world, torch.device("cpu")))
    assert codec._field_bits() == (bits, fields)
    # the payload of a layer of 64 slices of d=64 at k=4: ceil(256 / F) int64 words and the fp32
    # scale, and a tail of 5 values in fp32
    assert codec.payload_nbytes(64 * 64 + 5) == 8 * -(-64 * 4 // fields) + 4 + 4 * 5


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 16, 64])
def test_filled_levels_are_the_most_that_pack_as_many_fields_a_word(world):
    def fields(levels: int) -> int:
        return 63 // math.ceil(math.log2(2 * world * levels + 1))

    for levels in range(1, 600):
        filled = GradiVeQCodec.fill_levels(levels, world)
        assert filled >= levels
        assert fields(filled) == fields(levels), (levels, filled)
        assert fields(filled + 1) < fields(levels), (levels, filled)  # one more needs a wider field
    assert GradiVeQCodec.fill_levels(0, world) == 0  # unquantized stays unquantized
    # the codec sends the filled levels in the bytes of the unfilled ones
    filled, plain = (make_codec("gradiveq", quant_fill=fill) for fill in (True, False))
    for codec in (filled, plain):
        codec.setup(CodecContext(0, world, torch.device("cpu")))
    assert (filled.levels, plain.levels) == (GradiVeQCodec.fill_levels(7, world), 7)
    assert filled._field_bits()[1] == plain._field_bits()[1]
    assert filled.payload_nbytes(64 * 64 + 5) == plain.payload_nbytes(64 * 64 + 5)


@pytest.mark.parametrize("quant_scale", ["component", "layer"])
@pytest.mark.parametrize("quant_rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize(
    ("world", "quant_levels", "quant_fill", "bits", "fields"),
    # filled, fifteen levels become 31 with eight ranks: 9-bit fields where fifteen's are 8, still
    # seven a word; seven levels already fill their fields with two ranks and with eight
    [(2, 7, False, 5, 12), (2, 3, False, 4, 15), (2, 7, True, 5, 12), (8, 7, False, 7, 9), (8, 15, True, 9, 7)],
)
def test_packed_quantized_levels_sum_exactly(
    quant_scale, quant_rounding, world, quant_levels, quant_fill, bits, fields
):
    codec, g = fitted_codec(
        world=world,
        n=8 * 200,
        quant_levels=quant_levels,
        quant_fill=quant_fill,
        quant_scale=quant_scale,
        quant_rounding=quant_rounding,
    )
    if world == 2:
        xs = [torch.randn(8 * 200 + 3, generator=g) for _ in range(world)]
    else:  # every rank the same values: the coefficient at the scale takes the top level on every
        # rank, so its field holds the largest sum, 2*N*s, and must not carry into its neighbour
        xs = [torch.randn(8 * 200 + 3, generator=g)] * world
    scale = _shared_scale(codec, xs)
    assert scale.shape == ((3,) if quant_scale == "component" else (1,))
    encs = []
    for r, v in enumerate(xs):
        codec.context = CodecContext(r, world, torch.device("cpu"))
        encs.append(codec.encode(v, "w", None, 10, prepared=_SharedScale(scale)))
    b, f = codec._field_bits()
    assert (b, f) == (bits, fields)  # levels sum to [0, 2Ns]: s=7, N=2: 5 bits, 12 a word; s=3: 4 bits, 15
    # filled: two ranks keep 7 (their fields are full), eight ranks raise 15 to 31
    assert codec.levels == ({(2, 7): 7, (8, 15): 31}[(world, quant_levels)] if quant_fill else quant_levels)
    words, scales, tail = encs[0].payload
    assert words.dtype == torch.int64 and words.numel() == -(-200 * 3 // f)
    assert scales.dtype == torch.float32 and scales.numel() == scale.numel()
    assert codec.payload_nbytes(xs[0].numel()) == sum(p.numel() * p.element_size() for p in encs[0].payload)
    summed = [sum(enc.payload[i] for enc in encs) for i in range(3)]
    total = codec.decode(summed, encs[0].ctx, xs[0].numel(), world)
    n = xs[0].numel()
    torch.testing.assert_close(
        total, sum(local_reconstruction(codec, enc, n) for enc in encs), atol=1e-5 * world, rtol=0
    )
    if world > 2:  # the top level's sum decoded whole: N times the scale
        top = codec._dequantize(summed[0], summed[1], 200 * 3, world).abs().max()
        torch.testing.assert_close(top, world * scale.max(), atol=0, rtol=1e-6)
    # every decoded coefficient lies within one level step of its own component's scale (half a
    # step when rounded to the nearest)
    exact = codec._coefficients(xs[0], "w")
    got = codec._dequantize(*encs[0].payload[:2], exact.numel(), 1).view_as(exact)
    step = scale / codec.levels
    bound = step / 2 if quant_rounding == "nearest" else step
    assert ((got - exact).abs() <= bound * (1 + 1e-5)).all()


def test_stochastic_levels_are_unbiased_and_nearest_levels_have_the_smaller_error():
    codec, g = fitted_codec(world=1, n=8 * 200, quant_levels=7, quant_rounding="stochastic")
    x = torch.randn(8 * 200, generator=g)
    scale = _shared_scale(codec, [x])
    exact = codec._coefficients(x, "w").reshape(-1)
    draws = []
    for step in range(200):
        words, scales, _ = codec.encode(x, "w", None, step, prepared=_SharedScale(scale)).payload
        draws.append(codec._dequantize(words, scales, exact.numel(), 1))
    err_mean = (torch.stack(draws).mean(0) - exact).abs().max()
    err_one = (draws[0] - exact).abs().max()
    assert err_mean < err_one / 5
    nearest, _ = fitted_codec(world=1, n=8 * 200, quant_levels=7, quant_rounding="nearest")
    got = nearest._dequantize(
        *nearest.encode(x, "w", None, 0, prepared=_SharedScale(scale)).payload[:2], exact.numel(), 1
    )
    assert (got - exact).norm() < (draws[0] - exact).norm()


def test_a_scale_per_component_quantizes_the_weaker_components_finer():
    # component 0 carries most of the energy: one scale for the layer leaves the others few levels
    by_layer, g = fitted_codec(world=1, n=8 * 200, quant_levels=7, quant_scale="layer")
    by_component, _ = fitted_codec(world=1, n=8 * 200, quant_levels=7, quant_scale="component")
    x = torch.randn(8 * 200, generator=g)
    errors = []
    for codec in (by_layer, by_component):
        exact = codec._coefficients(x, "w")
        scale = _shared_scale(codec, [x])
        got = codec._dequantize(
            *codec.encode(x, "w", None, 0, prepared=_SharedScale(scale)).payload[:2], exact.numel(), 1
        )
        errors.append((got.view_as(exact) - exact).norm())
    assert errors[1] < errors[0]


def test_state_dict_round_trip_through_weights_only_load():
    codec, g = fitted_codec(center=True, quant_levels=0)
    buf = io.BytesIO()
    torch.save(codec.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    fresh = make_codec("gradiveq", **{k: v for k, v in codec.config().items()})
    fresh.setup(CodecContext(0, 1, torch.device("cpu")))
    assert not fresh.fitted
    fresh.load_state_dict(state)
    assert fresh.basis_digest() == codec.basis_digest() and fresh.fits == 1
    x = torch.randn(8 * 20 + 1, generator=g)
    assert torch.equal(fresh.encode(x, "w", None, 9).payload[0], codec.encode(x, "w", None, 9).payload[0])
    other = make_codec("gradiveq", basis_source="aggregate", slice_dim=16)
    with pytest.raises(ValueError, match="slice_dim"):
        other.load_state_dict(state)


# --------------------------------------------------------------------------------------------------
# real 2-process runs
WARMUP = 3
LAYERS = (33, 100, 11)  # 3300 and 1100 weights: both leave a tail of 4 after slices of 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(LAYERS[0], LAYERS[1]), nn.Tanh(), nn.Linear(LAYERS[1], LAYERS[2]))


def local_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad.detach().reshape(-1).clone() for n, p in model.named_parameters()}


def ddp_run(rank: int, world: int, steps: int, **opts):
    """Train with the codec; at the last (compressed) step compare DDP's gradient with references."""
    model = make_model()
    ref = make_model()  # same weights, no DDP: this rank's own gradient
    ddp = DDP(model)
    state, hook = make_comm_hook(
        "gradiveq",
        ddp,
        basis_source="aggregate",
        warmup_steps=WARMUP,
        refresh_every=0,
        min_numel=1000,
        dense_layers="none",
        **opts,
    )
    ddp.register_comm_hook(state, hook)
    codec = state.codec
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + rank)
    out = {"payload": []}
    for step in range(steps):
        x, y = torch.randn(16, LAYERS[0], generator=g), torch.randint(0, 10, (16,), generator=g)
        mine = local_grads(ref, x, y)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        out["payload"].append(state.stats.pop().payload_bytes)
        got = {n: p.grad.detach().reshape(-1).clone() for n, p in model.named_parameters()}
        if step == steps - 1:
            # the true mean gradient, and the mean of every rank's own decoded gradient
            every = [dict() for _ in range(world)]
            for n, v in mine.items():
                parts = [torch.zeros_like(v) for _ in range(world)]
                dist.all_gather(parts, v)
                for r in range(world):
                    every[r][n] = parts[r]
            decoded = {}
            for n, v in mine.items():
                if v.numel() < codec.harness.min_numel:
                    continue
                prepared = None
                if codec.options.quant_levels:  # the same shared scale as the hook's
                    rc = RoundContext(step, codec.context)
                    prepared = codec.prepare_bucket([(n, v, None)], rc).per_layer.get(n)
                enc = codec.encode(v, n, None, step, prepared=prepared)
                decoded[n] = local_reconstruction(codec, enc, v.numel())
                parts = [torch.zeros_like(v) for _ in range(world)]
                dist.all_gather(parts, decoded[n])
                decoded[n] = sum(parts) / world
            out.update(got=got, true_mean={n: sum(e[n] for e in every) / world for n in mine}, decoded_mean=decoded)
        # keep both copies on the same weights (the DDP gradient is what every rank applies)
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            q.grad = p.grad.clone()
        opt.step()
        opt_ref.step()
    codec.on_step_end(steps - 1)  # nothing happens (no window ends) but it must not fail
    out.update(
        digest=codec.basis_digest(),
        bases={k: v.clone() for k, v in codec.state_dict()["bases"].items()},
        compressing=[state.compressing(s) for s in range(steps)],
        state_dict=codec.state_dict(),
        numels={n: p.numel() for n, p in model.named_parameters()},
        payload_nbytes={n: codec.payload_nbytes(p.numel()) for n, p in model.named_parameters() if p.numel() >= 1000},
    )
    return out


def gloo_worker(rank: int, world: int) -> bytes:
    steps = WARMUP + 2
    out = {
        "k4": ddp_run(rank, world, steps, slice_dim=8, num_components=2, quant_levels=0),
        "kd": ddp_run(rank, world, steps, slice_dim=8, num_components=8, center=True, quant_levels=0),
        "q": ddp_run(rank, world, steps, slice_dim=8, num_components=2, quant_levels=7, quant_fill=False),
        # 50 levels, filled: 127 with two ranks, in 9-bit fields where 50's are 8, seven to a word either way
        "q50": ddp_run(rank, world, steps, slice_dim=8, num_components=2, quant_levels=50, quant_fill=False),
        "qfill": ddp_run(rank, world, steps, slice_dim=8, num_components=2, quant_levels=50, quant_fill=True),
        "mismatch": _mismatch(rank, world),
    }
    # bytes, not tensors: tensors in a multiprocessing queue live in the sender's shared memory,
    # which is gone once the rank exits
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def test_two_ranks_sum_codes_in_the_all_reduce():
    r0, r1 = (torch.load(io.BytesIO(r), weights_only=True) for r in run_gloo(gloo_worker, 2))
    for name in ("k4", "kd", "q", "q50", "qfill"):
        a, b = r0[name], r1[name]
        # (2) the bases are identical on both ranks, bit for bit
        assert a["digest"] == b["digest"], name
        assert a["bases"].keys() == b["bases"].keys() == {"0.weight", "2.weight"}
        for k in a["bases"]:
            assert torch.equal(a["bases"][k], b["bases"][k])
        assert a["compressing"] == [False] * WARMUP + [True, True]
        # (1) linearity: the aggregate is the mean of each rank's own decoded gradient
        for n, v in a["decoded_mean"].items():
            torch.testing.assert_close(a["got"][n], v, atol=1e-5, rtol=1e-5, msg=f"{name} {n}")
            torch.testing.assert_close(b["got"][n], v, atol=1e-5, rtol=1e-5, msg=f"{name} {n}")
        # small layers travel exactly
        torch.testing.assert_close(a["got"]["0.bias"], a["true_mean"]["0.bias"], atol=1e-6, rtol=0)
    # ... and with k = d it is the true mean gradient
    kd = r0["kd"]
    for n in kd["got"]:
        torch.testing.assert_close(kd["got"][n], kd["true_mean"][n], atol=1e-5, rtol=0, msg=n)
    # with k < d it is not (the test could fail)
    k4 = r0["k4"]
    assert (k4["got"]["0.weight"] - k4["true_mean"]["0.weight"]).abs().max() > 1e-3
    # (3) bytes: every warm-up step sends the whole gradient, compressed steps the expected payload
    for name, ratio in (("k4", True), ("q", False)):
        res = r0[name]
        numels = res["numels"]
        dense = sum(v for v in numels.values() if v < 1000)
        raw = 4 * (sum(numels.values()) + 1)  # one bucket, one flag
        expect = sum(res["payload_nbytes"].values()) + 4 * (dense + 1)
        assert res["payload"][:WARMUP] == [raw] * WARMUP
        # q: + the all-reduce(MAX) of the shared scales, one per layer (2)
        assert res["payload"][WARMUP:] == [expect + (4 * 2 if name == "q" else 0)] * 2
        if ratio:  # slices of 8 sent as 2 coefficients, each weight's tail of 4 raw, small layers raw
            assert expect == 4 * ((3300 // 8) * 2 + 4 + (1100 // 8) * 2 + 4 + dense + 1)
    assert r0["q"]["payload"][-1] < r0["k4"]["payload"][-1] / 3  # the whole step, small layers included
    # the weights' payloads: 7 levels send 12 coefficients in 8 bytes, where fp32 takes 48
    q_bytes, k4_bytes = (sum(r0[name]["payload_nbytes"].values()) for name in ("q", "k4"))
    assert q_bytes < k4_bytes / 5
    # filled to fifteen levels, the same bytes on every step, and the levels did change the sums
    assert r0["qfill"]["payload"] == r0["q50"]["payload"]
    assert not torch.equal(r0["qfill"]["got"]["0.weight"], r0["q50"]["got"]["0.weight"])
    # (4) the state dict restores the basis
    fresh = make_codec("gradiveq", basis_source="aggregate", slice_dim=8, num_components=8, center=True, quant_levels=0)
    fresh.load_state_dict(r0["kd"]["state_dict"])
    assert fresh.basis_digest() == r1["kd"]["digest"]
    # (5) bases fitted from different data on the two ranks are detected on both
    assert "differ across ranks" in r0["mismatch"] and "differ across ranks" in r1["mismatch"]


def _mismatch(rank: int, world: int) -> str:
    """Bases fitted on different data on each rank must be caught by the digest check."""
    codec = make_codec("gradiveq", basis_source="aggregate", slice_dim=4, num_components=2, warmup_steps=1, min_numel=0)
    codec.setup(CodecContext(rank, world, torch.device("cpu")))
    codec.observe_dense("w", torch.randn(64, generator=torch.Generator().manual_seed(rank)), 0)
    try:
        codec.on_step_end(0)
    except RuntimeError as e:
        return str(e)
    return "no error"


# --------------------------------------------------------------------------------------------------
# Lightning: the callback drives the schedule and logs; the checkpoint holds the bases
class _Tiny(__import__("lightning.pytorch").pytorch.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(512, LAYERS[0], generator=g), torch.randint(0, LAYERS[2], (512,), generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def test_lightning_pca_warmup_schedule_logging_and_checkpoint(tmp_path):
    import csv

    import lightning.pytorch as pl

    from lightning_gradcomp import CompressedDDPStrategy
    from lightning_gradcomp.callbacks import PCAWarmup

    strategy = CompressedDDPStrategy(
        codec="gradiveq",
        codec_options={
            "basis_source": "aggregate",
            "slice_dim": 8,
            "num_components": 2,
            "min_numel": 1000,
            "dense_layers": "none",
        },
        adaptive_level=False,  # the schedule alone: the level controller would change k (its default)
        start_method="spawn",
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=10,
        logger=pl.loggers.CSVLogger(tmp_path, name="log", version=0),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[
            PCAWarmup(warmup_steps=3, refresh_every=3, refresh_window=2),
            pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True),
        ],
    )
    trainer.fit(_Tiny())
    with open(tmp_path / "log" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("gradcomp/pca_phase")]
    phases = [int(float(r["gradcomp/pca_phase"])) for r in rows]
    # warm-up 0-2, compress 3-5, refresh window 6-7, compress 8-9
    assert phases == [0, 0, 0, 1, 1, 1, 2, 2, 1, 1]
    ks = [float(r["gradcomp/pca_k"]) for r in rows]
    assert ks[:3] == [0.0, 0.0, 0.0] and ks[3:] == [2.0] * 7
    ev = float(rows[-1]["gradcomp/explained_variance"])
    assert 0.0 < ev < 1.0
    ratios = [float(r["gradcomp/compression_ratio"]) for r in rows]
    assert ratios[2] == pytest.approx(1.0, rel=0.01) and ratios[4] > 3
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["gradcomp"]["shared"]["codec"]
    assert saved["fits"] == 2 and saved["last_fit_step"] == 7
    assert set(saved["bases"]) == {"net.0.weight", "net.2.weight"}
    fresh = make_codec("gradiveq", basis_source="aggregate", slice_dim=8, num_components=2)
    fresh.load_state_dict(saved)
    assert fresh.fitted and fresh.k == 2


# --------------------------------------------------------------------------------------------------
# the default source: the leader fits each step's bases on its compensated gradient, broadcasts them
def _leader_run(rank: int, world: int, steps: int) -> dict:
    model = make_model()
    ddp = DDP(model)
    state, hook = make_comm_hook(
        "gradiveq", ddp, slice_dim=8, num_components=2, quant_levels=0, min_numel=1000, dense_layers="none"
    )
    ddp.register_comm_hook(state, hook)
    codec = state.codec
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(20 + rank)
    sent_sum = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in model.named_parameters()}
    grad_sum = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in model.named_parameters()}
    rows = []
    for step in range(steps):
        x, y = torch.randn(16, LAYERS[0], generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        ref = make_model()
        ref.load_state_dict(model.state_dict())
        mine = local_grads(ref, x, y)
        nn.functional.cross_entropy(ddp(x), y).backward()
        st = state.stats.pop()
        bases = {k: v.clone() for k, v in codec.state_dict()["bases"].items()}
        for n, p in model.named_parameters():
            grad_sum[n] += mine[n].double()
            sent_sum[n] += p.grad.reshape(-1).double()  # the mean of what every rank sent
        rows.append({"compressing": state.compressing(step), "payload": st.payload_bytes, "bases": bases})
        opt.step()
    residual = {k: v.double().clone() for k, v in state.memory.residuals.items()}
    return {"rows": rows, "grad_sum": grad_sum, "sent_sum": sent_sum, "residual": residual}


def test_leader_bases_are_broadcast_and_error_feedback_conserves_the_gradient():
    steps = 6
    r0, r1 = run_gloo(_leader_run, 2, args=(steps,))
    # compression starts as soon as DDP allows, with no uncompressed warm-up
    assert [r["compressing"] for r in r0["rows"]] == [False, False] + [True] * (steps - 2)
    for a, b in zip(r0["rows"], r1["rows"]):
        assert a["bases"].keys() == b["bases"].keys()
        for k in a["bases"]:  # the leader's bases, identical on both ranks, refitted every step
            assert torch.equal(a["bases"][k], b["bases"][k])
    fitted = [r["bases"]["0.weight"] for r in r0["rows"] if r["compressing"]]
    assert all(not torch.equal(u, fitted[0]) for u in fitted[1:])
    # error feedback loses nothing: mean sent + mean residual = mean gradient, summed over the run
    for n in r0["grad_sum"]:
        if n not in r0["residual"]:
            continue
        mean_grad = (r0["grad_sum"][n] + r1["grad_sum"][n]) / 2
        mean_res = (r0["residual"][n] + r1["residual"][n]) / 2
        assert torch.allclose(r0["sent_sum"][n] + mean_res, mean_grad, atol=1e-5), n
        assert float(mean_res.abs().max()) > 1e-4  # something really was held back


def test_leader_basis_is_never_fitted_on_a_non_finite_gradient():
    # a step with NaN/Inf is skipped by the hook; the learned bases must not take it in
    codec = GradiVeQCodec(min_numel=0, refit_every=3)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 40, generator=gen)
    param = torch.zeros_like(x)
    one = CodecContext(0, 1, torch.device("cpu"))
    codec.prepare_bucket([("w", x, param)], RoundContext(2, one))  # the first fit
    fitted = codec._u32["w"].clone()
    assert bool(torch.isfinite(fitted).all())
    bad = x.clone()
    bad[5] = float("nan")
    bad[9] = float("inf")
    codec.prepare_bucket([("w", bad, param)], RoundContext(5, one))  # a refit, due at step 5, on a NaN gradient
    assert torch.equal(codec._u32["w"], fitted)  # the previous basis stays
    fresh = GradiVeQCodec(min_numel=0)
    fresh.prepare_bucket([("w", bad, param)], RoundContext(2, one))  # no basis yet: a finite one, unit vectors
    assert torch.equal(fresh._u32["w"], torch.eye(64, 4))


def test_the_largest_magnitude_is_that_of_abs_max_whichever_sign_holds_it():
    """The basis fit's scale and the quantizer's come from ``aminmax`` (no copy of ``|x|``): the
    same value as ``x.abs().max()``, per column too, when the largest entry is negative, and NaN
    when an entry is NaN (the step is then skipped, and nothing may look finite)."""
    x = torch.tensor([[1.0, -7.0, 2.0], [-3.0, 5.0, 0.5]])
    assert _max_magnitude(x).item() == 7.0
    assert torch.equal(_max_magnitude(x, 0), torch.tensor([3.0, 7.0, 2.0]))
    g = torch.randn(4096, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(_max_magnitude(g), g.abs().max())
    assert torch.equal(_max_magnitude(g, 0), g.abs().amax(0))
    x[1, 2] = float("nan")
    assert _max_magnitude(x).isnan() and _max_magnitude(x, 0)[2].isnan()


@pytest.mark.parametrize("b", range(1, 25))
def test_packing_in_fp32_chunks_gives_the_words_of_one_int64_shift_a_field(b):
    """``_pack`` sums up to ``floor(24 / b)`` fields in fp32 before it widens them to int64; the
    words must be those of shifting every field on its own, with every field at its largest value
    (the sums nearest ``2^24``) and at random ones."""
    f = 63 // b
    g = torch.Generator().manual_seed(b)
    for levels in (torch.full((f * 5,), 2.0**b - 1), torch.randint(0, 2**b, (f * 7,), generator=g).float()):
        reference = (levels.to(torch.int64).view(-1, f) << (torch.arange(f) * b)).sum(1)
        assert torch.equal(_pack(levels, b, f), reference)


@pytest.mark.parametrize("quant_rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize(("world", "quant_levels"), [(1, 7), (2, 7), (2, 3), (8, 15)])
def test_the_residuals_reconstruction_is_what_the_payload_alone_decodes_to(world, quant_rounding, quant_levels):
    """With error feedback the quantized encode hands the hook its own reconstruction, made from
    its levels instead of unpacking its words: it must be the payload's decode on one rank, bit for
    bit, tail included, as the residual was before."""
    codec, g = fitted_codec(
        world=world, quant_levels=quant_levels, quant_rounding=quant_rounding, quant_fill=False, error_feedback=True
    )
    assert codec.harness.error_feedback
    x = torch.randn(8 * 301 + 5, generator=g)  # 903 coefficients: the last word padded
    for step in (0, 1):
        c = codec._coefficients(x, "w")
        enc = codec.encode(x, "w", None, step, prepared=_SharedScale(codec._local_scale(c), c))
        assert enc.local is not None
        decoded = codec.decode([p.clone() for p in enc.payload], enc.ctx, x.numel(), count=1)
        assert torch.equal(enc.local, decoded)
        assert torch.equal(enc.local[-5:], x[-5:])
