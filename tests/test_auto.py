"""``codec="auto"``: the cost model, its choice, and the choice in real 2-process gloo runs."""

from __future__ import annotations

import copy
from collections import deque
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_utils import run_gloo
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import CodecContext, CompressedDDPStrategy, comm, make_codec, make_comm_hook
from lightning_gradcomp.codecs import auto
from lightning_gradcomp.codecs.auto import BucketCosts, LinkModel, choose_plan, predict_step, rank_plans

MBIT = 1e6 / 8  # bytes per second in one Mbit/s


def bucket(key, raw, gap, encode, decode, wire):
    return BucketCosts(key, raw, gap, list(encode), list(decode), list(wire))


# arms: 0 plain, 1 light (half the bytes, 2 ms to encode), 2 heavy (1/50 of the bytes, 10 ms)
def arms_for(raw: float, gap: float = 0.0, key: str = "b") -> BucketCosts:
    return bucket(key, int(raw), gap, [0.0, 0.002, 0.010], [0.0, 0.001, 0.002], [raw, raw / 2, raw / 50])


def test_predicted_step_follows_the_formula():
    b0, b1 = arms_for(4e6, 0.0, "b0"), arms_for(1e6, 0.05, "b1")
    link = LinkModel(0.001, 100 * MBIT)
    # plain: b0's collective 1 ms + 4e6/12.5e6 = 321 ms from t=0; b1 arrives at 50 ms, waits for the link
    assert predict_step((0, 0), [b0, b1], link) == pytest.approx(0.321 + 0.001 + 0.08)
    # heavy b0: encoded by 10 ms, on the link 1 + 6.4 ms, decoded 2 ms later; b1 (heavy) arrives at
    # 10 + 50 + 10 ms, its collective ends 1 + 1.6 ms later, decoded 2 ms later
    assert predict_step((2, 2), [b0, b1], link) == pytest.approx(0.070 + 0.001 + 0.0016 + 0.002)


def test_an_early_buckets_long_decoding_ends_the_step_after_later_buckets():
    # b0's result needs 300 ms of decoding, longer than b1's arrival, collective and decoding
    b0 = bucket("b0", 1_000_000, 0.0, [0.0], [0.3], [1e6])
    b1 = bucket("b1", 1_000_000, 0.01, [0.0], [0.0], [1e6])
    link = LinkModel(0.001, 100 * MBIT)
    # b0 on the link 1 + 80 ms, then decoded 300 ms; b1 done at 0.081 + 0.081 = 0.162
    assert predict_step((0, 0), [b0, b1], link) == pytest.approx(0.081 + 0.3)


def test_the_link_is_timed_as_the_slowest_ranks_latency_and_the_large_probes_extra_time(monkeypatch):
    """Latency is the one-float all-reduce's time, bandwidth the ring bytes of the large one over
    the time it takes beyond the small one's, each the slowest rank's (a virtual clock: every
    all-reduce of a probe advances it; the other rank's small probe took 10 ms)."""
    now = [0.0]

    class Context:
        device, world_size = torch.device("cpu"), 2

        def all_reduce(self, t, op="sum"):
            if op == "max":  # the ranks' times: the other rank's (10 ms, 0 s) against ours
                t.copy_(torch.maximum(t, torch.tensor([0.010, 0.0], dtype=t.dtype)))
            else:  # a probe: 2 ms, and its bytes at 100 Mbit/s
                now[0] += 0.002 + t.numel() * 4 / (100 * MBIT)

    monkeypatch.setattr(auto.time, "perf_counter", lambda: now[0])
    link = auto.time_link(Context(), probe_bytes=1 << 20)
    assert link.latency_s == pytest.approx(0.010)
    ring = comm.wire_bytes("allreduce", 1 << 20, 2)
    assert link.bytes_per_s == pytest.approx(ring / (0.002 + (1 << 20) / (100 * MBIT) - 0.010))


