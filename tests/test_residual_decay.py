"""The ``residual_decay`` harness option: error feedback keeps ``decay * ((g + e) - C(g + e))``."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_gloo
from torch import nn

from lightning_gradcomp.registry import make_codec

KEY = "0.weight"  # 64 x 32 = 2,048 values: compressed (min_numel 1000)


def _steps(rank: int, world: int, decay: float) -> dict:
    """Three steps of topk at 5 % (DDP's two plain ones first): the third is compressed."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    ddp = DDP(model)
    state, hook = make_comm_hook("topk", ddp, min_numel=1000, ratio=0.05, residual_decay=decay)
    ddp.register_comm_hook(state, hook)
    gen = torch.Generator().manual_seed(100 + rank)
    residuals = []
    for _ in range(4):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        names = dict(model.named_parameters())
        (g,) = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), [names[KEY]])
        before = state.memory.get(KEY)
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        residuals.append(
            {
                "input": g.reshape(-1) + (0 if before is None else before),
                "sent": names[KEY].grad.reshape(-1).clone(),
                "residual": state.memory.get(KEY),
            }
        )
    return {"compressed": state.compressing(2), "steps": residuals[2:]}


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_the_residual_is_what_was_not_sent_times_the_decay(decay):
    (out,) = run_gloo(_steps, 1, args=(decay,))
    assert out["compressed"]
    for step in out["steps"]:  # the first compressed step, and one that adds a decayed residual
        sent = step["sent"] != 0
        assert 0 < int(sent.sum()) <= 103  # ceil(5 % of 2,048)
        torch.testing.assert_close(step["sent"][sent], step["input"][sent], rtol=1e-5, atol=1e-9)
        expected = decay * torch.where(sent, 0.0, step["input"])
        torch.testing.assert_close(step["residual"], expected, rtol=1e-5, atol=1e-9)


def test_residual_decay_is_checked():
    assert make_codec("topk", residual_decay=0.9).harness.residual_decay == 0.9
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"residual_decay must be in \(0, 1\]"):
            make_codec("topk", residual_decay=bad)
    with pytest.raises(ValueError, match="residual_decay shrinks the error-feedback residual"):
        make_codec("fp16", residual_decay=0.9)
