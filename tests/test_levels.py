"""lgc's learned code: magnitude levels fitted by Lloyd-Max, on their own and on two gloo ranks."""

from __future__ import annotations

import copy
import io
import math
from types import SimpleNamespace

import codec_driver
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_gloo
from torch import Tensor, nn

from lightning_gradcomp.codecs import levels
from lightning_gradcomp.codecs.bits import codes_nbytes
from lightning_gradcomp.codecs.lgc import MIN_AE_LEN, LGCCodec
from lightning_gradcomp.codecs.positions import (
    channel_counts,
    choose_encoding,
    counts_nbytes,
    encoded_nbytes,
    kernel_counts,
    kernel_fields,
    rice_fields,
)

RATIO = 0.1
WARMUP, COLLECT, STAGE3 = 3, 8, 3


# --------------------------------------------------------------------------------------------------
# the levels alone
def test_lloyd_max_finds_the_centres_of_separated_clusters():
    g = torch.Generator().manual_seed(0)
    m = torch.cat([1.0 + 0.01 * torch.randn(5000, generator=g), 3.0 + 0.01 * torch.randn(5000, generator=g)])
    fitted = levels.fit_levels(m, 2)
    assert fitted.tolist() == pytest.approx([1.0, 3.0], abs=1e-2)


def test_fitted_levels_beat_evenly_spaced_ones_on_heavy_tailed_values():
    """The point of learning them: top-k gradient values are far from uniform in magnitude."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(4000, generator=g) * torch.rand(4000, generator=g).pow(3) * 10
    fitted = levels.fit_levels(levels.relative_magnitudes(v), 2)
    rms = v.pow(2).mean().sqrt()
    a = v.abs() / rms
    even = torch.stack([a.min(), a.max()])
    err = lambda lv: float((levels.dequantize(*levels.quantize(v, lv), lv) - v).norm() / v.norm())  # noqa: E731
    assert err(fitted) < 0.7 * err(even)


def _lloyd_max_by_distance_table(m: torch.Tensor, count: int, max_samples: int = 200_000, seed: int = 0):
    """Lloyd-Max written the direct way, every value against every level each pass (what
    ``fit_levels`` computed before it sorted the values once): the reference it must equal."""
    m = m.reshape(-1).double()
    if m.numel() > max_samples:
        m = m[torch.randperm(m.numel(), generator=torch.Generator().manual_seed(seed))[:max_samples]]
    centers = torch.quantile(m, torch.linspace(0.5 / count, 1 - 0.5 / count, count, dtype=torch.float64))
    for _ in range(30):
        assign = (m.unsqueeze(1) - centers).abs().argmin(1)
        counts = torch.bincount(assign, minlength=count)
        sums = torch.zeros(count, dtype=torch.float64).index_add_(0, assign, m)
        centers = torch.where(counts > 0, sums / counts.clamp_min(1), centers)
    return centers.sort().values.float()


@pytest.mark.parametrize("count", [1, 2, 4, 128])
@pytest.mark.parametrize("spread", ["gaussian", "heavy", "three values"])
@pytest.mark.parametrize("n", [7, 5000, 250_000])
def test_fit_levels_equals_lloyd_max_against_every_level(count, spread, n):
    """The fit sorts the magnitudes once and assigns them by the midpoints between the levels;
    it must give the levels of the direct iteration, to the bit: with ties at a midpoint and
    empty levels ("three values", 128 levels), and through the sample drawn above 200,000."""
    g = torch.Generator().manual_seed(n + count)
    x = {
        "gaussian": lambda: torch.randn(n, generator=g),
        "heavy": lambda: torch.randn(n, generator=g) ** 3,
        "three values": lambda: torch.randint(0, 3, (n,), generator=g).float(),
    }[spread]()
    m = levels.relative_magnitudes(x)
    assert torch.equal(levels.fit_levels(m, count, seed=5), _lloyd_max_by_distance_table(m, count, seed=5))


@pytest.mark.parametrize("count", [1, 2, 4, 8, 9, 16, 128])
def test_nearest_is_the_binary_search_over_the_midpoints_whichever_way_it_counts(count):
    # few levels are counted against the midpoints, more go through torch.bucketize: the same
    # index for every magnitude, ties at a midpoint (to the lower level), 0, inf and NaN included
    g = torch.Generator().manual_seed(count)
    lv = torch.rand(count, generator=g).sort().values * 3
    midpoints = (lv[1:] + lv[:-1]) / 2
    special = torch.tensor([0.0, float("inf"), float("nan"), *midpoints.tolist()])
    m = torch.cat([torch.rand(5000, generator=g) * 4, special])
    assert torch.equal(levels.nearest(m, lv), torch.bucketize(m, midpoints))


def test_relative_magnitudes_divide_each_message_by_its_own_rms():
    # a row is one message: a row a hundred times larger must come out in the same units
    g = torch.Generator().manual_seed(0)
    v = torch.randn(2, 500, generator=g)
    v[1] *= 100
    m = levels.relative_magnitudes(v).reshape(2, 500)
    assert m.pow(2).mean(1).sqrt().tolist() == pytest.approx([1.0, 1.0], rel=1e-5)
    assert torch.allclose(m * v.pow(2).mean(1, keepdim=True).sqrt(), v.abs(), rtol=1e-5)


def test_levels_fitted_on_no_magnitudes_decode_a_value_to_the_messages_rms():
    fitted = levels.fit_levels(torch.empty(0), 4)
    assert fitted.tolist() == [1.0] * 4
    v = torch.tensor([3.0, -1.0, 0.5])
    rms, codes = levels.quantize(v, fitted)
    assert levels.dequantize(rms, codes, fitted).tolist() == pytest.approx((rms * torch.sign(v)).tolist())


def test_role_parts_give_a_rank_a_second_message_only_for_positions_it_did_not_name():
    v = torch.arange(12.0).reshape(2, 6)
    assert levels.role_parts(v, 1) == [(0, levels.OTHERS, None), (1, levels.LEADER, None)]
    named = torch.tensor([[True] * 6, [True, False, True, False, False, False]])
    parts = levels.role_parts(v, named)
    # rank 0 named every position: one message, on the leader's row; rank 1 one on each row
    assert [(r, rl) for r, rl, _ in parts] == [(0, levels.LEADER), (1, levels.LEADER), (1, levels.OTHERS)]
    assert parts[0][2].tolist() == [True] * 6
    assert parts[1][2].tolist() == named[1].tolist() and parts[2][2].tolist() == (~named[1]).tolist()


@pytest.mark.parametrize("union", [False, True])
def test_aggregate_errors_are_in_units_of_the_leaders_rms(union):
    """The gate compares layers by these numbers: both the error and the aggregate's norm are
    divided by the RMS of what the leader's row codes (not, say, its mean magnitude)."""
    v = torch.tensor([[4.0, 0.0, 0.0, 2.0], [0.5, -0.5, 1.0, 0.0]])
    lead = torch.tensor([[True, False, False, True], [False, True, True, False]]) if union else 0
    picked = v[lead] if union else v[0]
    scale2 = float(picked.pow(2).mean())
    table = torch.tensor([[0.5, 1.0, 1.5, 2.0], [0.5, 1.0, 1.5, 2.0]])
    (err, ref) = levels.aggregate_errors([("w", 0, lead, 4, v)], {"w": table})["w"]
    assert ref == pytest.approx(float(v.mean(0).pow(2).sum()) / scale2, rel=1e-6)
    # the same sample ten times larger reads the same in these units
    (err10, ref10) = levels.aggregate_errors([("w", 0, lead, 4, 10 * v)], {"w": table})["w"]
    assert (err10, ref10) == pytest.approx((err, ref), rel=1e-5)


@pytest.mark.parametrize("bits", [1, 2, 3, 8])
def test_message_round_trip_decodes_to_the_nearest_level_with_the_sign(bits):
    g = torch.Generator().manual_seed(bits)
    v = torch.randn(1001, generator=g)
    lv = levels.fit_levels(levels.relative_magnitudes(v), 2 ** (bits - 1))
    assert levels.table_bits(lv) == bits
    message, decoded = levels.encode(v, lv)
    assert sum(t.numel() * t.element_size() for t in message) == levels.message_nbytes(1001, bits)
    assert message[1].numel() == codes_nbytes(1001, bits)
    assert torch.equal(levels.decode(message, lv, 1001), decoded)
    assert torch.equal(decoded.sign(), v.sign())
    # bit for bit: the sign times the product of the level and the message's RMS
    r, index = message[0], levels.nearest(v.abs() / message[0], lv)
    assert torch.equal(decoded, torch.where(v < 0, -(lv[index] * r), lv[index] * r))
    rms = v.pow(2).mean().sqrt()
    nearest = lv[(v.abs().unsqueeze(1) / rms - lv).abs().argmin(1)] * rms
    torch.testing.assert_close(decoded.abs(), nearest)
    if bits == 8:  # 128 levels: close to exact
        assert float((decoded - v).norm() / v.norm()) < 0.02


