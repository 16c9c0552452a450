"""The ``precondition`` harness option: codecs compress ``x / d`` with ``d`` from the optimizer's
second moment, and the aggregate comes back in units of the gradient.

Under Adam every coordinate moves by about the learning rate, whatever its gradient's scale, so a
sparsifier should keep the coordinates with the largest ``|x| / sqrt(v)``, not the largest ``|x|``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from dist_utils import run_gloo
from torch import nn

from lightning_gradcomp.codecs.base import CodecContext
from lightning_gradcomp.hook import CodecHookState
from lightning_gradcomp.registry import make_codec

KEY = "0.weight"  # 64 x 32 = 2,048 values: compressed (min_numel 1000)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))


def _one_step(rank: int, world: int, codec: str, options: dict, precondition: bool) -> dict:
    """One compressed step (DDP's two plain ones first), with a second moment for ``0.weight``
    that is 10^6 times larger on its first 32 rows: in Adam's terms those rows barely move."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    model = _model()
    ddp = DDP(model)
    state, hook = make_comm_hook(
        codec, ddp, min_numel=1000, dense_layers="none", precondition=precondition, **options
    )  # fmt: skip
    ddp.register_comm_hook(state, hook)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        names = dict(model.named_parameters())
        (g,) = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), [names[KEY]])
        scale = torch.ones_like(g)
        scale[:32] = 1e3
        v = (1e-2 * scale) ** 2  # the same on every rank, as Adam's is
        state.set_second_moments({KEY: v})
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
    residual = state.memory.residuals.get(KEY)
    return {
        "compressed": state.compressing(2),
        "local": g,
        "aggregate": names[KEY].grad.clone(),
        "residual": None if residual is None else residual.view_as(g).clone(),
    }


def test_a_preconditioned_support_keeps_what_adam_would_move_and_feedback_keeps_the_rest():
    plain, pre = (run_gloo(_one_step, 1, args=("topk", {"ratio": 0.05}, p))[0] for p in (False, True))
    assert plain["compressed"] and pre["compressed"]
    for r in (plain, pre):
        sent = r["aggregate"] != 0
        assert 0 < int(sent.sum()) <= 103  # ceil(5 % of 2,048)
        # what was sent is the gradient itself there (x / d, then times d), and error feedback
        # keeps exactly the rest, in units of the gradient
        torch.testing.assert_close(r["aggregate"][sent], r["local"][sent], rtol=1e-5, atol=0)
        torch.testing.assert_close(r["residual"], torch.where(sent, 0.0, r["local"]), rtol=1e-5, atol=1e-12)
    # by |x| the support spreads over every row; by |x| / d it leaves the first 32 rows alone
    assert int((plain["aggregate"][:32] != 0).sum()) > 10
    assert int((pre["aggregate"][:32] != 0).sum()) == 0


@pytest.mark.parametrize(("codec", "options"), [("topk", {"ratio": 1.0}), ("fp16", {})])
def test_two_ranks_receive_the_mean_gradient_through_a_preconditioned_lossless_codec(codec, options):
    # the all-gather path (topk keeping everything) and the all-reduce path (fp16)
    ranks = run_gloo(_one_step, 2, args=(codec, options, True))
    mean = (ranks[0]["local"] + ranks[1]["local"]) / 2
    assert ranks[0]["compressed"]
    torch.testing.assert_close(ranks[0]["aggregate"], ranks[1]["aggregate"], rtol=0, atol=0)
    tol = 1e-6 if codec == "topk" else 2e-3
    torch.testing.assert_close(ranks[0]["aggregate"], mean, rtol=tol, atol=tol * float(mean.abs().max()))


