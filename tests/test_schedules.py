"""Schedules given as a fraction of the run, and DGC's warm-up of sparsity."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_gradcomp.codecs.base import CodecContext, DensityWarmup, check_run_steps, run_steps
from lightning_gradcomp.registry import make_codec


def test_run_steps_resolves_fractions_with_a_cap():
    assert run_steps(30, 1000, cap=200) == 30  # an int is a number of steps, whatever the run
    assert run_steps(0.05, 782, cap=200) == 39
    assert run_steps(0.05, 100_000, cap=200) == 200  # long runs: the paper's step count
    assert run_steps(0.05, None, cap=200) == 200  # unknown length: the cap
    assert run_steps(0.001, 100, cap=200) == 1  # never zero steps for a fraction
    assert check_run_steps("w", 2.0) == 2
    for bad in (-1, 1.5, 0.0 - 0.5):
        with pytest.raises(ValueError, match="w must be an integer >= 0 .steps. or a float in .0, 1."):
            check_run_steps("w", bad)


def test_lgc_and_gradiveq_fit_their_warm_ups_to_the_run():
    lgc = make_codec("lgc")
    lgc.fit_to_run(782)  # one CIFAR-10 epoch at 2 x 32 images a step
    assert (lgc.warmup_end, lgc.ae_start_step) == (39, 117)
    lgc.fit_to_run(None)
    assert (lgc.warmup_end, lgc.ae_start_step) == (200, 500)  # SOFF's stage lengths
    gradiveq = make_codec("gradiveq", basis_source="aggregate")
    gradiveq.fit_to_run(1000)
    assert gradiveq.warmup_end == 50 and gradiveq.phase_at(49) == "warmup" and gradiveq.phase_at(50) == "compress"


def test_a_resumed_run_keeps_the_schedule_of_the_run_that_started_it():
    """Resumed with a longer budget, lgc stays past its warm-up: the saved run length wins."""
    from lightning_gradcomp.hook import CodecHookState

    first = make_codec("lgc")
    first.fit_to_run(100)  # dense until step 5, autoencoder trained at step 15
    saved = CodecHookState(first).state_dict()
    resumed = make_codec("lgc")
    resumed.fit_to_run(10_000)  # the strategy's estimate for the new budget: dense until 200
    assert resumed.warmup_end == 200
    CodecHookState(resumed).load_state_dict(saved)
    assert (resumed.warmup_end, resumed.ae_start_step) == (first.warmup_end, first.ae_start_step) == (5, 15)


def test_density_warmup_shrinks_the_kept_fraction_exponentially():
    warm = DensityWarmup(steps=4, start=0.25)
    fractions = [warm.fraction(0.01, step, first_step=2, total_steps=None) for step in range(2, 8)]
    assert fractions[0] == pytest.approx(0.25)
    assert fractions[2] == pytest.approx((0.25 * 0.01) ** 0.5)  # halfway: the geometric mean
    assert fractions[4:] == [0.01, 0.01]
    assert all(a > b for a, b in zip(fractions[:4], fractions[1:5]))
    assert DensityWarmup(steps=0, start=0.25).fraction(0.01, 2, 2, None) == 0.01  # off
    # a codec that keeps more than the warm-up starts from is never made sparser by it
    assert [warm.fraction(0.5, step, first_step=2, total_steps=None) for step in range(2, 8)] == [0.5] * 6


@pytest.mark.parametrize("name, option", [("topk", "ratio"), ("iwp", "keep_fraction")])
@pytest.mark.parametrize("kept, light", [(0.01, 0.25), (0.5, 0.5)])
def test_sparsifiers_light_level_keeps_the_warmup_start_and_never_less_than_the_configured_fraction(
    name, option, kept, light
):
    codec = make_codec(name, **{option: kept})
    codec.set_level(0.0)
    assert codec.kept_fraction == pytest.approx(light)
    codec.set_level(0.5)
    assert codec.kept_fraction == pytest.approx(math.sqrt(light * kept))
    codec.set_level(1.0)
    assert codec.kept_fraction == pytest.approx(kept)


@pytest.mark.parametrize("name, option", [("topk", "ratio"), ("iwp", "keep_fraction")])
def test_sparsifiers_send_more_during_the_density_warmup(name, option):
    codec = make_codec(name, density_warmup=0.1, **{option: 0.01})
    codec.setup(CodecContext(0, 1, torch.device("cpu")))
    codec.fit_to_run(100)  # a 10-step warm-up after step 2
    x, w = torch.randn(10_000), torch.randn(10_000)
    kept = [int((codec.encode(x, "w", w, step).local != 0).sum()) for step in (2, 7, 12, 50)]
    assert kept == [2500, codec.k_for(10_000, 7), 100, 100]
    assert 100 < kept[1] < 2500
