"""The fallback policy's decisions, driven step by step with a fake clock (one process).

The 2-process runs in ``test_strategy.py`` check that ranks agree; here the timings are chosen,
so each branch of the decision is reached on purpose.
"""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp import fallback as fallback_module
from lightning_gradcomp.fallback import FallbackPolicy


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def drive(
    policy: FallbackPolicy,
    clock: FakeClock,
    plain_s: float,
    compressed_s: float,
    steps: int,
    start: int = 2,
    compressed_share: float = 0.2,
):
    """Run ``steps`` steps of one bucket as the hook does: a step takes ``plain_s`` when sent
    plainly and ``compressed_s`` when compressed (compression starts at step ``start``); the
    bucket's collective takes 0.2 of a plain step, ``compressed_share`` of a compressed one.
    Returns, per step, whether it was compressed."""
    kinds = []
    for step in range(steps):
        policy.start_step()
        policy.maybe_decide(None, torch.device("cpu"))
        compressed = step >= start and not policy.falls_back("bucket")
        body_start = clock.t
        step_s = compressed_s if compressed else plain_s
        clock.t += 0.01  # the hook body
        fut = torch.futures.Future()
        policy.track(fut, "bucket", compressed, body_start)
        share = compressed_share if compressed else 0.2
        clock.t += share * step_s  # the bucket's collective
        fut.set_result(torch.zeros(1))
        clock.t += (1 - share) * step_s - 0.01  # the rest of the step
        kinds.append(compressed)
    return kinds


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(fallback_module.time, "perf_counter", c)
    return c


def test_clear_win_is_decided_without_plain_probe_steps(clock):
    policy = FallbackPolicy(enabled=True)
    kinds = drive(policy, clock, plain_s=4.0, compressed_s=1.0, steps=10)
    assert kinds == [False, False] + [True] * 8  # never sent plainly once compressing
    assert policy.decided and policy.fallback == set()
    assert policy.step_decision == pytest.approx((1.0, 4.0))


def test_clear_win_keeps_a_bucket_whose_own_timing_looks_worse(clock):
    # the bucket's compressed collective (0.95 s) looks slower than its plain one (0.8 s), e.g.
    # because ranks sharing a core wait for each other, but the whole step is 4x faster
    policy = FallbackPolicy(enabled=True)
    kinds = drive(policy, clock, plain_s=4.0, compressed_s=1.0, steps=8, compressed_share=0.95)
    assert all(kinds[2:]) and policy.decided and policy.fallback == set()
    ((c, d),) = policy.decisions.values()
    assert c > 1.1 * d  # the per-bucket rule alone would have sent it plainly


def test_close_call_probes_plain_steps_and_keeps_the_faster_codec(clock):
    policy = FallbackPolicy(enabled=True)
    kinds = drive(policy, clock, plain_s=1.3, compressed_s=1.2, steps=12)
    # 3 compressed probe steps, then 3 plain probe steps, then compressed for good
    assert kinds == [False, False, True, True, True, False, False, False] + [True] * 4
    assert policy.decided and policy.fallback == set()
    assert policy.step_decision == pytest.approx((1.2, 1.3))


def test_close_call_falls_back_when_compression_is_slower(clock):
    policy = FallbackPolicy(enabled=True)
    kinds = drive(policy, clock, plain_s=1.3, compressed_s=1.36, steps=12)
    assert kinds == [False, False, True, True, True] + [False] * 7
    assert policy.decided and policy.fallback == {"bucket"}


def test_a_tie_goes_to_plain_all_reduce(clock):
    policy = FallbackPolicy(enabled=True, min_gain_ms=2.0)
    drive(policy, clock, plain_s=1.3, compressed_s=1.299, steps=12)  # 1 ms faster: within noise
    assert policy.fallback == {"bucket"}


def test_disabled_policy_never_times_or_falls_back(clock):
    policy = FallbackPolicy(enabled=False)
    kinds = drive(policy, clock, plain_s=1.0, compressed_s=5.0, steps=8)
    assert kinds == [False, False] + [True] * 6 and not policy.decided


def test_bad_arguments_name_the_option():
    with pytest.raises(ValueError, match="probe_steps"):
        FallbackPolicy(probe_steps=0)
    with pytest.raises(ValueError, match="clear_win"):
        FallbackPolicy(clear_win=1.5)


def test_close_call_still_drops_a_bucket_that_costs_more_compressed(clock):
    policy = FallbackPolicy(enabled=True)
    drive(policy, clock, plain_s=1.3, compressed_s=1.2, steps=12, compressed_share=0.3)
    ((c, d),) = policy.decisions.values()
    assert c > 1.1 * d and policy.fallback == {"bucket"}


def test_a_resumed_policy_keeps_its_decision_and_sends_the_bucket_plainly_at_once(clock):
    policy = FallbackPolicy(enabled=True)
    drive(policy, clock, plain_s=1.3, compressed_s=1.36, steps=12)
    assert policy.decided and policy.fallback == {"bucket"}
    resumed = FallbackPolicy(enabled=True)
    resumed.load_state_dict(policy.state_dict())
    # no step compressed or timed again: the checkpoint's decision holds from the first step
    kinds = drive(resumed, clock, plain_s=1.3, compressed_s=1.36, steps=6, start=0)
    assert kinds == [False] * 6
    assert resumed.decided and resumed.fallback == {"bucket"} and resumed.state_dict() == policy.state_dict()


def _ledger_across_a_fallback(rank: int, world: int) -> dict:
    """One rank (world size 1: what arrives is what was sent): topk with error feedback for four
    compressed steps, then the bucket sent plainly, as after a fallback decision. Returns, for a
    compressed layer, the sum of the gradients, the sum of what was sent, and the residual."""
    from test_lr_feedback import _mlp  # the same model as the learning-rate ledger
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    model = _mlp()
    ddp = DDP(model)
    state, hook = make_comm_hook("topk", ddp, ratio=0.02, min_numel=1000, dense_layers="none", fallback=False)
    ddp.register_comm_hook(state, hook)
    weight = dict(model.named_parameters())["0.weight"]
    gen = torch.Generator().manual_seed(3)
    want = torch.zeros(weight.numel(), dtype=torch.float64)
    got, residuals = torch.zeros_like(want), []
    for step in range(9):
        if step == 6:  # the fallback decided: every bucket travels plainly from now on
            state.fallback.falls_back = lambda bucket_key: True
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        (g,) = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), [weight])
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        want += g.reshape(-1).double()
        got += weight.grad.reshape(-1).double()
        residual = state.memory.get("0.weight")
        residuals.append(None if residual is None else float(residual.norm()))
    return {"want": want, "got": got, "residuals": residuals}


def test_a_bucket_sent_plainly_after_compressed_steps_sends_its_residual_once():
    from dist_utils import run_gloo

    (r,) = run_gloo(_ledger_across_a_fallback, 1)
    # steps 0-1 plain (DDP's bucket rebuild), 2-5 compressed with a growing residual, then plain
    assert r["residuals"][:2] == [None, None] and all(n > 0 for n in r["residuals"][2:6])
    assert r["residuals"][6:] == [None, None, None]  # travelled with step 6 and dropped
    # nothing lost, nothing sent twice: every gradient arrived exactly once
    torch.testing.assert_close(r["got"], r["want"], rtol=1e-5, atol=1e-5)