def test_the_strategy_hands_adams_second_moments_to_the_hook_and_not_sgds():
    from lightning_gradcomp import CompressedDDPStrategy

    strategy = CompressedDDPStrategy(codec="topk", codec_options={"precondition": True})
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    adam, sgd = torch.optim.AdamW([a], lr=0.1), torch.optim.SGD([b], lr=0.1, momentum=0.9)
    for p, opt in ((a, adam), (b, sgd)):
        p.grad = torch.tensor([1.0, 2.0, 4.0])
        opt.step()
    strategy.optimizers = [adam, sgd]
    state = CodecHookState(strategy.codec, param_names={id(a): "a", id(b): "b"})
    strategy.hook_state = state
    strategy.pre_backward(torch.tensor(0.0))
    assert set(state.second_moments) == {"a"}
    assert state.second_moments["a"] is adam.state[a]["exp_avg_sq"]
    torch.testing.assert_close(state.preconditioner("a"), adam.state[a]["exp_avg_sq"].sqrt())
    assert state.preconditioner("b") is None
    # a coordinate whose moment is still zero is floored at 1 % of the layer's mean scale
    state.set_second_moments({"a": torch.tensor([0.0, 1.0, 4.0])})
    torch.testing.assert_close(state.preconditioner("a"), torch.tensor([0.01, 1.0, 2.0]))
    # off (the default): nothing is read
    off = CodecHookState(make_codec("topk"), param_names={id(a): "a"})
    off.set_second_moments({"a": torch.ones(3)})
    assert off.second_moments == {} and off.preconditioner("a") is None


@pytest.mark.parametrize("codec", ["powersgd", "auto"])
def test_codecs_with_their_own_exchange_refuse_it(codec):
    with pytest.raises(ValueError, match="cannot precondition"):
        make_codec(codec, precondition=True)


def test_bfloat16_dense_layers_halve_their_bytes_and_stay_identical_on_two_ranks():
    # the bias of 0 and both tensors of layer 2 are small: they travel uncompressed in the gather
    fp32, bf16 = (
        run_gloo(_dense_step, 2, args=(dtype,)) for dtype in ("float32", "bfloat16")
    )  # fmt: skip
    for ranks in (fp32, bf16):
        torch.testing.assert_close(ranks[0]["grads"], ranks[1]["grads"], rtol=0, atol=0)
    mean = (fp32[0]["local"] + fp32[1]["local"]) / 2
    torch.testing.assert_close(fp32[0]["grads"], mean, rtol=1e-6, atol=1e-9)
    # each rank's share rounded to bfloat16 (at most 2^-8 of it), then summed exactly in fp32
    bound = 2**-8 * (fp32[0]["local"].abs() + fp32[1]["local"].abs()) / 2
    assert not torch.equal(bf16[0]["grads"], mean)
    assert bool(((bf16[0]["grads"] - mean).abs() <= bound * 1.0001 + 1e-12).all())
    dense_values = fp32[0]["grads"].numel()
    assert fp32[0]["bytes"] - bf16[0]["bytes"] == 2 * dense_values


def _dense_step(rank: int, world: int, dtype: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    model = _model()
    ddp = DDP(model)
    state, hook = make_comm_hook("topk", ddp, min_numel=1000, dense_layers="none", ratio=0.05, dense_dtype=dtype)
    ddp.register_comm_hook(state, hook)
    gen = torch.Generator().manual_seed(100 + rank)
    small = ["0.bias", "2.weight", "2.bias"]
    for _ in range(3):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        names = dict(model.named_parameters())
        local = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), [names[k] for k in small])
        ddp.zero_grad()
        state.stats.pop()
        nn.functional.cross_entropy(ddp(x), y).backward()
    return {
        "local": torch.cat([g.reshape(-1) for g in local]),
        "grads": torch.cat([names[k].grad.reshape(-1) for k in small]),
        "bytes": state.stats.pop().wire_bytes,  # the last (compressed) step's
    }


@pytest.mark.parametrize("codec", ["gradiveq", "iwp", "fp16", "powersgd"])
def test_codecs_that_all_reduce_refuse_bfloat16_dense_layers(codec):
    with pytest.raises(ValueError, match="dense_dtype='bfloat16' applies to codecs that gather"):
        make_codec(codec, dense_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"dense_dtype must be one of \['float32', 'bfloat16'\]"):
        make_codec("topk", dense_dtype="float16")