def test_a_buckets_result_time_starts_when_it_could_first_arrive_and_a_failed_step_times_nothing():
    """``r``, a bucket's time from its hook body's end to its result, counts from the previous
    bucket's result where that came later (results arrive in order); a step with a bucket whose
    result never arrived gives no step time and, from that bucket on, no sample (marks are
    perf_counter readings on a CPU)."""
    codec = make_codec("auto")
    codec._marks = [
        ["b0", 2, 10.000, 10.002, 10.100, SimpleNamespace(wire=500.0)],
        ["b1", 2, 10.050, 10.052, 10.120, SimpleNamespace(wire=300.0)],
    ]
    assert codec._read_marks(step=5) > 0
    assert codec._samples[(2, "b0")][-1] == pytest.approx((0.002, 0.098, 500.0))
    assert codec._samples[(2, "b1")][-1] == pytest.approx((0.002, 0.020, 300.0))  # from b0's result
    assert list(codec._gaps["b1"]) == pytest.approx([0.048]) and codec._order == ["b0", "b1"]
    codec._marks = [
        ["b0", 2, 20.000, 20.002, None, SimpleNamespace(wire=500.0)],
        ["b1", 2, 20.050, 20.052, 20.120, SimpleNamespace(wire=300.0)],
    ]
    assert codec._read_marks(step=6) is None  # no step time for a trial
    assert len(codec._samples[(2, "b1")]) == 1 and len(codec._gaps["b1"]) == 1


def test_every_allowed_arm_is_timed_for_probe_steps_steps_in_turn():
    codec = make_codec("auto", probe_steps=3)  # arms: none, fp16, gradiveq at 0, 0.5 and 1
    assert codec.exploring_arm() == 1  # plain's costs come from the link model
    codec.explored[1] = 2
    assert codec.exploring_arm() == 1
    codec.explored[1] = 3
    assert codec.exploring_arm() == 2
    codec.explored = [3] * 5
    assert codec.exploring_arm() is None


def test_a_candidate_is_at_level_one_unless_it_names_one():
    assert make_codec("auto", candidates="none, fp16, gradiveq, gradiveq:0.25").arm_levels == [0.0, 0.0, 1.0, 0.25]


def test_every_compressing_arm_keeps_what_it_drops_for_the_buckets_next_arm():
    codec = make_codec("auto")
    for name, arm in zip(codec.options.candidates, codec.arms):
        assert arm.harness.error_feedback == (name != "none"), name


def test_a_resume_keeps_the_plan_made_at_its_level_or_times_the_arms_again_if_saved_while_timing():
    planned = make_codec("auto")
    planned.set_level(0.5)
    planned.plan, planned.kept, planned.explored = {"b0": 3}, {"b0": 3}, [2, 2, 2, 2, 0]
    resumed = make_codec("auto")
    resumed.load_state_dict(copy.deepcopy(planned.state_dict()))
    # the plan was made for the level the checkpoint holds: no re-plan at the next step's end
    assert resumed.compression_level == 0.5 and resumed._replan is None
    assert resumed.planned and resumed.plan == {"b0": 3} and resumed.explored == [2, 2, 2, 2, 0]
    timing = make_codec("auto")
    timing.explored = [2, 2, 1, 0, 0]  # saved in the middle of timing the arms
    resumed = make_codec("auto")
    resumed.load_state_dict(copy.deepcopy(timing.state_dict()))
    assert resumed.explored == [2, 0, 0, 0, 0] and resumed.exploring_arm() == 1


def test_the_plan_follows_the_link():
    buckets = [arms_for(25e6, 0.0, "b0"), arms_for(20e6, 0.2, "b1"), arms_for(1e6, 0.1, "b2")]
    fast, _ = choose_plan(buckets, [0, 1, 2], LinkModel(1e-4, 10_000 * MBIT))
    slow, _ = choose_plan(buckets, [0, 1, 2], LinkModel(1e-3, 10 * MBIT))
    assert fast == (0, 0, 0)  # encoding costs more than 10 Gbit/s takes to send
    assert slow == (2, 2, 2)


