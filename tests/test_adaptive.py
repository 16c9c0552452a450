"""AdaptiveCompression (Accordion's rule) and the codecs whose compression level it sets.

The codecs: each level keeps through a state_dict and changes what is sent. The rule: a scripted
sequence of gradient norms and learning rates gives the levels Accordion's criterion gives. Real
runs: two gloo ranks take the same level at the same step, a resumed run goes on at the level its
checkpoint recorded, and PowerSGD changes its rank mid-run with every rank staying identical.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
from codec_driver import LayerBucket, round_trip
from dist_utils import run_gloo
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import CompressedDDPStrategy, make_codec, make_comm_hook
from lightning_gradcomp.callbacks import AdaptiveCompression, CompressionReport, ThetaDecay
from lightning_gradcomp.callbacks.adaptive import adjustable_codecs
from lightning_gradcomp.codecs.base import AdjustableCompression, CodecContext

ADJUSTABLE = ["topk", "iwp", "qsgd", "powersgd", "gradiveq"]


def _payload_bytes(codec, x: torch.Tensor, step: int = 5) -> int:
    """Bytes one rank puts on the wire for the 256 x 256 layer ``x`` at the codec's level in use."""
    if codec.name == "powersgd":  # torch's hook: the elements of P and Q by torch's own rule
        return 4 * codec.payload_elements(LayerBucket(x, [x.view(256, 256)]))
    enc, _ = round_trip(codec, x.reshape(-1).clone(), "w", x.view(256, 256), step)
    return sum(t.numel() * t.element_size() for t in enc.payload)


def _fresh(name: str):
    codec = make_codec(name)
    if name != "powersgd":
        codec.setup(CodecContext(0, 1, torch.device("cpu")))
    return codec


@pytest.mark.parametrize("name", ADJUSTABLE)
def test_a_lower_level_sends_more_and_the_level_keeps_through_state_dict(name):
    x = torch.randn(256 * 256, generator=torch.Generator().manual_seed(0))
    codec = _fresh(name)
    assert isinstance(codec, AdjustableCompression) and codec.compression_level == 1.0
    configured = _payload_bytes(codec, x)
    assert configured == _payload_bytes(_fresh(name), x)  # level 1 is the configured setting
    sizes = {}
    for level in (1.0, 0.5, 0.0):
        codec.set_level(level)
        sizes[level] = _payload_bytes(codec, x)
    assert sizes[1.0] == configured
    assert sizes[1.0] < sizes[0.0] and sizes[1.0] <= sizes[0.5] <= sizes[0.0], sizes
    codec.set_level(0.3)
    codec.compression_limit = 0.2  # a rollback's cap: the codec applies min(level, limit)
    assert codec.compression_level == pytest.approx(0.2)
    state = codec.state_dict()
    again = _fresh(name)
    again.load_state_dict(state)
    assert (again.compression_level, again.compression_limit) == (codec.compression_level, 0.2)
    assert _payload_bytes(again, x) == _payload_bytes(codec, x) > configured


def test_the_adjustable_codecs_are_named():
    assert set(ADJUSTABLE) | {"fft"} <= set(adjustable_codecs())
    assert not {"none", "fp16", "terngrad", "rangefloat"} & set(adjustable_codecs())


# --------------------------------------------------------------------------------------------------
# refusals, before any process starts
def _fake_trainer(codec, callbacks=()):
    return SimpleNamespace(strategy=SimpleNamespace(codec=codec), callbacks=list(callbacks))


def test_a_codec_without_a_level_is_refused_with_the_names_of_those_that_have_one():
    with pytest.raises(ValueError, match=r"AdjustableCompression: .*'topk'.*the strategy's codec is 'none'"):
        CompressedDDPStrategy(codec="none", adaptive_level=True)
    with pytest.raises(ValueError, match=r"'powersgd'.*the strategy's codec is 'terngrad'"):
        AdaptiveCompression().setup(_fake_trainer(make_codec("terngrad")), None, "fit")
    CompressedDDPStrategy(codec="none", adaptive_level=False)  # off: any codec
    CompressedDDPStrategy(codec="none", adaptive_level=None)