def _set_up_beside(optimizer: str, resumed_from: dict | None = None, **kwargs):
    """A strategy whose optimizers exist, after it adopted what it adopts beside them
    (``resumed_from``: the gradcomp part of a checkpoint it resumed from)."""
    from lightning_gradcomp import CompressedDDPStrategy

    strategy = CompressedDDPStrategy(**kwargs)
    strategy._resumed_from = resumed_from
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w]) if optimizer == "adamw" else torch.optim.SGD([w], lr=0.1, momentum=0.9)
    strategy.optimizers = [opt]
    strategy.hook_state = CodecHookState(strategy.codec)
    strategy._adopt_adaptive_optimizer_defaults()
    return strategy


def _strategy_beside(optimizer: str, **kwargs):
    return _set_up_beside(optimizer, **kwargs).codec


def test_lgc_beside_adam_keeps_a_denser_support_unless_told_otherwise():
    codec = _strategy_beside("adamw", codec="lgc")
    assert (codec.options.ratio, codec.harness.dense_dtype, codec.harness.dense_layers) == (0.14, "bfloat16", ("none",))
    assert codec.config()["ratio"] == 0.14 and codec.config()["dense_dtype"] == "bfloat16"
    assert codec.options.light_ratio == 0.5  # the light steps keep half of each layer
    assert codec.options.max_recon_error == 0.35  # the guard's threshold for 2-bit levels at 7 %
    assert codec.options.support == "union"  # every rank names its share of the support
    # what travels exactly goes in bfloat16, with error feedback to keep each rank's rounding;
    # without it, or given in fp32, it stays in fp32
    assert codec.harness.plain_dtype == "bfloat16"
    assert (
        _strategy_beside("adamw", codec="lgc", codec_options={"error_feedback": False}).harness.plain_dtype == "float32"
    )
    given = _strategy_beside("adamw", codec="lgc", codec_options={"plain_dtype": "float32"})
    assert given.harness.plain_dtype == "float32" and given.options.ratio == 0.14
    # the union is for the 2-bit levels: a support the user chose, or the autoencoder's code (which
    # decodes the leader's support), keeps the leader's
    for given in ({"support": "leader"}, {"code": "autoencoder"}):
        codec = _strategy_beside("adamw", codec="lgc", codec_options=given)
        assert (codec.options.ratio, codec.options.light_ratio, codec.options.support) == (0.14, 0.5, "leader")
    # the light level is never below the support: a user's support above the default light level
    # keeps its own light level, a user's light level below the default support caps the support
    codec = _strategy_beside("adamw", codec="lgc", codec_options={"ratio": 0.6})
    assert (codec.options.ratio, codec.options.light_ratio) == (0.6, None)
    codec = _strategy_beside("adamw", codec="lgc", codec_options={"light_ratio": 0.08})
    assert (codec.options.ratio, codec.options.light_ratio) == (0.08, 0.08)
    codec = _strategy_beside("sgd", codec="lgc")  # lgc's dense layers go in bfloat16 with any optimizer
    sgd = (codec.options.ratio, codec.harness.dense_dtype, codec.harness.dense_layers)
    assert sgd == (0.0075, "bfloat16", ("auto",)) and codec.options.max_recon_error == 0.3
    assert codec.options.support == "leader" and codec.harness.plain_dtype == "float32"
    # what the user set stays; a codec built by the user is kept as it is
    codec = _strategy_beside(
        "adamw", codec="lgc", codec_options={"ratio": 0.02, "dense_dtype": "float32", "dense_layers": "auto"}
    )
    assert (codec.options.ratio, codec.harness.dense_dtype, codec.harness.dense_layers) == (0.02, "float32", ("auto",))
    codec = _strategy_beside("adamw", codec=make_codec("lgc", ratio=0.02))
    assert codec.options.ratio == 0.02
    # codecs without such defaults are left alone
    codec = _strategy_beside("adamw", codec="topk")
    assert codec.config() == make_codec("topk").config()


