"""The hook's state object on its own: its checks, what it carries over (a second fit, a
checkpoint, a snapshot, a pickle) and how a bucket's end commits, drops or takes back residuals.

The paths that send buckets are covered by the two-rank runs of test_hook_gloo.py and
test_reliability.py; here each rule of ``CodecHookState`` is pinned where it is decided."""

import pickle

import pytest
import torch
import torch.nn as nn
from codec_driver import one_rank_group

from lightning_gradcomp.hook import CodecHookState
from lightning_gradcomp.hook.consistency import make_context
from lightning_gradcomp.hook.state import check_dense_gradients, read_in_bucket_order
from lightning_gradcomp.registry import make_codec


def _state(codec: str = "topk", **options) -> CodecHookState:
    return CodecHookState(make_codec(codec), **options)


def test_stats_every_and_nonfinite_are_checked_where_the_state_is_made():
    assert _state(stats_every=1).stats_every == 1
    with pytest.raises(ValueError, match="stats_every must be >= 1, got 0"):
        _state(stats_every=0)
    with pytest.raises(ValueError, match=r"nonfinite must be one of \['skip', 'zero', 'raise'\]"):
        _state(nonfinite="ignore")


@pytest.mark.parametrize("static_graph, first", [(False, 2), (True, 3)])
def test_nothing_is_compressed_before_ddp_has_rebuilt_its_buckets(static_graph, first):
    # DDP rebuilds its buckets after step 0 (after step 1 with static_graph): a step compressed
    # before that would key the codec's state by buckets that are about to change
    state = CodecHookState(make_codec("topk", start_step=0), static_graph=static_graph)  # the codec would from 0
    assert [state.compressing(s) for s in range(first + 2)] == [False] * first + [True, True]
    state.step = first
    assert state.compressing()


def test_a_router_times_its_buckets_itself_so_the_fallback_stays_off():
    assert not _state("auto", fallback=True).fallback.enabled
    assert _state("topk", fallback=True).fallback.enabled


def test_a_second_fit_takes_over_the_pending_step_end_and_the_whole_run_totals():
    first = _state()
    first._step_end_pending = True
    first.stats.totals.buckets, first.stats.totals.wire_bytes = 7, 1234
    second = CodecHookState(first.codec)
    second.continue_from(first)
    assert second._step_end_pending
    assert (second.stats.totals.buckets, second.stats.totals.wire_bytes) == (7, 1234)


def test_a_pickled_state_leaves_the_optimizers_moments_and_its_lock_behind():
    state = CodecHookState(make_codec("topk", precondition=True))
    state.set_second_moments({"w": torch.ones(3)})
    state.memory.set("w", torch.full((3,), 2.0))
    state.step = 5
    assert "second_moments" not in state.__getstate__()  # the optimizer's tensors are not copied
    copy = pickle.loads(pickle.dumps(state))
    assert copy.second_moments == {} and copy.process_group is None
    assert copy.step == 5 and torch.equal(copy.memory.residuals["w"], torch.full((3,), 2.0))
    assert copy._lock is not state._lock and copy._lock.acquire(blocking=False)


def test_deflating_needs_the_cpu_and_another_rank():
    one_rank_group()
    state = CodecHookState(make_codec("topk", deflate=True))
    assert not state.deflating(torch.zeros(4))  # a one-rank group sends nothing


def test_a_rescale_at_the_same_rate_leaves_the_residual_as_it_is():
    state = CodecHookState(make_codec("topk", lr_scaled_feedback=True))
    state.memory.set("w", torch.full((3,), 3.0))
    state.rescale_residuals({"w": 0.1})
    state.rescale_residuals({"w": 0.1})
    assert torch.equal(state.memory.residuals["w"], torch.full((3,), 3.0))
    state.rescale_residuals({"w": 0.4})  # the rate quadruples: a quarter of the residual keeps lr * e
    assert torch.equal(state.memory.residuals["w"], torch.full((3,), 0.75)) and state.residual_lr == {"w": 0.4}
    state.rescale_residuals({"w": -0.1})  # not a rate that applies anything
    assert torch.equal(state.memory.residuals["w"], torch.full((3,), 0.75)) and state.residual_lr == {"w": 0.4}


def test_a_layer_whose_moment_is_all_zero_is_floored_at_adams_eps():
    state = CodecHookState(make_codec("topk", precondition=True))
    state.set_second_moments({"w": torch.zeros(4), "v": torch.tensor([0.0, 0.0, 16.0, 16.0])})
    assert torch.equal(state.preconditioner("w"), torch.full((4,), 1e-8))  # not 0: x / d stays finite
    # 1 % of the mean of sqrt(v) (2.0): 0.02 for the two coordinates never stepped
    torch.testing.assert_close(state.preconditioner("v"), torch.tensor([0.02, 0.02, 4.0, 4.0]))