@pytest.mark.parametrize(
    "adaptive_level, match",
    [
        ({"etaa": 0.5}, "no argument 'etaa'.*eta, interval"),
        ({"eta": 0}, "eta must be"),
        ({"interval": 0}, "interval must be"),
        ({"low_level": 0.8, "high_level": 0.5}, "low_level"),
        ({"lr_drop": 2}, "lr_drop"),
        ("yes", "adaptive_level must be"),
    ],
)
def test_invalid_adaptive_level_is_refused_by_the_strategy(adaptive_level, match):
    with pytest.raises(ValueError, match=match):
        CompressedDDPStrategy(codec="topk", adaptive_level=adaptive_level)


def test_the_strategy_builds_the_callback_it_will_attach():
    strategy = CompressedDDPStrategy(codec="topk", adaptive_level={"eta": 0.3, "interval": 20})
    cb = strategy._adaptive_callback
    assert isinstance(cb, AdaptiveCompression) and (cb.eta, cb.interval) == (0.3, 20)
    assert CompressedDDPStrategy(codec="topk", adaptive_level=True)._adaptive_callback.interval == 50
    assert CompressedDDPStrategy(codec="topk")._adaptive_callback is None  # off by default
    # on by default for gradiveq, holding its light level (16 components on every step, measured
    # beside SGD and beside Adam); True gives the callback's defaults
    gradiveq = CompressedDDPStrategy(codec="gradiveq")._adaptive_callback
    assert (gradiveq.high_level, gradiveq.low_level) == (0.0, 0.0)
    plain = CompressedDDPStrategy(codec="gradiveq", adaptive_level=True)._adaptive_callback
    assert (plain.warmup, plain.lr_drop, plain.lr_reference) == (0.05, 0.5, "previous")
    assert CompressedDDPStrategy(codec="lgc")._adaptive_callback.lr_reference == "previous"


def test_gradiveqs_default_beside_sgd_holds_the_light_level_and_its_earlier_schedule_sees_a_step_decay():
    total, drop_at = 200, 140
    step_rates = [0.05 if s < drop_at else 0.005 for s in range(total)]
    # the default holds the light level whatever the norm and the rate do
    held = CompressedDDPStrategy(codec="gradiveq")._adaptive_callback
    assert _drive(held, [1.0 + (s % 7) for s in range(total)], step_rates)[0] == [0.0] * total

    # the schedule that was the default before, {"warmup": 0.5}: light for the first half of the
    # run, then heavy (the norm is constant here, so after the first window's comparison the norm
    # rule never fires); a tenfold step decay at step 140 is light from the next step to the end
    # of the next full window (step 200, the run's end), while the recipe's cosine is light only
    # after its last halving of the rate, at its final step
    def levels_under(rates: list[float]) -> list[float]:
        cb = CompressedDDPStrategy(codec="gradiveq", adaptive_level={"warmup": 0.5})._adaptive_callback
        return _drive(cb, [1.0] * total, rates)[0]

    step_decay = levels_under(step_rates)
    assert step_decay == [0.0] * 100 + [1.0] * (drop_at + 1 - 100) + [0.0] * (total - drop_at - 1), step_decay
    schedule = _load_recipe("resnet_cifar10").warmup_cosine(total)  # the CIFAR-10 recipe's own
    cosine = levels_under([0.05 * schedule(s) for s in range(total)])
    assert cosine == [0.0] * 100 + [1.0] * (total - 101) + [0.0], cosine
    # the rule it replaced (the rate ignored) stays heavy after the step decay
    rates = [0.05] * drop_at + [0.005] * (total - drop_at)
    ignored = _drive(AdaptiveCompression(warmup=0.5, lr_drop=0.0), [1.0] * total, rates)[0]
    assert ignored == [0.0] * 100 + [1.0] * 100, ignored