def test_communication_hidden_behind_backward_stays_plain():
    # the first bucket's plain all-reduce (80 ms at 100 Mbit/s) ends before backward reaches the
    # last bucket (300 ms later): compressing it saves nothing, and its encoding would cost backward
    buckets = [arms_for(1e6, 0.0, "early"), arms_for(1e6, 0.3, "last")]
    link = LinkModel(1e-3, 100 * MBIT)
    plan, predicted = choose_plan(buckets, [0, 1, 2], link)
    assert plan == (0, 2)
    assert predicted == pytest.approx(0.3 + 0.010 + 0.001 + 0.0016 + 0.002)
    # the plans timed next: the best few, fastest first, only those within the margin
    ranked = rank_plans(buckets, [0, 1, 2], link, limit=3, margin=0.25)
    assert ranked[0] == (predicted, (0, 2)) and len(ranked) == 3
    assert all(t <= 1.25 * predicted for t, _ in ranked) and [t for t, _ in ranked] == sorted(t for t, _ in ranked)
    assert rank_plans(buckets, [0, 1, 2], link, limit=9, margin=0.0) == [(predicted, (0, 2))]


def test_equal_predictions_take_the_plan_that_compresses_less():
    # the first bucket's all-reduce ends behind backward's 500 ms whether it travels plainly or in
    # half the bytes (both arms cost no CPU here): the model cannot tell the two plans apart, and
    # the one that compresses less carries less error for the same time
    buckets = [
        bucket("early", 1e6, 0.0, [0.0, 0.0], [0.0, 0.0], [1e6, 5e5]),
        bucket("last", 1e6, 0.5, [0.0, 0.0], [0.0, 0.0], [1e6, 5e5]),
    ]
    link = LinkModel(1e-3, 100 * MBIT)
    assert predict_step((0, 1), buckets, link) == predict_step((1, 1), buckets, link)
    ranked = rank_plans(buckets, [0, 1], link, limit=4, margin=0.0)
    assert [plan for _, plan in ranked] == [(0, 1), (1, 1)]
    assert choose_plan(buckets, [0, 1], link)[0] == (0, 1)


def _trials_of(codec, step_times: list[list[float]]) -> dict[str, int]:
    """Time two trial plans, plain (arm 0) and gradiveq (arm 2, a tenth of the bytes), at these
    step times, and return the plan kept."""
    codec._trials, codec._trial_times, codec._trial_reason = [(0.1, (0,)), (0.1, (2,))], [[], []], "test"
    for times in step_times:
        for t in times:
            codec._trial_step(t)
    assert not codec._trials  # decided
    return dict(codec.plan)


def _trial_codec(probe_steps: int = 2):
    codec = make_codec("auto", probe_steps=probe_steps, slack=0.02)
    codec.setup(CodecContext(0, 1, torch.device("cpu")))
    codec.costs = [arms_for(1e6)]
    codec.link = LinkModel(1e-3, 100 * MBIT)
    return codec


def _kept_after_trials(step_times: list[list[float]], probe_steps: int = 2) -> dict[str, int]:
    """The plan ``auto`` keeps (one rank) when its two trial plans take these step times, the first
    of each not counted."""
    return _trials_of(_trial_codec(probe_steps), step_times)


def test_timed_plans_within_the_slack_keep_the_one_that_sends_fewest_bytes():
    # gradiveq 1 % slower than plain is as fast within the 2 % slack: it is kept for its bytes
    assert _kept_after_trials([[9.0, 0.100, 0.100], [9.0, 0.101, 0.101]]) == {"b": 2}
    # 5 % slower is slower: plain is kept
    assert _kept_after_trials([[9.0, 0.100, 0.100], [9.0, 0.105, 0.105]]) == {"b": 0}
    # the first step of a plan pays for the switch and is not counted
    assert _kept_after_trials([[0.0, 0.100, 0.100], [9.0, 0.100, 0.100]]) == {"b": 2}
    assert _kept_after_trials([[9.0, 0.100], [0.0, 0.105]], probe_steps=1) == {"b": 0}