def test_the_codecs_scalars_are_those_of_the_step_that_just_communicated():
    codec = make_codec("lgc")
    state = CodecHookState(codec)
    assert state.codec_scalars() == {}  # no step yet
    asked = []
    codec.scalars = lambda step, compressing: asked.append((step, compressing)) or {"x": 1}
    state.step = 3
    assert state.codec_scalars() == {"x": 1.0} and asked == [(2, state.compressing(2))]
    state.step = 1
    state.codec_scalars()
    assert asked[-1] == (0, False)


def test_a_checkpoint_carries_the_counts_the_pending_step_end_and_the_runs_length():
    saved = CodecHookState(make_codec("lgc"))
    saved.codec.fit_to_run(1000)
    saved.step, saved.nonfinite_steps, saved._step_end_pending = 40, 2, True
    saved.residual_lr = {"w": 0.25}
    state = saved.state_dict()
    resumed = CodecHookState(make_codec("lgc"))
    resumed.codec.fit_to_run(5000)  # a resume with a longer budget keeps the first run's boundaries
    resumed.load_state_dict(state)
    assert (resumed.step, resumed.nonfinite_steps, resumed._step_end_pending) == (40, 2, True)
    assert resumed.residual_lr == {"w": 0.25} and resumed.codec.run_total_steps == 1000
    # a checkpoint of a run whose length was unknown leaves this run's as it is
    unknown = CodecHookState(make_codec("lgc"))
    unknown.load_state_dict({**state, "run_total_steps": None})
    assert unknown.codec.run_total_steps is None


def test_a_ranks_tensors_round_trip_with_momentum_and_totals():
    saved = _state()
    saved.memory.set("w", torch.ones(3))
    saved.momentum_buffers.set("w", torch.full((3,), 5.0))
    saved.stats.totals.wire_bytes = 99
    tensors = saved.rank_state_dict()
    assert set(tensors) == {"residual.w", "momentum.w", "stats.totals"}
    assert "stats.totals" not in saved.rank_state_dict(stats=False)
    resumed = _state()
    resumed.load_rank_state_dict(tensors, torch.device("cpu"))
    assert torch.equal(resumed.momentum_buffers.residuals["w"], torch.full((3,), 5.0))
    assert torch.equal(resumed.memory.residuals["w"], torch.ones(3)) and resumed.stats.totals.wire_bytes == 99
    # written before the totals were kept: they stay as they are
    older = _state()
    older.stats.totals.wire_bytes = 7
    older.load_rank_state_dict({"residual.w": torch.ones(3)}, torch.device("cpu"))
    assert older.stats.totals.wire_bytes == 7


def test_a_snapshot_can_be_restored_twice_and_does_not_follow_later_changes():
    # a rollback may go back to the same snapshot more than once, and training goes on in between
    state = CodecHookState(make_codec("topk", lr_scaled_feedback=True))
    state.memory.set("w", torch.ones(3))
    state.rescale_residuals({"w": 0.1})
    snapshot = state.snapshot()
    state.residual_lr["w"] = 0.5  # as rescale_residuals changes it, in place
    assert snapshot["residual_lr"] == {"w": 0.1}
    for _ in range(2):
        state.restore(snapshot, torch.device("cpu"))
        state.memory.residuals["w"].mul_(3.0)  # training goes on from the restored tensors, in place
        state.residual_lr["v"] = 1.0
    assert torch.equal(snapshot["rank"]["residual.w"], torch.ones(3)) and snapshot["residual_lr"] == {"w": 0.1}


def test_the_step_end_lets_go_of_what_a_kept_step_replaced_in_momentum_too():
    state = _state()
    state.momentum_buffers.set("w", torch.ones(3))
    state.momentum_buffers.stage("w", torch.full((3,), 2.0))
    state.settle(torch.zeros(3), True, momentum_keys=["w"])
    assert not state.consume_skip()
    state.momentum_buffers.revert_step()  # nothing of an ended step is left to take back
    assert torch.equal(state.momentum_buffers.residuals["w"], torch.full((3,), 2.0))


def test_a_nonfinite_step_counts_once_and_is_recorded_in_the_statistics():
    state = _state()
    state.note_nonfinite()
    state.note_nonfinite()  # a second bucket of the same step
    assert state.nonfinite_steps == 1 and state.stats._current.nonfinite
    assert state.consume_skip() and not state.consume_skip()
    state.note_nonfinite()
    assert state.nonfinite_steps == 2


def _staged(state: CodecHookState) -> None:
    for memory in (state.memory, state.momentum_buffers):
        for key in ("a", "b"):
            memory.set(key, torch.ones(2))
            memory.stage(key, torch.full((2,), 2.0))