def test_gradiveq_beside_adam_quantizes_its_coefficients_finer_unless_told_otherwise():
    assert _strategy_beside("adamw", codec="gradiveq").options.quant_levels == 31
    assert _strategy_beside("sgd", codec="gradiveq").options.quant_levels == 7
    assert _strategy_beside("adamw", codec="gradiveq", codec_options={"quant_levels": 3}).options.quant_levels == 3
    assert _strategy_beside("adamw", codec=make_codec("gradiveq")).options.quant_levels == 7
    # a run that started before this default (its checkpoint took nothing beside Adam) goes on at seven levels
    recorded = {"optimizer_defaults": {"options": {}, "controller": {"lr_reference": "peak"}}}
    strategy = _set_up_beside("adamw", codec="gradiveq", resumed_from=recorded)
    assert strategy.codec.options.quant_levels == 7
    strategy = _set_up_beside("adamw", codec="gradiveq")
    assert strategy._optimizer_defaults["options"] == {"quant_levels": 31}
    # a world too large for 31 levels (their sums must stay exact in fp32) is refused when they are
    # adopted, before the first step, and the codec keeps its seven
    codec = make_codec("gradiveq")
    codec.setup(CodecContext(0, 300_000, torch.device("cpu")))  # seven levels fit 300,000 ranks
    with pytest.raises(ValueError, match=r"quant_levels=31 with 300000 ranks.*use quant_levels <= 27"):
        codec.adopt_defaults({"quant_levels": 31})
    assert codec.options.quant_levels == 7


def test_gradiveq_beside_adam_holds_its_light_level_unless_told_otherwise():
    """Beside Adam the heavy steps' 4 components cost mIoU wherever they fell, so the controller
    attached by default holds the light level: 16 components on every step."""
    strategy = _set_up_beside("adamw", codec="gradiveq")
    controller = strategy._adaptive_callback
    assert (controller.low_level, controller.high_level) == (0.0, 0.0)  # one level: no rule applies
    assert strategy._optimizer_defaults == {"options": {"quant_levels": 31}, "controller": {"high_level": 0.0}}
    codec = strategy.codec
    codec.set_level(controller.high_level)
    assert codec.num_components == 16  # min(d, 4k) for the default k = 4 and d = 64
    codec.set_level(1.0)
    assert codec.num_components == 4
    # beside SGD the default holds the same light level (measured there too since the int64 words)
    assert _controller_beside("sgd", codec="gradiveq").high_level == 0.0
    # the user's own arguments are kept: the heavy level is then the configured 4 components
    assert _controller_beside("adamw", codec="gradiveq", adaptive_level={"lr_reference": "peak"}).high_level is None
    assert _controller_beside("sgd", codec="gradiveq", adaptive_level={"warmup": 0.5}).high_level is None
    # a run whose checkpoint took no controller arguments beside Adam (an earlier version) gets the
    # default's arguments here; its controller's own state (its heavy level) decides on resume
    recorded = {"optimizer_defaults": {"options": {"quant_levels": 31}, "controller": {}}}
    assert _controller_beside("adamw", codec="gradiveq", resumed_from=recorded).high_level == 0.0


def _controller_beside(optimizer: str, **kwargs):
    return _set_up_beside(optimizer, **kwargs)._adaptive_callback