def test_a_run_resumed_under_the_held_default_goes_on_with_the_schedule_it_started_with():
    # a checkpoint written under gradiveq's default of the version before ({"warmup": 0.5}): the
    # controller's state holds its heavy level and warm-up, so the held default of now resumes it
    # as the uninterrupted run would have gone on, heavy after the first half
    total, cut = 200, 130
    norms, rates = [1.0] * total, [0.05] * total

    def schedule() -> AdaptiveCompression:
        return CompressedDDPStrategy(codec="gradiveq", adaptive_level={"warmup": 0.5})._adaptive_callback

    whole = _drive(schedule(), norms, rates, codec=make_codec("gradiveq"))[0]
    assert whole == [0.0] * 100 + [1.0] * 100
    first = schedule()
    _drive(first, norms[:cut], rates[:cut], codec=make_codec("gradiveq"))
    held = CompressedDDPStrategy(codec="gradiveq")._adaptive_callback
    later = _drive(held, norms[cut:], rates[cut:], codec=make_codec("gradiveq"), start=cut, state=first.state_dict())[0]
    assert later == whole[cut:]
    # a fresh run under the held default stays light
    assert _drive(CompressedDDPStrategy(codec="gradiveq")._adaptive_callback, norms, rates)[0] == [0.0] * total


def test_iwp_keeps_its_residual_in_units_of_the_update_whenever_the_controller_runs():
    # the two were measured together: the controller by default brings the rescaled residual along
    strategy = CompressedDDPStrategy(codec="iwp")
    assert strategy._adaptive_callback.lr_reference == "previous"
    assert strategy.codec.harness.lr_scaled_feedback is True
    assert CompressedDDPStrategy(codec="iwp", adaptive_level=True).codec.harness.lr_scaled_feedback is True
    # without the controller it cost accuracy: off, the residual stays in units of the gradient
    strategy = CompressedDDPStrategy(codec="iwp", adaptive_level=False)
    assert strategy._adaptive_callback is None and strategy.codec.harness.lr_scaled_feedback is False
    assert make_codec("iwp").harness.lr_scaled_feedback is False  # a codec outside the strategy: no controller
    # what the user sets is kept, and so is a codec the user built
    options = {"lr_scaled_feedback": False, "keep_fraction": 0.02}
    codec = CompressedDDPStrategy(codec="iwp", codec_options=options).codec
    assert (codec.harness.lr_scaled_feedback, codec.options.keep_fraction) == (False, 0.02)
    codec = CompressedDDPStrategy(codec="iwp", codec_options={"keep_fraction": 0.02}).codec
    assert (codec.harness.lr_scaled_feedback, codec.options.keep_fraction) == (True, 0.02)
    built = make_codec("iwp")
    assert CompressedDDPStrategy(codec=built).codec is built
    # error feedback off leaves no residual to rescale: the option steps aside, as a codec's own
    # default does
    codec = CompressedDDPStrategy(codec="iwp", codec_options={"error_feedback": False}).codec
    assert codec.harness.lr_scaled_feedback is False
    # a codec without such options keeps its own under the controller
    assert CompressedDDPStrategy(codec="topk", adaptive_level=True).codec.harness.lr_scaled_feedback is False