def test_a_single_plan_is_kept_untimed_and_only_later_plans_count_as_replans():
    codec = _trial_codec()
    # the first plan kept is not a re-plan; each one after it is
    assert _trials_of(codec, [[9.0, 0.1, 0.1], [9.0, 0.1, 0.1]]) == {"b": 2} and codec.replans == 0
    assert _trials_of(codec, [[9.0, 0.1, 0.1], [9.0, 0.2, 0.2]]) == {"b": 0} and codec.replans == 1
    # at level 0 only plain is left (gradiveq:1 is a level-1 arm): one plan, kept without a trial
    codec = make_codec("auto", candidates=["none", "gradiveq:1"])
    codec.setup(CodecContext(0, 1, torch.device("cpu")))
    codec.set_level(0.0)
    codec.costs = [bucket("b", 1e6, 0.0, [0.0, 0.01], [0.0, 0.002], [1e6, 2e4])]
    codec._start_trials(LinkModel(1e-3, 10 * MBIT), "test")
    assert codec.planned and codec.kept == {"b": 0} and codec.measured_s is None


def test_the_costs_are_the_ranks_medians_with_the_link_taken_out_of_decoding():
    codec = make_codec("auto", candidates=["none", "fp16", "gradiveq:1"])
    codec.setup(CodecContext(0, 4, torch.device("cpu")))
    link = LinkModel(1e-3, 100 * MBIT)
    codec._order, codec._raw = ["b0", "b1"], {"b0": 4_000_000, "b1": 400_000}
    codec._gaps = {"b0": deque([0.0, 0.0, 0.0]), "b1": deque([0.05, 0.09, 0.06])}
    # per step of an arm on a bucket: (encode s, result s after the body, bytes one rank sent)
    codec._samples = {
        (2, "b0"): deque([(0.010, 0.020, 8e4), (0.012, 0.021, 8e4), (0.011, 0.040, 8e4)]),
        (1, "b1"): deque([(0.001, 0.0005, 4e5), (0.002, 0.0006, 4e5)]),
    }
    b0, b1 = codec._averaged_costs(link)
    assert (b0.key, b0.raw_bytes, b0.gap, b1.gap) == ("b0", 4_000_000, 0.0, 0.06)
    assert b0.encode[2] == pytest.approx(0.011) and b0.wire[2] == 8e4
    assert b0.decode[2] == pytest.approx(0.021 - link.seconds(8e4))  # the wire is the link model's
    assert b1.decode[1] == 0.0  # a result faster than the link model: nothing left to decode
    assert b0.encode[1] == b0.decode[1] == b0.wire[1] == 0.0  # an arm not timed on a bucket
    # plain all-reduce's bytes are the ring's, for the bucket and its flag: 2 (N-1)/N of them
    assert b0.wire[0] == pytest.approx(1.5 * 4_000_004) and b1.wire[0] == pytest.approx(1.5 * 400_004)


def _auto_costs_with_order(rank: int, world: int, orders: tuple[tuple[str, ...], ...]) -> str:
    codec = make_codec("auto", candidates=["none", "fp16", "gradiveq:1"])
    codec.setup(CodecContext(rank, world, torch.device("cpu")))
    codec._order, codec._raw = list(orders[rank]), {"b0": 4_000_000, "b1": 400_000}
    try:
        costs = codec._averaged_costs(LinkModel(1e-3, 100 * MBIT))
    except RuntimeError as err:
        return str(err)
    return ",".join(c.key for c in costs)


@pytest.mark.parametrize(
    "orders", [(("b0", "b1"), ("b0", "b1")), (("b0",), ("b0", "b1")), (("b0", "b1"), ("b1", "b0"))], ids=str
)
def test_ranks_that_timed_other_buckets_all_refuse_to_plan(orders):
    """The costs are averaged entry by entry: every rank raises unless all timed the same buckets
    in the same order (a vector of another length would fail in the reduce; another order would
    average one bucket's costs with another's)."""
    res = run_gloo(_auto_costs_with_order, 2, args=(orders,))
    if orders[0] == orders[1]:
        assert res == ["b0,b1"] * 2
    else:
        assert all(r.startswith("auto: ranks timed different bucket layouts") for r in res), res