def _values(memory) -> dict[str, float]:
    return {k: float(v[0]) for k, v in memory.residuals.items()}


def test_skip_takes_back_the_momentum_an_earlier_bucket_of_the_step_committed():
    state = _state(nonfinite="skip")
    _staged(state)
    state.settle(torch.zeros(2), True, ["a"], ["a"])
    assert _values(state.momentum_buffers) == {"a": 2.0, "b": 1.0}
    buf = torch.ones(2)
    state.settle(buf, False, ["b"], ["b"])
    assert torch.equal(buf, torch.zeros(2))
    assert _values(state.memory) == _values(state.momentum_buffers) == {"a": 1.0, "b": 1.0}
    # a bucket of the discarded step that settles later commits nothing, momentum included
    state.memory.stage("a", torch.full((2,), 3.0))
    state.momentum_buffers.stage("a", torch.full((2,), 3.0))
    state.settle(torch.zeros(2), True, ["a"], ["a"])
    assert state.consume_skip()
    state.memory.commit(["a"])
    state.momentum_buffers.commit(["a"])
    assert _values(state.memory) == _values(state.momentum_buffers) == {"a": 1.0, "b": 1.0}


def test_zero_keeps_what_the_finite_buckets_committed_and_drops_the_bad_buckets_staging():
    state = _state(nonfinite="zero")
    _staged(state)
    state.settle(torch.zeros(2), True, ["a"], ["a"])
    state.settle(torch.ones(2), False, ["b"], ["b"])
    state.memory.commit(["b"])
    state.momentum_buffers.commit(["b"])
    assert _values(state.memory) == _values(state.momentum_buffers) == {"a": 2.0, "b": 1.0}


def test_a_bucket_sent_plainly_drops_the_residuals_it_carried_but_commits_momentum():
    state = _state()
    _staged(state)
    state.memory.discard(["a"])  # the plain path stages no residual: it sends it
    state.settle(torch.zeros(2), True, ["a"], ["a"], flushed=True)
    assert "a" not in state.memory.residuals and _values(state.momentum_buffers)["a"] == 2.0


def test_a_rounds_context_samples_the_statistics_step_and_discards_with_the_buckets_keys():
    one_rank_group()
    codec = make_codec("topk")
    codec.setup(make_context(None, torch.device("cpu")))
    state = CodecHookState(codec, stats_every=4)
    assert [state.round_context(s).sample for s in range(6)] == [True, False, False, False, True, False]
    assert state.round_context(0).revertible
    zero = CodecHookState(codec, nonfinite="zero")
    assert not zero.round_context(0).revertible
    # with "zero" a discarded bucket drops what it staged, its momentum included, and only that
    _staged(zero)
    buf = torch.ones(2)
    assert zero.round_context(5, ["a"], ["a"]).discard(buf) is buf and torch.equal(buf, torch.zeros(2))
    zero.memory.commit(["a", "b"])
    zero.momentum_buffers.commit(["a", "b"])
    assert _values(zero.memory) == _values(zero.momentum_buffers) == {"a": 1.0, "b": 2.0}
    assert zero.consume_skip() and zero.nonfinite_steps == 1


def test_a_frozen_sparse_embedding_is_no_gradient_to_refuse():
    frozen = nn.Embedding(10, 4, sparse=True)
    frozen.weight.requires_grad_(False)
    check_dense_gradients(nn.Sequential(frozen, nn.Linear(4, 2)))
    with pytest.raises(ValueError, match="'0'"):
        check_dense_gradients(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)))


def test_only_a_dense_parameter_in_another_order_is_read_with_its_strides():
    w = torch.zeros(8, 3, 5, 5).to(memory_format=torch.channels_last)
    assert read_in_bucket_order(w)
    # a view with gaps is not dense: DDP lays its gradient out C-contiguous
    assert not read_in_bucket_order(torch.zeros(4, 6)[:, ::2])
    # a size-1 dimension's stride says nothing of the order
    assert read_in_bucket_order(torch.zeros(6, 1, 4).as_strided((6, 1, 4), (1, 99, 6)))


def test_the_fallbacks_decision_is_reported_with_the_step_that_made_it():
    # logged as gradcomp/fallback_buckets by the CompressionMonitor
    one_rank_group()
    state = _state(fallback=True)
    state.fallback.maybe_decide = lambda group, device: None  # still timing
    state._step_end_pending = True
    state._run_step_end()
    assert "fallback_buckets" not in state.stats._current.extra and not state._step_end_pending
    state.fallback.maybe_decide = lambda group, device: ["A..B[2]", "C..C[1]"]
    state._run_step_end()
    assert state.stats._current.extra == {"fallback_buckets": 2}