def test_a_run_resumed_without_the_controller_it_now_takes_by_default_is_told(tmp_path):
    # a checkpoint of iwp written before it took the controller by default: no controller state
    path = tmp_path / "earlier.ckpt"
    torch.save({"gradcomp": {"codec": "iwp"}, "callbacks": {}}, path)
    with pytest.warns(UserWarning, match=r"had no level controller.*'iwp' takes one by default.*adaptive_level=False"):
        CompressedDDPStrategy(codec="iwp").load_checkpoint(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the controller asked for, or off, is the user's choice; another codec's checkpoint starts fresh
        CompressedDDPStrategy(codec="iwp", adaptive_level=True).load_checkpoint(path)
        CompressedDDPStrategy(codec="iwp", adaptive_level=False).load_checkpoint(path)
        CompressedDDPStrategy(codec="gradiveq").load_checkpoint(path)
        # a checkpoint that holds the controller's state goes on as it ran
        key = CompressedDDPStrategy(codec="iwp")._adaptive_callback.state_key
        torch.save({"gradcomp": {"codec": "iwp"}, "callbacks": {key: {}}}, path)
        CompressedDDPStrategy(codec="iwp").load_checkpoint(path)


def test_theta_decay_beside_it_is_refused():
    trainer = _fake_trainer(make_codec("fft"), [ThetaDecay()])
    with pytest.raises(ValueError, match="both set the codec's compression level"):
        AdaptiveCompression().setup(trainer, None, "fit")


# --------------------------------------------------------------------------------------------------
# the rule, driven step by step with chosen gradients and learning rates (one process)
class _Module:
    def __init__(self) -> None:
        self.p = nn.Parameter(torch.zeros(3))
        self.logged: dict[str, float] = {}

    def named_parameters(self):
        return [("p", self.p)]

    def log(self, name, value, **kwargs):
        self.logged[name] = value


def _drive(
    cb: AdaptiveCompression,
    norms: list[float],
    rates: list[float],
    codec=None,
    optimizers: int = 1,
    start: int = 0,
    state: dict | None = None,
) -> tuple[list[float], _Module]:
    """Run ``cb`` over one step per entry, from step ``start``, with that step's gradient norm and
    learning rate, in one process (``optimizers`` calls of ``on_before_optimizer_step`` a step, as
    Lightning makes for a module with that many); the level in use at each step, and the module it
    logged to. ``state``: a checkpoint's state, loaded where Lightning restores callbacks (after
    ``setup``, before ``on_fit_start``)."""
    codec = make_codec("topk", ratio=0.01) if codec is None else codec
    optimizer = SimpleNamespace(param_groups=[{"lr": rates[0]}])
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(codec=codec, root_device=torch.device("cpu")),
        callbacks=[],
        optimizers=[optimizer],
        global_step=0,
        estimated_stepping_batches=max(100, len(norms)),
    )
    module = _Module()
    cb.setup(trainer, module, "fit")
    if state is not None:
        cb.load_state_dict(state)
    cb.on_fit_start(trainer, module)
    levels = []
    for step, (norm, rate) in enumerate(zip(norms, rates), start):
        trainer.global_step = step
        optimizer.param_groups[0]["lr"] = rate
        cb.on_train_batch_start(trainer, module, None, step)
        levels.append(codec.compression_level)
        module.p.grad = torch.tensor([float(norm), 0.0, 0.0])
        for _ in range(optimizers):
            cb.on_before_optimizer_step(trainer, module, optimizer)
    return levels, module


def test_the_rule_goes_light_on_a_fast_change_of_the_norm_and_after_a_learning_rate_drop():
    cb = AdaptiveCompression(eta=0.5, interval=2, warmup=6, low_level=0.0)
    # the mean gradient's norm per window of 2 steps: 1, 1, 1, 1, 1.2, 3, 3, 3, 3, 3
    norms = [1, 1, 1, 1, 1, 1, 1, 1, 1.2, 1.2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]
    drop_at = 15  # the learning rate falls tenfold at this step
    levels, module = _drive(cb, norms, [0.1 if step < drop_at else 0.01 for step in range(len(norms))])
    # steps 0-5: the warm-up (and nothing to compare with before step 2); 6-11: heavy (windows
    # 1 -> 1, then 1 -> 1.2: 20 % < eta); 12-13: light (1.2 -> 3: 150 %); 14-15: heavy (3 -> 3);
    # the drop at step 15 makes the next full window, 16-17, light; then heavy again
    assert levels == [0.0] * 6 + [1.0] * 6 + [0.0] * 2 + [1.0] * 2 + [0.0] * 2 + [1.0] * 2, levels
    assert cb.steps_at_level == {0.0: 10, 1.0: 10}
    assert [d["step"] for d in cb.decisions] == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    assert cb.decisions[4]["change"] == pytest.approx(0.2) and cb.decisions[5]["change"] == pytest.approx(1.5)
    assert module.logged["gradcomp/level"] == 1.0
    # a second callback given the first one's state goes on exactly where it stopped
    twin = AdaptiveCompression(eta=0.5, interval=2, warmup=6)
    twin.load_state_dict(cb.state_dict())
    scalars = [{k: v for k, v in c.state_dict().items() if k != "window_sum"} for c in (twin, cb)]
    assert scalars[0] == scalars[1]