def test_the_level_bounds_the_arms():
    buckets = [arms_for(25e6, 0.0, "b0")]
    plan, _ = choose_plan(buckets, [0, 1], LinkModel(1e-3, 10 * MBIT))
    assert plan == (1,)  # the heavy arm is not allowed: the light one is the fastest left
    codec = make_codec("auto")
    assert codec.allowed() == [0, 1, 2, 3, 4]
    codec.set_level(0.0)
    assert [codec.options.candidates[i] for i in codec.allowed()] == ["none", "fp16", "gradiveq:0"]
    codec.set_level(0.5)
    assert [codec.options.candidates[i] for i in codec.allowed()] == ["none", "fp16", "gradiveq:0", "gradiveq:0.5"]


def test_link_change_is_relative():
    link = LinkModel(0.002, 100 * MBIT)
    assert not link.changed(LinkModel(0.0022, 90 * MBIT), relink=0.25)
    assert link.changed(LinkModel(0.002, 10 * MBIT), relink=0.25)
    assert link.changed(LinkModel(0.05, 100 * MBIT), relink=0.25)
    # the bandwidth's relative change against log(1 + relink): 100 -> 75 Mbit/s is a third more time a byte
    assert link.changed(LinkModel(0.002, 75 * MBIT), relink=0.25)
    assert not link.changed(LinkModel(0.002, 85 * MBIT), relink=0.25)
    # latencies under a millisecond are noise however much they change in proportion
    fast = LinkModel(1e-4, 100 * MBIT)
    assert not fast.changed(LinkModel(5e-4, 100 * MBIT), relink=0.25)
    assert fast.changed(LinkModel(2e-3, 100 * MBIT), relink=0.25)


def test_bad_options_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="unknown codec 'nope'; available codecs: .*gradiveq"):
        make_codec("auto", candidates=["none", "nope"])
    with pytest.raises(ValueError, match="runs its own exchange"):
        CompressedDDPStrategy(codec="auto", codec_options={"candidates": ["none", "powersgd"]})
    with pytest.raises(ValueError, match="must include 'none'"):
        make_codec("auto", candidates=["fp16", "gradiveq"])
    with pytest.raises(ValueError, match="takes no level"):
        make_codec("auto", candidates=["none", "fp16:0.5"])
    with pytest.raises(ValueError, match="has no adjustable level"):
        make_codec("auto", candidates=["none", "randk:0.5"])
    with pytest.raises(ValueError, match="slack"):
        make_codec("auto", slack=1.0)
    with pytest.raises(ValueError, match="level of candidate 'gradiveq:1.5'"):
        make_codec("auto", candidates=["none", "gradiveq:1.5"])
    with pytest.raises(ValueError, match="probe_bytes must be at least 4096"):
        make_codec("auto", probe_bytes=1024)
    with pytest.raises(ValueError, match="momentum"):
        make_codec("auto", momentum=0.9)
    # a comma-separated string, as YAML and the command line give it
    assert make_codec("auto", candidates="none, fp16").options.candidates == ("none", "fp16")


def test_the_strategy_turns_the_level_controller_on_for_the_codecs_measured_to_need_it():
    assert CompressedDDPStrategy(codec="auto")._adaptive_callback is not None
    assert CompressedDDPStrategy(codec="auto", adaptive_level=False)._adaptive_callback is None
    assert CompressedDDPStrategy(codec="topk")._adaptive_callback is None
    assert CompressedDDPStrategy(codec="lgc")._adaptive_callback is not None  # lgc trains better with it
    assert CompressedDDPStrategy(codec="lgc", adaptive_level=False)._adaptive_callback is None
    assert CompressedDDPStrategy(codec="gradiveq")._adaptive_callback is not None  # so does gradiveq
    assert CompressedDDPStrategy(codec="iwp")._adaptive_callback is not None  # and iwp
    assert CompressedDDPStrategy(codec="powersgd")._adaptive_callback is None  # a baseline runs as published


