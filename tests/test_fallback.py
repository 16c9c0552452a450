"""The fallback policy's decisions, driven step by step with a fake clock (one process).

The 2-process runs in ``test_strategy.py`` check that ranks agree; here the timings are chosen,
so each branch of the decision is reached on purpose.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_gradcomp import fallback as fallback_module
from lightning_gradcomp.fallback import FallbackPolicy


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def start_step(policy: FallbackPolicy, clock: FakeClock, step_end_s: float = 0.0, exclude: str = "seconds") -> float:
    """A step's start as the hook sees it, after ``step_end_s`` of step-end work (a refit) that
    ``start_step`` is told to leave out, as seconds or as the clock's two marks around it; the
    policy decides here once it can. Returns the time the step's first bucket starts."""
    before = clock.t
    clock.t += step_end_s
    if exclude == "marks":
        policy.start_step(exclude_s=(before, clock.t))
    else:
        policy.start_step(exclude_s=step_end_s)
    policy.maybe_decide(None, torch.device("cpu"))
    return clock.t


def send_buckets(
    policy: FallbackPolicy,
    clock: FakeClock,
    start: float,
    buckets: list[tuple[str, float, float]],
    compressed: bool,
    step_s: float,
) -> None:
    """The buckets of a step that started at ``start`` and lasts ``step_s`` up to the next step's
    start. ``buckets``: ``(key, body_s, link_s)``, launched one after the other as their hook
    bodies end; a collective starts at the later of its launch and the previous bucket's
    completion, and takes ``link_s`` on the link."""
    events, launched, done = [], start, start
    for key, body_s, link_s in buckets:
        body_start, launched = launched, launched + body_s
        done = max(launched, done) + link_s
        events += [(launched, 0, key, body_start), (done, 1, key, None)]
    futures = {}
    for t, kind, key, body_start in sorted(events, key=lambda e: (e[0], e[1])):
        clock.t = t
        if kind == 0:
            futures[key] = torch.futures.Future()
            policy.track(futures[key], key, compressed, body_start)
        else:
            futures[key].set_result(torch.zeros(1))
    assert clock.t <= start + step_s
    clock.t = start + step_s


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
    bucket's hook body takes 0.01 s, its collective 0.2 of a plain step, ``compressed_share`` of
    a compressed one. Returns, per step, whether it was compressed."""
    kinds = []
    for step in range(steps):
        begin = start_step(policy, clock)
        compressed = step >= start and not policy.falls_back("bucket")
        step_s = compressed_s if compressed else plain_s
        link_s = (compressed_share if compressed else 0.2) * step_s
        send_buckets(policy, clock, begin, [("bucket", 0.01, link_s)], compressed, step_s)
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
    for bad in (dict(margin=-0.1), dict(min_gain_ms=-1.0)):
        with pytest.raises(ValueError, match="margin and min_gain_ms"):
            FallbackPolicy(**bad)


@pytest.mark.parametrize(
    "value, enabled", [("0", False), ("off", False), (" False ", False), ("NO", False), ("1", True)]
)
def test_the_environment_variable_turns_the_default_off(monkeypatch, value, enabled):
    monkeypatch.setenv(fallback_module.ENV_VAR, value)
    assert fallback_module.default_enabled() is enabled and FallbackPolicy().enabled is enabled
    assert FallbackPolicy(enabled=True).enabled  # an explicit choice wins


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


# --------------------------------------------------------------------------------------------------
# the costs themselves: buckets whose collectives queue behind each other, times exact in binary
def run_step(
    policy: FallbackPolicy,
    clock: FakeClock,
    buckets: list[tuple[str, float, float]],
    compressed: bool,
    step_s: float,
    step_end_s: float = 0.0,
    exclude: str = "seconds",
) -> None:
    """One step as the hook runs it: :func:`start_step`, then :func:`send_buckets`."""
    send_buckets(policy, clock, start_step(policy, clock, step_end_s, exclude), buckets, compressed, step_s)


def test_a_buckets_costs_are_its_own_time_on_the_link_and_in_the_hook(clock):
    """A bucket's plain cost is its link time on the last plain step; its compressed cost the hook
    body plus its link time, with the time it queued behind the previous bucket left out, as the
    median of the compressed steps after the first (which pays one-off allocations). The step
    pair is the median of those compressed steps against the last plain step, each without the
    step-end work before it (given as seconds or as marks)."""
    policy = FallbackPolicy(enabled=True)
    # two plain steps (the last one counts): A's link 0.5 then 0.25 s, B's 0.125 s queued behind A
    run_step(policy, clock, [("A", 0.0, 0.5), ("B", 0.0, 0.125)], False, step_s=4.0)
    run_step(policy, clock, [("A", 0.0, 0.25), ("B", 0.0, 0.125)], False, step_s=3.0)
    # the first compressed step pays 1 s of allocations in A's body and is slow as a whole
    run_step(policy, clock, [("A", 1.0, 0.0625), ("B", 0.0625, 0.03125)], True, step_s=6.0)
    # B's body ends at 0.1875 s, as does A's collective; in the next step A's ends at 0.25 s and B queues
    run_step(policy, clock, [("A", 0.125, 0.0625), ("B", 0.0625, 0.03125)], True, step_s=1.5)
    # each of the next two starts after step-end work, which the step before it does not count
    run_step(policy, clock, [("A", 0.125, 0.125), ("B", 0.0625, 0.03125)], True, step_s=1.75, step_end_s=0.5)
    run_step(policy, clock, [("A", 0.0, 0.25), ("B", 0.0, 0.125)], True, step_s=1.5, step_end_s=0.25, exclude="marks")
    assert policy.decided and policy.fallback == set()  # decided as this step started: a clear win
    assert policy.step_decision == ((1.5 + 1.75) / 2, 3.0)
    assert policy.decisions == {"A": ((0.1875 + 0.25) / 2, 0.25), "B": (0.0625 + 0.03125, 0.125)}
    times = {kind: list(t) for kind, t in policy.step_times.items()}
    run_step(policy, clock, [("A", 0.125, 0.0625), ("B", 0.0625, 0.03125)], True, step_s=1.5)
    assert policy.step_times == times  # decided: nothing is timed any more


def test_a_compressed_step_exactly_at_the_clear_win_bound_is_probed_against_plain_steps(clock):
    policy = FallbackPolicy(enabled=True, clear_win=0.5)
    for step in range(6):
        run_step(policy, clock, [("A", 0.0, 0.25)], step >= 2, step_s=2.0 if step < 2 else 1.0)
    assert not policy.decided and policy.falls_back("A")  # 1.0 s is not under half of 2.0 s


@pytest.mark.parametrize("min_gain_ms", [249.0, 250.0])
def test_after_the_plain_probe_each_bucket_needs_both_the_margin_and_the_gain_to_fall_back(clock, min_gain_ms):
    """A close call: the plain probe steps (10.25 s) are 250 ms slower than the compressed ones
    (10 s). A gain of exactly ``min_gain_ms`` is a tie, and a tie sends every bucket plainly.
    Otherwise a bucket falls back only when its compressed cost exceeds the median of its plain
    probe costs by more than ``margin`` and by more than ``min_gain_ms``: A (4.25 s against
    4.0 s, 6 % more) and B (0.125 s against 0.0625 s, but 62.5 ms) each miss one of them."""
    policy = FallbackPolicy(enabled=True, min_gain_ms=min_gain_ms)
    plain, compressed = [("A", 0.0, 4.0), ("B", 0.0, 0.0625)], [("A", 0.25, 4.0), ("B", 0.0625, 0.0625)]
    for _ in range(2):
        run_step(policy, clock, plain, False, step_s=10.25)
    for _ in range(3):
        run_step(policy, clock, compressed, True, step_s=10.0)
    for link in (4.0, 4.5, 3.0):  # the plain probe: A's median link is 4.0 s, its last 3.0 s
        run_step(policy, clock, [("A", 0.0, link), ("B", 0.0, 0.0625)], False, step_s=10.25)
        assert policy.falls_back("A") and policy.falls_back("B") and not policy.decided
    run_step(policy, clock, compressed, True, step_s=10.0)  # decides as it starts
    assert policy.decided and policy.step_decision == (10.0, 10.25)
    assert policy.decisions == {"A": (4.25, 4.0), "B": (0.125, 0.0625)}
    assert policy.fallback == ({"A", "B"} if min_gain_ms == 250.0 else set())


def test_a_pickled_policy_starts_a_fresh_step(clock):
    """What the hook state pickles (a spawned rank, a checkpoint) carries no marks of a step in
    flight (on CUDA they are events): the step after it times only its own buckets."""
    policy = FallbackPolicy(enabled=True)
    run_step(policy, clock, [("A", 0.0, 0.25)], False, step_s=2.0)
    restored = pickle.loads(pickle.dumps(policy))
    policy.start_step()
    restored.start_step()
    assert policy.dense_cost == {"A": 0.25} and restored.dense_cost == {}


def _average_with_bucket_keys(rank: int, world: int, layouts: tuple[tuple[str, ...], ...]) -> str:
    keys = list(layouts[rank])
    try:
        return str(FallbackPolicy(enabled=True)._average([1.0 + rank] * len(keys), keys, None, torch.device("cpu")))
    except RuntimeError as err:
        return str(err)


@pytest.mark.parametrize(
    "layouts", [(("a", "b"), ("a", "b")), (("a",), ("a", "b")), (("a", "b"), ("a", "c"))], ids=["same", "more", "other"]
)
def test_ranks_that_timed_different_buckets_all_refuse_to_decide(layouts):
    """The ranks average their costs only once they know they timed the same buckets; else every
    rank stops with the same error, before costs of different lengths could meet in a collective
    (gloo fails on them, NCCL may hang) and whatever the buckets' count."""
    from dist_utils import run_gloo

    res = run_gloo(_average_with_bucket_keys, 2, args=(layouts,))
    if layouts[0] == layouts[1]:
        assert res == ["[1.5, 1.5]"] * 2
    else:
        assert all(r.startswith("ranks timed different bucket layouts") and "ranks [0] agree" in r for r in res), res