def test_a_resumed_controller_decides_with_the_rule_its_run_started_with(caplog):
    # a cosine-like decay whose steps never halve the rate but whose sixth step is half the peak:
    # the peak rule goes light there, the previous-step rule does not
    rates = [0.1, 0.09, 0.08, 0.07, 0.06, 0.05, 0.045, 0.04, 0.035, 0.03]
    started = AdaptiveCompression(interval=2, warmup=2, lr_reference="peak", low_level=0.25)
    levels, _ = _drive(started, [1.0] * 4, rates[:4])
    state = started.state_dict()
    assert state["rule"] == {"low_level": 0.25, "lr_drop": 0.5, "lr_reference": "peak"}
    # resumed where a later version's defaults say "previous": the checkpoint's rule wins, told
    resumed = AdaptiveCompression(interval=2, warmup=2)
    with caplog.at_level(logging.INFO):
        resumed.load_state_dict(state)
    assert "goes on with them" in caplog.text
    assert (resumed.low_level, resumed.lr_drop, resumed.lr_reference) == (0.25, 0.5, "peak")
    # a checkpoint of an earlier version (no rule recorded) keeps the arguments given, silently
    caplog.clear()
    earlier = {k: v for k, v in state.items() if k != "rule"}
    given = AdaptiveCompression(interval=2, warmup=2)
    with caplog.at_level(logging.INFO):
        given.load_state_dict(earlier)
        AdaptiveCompression(interval=2, warmup=2, lr_reference="peak", low_level=0.25).load_state_dict(state)
    assert "goes on with them" not in caplog.text
    assert (given.low_level, given.lr_reference) == (0.0, "previous")
    # and so it decides the rest of the run as the uninterrupted one does: the rate at half its
    # peak at step 5 makes steps 6-7 light, which the previous-step rule would have left heavy
    whole, _ = _drive(AdaptiveCompression(interval=2, warmup=2, lr_reference="peak", low_level=0.25), [1.0] * 10, rates)
    assert whole == [0.25] * 4 + [1.0] * 2 + [0.25] * 2 + [1.0] * 2, whole
    rest, _ = _drive(resumed, [1.0] * 6, rates[4:], start=4)
    assert levels + rest == whole
    rest_given, _ = _drive(given, [1.0] * 6, rates[4:], start=4)
    assert levels + rest_given != whole  # the test can tell the two rules apart


def test_the_rule_at_its_boundaries_a_change_of_exactly_eta_and_a_rate_of_exactly_lr_drop():
    # windows of 2 steps: the first light (nothing to compare with), then 1 -> 1 heavy, then
    # 1 -> 1.5, a change of exactly eta (0.5), light
    cb = AdaptiveCompression(eta=0.5, interval=2, warmup=2, lr_drop=0.0)
    levels, _ = _drive(cb, [1, 1, 1, 1, 1.5, 1.5, 1.5, 1.5], [0.1] * 8)
    assert levels == [0.0] * 4 + [1.0] * 2 + [0.0] * 2, levels
    # a rate of exactly lr_drop times the previous one is a drop (1.0 -> 0.5 at step 5): light
    # from the next step to the end of the next full window
    cb = AdaptiveCompression(eta=0.5, interval=2, warmup=2, lr_drop=0.5)
    levels, _ = _drive(cb, [1] * 10, [1.0] * 5 + [0.5] * 5)
    assert levels == [0.0] * 4 + [1.0] * 2 + [0.0] * 2 + [1.0] * 2, levels
    # a rate of 0 (a warm-up that starts there) is no reference: 0 -> 0 is not a drop
    cb = AdaptiveCompression(eta=0.5, interval=2, warmup=2, lr_drop=0.5)
    levels, _ = _drive(cb, [1] * 8, [0.0] * 8)
    assert levels == [0.0] * 4 + [1.0] * 4, levels


def test_the_rule_counts_a_fall_of_the_norm_and_a_start_from_zero_and_one_step_per_step():
    # the norm of the window's mean gradient halves (2 -> 1), falls to 0 and rises from 0: each a
    # fast change; two optimizers make two calls a step, counted once
    cb = AdaptiveCompression(eta=0.5, interval=2, warmup=2, lr_drop=0.0)
    levels, _ = _drive(cb, [2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1], [0.1] * 14, optimizers=2)
    assert levels == [0.0] * 4 + [1.0] * 2 + [0.0] * 2 + [1.0] * 2 + [0.0] * 4, levels
    assert [d["norm"] for d in cb.decisions] == pytest.approx([2, 2, 1, 1, 0, 1, 1])
    assert cb.steps_at_level == {0.0: 10, 1.0: 4}