# --------------------------------------------------------------------------------------------------
# lgc with the levels: the gate at the switch, the checkpoint
def _samples(codec: LGCCodec, steps: int, noise: float, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        common = torch.randn(300, generator=g)
        v = torch.stack([common + noise * torch.randn(300, generator=g) for _ in range(2)]) * 1e-3
        codec._samples.append(("w", step, step % 2, 3000, v))


def test_levels_pass_the_gate_and_round_trip_through_a_checkpoint():
    c = LGCCodec(ratio=RATIO)
    _samples(c, 16, 0.3)
    c.train_autoencoder()
    assert c.ae_trained and list(c.ae_layers) == ["w"] and c.ae_recon_error < 0.3
    buf = io.BytesIO()
    torch.save(c.state_dict(), buf)
    buf.seek(0)
    d = LGCCodec(ratio=RATIO)
    assert d.ae_digest() != c.ae_digest()
    d.load_state_dict(torch.load(buf, weights_only=True))
    assert d.ae_digest() == c.ae_digest() and d.ae_layers == c.ae_layers
    assert torch.equal(d._levels["w"], c._levels["w"])


def test_the_leaders_and_the_others_messages_have_levels_of_their_own():
    """The leader's message holds its own largest values, another rank's its values at those
    positions, small ones among them: levels fitted per role carry the aggregate with a clearly
    smaller error than one set fitted to both kinds of message."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for step in range(16):
        lead = step % 2
        own = torch.randn(2, 3000, generator=g)
        support = own[lead].abs().topk(300).indices.sort().values  # the leader's top tenth
        samples.append(("w", step, lead, 3000, own[:, support] * 1e-3))
    by_role = torch.ones(1, 2, 2)
    levels.fit_layers(samples, samples, ["w"], by_role)
    assert by_role[0, levels.LEADER, 0] > 2 * by_role[0, levels.OTHERS, 0]  # the leader's smallest is large
    one = levels.fit_levels(torch.cat([levels.relative_magnitudes(s[4]) for s in samples]), 2)

    def error(table: torch.Tensor) -> float:
        ((e, r),) = levels.aggregate_errors(samples, {"w": table}).values()
        return math.sqrt(e / r)

    assert error(by_role[0]) < 0.8 * error(one.expand(2, 2))


def test_a_checkpoint_with_one_set_of_levels_resumes_with_it_for_both_roles():
    """Checkpoints written before the levels had a row per role hold one row a layer."""
    c = LGCCodec(ratio=RATIO)
    _samples(c, 16, 0.3)
    c.train_autoencoder()
    old = c.state_dict()
    old["levels"] = {k: v[levels.LEADER].clone() for k, v in old["levels"].items()}
    buf = io.BytesIO()
    torch.save(old, buf)
    buf.seek(0)
    d = LGCCodec(ratio=RATIO)
    d.load_state_dict(torch.load(buf, weights_only=True))
    assert d._levels["w"].shape == (2, 2) and d.ae_layers == c.ae_layers
    assert torch.equal(d._levels["w"][levels.OTHERS], old["levels"]["w"])
    assert torch.equal(d._levels["w"][levels.LEADER], old["levels"]["w"])


def test_gate_refuses_a_code_above_the_threshold():
    """A sign alone (1 bit) cannot carry values to within 1 %: every layer stays exact."""
    c = LGCCodec(ratio=RATIO, code_bits=1, max_recon_error=0.01)
    _samples(c, 16, 0.3)
    c.train_autoencoder()
    assert c.ae_trained and c.ae_layers == {} and c.ae_recon_error > 0.01


def test_checkpoint_whose_autoencoder_carried_layers_names_the_code_to_resume_with():
    """A checkpoint of the version before the levels (no "code" key) whose AE carried a layer."""
    old = LGCCodec(code="autoencoder", ratio=RATIO, ae_epochs=1, max_recon_error=100.0)
    _samples(old, 8, 0.3)
    old.train_autoencoder()
    state = old.state_dict()
    del state["code"], state["levels"]
    with pytest.raises(ValueError, match="resume with codec_options=.'code': 'autoencoder'"):
        LGCCodec(ratio=RATIO).load_state_dict(state)
    LGCCodec(code="autoencoder", ratio=RATIO).load_state_dict(state)  # as it asks
    state["ae_layers"] = {}  # an AE that carried nothing resumes under the levels: exact values either way
    LGCCodec(ratio=RATIO).load_state_dict(state)


@pytest.mark.parametrize(
    "opts, match",
    [
        (dict(code="pca"), "code must be one of"),
        (dict(code_bits=0), "code_bits must be an integer"),
        (dict(light_code_bits=9), "light_code_bits must be an integer"),
        (dict(light_code_bits=2.5), "light_code_bits must be an integer"),
        (dict(refit_every=-1), "refit_every"),
        (dict(code_denser="no"), "code_denser must be True or False"),
        (dict(support="all"), "support must be one of"),
        (dict(support="union", code="autoencoder"), "support='union' is a support for code='levels'"),
        (dict(light_scale="row"), "light_scale must be one of"),
        (dict(light_scale="channel", code="autoencoder"), "light_scale='channel' scales the messages of code='levels'"),
    ],
)
def test_invalid_code_options_name_the_option(opts, match):
    with pytest.raises(ValueError, match=match):
        LGCCodec(**opts)


# --------------------------------------------------------------------------------------------------
# two real gloo ranks whose gradients share a component by construction
def _mlp() -> nn.Module:
    # weights of 16384, 65536 and 2560 entries: supports of 1639, 6554 and 256 values
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _train_levels(
    rank: int,
    world: int,
    light_collect: bool = False,
    refit_every: int = 0,
    stage3: int = STAGE3,
    code_denser: bool = True,
    extra: dict | None = None,
) -> dict:
    """``light_collect``: stage 2 runs at compression level 0 (the controller's light level: a
    support 2.5 times denser here), stage 3 at level 1, and its last step at level 0 again."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook
    from lightning_gradcomp.callbacks import AutoencoderWarmup

    torch.manual_seed(0)
    model = _mlp()
    ddp = DDP(model)
    opts = dict(warmup_steps=WARMUP, ae_train_steps=COLLECT, ratio=RATIO, min_numel=1000, dense_layers="none")
    opts.update(refit_every=refit_every, code_denser=code_denser, **(extra or {}))
    state, hook = make_comm_hook("lgc", ddp, stats_every=1, **opts)
    buckets = []  # (step, bytes, supports, on a union support each rank's count of names, and the names)
    prepare = state.codec.prepare_bucket

    def recording_prepare(layers, rc):
        prepared = prepare(layers, rc)
        supports = {key: sh.support.clone() for key, sh in prepared.per_layer.items()}
        named = {key: int(sh.named[0].sum()) for key, sh in prepared.per_layer.items() if sh.named is not None}
        names = {
            key: [sh.support[who] for who in sh.named] for key, sh in prepared.per_layer.items() if sh.named is not None
        }
        buckets.append((rc.step, prepared.nbytes, supports, named, names))
        return prepared

    state.codec.prepare_bucket = recording_prepare
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    shared = torch.Generator().manual_seed(5)  # the same on both ranks: most of each batch
    own = torch.Generator().manual_seed(100 + rank)
    rows = []
    total = WARMUP + COLLECT + stage3
    at_switch = {}
    sample_leads: set[tuple[int, int]] = set()  # (step, leader) of every stage-2 sample kept
    # this rank's own gradient, from a copy of the model outside DDP: what the rank compensated,
    # less what stays in its residual, is what it sent
    local_model = copy.deepcopy(model)
    coded = [n for n, p in model.named_parameters() if p.numel() >= 1000]
    for step in range(total):
        if light_collect:
            state.codec.set_level(0.0 if step < WARMUP + COLLECT or step == total - 1 else 1.0)
        x = torch.randn(32, 64, generator=shared) + 0.3 * torch.randn(32, 64, generator=own)
        y = torch.randint(0, 10, (32,), generator=shared)
        local_model.load_state_dict(model.state_dict())
        local_model.zero_grad()
        nn.functional.cross_entropy(local_model(x), y).backward()
        own_grads = dict(local_model.named_parameters())
        held = {k: v.clone() for k, v in state.memory.residuals.items()}
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        st = state.stats.pop()
        residual_sq = sum(float(r.double().pow(2).sum()) for r in state.memory.residuals.values())
        sent = torch.cat(
            [
                own_grads[n].grad.reshape(-1)
                + held.get(n, torch.zeros(1)).reshape(-1)
                - state.memory.residuals.get(n, torch.zeros(1)).reshape(-1)
                for n in coded
            ]
        )
        dist.all_reduce(sent)  # every rank's share, summed
        mean = torch.cat([p.grad.reshape(-1) for n, p in model.named_parameters() if n in coded])
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        rank0 = grads.clone()
        dist.broadcast(rank0, 0)
        rows.append(
            {
                "stage": state.codec.stage(step),
                "used": state.codec.ae_layers_used,
                "wire": st.wire_bytes,
                "err_sq": st.err_sq,
                "residual_sq": residual_sq,
                "identical": torch.equal(grads, rank0),
                # the mean the step delivered is the ranks' shares as each rank accounted for it
                "sent_error": float((sent / world - mean).norm() / mean.norm().clamp_min(1e-30)),
                "grads": grads,
            }
        )
        opt.step()
        sample_leads.update((smp[1], smp[2]) for smp in state.codec._samples if not isinstance(smp[2], Tensor))
        if step == WARMUP + COLLECT:
            at_switch = {k: v.tolist() for k, v in state.codec._levels.items()}
    codec = state.codec
    denser = sorted(codec._levels_denser)
    return {
        "rows": rows,
        "buckets": buckets,
        "digest": codec.ae_digest(),
        "layers": codec.ae_layers,
        "denser": denser,
        "values_run": codec.values_run,
        "values_used": codec.values_used,
        "sample_leads": sorted(sample_leads),
        "refit_kept": sorted({(smp[1], smp[3]) for smp in codec._refit_samples}),  # (step, denser)
        "refits": codec.refits,
        "levels": {k: v.tolist() for k, v in codec._levels.items()},
        "levels_at_switch": at_switch,
        "summary": AutoencoderWarmup.summary(codec, total),
    }


def _expected_stage3_wire(world: int, fraction: float = RATIO, bits: int = 2) -> float:
    """Bytes of a stage-3 step whose every layer the code carries, on a support of ``fraction``
    of each layer in ``bits`` bits a value."""
    sizes = [p.numel() for p in _mlp().parameters() if p.numel() >= 1000]
    dense = sum(p.numel() for p in _mlp().parameters() if p.numel() < 1000)
    ks = [math.ceil(fraction * n) for n in sizes]
    positions = sum(encoded_nbytes(choose_encoding("auto", k, n), k, n) for k, n in zip(ks, sizes))
    broadcast = positions + 4 * len(ks)  # positions and one guard flag a layer
    # the dense layers in bfloat16 (lgc's default), the non-finite flag in fp32
    return broadcast + (world - 1) * (sum(levels.message_nbytes(k, bits) for k in ks) + 2 * dense + 4)


def _assert_every_layer_coded_on_identical_ranks(r: dict, coded: int = 3) -> None:
    """The stages as scheduled, the same gradient on every rank at every step, and in stage 3
    ``coded`` of the three eligible layers carried by the code (every one, by default), with what
    the step did not carry in the residual, exactly."""
    rows = r["rows"]
    assert [row["stage"] for row in rows] == [1] * WARMUP + [2] * COLLECT + [3] * STAGE3
    for row in rows:
        assert row["identical"]
    for row in rows[WARMUP + COLLECT :]:
        assert row["used"] == (coded, 3)
        assert row["err_sq"] == pytest.approx(row["residual_sq"], rel=1e-6)
        assert row["sent_error"] < 1e-5


def test_levels_carry_every_layer_identically_on_two_ranks_with_exact_error_feedback():
    res = run_gloo(_train_levels, world_size=2, timeout=300)
    assert res[0]["digest"] == res[1]["digest"] and res[0]["layers"] == res[1]["layers"]
    assert len(res[0]["layers"]) == 3, res[0]["layers"]  # the learned code engaged on every layer
    for r in res:
        _assert_every_layer_coded_on_identical_ranks(r)
        for row in r["rows"][WARMUP + COLLECT :]:
            assert row["wire"] == pytest.approx(_expected_stage3_wire(2))
        support = sum(math.ceil(RATIO * p.numel()) for p in _mlp().parameters() if p.numel() >= 1000)
        assert r["values_run"] == {"configured": (STAGE3 * support, STAGE3 * support), "denser": (0, 0)}
        # each stage-2 sample names the rank that led its step: the levels of each role are fitted
        # on that role's messages
        assert r["sample_leads"] and all(lead == step % 2 for step, lead in r["sample_leads"])
        assert {step for step, _ in r["sample_leads"]} == set(range(WARMUP, WARMUP + COLLECT))


def test_compression_level_moves_the_support_between_ten_times_denser_and_the_ratio():
    c = LGCCodec(ratio=0.01)
    assert c.k_for(10_000) == 100
    c.set_level(0.0)
    assert c.k_for(10_000) == 1000
    c.set_level(0.5)
    assert c.k_for(10_000) == math.ceil(10_000 * math.sqrt(0.1 * 0.01))
    d = LGCCodec(ratio=0.01)
    d.load_state_dict(c.state_dict())
    assert d.compression_level == 0.5 and d.k_for(10_000) == c.k_for(10_000)


def test_samples_at_the_configured_support_fit_no_denser_levels():
    # stage 2 without the controller's light steps: every sample holds exactly k values, so there
    # is no denser support and no second set of levels
    g = torch.Generator().manual_seed(0)
    c = LGCCodec(ratio=RATIO)
    k = math.ceil(RATIO * 3000)
    for step in range(16):
        c._samples.append(("w", step, step % 2, 3000, torch.randn(2, k, generator=g) * 1e-3))
    configured, denser = c._samples_by_support()
    assert len(configured) == 16 and denser == []
    c.train_autoencoder()
    assert set(c._levels) == {"w"} and c._levels_denser == {}


def test_a_support_shorter_than_min_ae_len_travels_exactly_and_keeps_no_stage_2_sample():
    """A layer whose support holds fewer than ``MIN_AE_LEN`` values at a step sends them exactly:
    in stage 2 that step's sample is not kept, and in stage 3 the code does not carry it, even
    where its levels were fitted on the light steps' denser support (10 % here: 300 values)."""
    c = codec_driver.set_up(LGCCodec(ratio=0.01, warmup_steps=0, ae_train_steps=6, max_recon_error=1.0))
    param = torch.zeros(30, 100)
    g = torch.Generator().manual_seed(0)
    assert c.k_for(3000) == 30 < MIN_AE_LEN
    decoded = {}
    for step in range(8):
        c.set_level(0.0 if step in (4, 5, 7) else 1.0)  # light: a support of 300
        x = torch.randn(3000, generator=g)
        if step < 2:
            c.observe_dense("w", x, step)
        else:
            decoded[step] = (x, codec_driver.round_trip(c, x, "w", param, step)[1])
        if step == 3:
            assert c._samples == []  # steps 2 and 3 held 30 values a rank
        c.on_step_end(step)
    assert c.stage(6) == 3 and list(c.ae_layers) == ["w"]
    x, out = decoded[6]  # heavy: 30 values, exactly
    assert torch.equal(out[out != 0], x[out != 0]) and int((out != 0).sum()) == 30
    x, out = decoded[7]  # light: 300 values through the levels
    assert int((out != 0).sum()) == 300 and not torch.equal(out[out != 0], x[out != 0])


def test_denser_samples_are_cut_to_the_configured_support_and_fit_levels_of_their_own():
    """Under the level controller stage 2 can run on a denser support, whose values have another
    shape in units of their RMS. The configured support's levels are fitted to each sample cut to
    the leader's ``k`` largest values (the configured support of that step's gradient); a second
    set is fitted to the denser values and serves the steps that run denser."""
    g = torch.Generator().manual_seed(0)
    c = LGCCodec(ratio=RATIO)
    heavy_k = math.ceil(RATIO * 3000)
    c.set_level(0.0)
    light_k = c.k_for(3000)
    c.set_level(1.0)
    assert light_k > heavy_k
    for step in range(16):
        # a dense support: heavy_k large values (magnitudes in [2, 3], the same positions on both
        # ranks, scattered), many small ones
        v = torch.randn(2, light_k, generator=g).abs() * 0.3
        top = torch.randperm(light_k, generator=g)[:heavy_k]
        v[:, top] = 2 + torch.rand(2, heavy_k, generator=g)
        v *= torch.sign(torch.randn(2, light_k, generator=g)) * 1e-3
        c._samples.append(("w", step, step % 2, 3000, v))
        if step == 0:
            first_top = top.sort().values
    configured, denser = c._samples_by_support()
    assert len(denser) == 16 and {s[4].shape[-1] for s in configured} == {heavy_k}
    assert torch.equal(configured[0][4], c._samples[0][4][:, first_top])
    train, val = c._split_samples(configured)
    assert sorted({s[1] for s in train}) == list(range(14)) and {s[1] for s in val} == {14, 15}
    c.train_autoencoder()
    assert list(c.ae_layers) == ["w"] and c.ae_recon_error < 0.15  # two levels inside [2, 3] / RMS
    heavy, light = c._levels_for("w", heavy_k, 3000), c._levels_for("w", light_k, 3000)
    assert heavy is c._levels["w"] and light is c._levels_denser["w"]
    # the denser support's lower level sits among its small values
    assert light[levels.LEADER, 0] < 0.5 * heavy[levels.LEADER, 0]
    # both sets travel in the digest and the checkpoint; a checkpoint without the second loads
    d = LGCCodec(ratio=RATIO)
    d.load_state_dict(c.state_dict())
    assert d.ae_digest() == c.ae_digest() and torch.equal(d._levels_denser["w"], light)
    old = c.state_dict()
    del old["levels_denser"]
    e = LGCCodec(ratio=RATIO)
    e.load_state_dict(old)
    assert e._levels_denser == {} and torch.equal(e._levels_for("w", light_k, 3000), heavy)


def test_light_code_bits_fit_the_denser_support_more_levels_and_keep_their_number():
    """``light_code_bits=3``: the denser support's levels are four magnitudes, fitted to the same
    samples as the two-level ones would be, with a lower error on a wide spread; the configured
    support keeps ``code_bits``. A refit, a checkpoint and the bytes a layer costs all follow the
    number of levels the table holds."""
    g = torch.Generator().manual_seed(0)
    light_k = math.ceil(0.25 * 3000)

    def fitted(**opts):
        c = LGCCodec(ratio=RATIO, **opts)
        c.set_level(0.0)
        assert c.k_for(3000) == light_k
        for step in range(16):  # a wide, heavy-tailed spread of magnitudes, as at 50 % of a layer
            c._samples.append(("w", step, step % 2, 3000, torch.randn(2, light_k, generator=g).pow(3)))
        c.train_autoencoder()
        return c

    two, three = fitted(), fitted(light_code_bits=3)
    assert two.denser_code_bits == 2 and three.denser_code_bits == 3
    assert three._levels["w"].shape == (2, 2) and three._levels_denser["w"].shape == (2, 4)
    assert three._code_nbytes("w", light_k, 3000) == levels.message_nbytes(light_k, 3)
    assert three._code_nbytes("w", math.ceil(RATIO * 3000), 3000) == levels.message_nbytes(300, 2)
    v = torch.randn(light_k, generator=g).pow(3)

    def error(c):
        _, decoded = levels.encode(v, c._levels_for("w", light_k, 3000, levels.LEADER))
        return float((decoded - v).norm() / v.norm())

    assert error(three) < 0.75 * error(two)
    for step in range(three.ae_start_step, three.ae_start_step + 4):  # a refit keeps four levels
        three._keep_for_refit("w", step, torch.randn(light_k, generator=g).pow(3), denser=True)
    before = three._levels_denser["w"].clone()
    three.refit_levels()
    assert three._levels_denser["w"].shape == (2, 4) and not torch.equal(three._levels_denser["w"], before)
    resumed = LGCCodec(ratio=RATIO)  # the checkpoint's levels decide, not the resuming option
    resumed.load_state_dict(three.state_dict())
    assert resumed.denser_code_bits == 3 and resumed.ae_digest() == three.ae_digest()


def test_levels_fitted_on_a_denser_stage_2_carry_the_configured_support_on_two_ranks():
    """The controller's case: stage 2 wholly at the light level. The code still carries every layer
    at the configured level, and a later light step uses the denser support's levels, identically
    on both ranks, with exact error feedback throughout. With the refit on (every 100 steps: not
    reached here) rank 0 keeps each stage-3 message for it, the light step's as the denser support's."""
    res = run_gloo(_train_levels, world_size=2, args=(True, 100), timeout=300)
    assert res[0]["digest"] == res[1]["digest"] and res[0]["layers"] == res[1]["layers"]
    assert len(res[0]["layers"]) == 3 and res[0]["denser"] == sorted(res[0]["layers"])
    for r in res:
        rows = r["rows"]
        for row in rows:
            assert row["identical"]
        for row in rows[WARMUP + COLLECT :]:
            assert row["used"] == (3, 3)
            assert row["err_sq"] == pytest.approx(row["residual_sq"], rel=1e-6)
        assert rows[WARMUP + COLLECT]["wire"] == pytest.approx(_expected_stage3_wire(2))
        assert rows[-1]["wire"] > rows[-2]["wire"]  # the last step ran the denser support
        # the report's tally: every support value coded, two steps configured and one denser
        support = sum(math.ceil(RATIO * p.numel()) for p in _mlp().parameters() if p.numel() >= 1000)
        denser = sum(math.ceil(0.25 * p.numel()) for p in _mlp().parameters() if p.numel() >= 1000)
        assert r["values_run"] == {"configured": (2 * support, 2 * support), "denser": (denser, denser)}
        assert r["summary"].endswith(
            f"over the run it carried 100 % of {2 * support:,} at the configured support "
            f"and 100 % of {denser:,} at the denser support"
        )
    stage3 = range(WARMUP + COLLECT, WARMUP + COLLECT + STAGE3)
    assert res[0]["refit_kept"] == [(step, step == stage3[-1]) for step in stage3]
    assert res[1]["refit_kept"] == []  # rank 0 alone refits


def test_light_code_bits_send_the_denser_steps_in_three_bits_on_two_ranks():
    """``light_code_bits=3`` beside the controller's case: the configured steps still travel in two
    bits a value, the denser last step in three, every rank identical and the error feedback
    exact."""
    res = run_gloo(_train_levels, world_size=2, args=(True, 0, STAGE3, True, {"light_code_bits": 3}), timeout=300)
    assert res[0]["digest"] == res[1]["digest"] and len(res[0]["layers"]) == 3
    for r in res:
        rows = r["rows"]
        assert all(row["identical"] for row in rows)
        for row in rows[WARMUP + COLLECT :]:
            assert row["used"] == (3, 3)
            assert row["err_sq"] == pytest.approx(row["residual_sq"], rel=1e-6)
        assert rows[-2]["wire"] == pytest.approx(_expected_stage3_wire(2))
        assert rows[-1]["wire"] == pytest.approx(_expected_stage3_wire(2, 0.25, 3))
        assert "2-bit levels (3-bit at the denser support) carried 3 of 3 layer(s)" in r["summary"]


# --------------------------------------------------------------------------------------------------
# light_scale="channel": the light steps' values in units of their output channel's RMS
def _channel_mixture(g: torch.Generator, channels: int = 8, per: int = 400) -> tuple[Tensor, Tensor]:
    """Values whose channels differ in scale by a factor of 1000, as a convolution's output
    channels' gradients do, and each value's channel."""
    scales = torch.logspace(-2, 1, channels)
    values = torch.randn(channels, per, generator=g) * scales[:, None]
    return values.reshape(-1), torch.arange(channels).repeat_interleave(per)


def test_a_scale_a_channel_decodes_to_what_the_encoder_kept_and_cuts_the_error_of_a_scale_mixture():
    g = torch.Generator().manual_seed(0)
    v, channels = _channel_mixture(g)
    v[channels == 3] = 0.0  # a silent channel: no NaN
    units, scales = levels.normalize_by_channel(v, channels, 8)
    assert scales.dtype == torch.bfloat16 and scales.shape == (8,) and torch.isfinite(units).all()
    by_channel = levels.fit_levels(levels.relative_magnitudes(units), 2)
    by_message = levels.fit_levels(levels.relative_magnitudes(v), 2)
    message, decoded = levels.encode_by_channel(v, by_channel, channels, 8)
    assert [t.dtype for t in message] == [torch.bfloat16, torch.float32, torch.uint8]
    assert sum(t.numel() * t.element_size() for t in message) == 2 * 8 + levels.message_nbytes(v.numel(), 2)
    # the decoder reads the same values, bit for bit: what error feedback keeps is what arrived
    assert torch.equal(levels.decode_by_channel(message, by_channel, channels), decoded)
    assert decoded[channels == 3].abs().max() <= 1e-29  # its scale is 1e-30: a level times that
    _, one_scale = levels.encode(v, by_message)
    error = float((decoded - v).norm() / v.norm())
    assert error < 0.8 * float((one_scale - v).norm() / v.norm())  # 0.36 against 0.49
    # a stage-2 sample seen as its messages: on a union support each rank's named values and the
    # rest scale apart; on the leader's support each rank's row is one message
    named = torch.zeros(2, v.numel(), dtype=torch.bool)
    named[0, ::2], named[1, 1::2] = True, True
    sample = torch.stack([v, v.flip(0)])
    union = levels.normalize_sample(sample, named, channels, 8)
    cols = named[1].nonzero().reshape(-1)
    assert torch.equal(union[1, cols], levels.normalize_by_channel(sample[1, cols], channels[cols], 8)[0])
    leader = levels.normalize_sample(sample, None, channels, 8)
    assert torch.equal(leader[0], units)


def test_a_scale_a_channel_fits_the_denser_levels_in_its_units_and_a_checkpoint_keeps_the_channels():
    """With ``light_scale="channel"`` the switch fits the denser support's levels to the samples in
    units of their channel's RMS (each sample keeps how its positions fall in the channels); the
    configured support's levels and gate are the same as without it."""
    light_k = math.ceil(0.25 * 3200)

    def collected(**opts):
        c = LGCCodec(ratio=RATIO, **opts)
        c.set_level(0.0)
        assert c.k_for(3200) == light_k
        gen = torch.Generator().manual_seed(1)
        for step in range(16):
            v, channels = _channel_mixture(gen, 8, light_k // 8)
            c._samples.append(("w", step, step % 2, 3200, torch.stack([v, v * 0.5 + 0.1 * v.flip(0)])))
            c._sample_channels[("w", step)] = torch.bincount(channels, minlength=8)
        return c

    plain, scaled = collected(), collected(light_scale="channel")
    resumed = LGCCodec(ratio=RATIO, light_scale="channel")
    resumed.load_state_dict(scaled.state_dict())
    assert resumed._sample_channels.keys() == scaled._sample_channels.keys()
    assert all(torch.equal(resumed._sample_channels[k], c) for k, c in scaled._sample_channels.items())
    for c in (plain, scaled, resumed):
        c.train_autoencoder()
        assert c._sample_channels == {}  # kept no longer than the samples
    assert torch.equal(plain._levels["w"], scaled._levels["w"]) and plain.ae_layers == scaled.ae_layers
    assert not torch.equal(plain._levels_denser["w"], scaled._levels_denser["w"])
    assert resumed.ae_digest() == scaled.ae_digest()
    # the scaled levels are those of the samples in channel units
    expected = torch.ones(1, 2, 2)
    units = [
        (key, step, lead, n, levels.normalize_sample(v, None, torch.arange(8).repeat_interleave(light_k // 8), 8))
        for key, step, lead, n, v in collected()._samples
    ]
    levels.fit_roles(levels.split_held_out(units)[0], ["w"], expected, scaled.options.seed)
    assert torch.equal(scaled._levels_denser["w"], expected[0])


@pytest.mark.parametrize("support", ["leader", "union"])
def test_a_scale_a_channel_sends_the_light_steps_with_two_bytes_a_channel_on_two_ranks(support):
    """``light_scale="channel"`` beside the controller's case: every step before the last (light)
    one trains bit for bit as with one scale a message; the light step sends each message with
    two bytes a weight's output channel more, every rank identical and the error feedback exact."""
    extra = {"support": support}
    scaled = run_gloo(_train_levels, world_size=2, args=(True, 0, STAGE3, True, {**extra, "light_scale": "channel"}))
    plain = run_gloo(_train_levels, world_size=2, args=(True, 0, STAGE3, True, extra))
    channels = sum(p.shape[0] for p in _mlp().parameters() if p.numel() >= 1000)
    messages = 2 if support == "union" else 1  # a union: the named values and the rest
    for r, q in zip(scaled, plain):
        rows = r["rows"]
        assert all(row["identical"] for row in rows)
        for row in rows[WARMUP + COLLECT :]:
            assert row["used"] == (3, 3)
            assert row["err_sq"] == pytest.approx(row["residual_sq"], rel=1e-6)
        for a, b in zip(rows[:-1], q["rows"][:-1], strict=True):
            assert torch.equal(a["grads"], b["grads"]) and a["wire"] == b["wire"]
        assert rows[-1]["wire"] == q["rows"][-1]["wire"] + 2 * channels * messages
        # and the end-of-fit report's count of the code's bytes takes them in
        assert r["values_used"][2] == q["values_used"][2] + 2 * channels * messages
        assert not torch.equal(rows[-1]["grads"], q["rows"][-1]["grads"])
    assert scaled[0]["digest"] == scaled[1]["digest"] != plain[0]["digest"]


# --------------------------------------------------------------------------------------------------
# the levels follow the run: fitted again in stage 3 on rank 0's own messages
def test_refit_rows_fits_each_role_on_its_own_messages_and_reports_the_held_out_error():
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    samples = []
    for step in range(16):
        r = step % 2
        centres = (0.5, 1.5) if r == levels.LEADER else (0.2, 3.0)
        m = torch.tensor(centres).repeat(500) + 0.01 * torch.randn(1000, generator=g)
        samples.append(("w", step, r, False, m))
    error = levels.refit_rows(samples, rows, 2)
    assert rows[levels.LEADER].tolist() == pytest.approx([0.5, 1.5], abs=0.01)
    assert rows[levels.OTHERS].tolist() == pytest.approx([0.2, 3.0], abs=0.01)
    assert error is not None and error < 0.02
    # a role seen on fewer than two (training) steps keeps its row; no sample: nothing
    kept = torch.tensor([[1.0, 2.0], [7.0, 9.0]])
    assert levels.refit_rows([s for s in samples if s[2] == levels.LEADER][:3] + samples[1:2], kept, 2) is not None
    assert kept[levels.OTHERS].tolist() == [7.0, 9.0]
    assert levels.refit_rows([], kept, 2) is None


def test_rank_0_keeps_a_seeded_subsample_of_its_recent_messages_for_the_refit():
    """What a refit fits on: at most REFIT_VALUES of a message's relative magnitudes, the same ones
    for the same step, with the role it was sent in, and only the last ``refit_every`` steps."""
    from lightning_gradcomp.codecs.lgc_learning import REFIT_VALUES

    c = LGCCodec(ratio=RATIO, refit_every=4)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(3 * REFIT_VALUES, generator=g)
    magnitudes = levels.relative_magnitudes(v)
    c._keep_for_refit("w", 10, v, denser=False)
    c._keep_for_refit("w", 10, v, denser=True, role=levels.OTHERS)  # a union support's other half
    (_, _, role, denser, kept), (_, _, role_given, denser_given, kept_again) = c._refit_samples
    assert kept.numel() == REFIT_VALUES and torch.isin(kept, magnitudes).all()
    assert torch.equal(kept, kept_again)  # seeded by the step: the same subsample
    assert (role, denser) == (c._role(10), False) and (role_given, denser_given) == (levels.OTHERS, True)
    c._keep_for_refit("w", 11, v, denser=False)
    assert not torch.equal(c._refit_samples[-1][4], kept)  # another step, another subsample
    short = torch.randn(100, generator=g)
    c._keep_for_refit("w", 13, short, denser=False)
    assert torch.equal(c._refit_samples[-1][4].sort().values, levels.relative_magnitudes(short).sort().values)
    c._keep_for_refit("w", 14, short, denser=False)  # step 10 is refit_every steps back: it goes
    assert [smp[1] for smp in c._refit_samples] == [11, 13, 14]


def test_a_refit_fits_the_configured_and_the_denser_support_each_on_its_own_messages():
    """Rank 0's messages at the configured support and at the denser one (the controller's light
    steps) have levels of their own: each table is fitted again on its own messages alone, and the
    gate reads the configured support's error."""
    c = LGCCodec(ratio=RATIO, refit_every=8)
    _samples(c, 16, 0.3)
    c.train_autoencoder()
    c._levels_denser = {"w": c._levels["w"].clone()}
    g = torch.Generator().manual_seed(1)
    start = c.ae_start_step
    for step in range(start, start + 8):
        sign = torch.sign(torch.randn(300, generator=g))
        v = torch.cat([0.1 * torch.ones(150), 4.0 * torch.ones(150)]) * sign
        d = (torch.linspace(0, 100, 300) ** 2) * sign  # spread: no two levels carry it
        c._keep_for_refit("w", step, v + 0.001 * torch.randn(300, generator=g), denser=False)
        c._keep_for_refit("w", step, d, denser=True)
    configured = [smp for smp in c._refit_samples if not smp[3]]
    denser = [smp for smp in c._refit_samples if smp[3]]
    expected, expected_denser = c._levels["w"].clone(), c._levels_denser["w"].clone()
    error = levels.refit_rows(configured, expected, expected.shape[-1], c.options.seed)
    levels.refit_rows(denser, expected_denser, expected_denser.shape[-1], c.options.seed)
    # the gate at its bound keeps the layer (the error travels in float32)
    c.replace_options(max_recon_error=torch.tensor(error, dtype=torch.float32).item())
    c.refit_levels()
    assert torch.equal(c._levels["w"], expected) and torch.equal(c._levels_denser["w"], expected_denser)
    assert c.ae_layers == {"w": pytest.approx(error)} and error < 0.05  # the denser spread does not gate


def test_stage_2_samples_of_a_denser_support_are_cut_to_the_configured_one():
    """The fit at the switch takes each sample at the configured support: a denser leader's
    support is cut to the leader's ``k`` largest values (every rank's values there), a denser
    union to each rank's ``ceil(k / N)`` largest among the positions it named; a sample already at
    the configured size is kept whole and is not a denser one."""
    c = LGCCodec(ratio=RATIO, support="union")
    numel, k = 1000, 100  # keep_count(0.1, 1000)
    g = torch.Generator().manual_seed(0)
    led_by_1 = torch.randn(2, 250, generator=g)  # a denser leader's support, rank 1 leading
    c._samples.append(("a", 1, 1, numel, led_by_1))
    named = torch.zeros(2, 80, dtype=torch.bool)  # a union at the configured size: 50 names a rank
    named[0, :50] = named[1, 30:] = True
    union = torch.randn(2, 80, generator=g)
    c._samples.append(("b", 2, named, numel, union))
    wide = torch.zeros(2, 160, dtype=torch.bool)  # a denser union: 100 names a rank
    wide[0, :100] = wide[1, 60:] = True
    denser_union = torch.randn(2, 160, generator=g)
    c._samples.append(("c", 3, wide, numel, denser_union))
    configured, denser = c._samples_by_support()
    assert [(smp[0], smp[1]) for smp in denser] == [("a", 1), ("c", 3)]
    by_key = {smp[0]: smp for smp in configured}
    keep = led_by_1[1].abs().topk(k).indices.sort().values  # the leader's, not rank 0's
    assert torch.equal(by_key["a"][4], led_by_1[:, keep]) and by_key["a"][2] == 1
    assert by_key["b"][4] is union and by_key["b"][2] is named
    picks = []
    for r in range(2):
        columns = wide[r].nonzero().reshape(-1)
        picks.append(set(columns[denser_union[r, columns].abs().topk(50).indices].tolist()))
    kept = sorted(picks[0] | picks[1])
    assert torch.equal(by_key["c"][4], denser_union[:, kept])
    assert by_key["c"][2].tolist() == [[i in picks[r] for i in kept] for r in range(2)]


@pytest.mark.parametrize("denser_steps", [1, 2])
def test_the_denser_support_gets_levels_of_its_own_from_two_steps_of_it(denser_steps):
    """Levels of their own for the controller's denser support are fitted only from at least two
    steps of it in stage 2 (one step has no held-out step to gate on); below that the denser
    support uses the configured support's levels."""
    c = LGCCodec(ratio=RATIO)
    _samples(c, 16, 0.3)  # 300 values of 3,000: the configured support
    g = torch.Generator().manual_seed(2)
    for step in range(16, 16 + denser_steps):
        common = torch.randn(750, generator=g)  # the ranks' values alike, as _samples makes them
        v = torch.stack([common + 0.3 * torch.randn(750, generator=g) for _ in range(2)]) * 1e-3
        c._samples.append(("w", step, step % 2, 3000, v))
    c.train_autoencoder()
    assert list(c.ae_layers) == ["w"]
    assert sorted(c._levels_denser) == ([] if denser_steps == 1 else ["w"])
    # the code's own size: a (2, 2) table of fp32 levels a support (two bits a value)
    tables = 1 if denser_steps == 1 else 2
    assert c.ae_cost() == {"ae_params": 4.0 * tables, "ae_param_bytes": 16.0 * tables}


def test_a_checkpoint_carries_the_runs_tallies_of_the_learned_code():
    """What the end-of-run report counts (support values the code carried, and all of them, at
    each support) goes on after a resume from where it was."""
    c = LGCCodec(ratio=RATIO)
    _samples(c, 16, 0.3)
    c.train_autoencoder()
    c._values_run = {"configured": [1200, 1500], "denser": [40, 90]}
    d = LGCCodec(ratio=RATIO)
    d.load_state_dict(c.state_dict())
    assert d.values_run == {"configured": (1200, 1500), "denser": (40, 90)}


def test_a_refit_gates_layers_again_on_what_the_run_sends_now():
    """Levels fitted at the switch on values in [2, 3] of their RMS scale; later the messages hold
    a wide spread, which those levels carry badly: the refit fits them again and the layer keeps
    the code; a spread no two levels can carry takes the layer off the code until a later refit."""
    c = LGCCodec(ratio=RATIO, refit_every=4)
    _samples(c, 16, 0.3)
    c.train_autoencoder()
    assert list(c.ae_layers) == ["w"] and c.refits == 0
    before = c._levels["w"].clone()
    g = torch.Generator().manual_seed(1)
    start = c.ae_start_step
    for step in range(start, start + 4):  # two clusters of magnitudes, far from the switch's levels
        v = torch.cat([0.1 * torch.ones(150), 4.0 * torch.ones(150)]) * torch.sign(torch.randn(300, generator=g))
        c._keep_for_refit("w", step, v + 0.001 * torch.randn(300, generator=g), denser=False)
    c.refit_levels()
    assert c.refits == 1 and not torch.equal(c._levels["w"], before)
    assert "w" in c.ae_layers and c.ae_layers["w"] < 0.05
    assert c._refit_samples == []  # the next refit fits on what comes after this one
    for step in range(start + 4, start + 8):  # magnitudes spread evenly over [0, 100]: two levels fail
        v = torch.linspace(0, 100, 300) ** 2 * torch.sign(torch.randn(300, generator=g))
        c._keep_for_refit("w", step, v, denser=False)
    c.refit_levels()
    assert c.refits == 2 and c.ae_layers == {}
    d = LGCCodec(ratio=RATIO, refit_every=4)  # the checkpoint holds the refitted levels and the count
    d.load_state_dict(c.state_dict())
    assert d.refits == 2 and d.ae_digest() == c.ae_digest() and d.ae_layers == {}


def test_levels_fitted_again_in_stage_3_stay_identical_on_two_ranks():
    """refit_every=4: the levels are fitted again after four stage-3 steps, on rank 0's messages
    (two as the leader, two as the other rank), broadcast and checked; error feedback stays exact."""
    res = run_gloo(_train_levels, world_size=2, args=(False, 4, 5), timeout=300)
    assert res[0]["refits"] == res[1]["refits"] == 1
    assert res[0]["digest"] == res[1]["digest"] and res[0]["levels"] == res[1]["levels"]
    for key, table in res[0]["levels"].items():  # both rows fitted again, on other values
        assert table[0] != res[0]["levels_at_switch"][key][0] and table[1] != res[0]["levels_at_switch"][key][1]
    assert res[0]["layers"] == res[1]["layers"]
    for r in res:
        for row in r["rows"]:
            assert row["identical"]
        for row in r["rows"][WARMUP + COLLECT :]:
            assert row["err_sq"] == pytest.approx(row["residual_sq"], rel=1e-6)


def test_code_denser_false_sends_the_light_steps_exactly():
    """With code_denser=False the learned code carries the configured support only: the
    controller's light step (the last) sends its denser support's values exactly, on both ranks."""
    res = run_gloo(_train_levels, world_size=2, args=(True, 0, STAGE3, False), timeout=300)
    support = sum(math.ceil(RATIO * p.numel()) for p in _mlp().parameters() if p.numel() >= 1000)
    denser = sum(math.ceil(0.25 * p.numel()) for p in _mlp().parameters() if p.numel() >= 1000)
    for r in res:
        rows = r["rows"]
        assert [row["used"] for row in rows[WARMUP + COLLECT :]] == [(3, 3), (3, 3), (0, 0)]
        for row in rows:
            assert row["identical"]
            assert row["err_sq"] == pytest.approx(row["residual_sq"], rel=1e-6)
        assert r["values_run"] == {"configured": (2 * support, 2 * support), "denser": (0, denser)}


def test_a_light_ratio_of_one_sends_whole_layers_exactly_then_coded_without_positions():
    """light_ratio=1.0: the controller's light steps keep every value. In stage 2 they travel
    exactly (no error, nothing left in the residual); in stage 3 the code carries whole layers,
    with no position code on the wire, identically on both ranks and with exact error feedback."""
    extra = {"light_ratio": 1.0, "max_recon_error": float("inf")}
    res = run_gloo(_train_levels, world_size=2, args=(True, 0, STAGE3, True, extra), timeout=300)
    sizes = [p.numel() for p in _mlp().parameters() if p.numel() >= 1000]
    dense = sum(p.numel() for p in _mlp().parameters() if p.numel() < 1000)
    assert res[0]["digest"] == res[1]["digest"] and res[0]["denser"] == sorted(res[0]["layers"])
    for r in res:
        rows = r["rows"]
        for row in rows:
            assert row["identical"]
        for row in rows[WARMUP : WARMUP + COLLECT]:  # stage 2, every value on the support
            assert row["err_sq"] == 0.0 and row["residual_sq"] == 0.0
        last = rows[-1]
        assert last["used"] == (3, 3) and last["err_sq"] > 0
        assert last["err_sq"] == pytest.approx(last["residual_sq"], rel=1e-6)
        # one guard flag a layer and no positions; each rank's 2-bit message; the dense layers
        expected = 4 * len(sizes) + sum(levels.message_nbytes(n, 2) for n in sizes) + 2 * dense + 4
        assert last["wire"] == pytest.approx(expected)
        assert r["values_run"]["denser"] == (sum(sizes), sum(sizes))


def test_the_report_does_not_blame_the_gate_when_the_layers_that_passed_it_fell_back():
    """A code that passed the gate, on a run whose buckets all went back to plain all-reduce (the
    strategy's fallback), carried nothing at the last step: the report says why, and does not
    claim an error above the threshold that the code was below."""
    from lightning_gradcomp.callbacks import AutoencoderWarmup

    c = LGCCodec(warmup_steps=2, ae_train_steps=3)
    c._ae_state.update(trained=True, recon_error=0.17, loss=0.1)
    c._ae_layers = {"w": 0.17}
    line = AutoencoderWarmup.summary(c, 40, fell_back=True)
    assert "passed the gate on 1 layer(s) at the switch (held-out error 0.17)" in line
    assert "went back to plain all-reduce" in line and "> max_recon_error" not in line
    # a code that passed no layer is reported as before
    c._ae_layers = {}
    line = AutoencoderWarmup.summary(c, 40)
    assert "no layer passed the gate (held-out error of the 2-bit levels 0.17 > max_recon_error 0.3)" in line


def _reported_codec(**more) -> SimpleNamespace:
    """What ``AutoencoderWarmup.summary`` reads of an ``lgc`` codec, set by hand: dense until step
    4, the code from step 10, 2 of 3 layers carried at the last step."""
    c = SimpleNamespace(
        warmup_end=4,
        ae_start_step=10,
        ae_trained=True,
        ae_layers_used=(2, 3),
        values_used=(600, 615, 160),
        options=SimpleNamespace(code="levels", code_bits=2, variant="ps", max_recon_error=0.3),
        denser_code_bits=2,
        ae_recon_error=0.14,
        refits=1,
        values_run={"configured": (90, 100)},
        ae_layers={"a": 0.1, "b": 0.1},
    )
    c.__dict__.update(more)
    c.stage = lambda step: 1 if step < c.warmup_end else (2 if step < c.ae_start_step else 3)
    return c


def test_the_stage_report_says_what_the_code_carried_at_the_last_step_and_over_the_run(capsys):
    from lightning_gradcomp.callbacks import AutoencoderWarmup

    assert AutoencoderWarmup.summary(_reported_codec(), 40) == (
        "lgc: learned code from step 10: the 2-bit levels carried 2 of 3 layer(s) at the last step, 600 of the "
        "615 support values (98 %), in 160 bytes instead of 2,400 (x15.0 on top of the support); held-out error "
        "0.14 at the switch; the run-time guard sent the other layers' values exactly; the levels were fitted "
        "again 1 time(s) after the switch; over the run it carried 90 % of 100 at the configured support"
    )
    # 4 steps ran: the last, step 3, was dense
    assert AutoencoderWarmup.summary(_reported_codec(), 4).startswith("lgc: still in the dense warm-up after 4 steps")
    # too few stage-2 samples to measure the code's error: no number is made up
    line = AutoencoderWarmup.summary(_reported_codec(ae_layers_used=(0, 0), ae_layers={}, ae_recon_error=math.nan), 40)
    assert "no layer passed the gate (too few stage-2 samples to measure the error of the 2-bit levels)" in line
    # only rank 0 prints it
    hook_state = SimpleNamespace(step=40, fallback=SimpleNamespace(fallback={}))
    trainer = SimpleNamespace(strategy=SimpleNamespace(codec=LGCCodec(), hook_state=hook_state), is_global_zero=False)
    AutoencoderWarmup().on_fit_end(trainer, None)
    assert capsys.readouterr().out == ""


# --------------------------------------------------------------------------------------------------
# a union support: every rank names its own largest positions
def _union_round(rank: int, world: int) -> dict:
    """One stage-2 bucket of a union support, by hand: what ``prepare_bucket`` chose, what the
    aggregate of every rank's payload gave, and the codec's state after it kept the sample."""
    from lightning_gradcomp.codecs.base import CodecContext, RoundContext

    codec = LGCCodec(support="union", selection="exact", warmup_steps=2, ae_train_steps=4, ratio=RATIO)
    ctx = CodecContext(rank, world, torch.device("cpu"))
    codec.setup(ctx)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(10 + rank))
    everyone = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(everyone, x)
    step = 3
    assert codec.stage(step) == 2
    prepared = codec.prepare_bucket([("w", x, torch.zeros(3000))], RoundContext(step=step, comm=ctx))
    shared = prepared.per_layer["w"]
    enc = codec.encode(x, "w", torch.zeros(3000), step, prepared=shared)
    gathered = [torch.empty_like(enc.payload[0]) for _ in range(world)]
    dist.all_gather(gathered, enc.payload[0])
    total = codec.aggregate([[p] for p in gathered], enc.ctx, 3000)
    return {
        "everyone": torch.stack(everyone),
        "support": shared.support,
        "named": shared.named,
        "nbytes": prepared.nbytes,
        "collective": prepared.collective,
        "local": enc.local,
        "total": total,
        "state": codec.state_dict(),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_a_union_support_is_every_ranks_largest_positions_and_stage_2_sums_them_exactly(world):
    res = run_gloo(_union_round, world_size=world, timeout=120)
    everyone = res[0]["everyone"]
    k = math.ceil(RATIO * 3000)
    m = math.ceil(k / world)
    named = [row.abs().topk(m).indices.sort().values for row in everyone]
    union = torch.unique(torch.cat(named))
    assert m < union.numel() <= world * m  # independent gradients: few positions in common
    for r in res:
        assert torch.equal(r["support"], union)
        for rank in range(world):
            assert torch.equal(union[r["named"][rank]], named[rank])
        # each rank's names travel in an all-gather: a vector's ceil(k / N) names as the Rice code
        # of their gaps (one channel), after 4 bytes of each rank's code length; padded to the
        # longest rank's code, and below the Elias-Fano code over the layer
        assert r["collective"] == "allgather"
        longest = 0
        for own in named:
            lows, quotients = rice_fields(own, torch.tensor([m]), 3000)
            longest = max(longest, lows.numel() + int((quotients + 1).sum()))
        assert r["nbytes"] == 4 + -(-longest // 8) < 4 + encoded_nbytes(choose_encoding("auto", m, 3000), m, 3000)
        # stage 2: the exact sum on the union, and this rank's values there in its local account
        expected = torch.zeros(3000)
        expected[union] = everyone[:, union].sum(0)
        torch.testing.assert_close(r["total"], expected)
    for rank, r in enumerate(res):
        kept = torch.zeros(3000)
        kept[union] = everyone[rank, union]
        assert torch.equal(r["local"], kept)
    # the stage-2 sample keeps who named what, and a checkpoint round trip keeps it
    state = res[0]["state"]
    (sample,) = state["samples"]
    assert torch.equal(sample["leader"], res[0]["named"]) and sample["values"].shape == (world, union.numel())
    restored = LGCCodec(support="union", warmup_steps=2, ae_train_steps=4, ratio=RATIO)
    restored.load_state_dict(state)
    assert torch.equal(restored._samples[0][2], res[0]["named"])


def test_union_samples_fit_each_role_on_the_positions_each_rank_named():
    """On a union support a rank's values at its own names are large and at the others' small:
    the leader's row is fitted to the former, the others' row to the latter, and a denser sample is
    cut to each rank's ``ceil(k / N)`` largest names."""
    g = torch.Generator().manual_seed(0)
    c = LGCCodec(ratio=RATIO, support="union")
    heavy_m = math.ceil(math.ceil(RATIO * 3000) / 2)
    for step in range(16):
        u = 2 * heavy_m + 40  # a denser step: 20 more names a rank
        named = torch.zeros(2, u, dtype=torch.bool)
        named[0, : u // 2], named[1, u // 2 :] = True, True
        v = 0.1 * torch.randn(2, u, generator=g)
        v[named] = (2 + torch.rand(u, generator=g)) * torch.sign(torch.randn(u, generator=g))
        small = torch.cat([torch.arange(heavy_m, u // 2), torch.arange(u // 2 + heavy_m, u)])
        v[:, small] *= 0.5  # the 20 extra names of each rank are its smallest
        c._samples.append(("w", step, named, 3000, v))
    configured, denser = c._samples_by_support()
    assert len(denser) == 16
    for _, _, named, _, v in configured:
        assert v.shape == (2, 2 * heavy_m) and named.sum(1).tolist() == [heavy_m, heavy_m]
    c.train_autoencoder()
    assert list(c.ae_layers) == ["w"]
    # in units of each message's RMS: the named values sit in [2, 3] (two close levels), the
    # others' are Gaussian (two levels far apart); a fit that mixed the roles would spread both
    rows = c._levels["w"]
    assert rows[levels.LEADER, -1] < 1.6 * rows[levels.LEADER, 0]
    assert rows[levels.OTHERS, -1] > 2.5 * rows[levels.OTHERS, 0]
    assert c.ae_layers["w"] < 0.15


def test_a_union_support_carries_every_layer_identically_on_two_ranks_with_exact_error_feedback():
    """Stage 2 on the light level, stage 3 at the configured one and its last step light again:
    the code carries every layer on a union support, every rank ends each step with the same
    gradient, what the code lost stays in the residual exactly, and a step sends fewer bytes
    than the leader's support of the same ``k`` would."""
    res = run_gloo(_train_levels, world_size=2, args=(True, 0, STAGE3, True, {"support": "union"}), timeout=300)
    assert res[0]["digest"] == res[1]["digest"] and res[0]["layers"] == res[1]["layers"]
    assert len(res[0]["layers"]) == 3 and res[0]["denser"] == sorted(res[0]["layers"])
    support = sum(math.ceil(RATIO * p.numel()) for p in _mlp().parameters() if p.numel() >= 1000)
    for r in res:
        _assert_every_layer_coded_on_identical_ranks(r)
        assert r["rows"][WARMUP + COLLECT]["wire"] < _expected_stage3_wire(2)
        carried, total = r["values_run"]["configured"]
        assert carried == total and 2 * (support // 2) <= total <= 2 * support  # two steps, union of halves


def _train_union_where_rank_1_fails_the_guard(rank: int, world: int) -> dict:
    """The union run above, with rank 1's own values failing the run-time guard on every layer (as
    a code that no longer fits that rank's gradients would), rank 0's passing it."""
    if rank == 1:  # this process only: the class is patched in rank 1's own interpreter
        LGCCodec._within_gate = lambda self, v, rec: torch.zeros((), dtype=torch.float32)
    return _train_levels(rank, world, True, 0, STAGE3, True, {"support": "union"})


def test_one_ranks_failing_guard_sends_the_layer_exactly_on_every_rank():
    """On a union support the code carries a layer only where every rank's guard passes: when one
    rank's own values fail it, every rank sends that layer's exact values on the support, the
    ranks stay identical, and what the support left out is in the residual, exactly."""
    res = run_gloo(_train_union_where_rank_1_fails_the_guard, world_size=2, timeout=300)
    for r in res:
        _assert_every_layer_coded_on_identical_ranks(r, coded=0)  # three eligible layers, none coded
        carried, total = r["values_run"]["configured"]
        assert carried == 0 and total > 0


def _train_union_with_every_position_code(rank: int, world: int) -> dict:
    return {
        code: _train_levels(rank, world, True, 0, STAGE3, True, {"support": "union", "position_code": code})
        for code in ("kernel", "rice", "channel", "layer")
    }


def _assert_the_same_training(run: dict, other: dict) -> None:
    """Two runs of ``_train_levels`` on one rank: identical ranks, and every step's aggregate the
    same, bit for bit."""
    for a, b in zip(run["rows"], other["rows"], strict=True):
        assert a["identical"] and torch.equal(a["grads"], b["grads"])


@pytest.fixture(scope="module")
def union_runs_by_position_code():
    return run_gloo(_train_union_with_every_position_code, world_size=2, timeout=300)


def test_the_channel_position_code_trains_bit_for_bit_as_the_layer_code_and_sends_what_its_counts_say(
    union_runs_by_position_code,
):
    """On a union support the names per output channel are lossless (every step's aggregate the
    same, bit for bit, as with one code over the layer), and a bucket sends its flags, every
    weight's counts, and the longest rank's names, each weight in the smaller of its two codes."""
    res = union_runs_by_position_code
    weights = {key: tuple(p.shape) for key, p in _mlp().named_parameters() if p.dim() == 2}
    channel_total = layer_total = 0
    for r in res:
        by_channel, by_layer = r["channel"], r["layer"]
        _assert_the_same_training(by_channel, by_layer)
        assert len(by_channel["buckets"]) == len(by_layer["buckets"]) > 0
        for (step, nbytes, supports, named, _), (_, nbytes_l, supports_l, _, _) in zip(
            by_channel["buckets"], by_layer["buckets"]
        ):
            assert supports.keys() == supports_l.keys()
            if not supports:  # stage 1: a plain all-reduce
                assert nbytes == nbytes_l == 0
                continue
            n_flags = by_layer["rows"][step]["used"][1]  # the layers the code may carry send a flag
            layer_code = header = 0
            for key, support in supports.items():
                assert torch.equal(support, supports_l[key])
                (channels, per), m = weights[key], named[key]
                layer_code += encoded_nbytes(choose_encoding("auto", m, channels * per), m, channels * per)
                header += counts_nbytes(channels, per)
            assert nbytes_l == 4 * n_flags + layer_code
            # the channel code: the counts, then each weight's names in the smaller code (the
            # channel code's own size is a function of counts the test does not see), padded to
            # the longest rank's
            assert 4 * n_flags + header < nbytes <= nbytes_l + header
            channel_total, layer_total = channel_total + nbytes, layer_total + nbytes_l
    assert channel_total < layer_total  # the MLP's gradient rows crowd (its inputs share most of each batch)


def test_the_rice_position_code_trains_bit_for_bit_and_sends_the_gaps_of_every_ranks_names(union_runs_by_position_code):
    """The Rice position code, the gaps of each rank's names in a Rice code, is lossless (every
    step's aggregate the same, bit for bit, as with the other codes), and a bucket sends its flags,
    every weight's counts, each rank's code length (4 bytes), then the longest rank's code: every
    coded layer's low bits and one unary field of their quotients, as the names each rank sent
    give them. It sends fewer bytes than the Elias-Fano code per channel."""
    res = union_runs_by_position_code
    weights = {key: tuple(p.shape) for key, p in _mlp().named_parameters() if p.dim() == 2}
    rice_total = channel_total = 0
    for r in res:
        by_rice, by_channel = r["rice"], r["channel"]
        _assert_the_same_training(by_rice, by_channel)
        for (step, nbytes, supports, _, names), (_, nbytes_c, supports_c, _, _) in zip(
            by_rice["buckets"], by_channel["buckets"], strict=True
        ):
            if not supports:  # stage 1: a plain all-reduce
                assert nbytes == nbytes_c == 0
                continue
            n_flags = by_rice["rows"][step]["used"][1]
            header, code_bits = 0, [0, 0]
            for key, support in supports.items():
                assert torch.equal(support, supports_c[key])
                channels, per = weights[key]
                header += counts_nbytes(channels, per)
                for rank, own in enumerate(names[key]):
                    assert torch.equal(own, own.sort().values)
                    lows, quotients = rice_fields(own, channel_counts(own, channels, per), per)
                    code_bits[rank] += lows.numel() + int((quotients + 1).sum())
            assert nbytes == 4 * n_flags + header + 4 + -(-max(code_bits) // 8)
            rice_total, channel_total = rice_total + nbytes, channel_total + nbytes_c
    assert rice_total < channel_total
    # the kernel code names a weight without kernels (this MLP's) as the Rice code does
    for r in res:
        assert [b[1] for b in r["kernel"]["buckets"]] == [b[1] for b in r["rice"]["buckets"]]
        _assert_the_same_training(r["kernel"], r["rice"])


def _union_names_of_a_convolution(rank: int, world: int) -> dict:
    """One stage-2 bucket of a union support on a (16, 8, 3, 3) convolution whose large values
    crowd into a fifth of its kernels, once per position code: the support, who named what, and
    the bytes sent."""
    from lightning_gradcomp.codecs.base import CodecContext, RoundContext

    g = torch.Generator().manual_seed(20 + rank)
    x = torch.randn(16, 8, 3, 3, generator=g)
    x[torch.rand(16, 8, generator=g) < 0.2] *= 10
    x = x.reshape(-1)
    out = {}
    for code in ("kernel", "rice", "layer"):
        codec = LGCCodec(
            support="union", selection="exact", warmup_steps=2, ae_train_steps=4, ratio=0.2, position_code=code
        )
        ctx = CodecContext(rank, world, torch.device("cpu"))
        codec.setup(ctx)
        prepared = codec.prepare_bucket([("w", x.clone(), torch.zeros(16, 8, 3, 3))], RoundContext(step=3, comm=ctx))
        shared = prepared.per_layer["w"]
        out[code] = {"support": shared.support, "named": shared.named, "nbytes": prepared.nbytes}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_the_kernel_position_code_names_a_convolutions_kernels_and_gives_every_rank_the_same_union(world):
    """The kernel code (the default) gives every rank the union the layer code gives, and sends
    the counts of named kernels per output channel, each rank's code length, then the longest
    rank's code: the kernels' gaps, each named kernel's count of entries and the index of its
    pattern. Where the names crowd into kernels that costs fewer bytes than the Rice code of the
    entries' gaps."""
    res = run_gloo(_union_names_of_a_convolution, world_size=world, timeout=120)
    for r in res:
        for code in ("kernel", "rice"):
            assert torch.equal(r[code]["support"], res[0]["layer"]["support"])
            assert torch.equal(r[code]["named"], res[0]["layer"]["named"])
        longest = 0
        for who in r["kernel"]["named"]:
            own = r["kernel"]["support"][who]
            lows, unary, index = kernel_fields(own, kernel_counts(own, 16, 72, 9), 72, 9)
            longest = max(longest, lows.numel() + int((unary + 1).sum()) + index.numel())
        assert r["kernel"]["nbytes"] == counts_nbytes(16, 8) + 4 + -(-longest // 8)
        assert r["kernel"]["nbytes"] < 0.95 * r["rice"]["nbytes"]
    assert len({r["kernel"]["nbytes"] for r in res}) == 1


def _union_names_both_codes(rank: int, world: int) -> dict:
    """One stage-2 bucket of a union support on a (30, 100) weight whose large values crowd into
    a few channels, once per position code: the support, who named what, and the bytes sent."""
    from lightning_gradcomp.codecs.base import CodecContext, RoundContext

    out = {}
    x = torch.randn(30, 100, generator=torch.Generator().manual_seed(10 + rank))
    x[: 3 + rank] *= 20  # each rank's large values in its own first few channels
    x = x.reshape(-1)
    for code in ("rice", "channel", "layer"):
        codec = LGCCodec(
            support="union", selection="exact", warmup_steps=2, ae_train_steps=4, ratio=RATIO, position_code=code
        )
        ctx = CodecContext(rank, world, torch.device("cpu"))
        codec.setup(ctx)
        prepared = codec.prepare_bucket([("w", x.clone(), torch.zeros(30, 100))], RoundContext(step=3, comm=ctx))
        shared = prepared.per_layer["w"]
        out[code] = {"support": shared.support, "named": shared.named, "nbytes": prepared.nbytes}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_the_rice_and_channel_position_codes_give_every_rank_the_same_union_as_the_layer_code(world):
    res = run_gloo(_union_names_both_codes, world_size=world, timeout=120)
    m = math.ceil(math.ceil(RATIO * 3000) / world)
    layer = encoded_nbytes(choose_encoding("auto", m, 3000), m, 3000)
    for r in res:
        assert torch.equal(r["channel"]["support"], res[0]["layer"]["support"])
        assert torch.equal(r["channel"]["named"], res[0]["layer"]["named"])
        assert r["layer"]["nbytes"] == layer
        # the counts, then the longest rank's names; crowded names cost less than the layer code
        assert counts_nbytes(30, 100) < r["channel"]["nbytes"] < layer
        assert torch.equal(r["rice"]["support"], res[0]["layer"]["support"])
        assert torch.equal(r["rice"]["named"], res[0]["layer"]["named"])
        # the counts, each rank's code length, then the longest rank's Rice code (the 4 bytes of
        # length can cost more than the gaps save on a bucket this small)
        longest = 0
        for who in r["rice"]["named"]:
            own = r["rice"]["support"][who]
            lows, quotients = rice_fields(own, channel_counts(own, 30, 100), 100)
            longest = max(longest, lows.numel() + int((quotients + 1).sum()))
        assert r["rice"]["nbytes"] == counts_nbytes(30, 100) + 4 + -(-longest // 8)
    for code in ("rice", "channel"):  # padded to the longest: equal on every rank
        assert len({r[code]["nbytes"] for r in res}) == 1
