"""Estimate feedback (``estimate_feedback``, EF21): each rank sends the change of its gradient from
its own estimate, and the optimizer receives the mean estimate, dense on every step.

Exact properties on two real gloo ranks: the gradient every rank receives is the mean of the ranks'
estimates; a sent coordinate's estimate is that step's gradient; an unsent one keeps its value; an
uncompressed step sets both estimates to the exact gradients; with every value kept nothing is lost.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_gloo
from torch import nn

from lightning_gradcomp.hook import CodecHookState
from lightning_gradcomp.registry import make_codec

KEY = "0.weight"  # 4,096 values: compressed
STEPS = 7


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 10))


def _run(rank: int, world: int, codec: str, ratio: float) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    model = _mlp()
    ddp = DDP(model)
    state, hook = make_comm_hook(codec, ddp, ratio=ratio, min_numel=1000, dense_layers="none", estimate_feedback=True)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    param = dict(model.named_parameters())[KEY]
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    out = {"local": [], "received": [], "own": [], "mean": [], "compressed": []}
    for step in range(STEPS):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        (g,) = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), [param])
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        out["local"].append(g.reshape(-1).clone())
        out["received"].append(param.grad.reshape(-1).clone())
        out["own"].append(state.memory.residuals[KEY].clone())
        out["mean"].append(state.estimates.residuals[KEY].clone())
        out["compressed"].append(state.compressing(step))
        opt.step()
    out["rank_state"] = state.rank_state_dict(stats=False)
    return out


@pytest.fixture(scope="module")
def topk_runs():
    return run_gloo(_run, 2, args=("topk", 0.02))


def test_every_rank_receives_the_mean_of_the_ranks_estimates(topk_runs):
    r0, r1 = topk_runs
    assert r0["compressed"][:2] == [False, False] and all(r0["compressed"][2:])
    for step in range(STEPS):
        mean_of_estimates = (r0["own"][step] + r1["own"][step]) / 2
        assert torch.equal(r0["received"][step], r1["received"][step])
        assert torch.allclose(r0["received"][step], mean_of_estimates, rtol=0, atol=1e-7), step
        assert torch.equal(r0["mean"][step], r0["received"][step])  # the mean estimate is what was received
        assert torch.equal(r1["mean"][step], r0["mean"][step])


def test_an_uncompressed_step_sets_the_estimates_to_the_gradients(topk_runs):
    for run in topk_runs:
        assert torch.equal(run["own"][1], run["local"][1])
    r0, r1 = topk_runs
    assert torch.allclose(r0["received"][1], (r0["local"][1] + r1["local"][1]) / 2, rtol=0, atol=1e-7)


def test_a_compressed_step_moves_the_estimate_to_the_gradient_where_it_sends(topk_runs):
    for run in topk_runs:
        for step in range(2, STEPS):
            before, after, g = run["own"][step - 1], run["own"][step], run["local"][step]
            sent = (after != before).nonzero().reshape(-1)
            assert 0 < sent.numel() <= int(0.02 * g.numel()) + 1
            assert torch.allclose(after[sent], g[sent], rtol=0, atol=1e-6)  # h + (g - h) = g there
            unsent = torch.ones_like(g, dtype=torch.bool)
            unsent[sent] = False
            assert torch.equal(after[unsent], before[unsent])
            # the received gradient is dense: every coordinate holds its last value that travelled
            assert (run["received"][step] != 0).float().mean() > 0.99
            assert not torch.allclose(after, g, rtol=0, atol=1e-6)  # something was left unsent


def test_with_every_value_kept_nothing_is_lost():
    r0, r1 = run_gloo(_run, 2, args=("topk", 1.0))
    for step in range(STEPS):
        assert torch.allclose(r0["received"][step], (r0["local"][step] + r1["local"][step]) / 2, rtol=0, atol=1e-6)


def test_the_estimates_are_checkpointed(topk_runs):
    r0, _ = topk_runs
    state = CodecHookState(make_codec("topk", estimate_feedback=True))
    state.load_rank_state_dict(r0["rank_state"], torch.device("cpu"))
    assert torch.equal(state.estimates.residuals[KEY], r0["mean"][-1])
    assert torch.equal(state.memory.residuals[KEY], r0["own"][-1])


def test_options_that_need_a_residual_are_refused():
    for clash in ({"error_feedback": False}, {"momentum": 0.9}, {"precondition": True}, {"lr_scaled_feedback": True}):
        with pytest.raises(ValueError, match="estimate_feedback replaces the error-feedback residual"):
            make_codec("topk", estimate_feedback=True, **clash)
    # lgc's default lr_scaled_feedback=True gives way to it; given explicitly it is refused
    assert make_codec("lgc", estimate_feedback=True).harness.lr_scaled_feedback is False
    with pytest.raises(ValueError, match="lr_scaled_feedback"):
        make_codec("lgc", estimate_feedback=True, lr_scaled_feedback=True)
    # codecs that keep their own memory or exchange refuse it rather than ignore it
    with pytest.raises(ValueError, match="estimate_feedback must be False"):
        make_codec("auto", estimate_feedback=True)
    with pytest.raises(ValueError, match="nor estimate_feedback"):
        make_codec("lgc", estimate_feedback=True, warmup_codec="powersgd")
    with pytest.raises(ValueError, match="use_error_feedback"):
        make_codec("powersgd", estimate_feedback=True, error_feedback=True)