def test_a_held_level_keeps_no_window_and_decides_nothing():
    """low_level equal to the heavy level: the level is set, logged and counted every step, and no
    gradient is summed, no decision made (a decision would need an all-reduce); a drop of the rate
    changes nothing either."""
    cb = AdaptiveCompression(interval=2, warmup=2, low_level=0.0, high_level=0.0)
    levels, module = _drive(cb, [1, 1, 3, 3, 1, 1, 9, 9], [0.1] * 4 + [0.01] * 4)
    assert levels == [0.0] * 8, levels
    assert cb.steps_at_level == {0.0: 8}
    assert cb.decisions == [] and cb._window_sum == {} and cb._window_count == 0
    assert "gradcomp/grad_change" not in module.logged and module.logged["gradcomp/level"] == 0.0
    # held at the heavy level too: the codec's own level when fit starts
    levels, _ = _drive(AdaptiveCompression(interval=2, warmup=2, low_level=1.0), [1, 1, 3, 3], [0.1] * 4)
    assert levels == [1.0] * 4, levels


def test_the_heavy_level_is_the_codecs_level_when_fit_starts():
    # fft's level is its theta: heavy steps run at the configured theta, 0.75, not at 1
    levels, _ = _drive(AdaptiveCompression(interval=2, warmup=2), [1] * 6, [0.1] * 6, make_codec("fft", theta=0.75))
    assert levels == [0.0] * 4 + [0.75] * 2, levels


def _drive_with_this_ranks_norms(rank: int, world: int) -> tuple[list[float], list[bool]]:
    """The rule above on two ranks that see different norms (as a codec that handed them different
    aggregates would make them): rank 1's jumps threefold at step 10, rank 0's stays flat."""
    cb = AdaptiveCompression(eta=0.5, interval=2, warmup=2, low_level=0.0)
    norms = [1.0] * 10 + [3.0 if rank == 1 else 1.0] * 6
    levels, _ = _drive(cb, norms, [0.1] * len(norms))
    return levels, [d["critical"] for d in cb.decisions]


def test_ranks_that_see_different_norms_still_take_the_same_level():
    """The verdict is agreed over the ranks (the largest norm, any rank's critical regime), so a
    rank that alone sees the jump still makes every rank go light, at the same step."""
    (levels0, critical0), (levels1, critical1) = run_gloo(_drive_with_this_ranks_norms, 2)
    assert levels0 == levels1 and critical0 == critical1
    # heavy after the warm-up until the window of steps 10-11, decided at step 12: light from
    # there on both ranks
    assert levels0[:14] == [0.0] * 4 + [1.0] * 8 + [0.0] * 2, levels0


@pytest.mark.parametrize("lr_reference", ["previous", "peak"])
def test_a_smooth_decay_is_a_drop_each_time_it_halves_the_peak_rate(lr_reference):
    """A rate that rises for 4 steps, then falls by 10 % a step: no step falls by half, so with
    ``"previous"`` it never drops; with ``"peak"`` it drops at the first step at or below half the
    highest rate (0.1 * 0.9**7 = 0.048 at step 10), and again at half of that one (step 17)."""
    cb = AdaptiveCompression(eta=1e6, interval=4, warmup=0, lr_reference=lr_reference)
    rates = [0.025 * (s + 1) if s < 4 else 0.1 * 0.9 ** (s - 3) for s in range(24)]
    levels, _ = _drive(cb, [1.0] * len(rates), rates)
    # the first two windows (steps 0-7) are light: the first has no window before it, and the
    # second follows a change from "nothing"; the norm never changes after that
    if lr_reference == "previous":
        assert levels == [0.0] * 8 + [1.0] * 16, levels
    else:
        # the drop at step 10 makes steps 11-15 light (the window after it ends at step 16); the
        # next, at step 17 (0.1 * 0.9**14 = 0.023 <= 0.024), makes steps 18-23 light
        assert [s for s, r in enumerate(rates) if s and r <= 0.5 * max(rates[:s])][:1] == [10]
        assert levels == [0.0] * 8 + [1.0] * 3 + [0.0] * 5 + [1.0] * 2 + [0.0] * 6, levels
    twin = AdaptiveCompression(eta=1e6, interval=4, warmup=0, lr_reference=lr_reference)
    twin.load_state_dict(cb.state_dict())
    assert twin._last_lrs == cb._last_lrs  # the reference rate survives a resume


def test_an_unknown_learning_rate_reference_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="lr_reference must be one of 'previous', 'peak'"):
        CompressedDDPStrategy(codec="topk", adaptive_level={"lr_reference": "max"})


