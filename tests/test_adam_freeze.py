"""FrozenAdamVariance: Adam's bias-corrected second moment stays what it was at the freeze."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_gradcomp.callbacks import FrozenAdamVariance


def _run(optimizer_cls, freeze_at: int | None, steps: int = 12, **opt_kwargs):
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = optimizer_cls(model.parameters(), lr=1e-2, **opt_kwargs)
    cb = FrozenAdamVariance(freeze_step=freeze_at) if freeze_at is not None else None
    module = SimpleNamespace(log=lambda *a, **k: None)
    history, grads = [], []
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(16, 8, generator=g) * (30.0 if step == 9 else 1.0)  # one spike after the freeze
        model(x).pow(2).mean().backward()
        grads.append(model.weight.grad.detach() + opt_kwargs.get("weight_decay", 0.0) * model.weight.detach())
        if cb is not None:
            trainer = SimpleNamespace(global_step=step, estimated_stepping_batches=steps, strategy=SimpleNamespace())
            cb.on_before_optimizer_step(trainer, module, opt)
        opt.step()
        state = opt.state[model.weight]
        beta2 = opt.param_groups[0]["betas"][1]
        # Adam's bias-corrected second moment, what its update divides by
        history.append((state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))).clone())
    return history, grads, cb


@pytest.mark.parametrize("optimizer_cls, kwargs", [(torch.optim.AdamW, {}), (torch.optim.Adam, {"weight_decay": 0.1})])
def test_variance_stays_at_its_value_from_the_freeze_on(optimizer_cls, kwargs):
    free, _, _ = _run(optimizer_cls, None, **kwargs)
    frozen, grads, cb = _run(optimizer_cls, 5, **kwargs)
    for step in range(5):  # before the freeze, Adam as usual
        torch.testing.assert_close(frozen[step], free[step])
    # from the freeze on: the variance at the freeze, except where a gradient more than
    # 1/sqrt(1 - beta2) times its frozen scale raises its own denominator for that step
    held = frozen[4].clamp(min=0.01 * float(frozen[4].mean()))  # the floor of tiny variances
    for step in range(5, 12):
        expected = torch.maximum(held, (1 - 0.999) * grads[step].pow(2))
        torch.testing.assert_close(frozen[step], expected, rtol=1e-4, atol=1e-10)
    assert not torch.equal(frozen[9], held)  # the 30x spike did
    assert torch.equal(frozen[9] > held * 1.001, (1 - 0.999) * grads[9].pow(2) > held * 1.001)
    assert not torch.allclose(free[11], free[4])  # without the callback the variance moves
    restored = FrozenAdamVariance()
    restored.load_state_dict(cb.state_dict())
    assert restored._freeze_at == 5 and all(torch.equal(restored._frozen[k], v) for k, v in cb._frozen.items())


def test_freeze_step_is_checked():
    with pytest.raises(ValueError, match="freeze_step"):
        FrozenAdamVariance(freeze_step=-3)


def test_a_coordinate_without_gradient_before_the_freeze_gets_a_bounded_step():
    """A weight that saw no gradient before the freeze: its frozen variance is floored, so its
    first step is of the tensor's usual size, not lr * m / eps."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.zeros(4, 4))
    opt = torch.optim.AdamW([w], lr=1e-2, weight_decay=0.0)
    cb = FrozenAdamVariance(freeze_step=3)
    module = SimpleNamespace(log=lambda *a, **k: None)
    for step in range(5):
        grad = torch.ones(4, 4)
        if step < 3:
            grad[0, 0] = 0.0  # never before the freeze
        w.grad = grad
        trainer = SimpleNamespace(global_step=step, estimated_stepping_batches=5, strategy=SimpleNamespace())
        before = w.detach().clone()
        cb.on_before_optimizer_step(trainer, module, opt)
        opt.step()
    frozen = opt.state[w]["exp_avg_sq"]
    assert float(frozen[0, 0]) >= 0.01 * float(frozen.mean()) * 0.999
    assert float((w.detach() - before).abs().max()) < 1.0  # lr 1e-2: no step of lr * m / eps