# --------------------------------------------------------------------------------------------------
# two processes: the plan is the same on every rank, and follows the link when it changes
SLOW_BPS = 10e6 / 8  # the simulated link: 10 Mbit/s
MAX_AUTO_STEPS = 40  # the loopback plan, then the slow link's, are kept well within this


def _slow_blocking_collectives() -> None:
    """From now on every blocking all-reduce in this process takes as long as on a 10 Mbit/s link
    (the asynchronous ones of the hook are left alone): the link as auto's probe measures it."""
    import time

    original = dist.all_reduce

    def slow(tensor, *args, **kwargs):
        work = original(tensor, *args, **kwargs)
        if not kwargs.get("async_op", False):
            time.sleep(0.002 + 2 * tensor.numel() * tensor.element_size() / SLOW_BPS)
        return work

    dist.all_reduce = slow


def _train_auto(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    ddp = DDP(model, bucket_cap_mb=0.5)  # several buckets
    state, hook = make_comm_hook(
        "auto",
        ddp,
        candidates=["none", "fp16", "gradiveq:1"],
        probe_steps=1,
        remeasure_every=2,
        probe_bytes=1 << 16,
    )
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    codec = state.codec
    plans, ratios, link_bps = [], [], []
    slowed_at = None  # the step after which the link turned slow
    # driven by the codec's own state, identical on every rank (its plans are digest-checked): how
    # many steps the loopback trials take depends on timings, so a fixed step for the slowdown
    # could come before the first plan was kept, or leave too few steps for the new one
    for step in range(MAX_AUTO_STEPS):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        plans.append(dict(codec.plan))
        ratios.append(state.stats.pop().compression_ratio)
        link_bps.append(codec.link.bytes_per_s if codec.link is not None else None)
        if slowed_at is None and codec.planned:
            slowed_at, replans_at_slow = step, codec.replans
            _slow_blocking_collectives()
        elif slowed_at is not None and codec.replans > replans_at_slow and codec.planned:
            break
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    # a resumed run: a new model, wrapper and hook loaded from what a checkpoint keeps
    saved, saved_rank = state.state_dict(), state.rank_state_dict()
    resumed_model = copy.deepcopy(model)
    resumed_ddp = DDP(resumed_model, bucket_cap_mb=0.5)
    resumed, hook = make_comm_hook(
        "auto", resumed_ddp, candidates=["none", "fp16", "gradiveq:1"], probe_steps=1, remeasure_every=2
    )
    resumed.load_state_dict(saved)
    resumed.load_rank_state_dict(saved_rank, torch.device("cpu"))
    resumed_ddp.register_comm_hook(resumed, hook)
    ratios_after = {"continued": [], "resumed": []}
    for _ in range(2):  # the new wrapper's first step has DDP's first bucket layout: sent plainly
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        for name, m, st in (("continued", ddp, state), ("resumed", resumed_ddp, resumed)):
            m.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            ratios_after[name].append(st.stats.pop().compression_ratio)
    return {
        "resumed_plan": dict(resumed.codec.plan),
        "resumed_planned": resumed.codec.planned,
        "resumed_ratio": ratios_after["resumed"][-1],
        "continued_ratio": ratios_after["continued"][-1],
        "plans": plans,
        "ratios": ratios,
        "slowed_at": slowed_at,
        "links": codec.link,
        "link_bps": link_bps,
        "replans": codec.replans,
        "weights": weights,
        "wire": {b.key: b.wire for b in codec.costs},
    }


def test_every_rank_takes_the_same_plan_and_a_slower_link_changes_it():
    r0, r1 = run_gloo(_train_auto, 2)
    assert r0["plans"] == r1["plans"]
    assert torch.equal(r0["weights"], r1["weights"])  # every rank applied the same averaged gradient
    slowed_at = r0["slowed_at"]
    assert slowed_at is not None, "no plan was kept on the loopback link"
    assert len(r0["plans"]) < MAX_AUTO_STEPS, "no new plan after the link turned slow"
    before, after = r0["plans"][slowed_at], r0["plans"][-1]
    assert 8 * r0["links"].bytes_per_s < 20e6  # the probe saw the 10 Mbit/s link
    # ... at most remeasure_every (2) steps after the link turned slow: the link is timed on schedule
    seen = next(i for i, bps in enumerate(r0["link_bps"]) if bps is not None and 8 * bps < 20e6)
    assert seen - slowed_at <= 2, (seen, slowed_at)
    # on 10 Mbit/s bytes cost far more than any arm's compute: the plans the model ranks first, of
    # which the timed trials keep one, all send a small part of plain all-reduce's bytes
    wire = r0["wire"]
    assert sum(wire[k][a] for k, a in after.items()) < 0.25 * sum(arms[0] for arms in wire.values()), (after, wire)
    if after != before:  # on loopback the arms' step times are close: which of them wins is timing
        assert sum(wire[k][a] for k, a in after.items()) < sum(wire[k][a] for k, a in before.items())
        assert r0["ratios"][-1] > r0["ratios"][slowed_at]
    # resumed from the checkpointed state, the plan and the bytes it sends are the same
    for r in (r0, r1):
        assert r["resumed_planned"] and r["resumed_plan"] == r["plans"][-1]
        assert r["resumed_ratio"] == pytest.approx(r["continued_ratio"])


def _level_flow(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
    ddp = DDP(model, bucket_cap_mb=0.1)
    state, hook = make_comm_hook("auto", ddp, candidates=["none", "fp16", "gradiveq:1"], probe_steps=1)
    ddp.register_comm_hook(state, hook)
    codec = state.codec
    codec.set_level(0.0)  # as AdaptiveCompression does in a critical regime
    gen = torch.Generator().manual_seed(rank)
    rows = []
    for step in range(24):
        if step == 12:
            codec.set_level(1.0)  # between two steps, as the callback does
        x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        # the arms every bucket of this step went through (the marks of the step just sent)
        used = sorted({m[1] for m in codec._marks})
        rows.append({"step": step, "level": codec.compression_level, "used": used, "explored": list(codec.explored)})
    wire, plan, planned = {b.key: list(b.wire) for b in codec.costs}, dict(codec.plan), codec.planned
    # the level falls while plans are on trial, one of them sending every bucket through gradiveq:
    # the step after it sends none through it
    heavy = tuple(2 for _ in codec.costs)
    codec._trials, codec._trial_times, codec._trial_reason = [(0.1, heavy)], [[]], "test"
    codec._use(heavy)
    codec.set_level(0.0)
    x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    ddp.zero_grad()
    nn.functional.cross_entropy(ddp(x), y).backward()
    lowered = {"plan": sorted(set(codec.plan.values())), "used": sorted({m[1] for m in codec._marks})}
    return {"rows": rows, "plan": plan, "planned": planned, "wire": wire, "lowered": lowered}


def test_the_level_bounds_every_step_and_a_newly_allowed_arm_is_timed_first():
    (out,) = run_gloo(_level_flow, 1)
    rows = out["rows"]
    for r in rows:
        if r["level"] == 0.0:
            assert 2 not in r["used"], r  # gradiveq (level 1) never at level 0
    assert rows[11]["explored"][2] == 0  # not timed while it was not allowed
    first = next(r for r in rows if 2 in r["used"])
    assert first["step"] >= 12 and first["used"] == [2]  # its first use: an exploration step, every bucket
    assert rows[-1]["explored"][2] == 1 and out["planned"]
    # the plan kept after timing it rests on its measured costs
    assert all(arms[2] > 0 for arms in out["wire"].values()), out["wire"]
    assert out["lowered"]["plan"] == [2] and 2 not in out["lowered"]["used"], out["lowered"]