# --------------------------------------------------------------------------------------------------
# two gloo ranks under Lightning: one level per step for both, and a resume that goes on at the
# level its checkpoint recorded
ADAPTIVE = {"eta": 1e6, "interval": 2, "warmup": 0}  # only the first windows and the rate's drop go light
LR_DROP_STEP = 8  # StepLR: the rate of step 8 is a tenth of step 7's


class Recorder(pl.Callback):
    """Each rank writes, per optimizer step, the level in use, the entries topk keeps of the
    compressed layer and the bytes the hook sent, and a digest of the weights at the end."""

    def __init__(self, out_dir: str, label: str) -> None:
        self.out_dir, self.label, self.steps = out_dir, label, {}

    def _bytes_of_previous_step(self, trainer) -> None:
        last = trainer.strategy.hook_state.stats.last
        if last is not None and str(trainer.global_step - 1) in self.steps:
            self.steps[str(trainer.global_step - 1)]["bytes"] = last.wire_bytes

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._bytes_of_previous_step(trainer)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        codec = trainer.strategy.codec
        self.steps[str(trainer.global_step)] = {"level": codec.compression_level, "kept": codec.k_for(2048)}

    def on_train_end(self, trainer, pl_module):
        self._bytes_of_previous_step(trainer)
        digest = hashlib.sha256()
        for t in pl_module.state_dict().values():
            digest.update(t.detach().cpu().numpy().tobytes())
        facts = {"steps": self.steps, "weights": digest.hexdigest(), "step": trainer.global_step}
        with open(os.path.join(self.out_dir, f"{self.label}.rank{trainer.global_rank}.json"), "w") as f:
            json.dump(facts, f)


class StepDecayModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))  # 2048 weights compressed

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=LR_DROP_STEP, gamma=0.1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 32, generator=g)
        y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _fit(tmp_path, label: str, ckpt_path: str | None = None) -> None:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=CompressedDDPStrategy(
            codec="topk", codec_options={"ratio": 0.01}, adaptive_level=ADAPTIVE, start_method="spawn"
        ),
        max_steps=16,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[
            Recorder(str(tmp_path), label),
            CompressionReport(metrics_json=str(tmp_path / f"{label}.report.json"), validate_last_step=False),
            pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1),
        ],
    )
    trainer.fit(StepDecayModule(), ckpt_path=ckpt_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("adaptive")
    _fit(tmp_path, "full")
    (ckpt,) = glob.glob(str(tmp_path / "ckpt" / "*step=6*.ckpt"))
    saved = torch.load(ckpt, weights_only=True)
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    _fit(resumed_dir, "resumed", ckpt_path=ckpt)
    read = lambda d, label, r: json.loads((d / f"{label}.rank{r}.json").read_text())  # noqa: E731
    return {
        "full": [read(tmp_path, "full", r) for r in range(2)],
        "resumed": [read(resumed_dir, "resumed", r) for r in range(2)],
        "report": json.loads((tmp_path / "full.report.json").read_text()),
        "checkpoint": saved,
    }


def test_both_ranks_take_the_same_level_at_the_same_step(runs):
    rank0, rank1 = runs["full"]
    assert rank0["steps"] == rank1["steps"] and rank0["weights"] == rank1["weights"]
    levels = [rank0["steps"][str(s)]["level"] for s in range(16)]
    # light: the first two windows (nothing to compare before), and from the step after the
    # drop at step 8 for one full window; heavy elsewhere (eta is out of reach)
    assert levels == [0.0] * 4 + [1.0] * 5 + [0.0] * 3 + [1.0] * 4, levels
    kept = {rank0["steps"][str(s)]["kept"] for s in range(16)}
    assert kept == {21, 512}  # 1 % and 25 % of 2048
    light = {rank0["steps"][str(s)]["bytes"] for s in (2, 3, 9, 10, 11)}
    heavy = {rank0["steps"][str(s)]["bytes"] for s in (4, 5, 6, 7, 12, 13)}
    assert len(light) == 1 and len(heavy) == 1 and min(light) > max(heavy)  # the level changed what was sent
    assert runs["report"]["level_steps"] == {"0": 7, "1": 9}


def test_a_resumed_run_goes_on_at_the_level_its_checkpoint_recorded(runs):
    (state,) = [v for k, v in runs["checkpoint"]["callbacks"].items() if k.startswith("AdaptiveCompression")]
    assert state["level"] == 1.0  # step 6 is heavy, while a fresh run starts light
    assert runs["checkpoint"]["gradcomp"]["shared"]["codec"]["level"] == 1.0
    full = runs["full"][0]["steps"]
    for r in range(2):
        resumed = runs["resumed"][r]
        assert sorted(resumed["steps"], key=int) == [str(s) for s in range(6, 16)]
        for s in range(6, 16):
            assert resumed["steps"][str(s)]["level"] == full[str(s)]["level"], s
    assert runs["resumed"][0]["weights"] == runs["resumed"][1]["weights"]


# --------------------------------------------------------------------------------------------------
# PowerSGD's rank changed between steps under plain DDP: P and Q reallocated alike on every rank
RANK_SCHEDULE = {0: 1.0, 4: 0.0, 7: 0.5, 10: 1.0}  # step -> level set before it


def _powersgd_steps(rank: int, world: int, limits: dict[int, float] | None = None) -> list[dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))
    ddp = DDP(model)
    state, hook = make_comm_hook("powersgd", ddp, fallback=False)
    ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    codec = state.codec
    records = []
    for step in range(13):
        if step in RANK_SCHEDULE:
            codec.set_level(RANK_SCHEDULE[step])
        if limits and step in limits:  # as a rollback lowers it
            codec.compression_limit = limits[step]
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
        x = torch.randn(16, 128, generator=g)
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        optimizer.step()
        torch_state = codec._torch_state
        records.append(
            {
                "rank": torch_state.matrix_approximation_rank,
                "q_sizes": sorted(v.numel() for v in torch_state.q_memory_dict.values()),
                "weights": [p.detach().clone() for p in model.parameters()],
            }
        )
    return records