def test_lgc_beside_adam_takes_the_peak_rule_only_for_the_controller_it_attached_by_default():
    assert _controller_beside("adamw", codec="lgc").lr_reference == "peak"
    assert _controller_beside("sgd", codec="lgc").lr_reference == "previous"
    # the user's own arguments, and a controller the user switched on, are kept as given
    assert _controller_beside("adamw", codec="lgc", adaptive_level={"eta": 0.5}).lr_reference == "previous"
    assert _controller_beside("adamw", codec="lgc", adaptive_level=True).lr_reference == "previous"
    assert _controller_beside("adamw", codec="lgc", adaptive_level=False) is None
    # gradiveq holds one level with any optimizer (below); iwp's rule is lgc's; topk has no
    # controller by default
    for optimizer in ("adamw", "sgd"):
        gradiveq = _controller_beside(optimizer, codec="gradiveq")
        assert (gradiveq.low_level, gradiveq.high_level, gradiveq.lr_reference) == (0.0, 0.0, "previous")
    assert _controller_beside("adamw", codec="iwp").lr_reference == "peak"
    assert _controller_beside("sgd", codec="iwp").lr_reference == "previous"
    assert _controller_beside("adamw", codec="topk") is None


def test_a_resumed_run_takes_what_its_checkpoint_took_beside_adam_and_names_options_that_differ(monkeypatch):
    # recorded by the run that wrote it: taken again, whatever this version's defaults
    recorded = {"options": {"ratio": 0.05}, "controller": {}}
    strategy = _set_up_beside("adamw", codec="lgc", resumed_from={"optimizer_defaults": recorded})
    assert strategy.codec.options.ratio == 0.05 and strategy.codec.harness.dense_layers == ("auto",)
    assert strategy._adaptive_callback.lr_reference == "previous"
    assert strategy._optimizer_defaults == {"options": {"ratio": 0.05}, "controller": {}}
    # the previous version recorded a 7 % support and the end layers compressed: it resumes with
    # the guard at 0.3, as it ran, not with the 0.35 this version takes beside Adam
    recorded = {"options": {"ratio": 0.07, "dense_layers": ["none"]}, "controller": {"lr_reference": "peak"}}
    strategy = _set_up_beside("adamw", codec="lgc", resumed_from={"optimizer_defaults": recorded})
    assert strategy.codec.options.max_recon_error == 0.3 and strategy.codec.harness.dense_layers == ("none",)
    assert _set_up_beside("adamw", codec="lgc").codec.options.max_recon_error == 0.35
    # and one that took the guard at 0.35 but not yet the union support resumes on the leader's
    recorded["options"]["max_recon_error"] = 0.35
    strategy = _set_up_beside("adamw", codec="lgc", resumed_from={"optimizer_defaults": recorded})
    assert strategy.codec.options.support == "leader"
    # and one that took the union at 7 % resumes there, its light steps at the plain 25 %
    recorded["options"]["support"] = "union"
    strategy = _set_up_beside("adamw", codec="lgc", resumed_from={"optimizer_defaults": recorded})
    options = strategy.codec.options
    assert (options.ratio, options.support, options.light_ratio) == (0.07, "union", None)
    # and one that took the 14 % union but not yet bfloat16 for what travels exactly goes on in fp32
    recorded["options"].update(ratio=0.14, light_ratio=0.5)
    strategy = _set_up_beside("adamw", codec="lgc", resumed_from={"optimizer_defaults": recorded})
    assert strategy.codec.options.ratio == 0.14 and strategy.codec.harness.plain_dtype == "float32"
    assert _set_up_beside("adamw", codec="lgc").codec.harness.plain_dtype == "bfloat16"
    # and one that took bfloat16 but not yet the scale a channel goes on with one scale a message
    recorded["options"]["plain_dtype"] = "bfloat16"
    strategy = _set_up_beside("adamw", codec="lgc", resumed_from={"optimizer_defaults": recorded})
    assert strategy.codec.options.light_scale == "message" and strategy.codec.harness.plain_dtype == "bfloat16"
    assert _set_up_beside("adamw", codec="lgc").codec.options.light_scale == "channel"
    assert _set_up_beside("adamw", codec="lgc", codec_options={"code": "autoencoder"}).codec.options.light_scale == (
        "message"
    )
    # an earlier version's checkpoint records only its options: their values, the default rule
    saved = {"options": {**make_codec("lgc").config(), "ratio": 0.03}}
    strategy = _set_up_beside("adamw", codec="lgc", resumed_from=saved)
    assert strategy.codec.options.ratio == 0.03 and strategy.codec.harness.dense_layers == ("auto",)
    assert strategy._adaptive_callback.lr_reference == "previous"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy._warn_options_differ_from_checkpoint()  # the same options: nothing to say
    # options the user gave win over the checkpoint's, and the run says which differ
    strategy = _set_up_beside("adamw", codec="lgc", codec_options={"ratio": 0.02}, resumed_from=saved)
    assert strategy.codec.options.ratio == 0.02
    with pytest.warns(UserWarning, match=r"ratio=0\.03 there, 0\.02 here") as caught:
        strategy._warn_options_differ_from_checkpoint()
    assert "dense_layers" not in str(caught[0].message)
    # an option this version does not have (a removed one) is named, not silently dropped
    strategy = _set_up_beside("adamw", codec="lgc", resumed_from={"options": {**saved["options"], "old_knob": 3}})
    with pytest.warns(UserWarning, match=r"options this version does not have: old_knob=3") as caught:
        strategy._warn_options_differ_from_checkpoint()
    assert len(caught) == 1 and "ratio=" not in str(caught[0].message)  # the options both have agree
    # a code of the positions only changes the bytes: said once as information, not as a warning
    strategy = _set_up_beside(
        "adamw", codec="lgc", resumed_from={"options": {**saved["options"], "position_code": "channel"}}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy._warn_options_differ_from_checkpoint()
    said: list[str] = []
    monkeypatch.setattr("lightning_gradcomp.strategy.rank_zero_info", said.append)
    strategy._warn_options_differ_from_checkpoint()
    assert len(said) == 1 and "position_code='channel' there, 'kernel' here" in said[0]
    assert "trains as it would have" in said[0]
    # so does the harness's lossless pass on the wire (deflate)
    strategy = _set_up_beside("adamw", codec="lgc", resumed_from={"options": {**saved["options"], "deflate": True}})
    said.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy._warn_options_differ_from_checkpoint()
    assert len(said) == 1 and "deflate=True there, False here" in said[0]
    # beside an option that does change training, that one is still a warning, alone
    strategy = _set_up_beside(
        "adamw",
        codec="lgc",
        codec_options={"ratio": 0.02},
        resumed_from={"options": {**saved["options"], "position_code": "channel"}},
    )
    with pytest.warns(UserWarning, match=r"ratio=0\.03 there, 0\.02 here") as caught:
        strategy._warn_options_differ_from_checkpoint()
    assert len(caught) == 1 and "position_code" not in str(caught[0].message)


def test_topk_keeps_its_residual_in_gradient_units_unless_told_otherwise():
    # measured: the rescaled residual helped topk only under the level controller, which is off
    # by default, so neither optimizer changes it; what the user sets stays
    for optimizer in ("sgd", "adamw"):
        codec = _strategy_beside(optimizer, codec="topk")
        assert codec.harness.lr_scaled_feedback is False
        assert codec.config() == make_codec("topk").config()
        codec = _strategy_beside(optimizer, codec="topk", codec_options={"lr_scaled_feedback": True})
        assert codec.harness.lr_scaled_feedback is True


def test_adopted_defaults_are_checked_like_given_ones():
    codec = make_codec("gradiveq")
    with pytest.raises(ValueError, match="dense_dtype='bfloat16' applies to codecs that gather"):
        codec.adopt_defaults({"dense_dtype": "bfloat16"})
    assert codec.harness.dense_dtype == "float32"  # a refused value changes nothing
    lgc = make_codec("lgc", dense_dtype="float32")
    with pytest.raises(ValueError, match="ratio must be in"):
        lgc.adopt_defaults({"ratio": 2.0})
    assert lgc.config()["ratio"] == 0.0075  # a refused value changes nothing
    lgc.adopt_defaults({"ratio": 0.03, "dense_dtype": "bfloat16"})
    assert lgc.config()["ratio"] == 0.03 and lgc.config()["dense_dtype"] == "bfloat16"
