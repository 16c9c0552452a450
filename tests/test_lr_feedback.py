"""Learning-rate-scaled error feedback: while the learning rate changes, nothing of the update is lost.

With a residual in units of the update, ``sum_t lr_t * sent_t + lr_last * residual`` equals
``sum_t lr_t * g_t`` whatever the schedule; with the residual in units of the gradient (the
default) it equals ``sum_t g_t`` instead, and the update is off whenever the rate changed.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_gloo
from torch import nn

from lightning_gradcomp.hook import CodecHookState
from lightning_gradcomp.registry import make_codec

RATES = [0.1, 0.1, 0.08, 0.05, 0.03, 0.02, 0.01, 0.005, 0.002, 0.001]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 10))


def _update_ledger(rank: int, world: int, scaled: bool) -> dict:
    """One rank (world size 1, so the averaged gradient is this rank's decoded one): returns, per
    compressed parameter, ``sum lr_t g_t`` and ``sum lr_t sent_t + lr_last * residual``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    model = _mlp()
    ddp = DDP(model)
    state, hook = make_comm_hook(
        "topk", ddp, ratio=0.02, min_numel=1000, dense_layers="none", lr_scaled_feedback=scaled
    )
    ddp.register_comm_hook(state, hook)
    names = dict(model.named_parameters())
    key = "0.weight"  # 4,096 values: compressed
    gen = torch.Generator().manual_seed(7)
    want = torch.zeros_like(names[key], dtype=torch.float64)
    got = torch.zeros_like(want)
    for step, lr in enumerate(RATES):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        # the local gradient, without the hook
        (g,) = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), [names[key]])
        state.rescale_residuals({n: lr for n in names})
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        want += lr * g.double()
        got += lr * names[key].grad.double()  # what was sent (world size 1: decoded = sent)
        # no optimizer step: the parameters stay put, so g is the gradient the hook saw
    compressed = state.compressing(len(RATES) - 1)
    residual = state.memory.residuals[key].double().view_as(want)
    got_with_residual = got + RATES[-1] * residual
    return {"compressed": compressed, "want": want, "got": got_with_residual, "residual_norm": float(residual.norm())}


@pytest.mark.parametrize("scaled", [True, False])
def test_lr_scaled_residual_keeps_every_update(scaled):
    (r,) = run_gloo(_update_ledger, 1, args=(scaled,))
    assert r["compressed"] and r["residual_norm"] > 0  # topk at 2 %: most of the gradient waits
    error = float((r["got"] - r["want"]).norm() / r["want"].norm())
    if scaled:
        assert error < 1e-5, error
    else:  # held back through a decaying rate, the gradient is applied at the smaller, later rate
        assert error > 1e-2, error


def test_rescale_arithmetic_zero_rate_and_switch():
    codec = make_codec("topk", lr_scaled_feedback=True)
    state = CodecHookState(codec)
    state.memory.set("w", torch.ones(3))
    state.rescale_residuals({"w": 0.1})  # first rate seen: nothing to rescale from
    assert torch.equal(state.memory.residuals["w"], torch.ones(3)) and state.residual_lr == {"w": 0.1}
    state.rescale_residuals({"w": 0.05})  # the rate halves: the residual doubles, lr * e is kept
    assert torch.allclose(state.memory.residuals["w"], torch.full((3,), 2.0))
    state.rescale_residuals({"w": 0.0})  # a step that applies nothing changes nothing
    assert torch.allclose(state.memory.residuals["w"], torch.full((3,), 2.0)) and state.residual_lr == {"w": 0.05}
    assert state.state_dict()["residual_lr"] == {"w": 0.05}
    fresh = CodecHookState(make_codec("topk", lr_scaled_feedback=True))
    fresh.load_state_dict(state.state_dict())
    assert fresh.residual_lr == {"w": 0.05}
    # off (the default of every codec but lgc): the residual is never touched
    plain = CodecHookState(make_codec("topk", lr_scaled_feedback=False))
    plain.memory.set("w", torch.ones(3))
    plain.rescale_residuals({"w": 0.1})
    plain.rescale_residuals({"w": 0.01})
    assert torch.equal(plain.memory.residuals["w"], torch.ones(3)) and plain.residual_lr == {}


def test_option_needs_error_feedback():
    with pytest.raises(ValueError, match="lr_scaled_feedback"):
        make_codec("topk", error_feedback=False, lr_scaled_feedback=True)


def test_strategy_rescales_before_every_backward_with_each_optimizer_rate():
    # pre_backward runs before the backward whose hook adds the residuals, in automatic and in
    # manual optimization; every optimizer's groups give their parameters' rates
    from lightning_gradcomp import CompressedDDPStrategy

    strategy = CompressedDDPStrategy(codec="topk", codec_options={"lr_scaled_feedback": True})
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.4)
    strategy.optimizers = [opt_a, opt_b]
    state = CodecHookState(strategy.codec, param_names={id(a): "a", id(b): "b"})
    strategy.hook_state = state
    strategy.pre_backward(torch.tensor(0.0))
    assert state.residual_lr == {"a": 0.1, "b": 0.4}
    state.memory.set("a", torch.ones(3))
    state.memory.set("b", torch.ones(3))
    opt_a.param_groups[0]["lr"], opt_b.param_groups[0]["lr"] = 0.05, 0.4
    strategy.pre_backward(torch.tensor(0.0))
    strategy.pre_backward(torch.tensor(0.0))  # a second micro-batch of the same step: no change
    assert torch.allclose(state.memory.residuals["a"], torch.full((3,), 2.0))
    assert torch.equal(state.memory.residuals["b"], torch.ones(3))


def test_a_snapshot_restores_each_residual_with_the_rate_it_was_scaled_to():
    # a rollback (AccuracyDropRollback) goes back to a snapshot: a residual and its rate travel
    # together, or the next rescale multiplies the restored residual by the wrong ratio
    state = CodecHookState(make_codec("topk", lr_scaled_feedback=True))
    state.memory.set("w", torch.ones(3))
    state.rescale_residuals({"w": 0.1})
    snapshot = state.snapshot()
    state.rescale_residuals({"w": 0.05})
    assert torch.allclose(state.memory.residuals["w"], torch.full((3,), 2.0))
    state.restore(snapshot, torch.device("cpu"))
    assert torch.equal(state.memory.residuals["w"], torch.ones(3)) and state.residual_lr == {"w": 0.1}
    state.rescale_residuals({"w": 0.05})  # as if the rolled-back steps had never run
    assert torch.allclose(state.memory.residuals["w"], torch.full((3,), 2.0))


def test_a_second_fit_continues_the_residuals_and_their_rates():
    first = CodecHookState(make_codec("topk", lr_scaled_feedback=True))
    first.memory.set("w", torch.ones(3))
    first.momentum_buffers.set("w", torch.full((3,), 3.0))
    first.rescale_residuals({"w": 0.1})
    first.step, first.nonfinite_steps = 12, 1
    second = CodecHookState(first.codec)
    second.continue_from(first)
    assert (second.step, second.nonfinite_steps, second.residual_lr) == (12, 1, {"w": 0.1})
    assert torch.equal(second.memory.residuals["w"], torch.ones(3))
    assert torch.equal(second.momentum_buffers.residuals["w"], torch.full((3,), 3.0))