def test_powersgd_changes_its_rank_between_steps_and_the_ranks_stay_identical():
    r0, r1 = run_gloo(_powersgd_steps)
    assert [s["rank"] for s in r0] == [4] * 4 + [16] * 3 + [8] * 3 + [4] * 3
    for step, (a, b) in enumerate(zip(r0, r1)):
        assert a["rank"] == b["rank"] and a["q_sizes"] == b["q_sizes"], step
        for wa, wb in zip(a["weights"], b["weights"]):
            assert torch.isfinite(wa).all() and torch.equal(wa, wb), step
    # from step 2 on torch's hook compresses both 128 x 128 weights: Q holds 2 * 128 * rank values
    for step in range(2, 13):
        assert r0[step]["q_sizes"] == [2 * 128 * r0[step]["rank"]], step


def test_a_lowered_compression_limit_changes_powersgds_rank_at_once():
    # the limit caps the level whatever the schedule sets: lowered to 0.5 at step 11, the rank in
    # use goes from 4 to 8 for the next step, as a level of 0.5 would
    r0, r1 = run_gloo(_powersgd_steps, args=({11: 0.5},))
    assert [s["rank"] for s in r0] == [4] * 4 + [16] * 3 + [8] * 3 + [4] + [8] * 2
    assert all(a["rank"] == b["rank"] and a["q_sizes"] == b["q_sizes"] for a, b in zip(r0, r1))
    assert r0[12]["q_sizes"] == [2 * 128 * 8]


# --------------------------------------------------------------------------------------------------
# the strategy option from YAML, through LightningCLI
def _load_recipe(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "recipes" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_adaptive_level_from_yaml_through_the_cli(tmp_path, capsys):
    recipe = _load_recipe("digits_quickstart")
    config = tmp_path / "adaptive.yaml"
    lines = [
        "trainer:",
        "  strategy:",
        "    init_args:",
        "      codec: topk",
        "      adaptive_level: {eta: 0.3, interval: 20}",
    ]
    config.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        recipe.main(["--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "codec: topk" in printed and "eta: 0.3" in printed and "interval: 20" in printed
    with pytest.raises(SystemExit) as exit_info:  # the codec cannot follow a level: a usage error
        recipe.main(["--trainer.strategy.codec", "none", "--trainer.strategy.adaptive_level", "true"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "AdjustableCompression" in err and "'topk'" in err
