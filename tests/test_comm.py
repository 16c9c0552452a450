"""The collectives codecs call in their process group, and the digest the ranks compare."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_gloo

from lightning_gradcomp import comm


def test_a_digest_tells_tensors_apart_by_dtype_and_shape_not_only_by_bytes():
    a = torch.zeros(2, 3)
    assert comm.digest(a) == comm.digest(torch.zeros(2, 3)) and 0 <= comm.digest(a) < 2**62
    assert comm.digest(a) != comm.digest(torch.zeros(3, 2))  # the same 24 bytes
    assert comm.digest(a) != comm.digest(torch.zeros(6, dtype=torch.int32))
    assert comm.digest("ab", "c") == comm.digest("ab", "c") != comm.digest("abc", torch.zeros(0))
    # 62 bits, so that every digest fits an int64 tensor for the ranks to compare (agree)
    digests = [comm.digest(str(i)) for i in range(64)]
    assert max(digests) < 2**62 and max(digests) >= 2**61


def _in_a_subgroup(rank: int, world: int) -> dict:
    """Ranks 1 and 2 of three form a group, in which rank 1 is rank 0: it broadcasts, they gather
    and compare digests there."""
    group = dist.new_group([1, 2])
    if rank == 0:
        return {}
    mine = 1 if rank == 1 else 2
    value = torch.tensor([float(mine)])
    comm.broadcast(value, 0, group, 2)
    gathered = comm.all_gather(torch.tensor([mine]), group, 2)
    comm.agree(7, "the same everywhere", group, torch.device("cpu"), 2)
    try:
        comm.agree(mine, "the ranks' own numbers", group, torch.device("cpu"), 2)
        differ = None
    except RuntimeError as err:
        differ = str(err)
    return {"broadcast": float(value), "gathered": gathered.reshape(-1).tolist(), "differ": differ}


def test_collectives_in_a_subgroup_speak_in_the_groups_ranks_and_agree_raises_on_a_difference():
    _, r1, r2 = run_gloo(_in_a_subgroup, 3)
    for r in (r1, r2):
        assert r["broadcast"] == 1.0  # from the group's rank 0, which is global rank 1
        assert r["gathered"] == [1, 2]
        assert r["differ"] == "the ranks' own numbers: ranks [0] agree; ranks [1] agree"


@pytest.mark.parametrize("world, factor", [(1, 1.0), (2, 1.0), (4, 1.5)])
def test_a_ring_all_reduce_sends_twice_the_message_less_one_share(world, factor):
    assert comm.wire_bytes("allreduce", 1000, world) == pytest.approx(1000 * factor)
    assert comm.wire_bytes("allgather", 1000, world) == pytest.approx(1000 * max(world - 1, 1))
    assert comm.wire_bytes("broadcast", 1000, world) == 1000  # each rank forwards the message once
    with pytest.raises(ValueError, match="unknown collective 'scatter'"):
        comm.wire_bytes("scatter", 1000, max(world, 2))


def test_a_layout_aligns_every_tensor_to_8_bytes_and_counts_only_their_bytes():
    tensors = [torch.ones(3, dtype=torch.uint8), torch.zeros(0), torch.arange(2, dtype=torch.float32)]
    buf, layout = comm.pack(tensors, torch.device("cpu"))
    assert layout.nbytes == buf.numel() == 16 and layout.payload_bytes == 11  # padding is not payload
    back = comm.unpack(buf, layout)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back, tensors))


def test_a_callback_runs_under_the_thread_count_of_the_thread_that_attached_it():
    # one worker thread completes both futures, so it runs both callbacks (torch runs a callback on
    # the thread that sets the result): the second must follow the caller's new count, not the
    # count the worker took for the first
    seen: list[int] = []
    before = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(max_workers=1) as worker:
            for n in (1, 3):
                torch.set_num_threads(n)
                fut = torch.futures.Future()
                chained = comm.then_like_caller(fut, lambda f: seen.append(torch.get_num_threads()))
                worker.submit(fut.set_result, None).result()
                chained.wait()
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 3]


def test_a_failed_all_gather_fails_its_future_instead_of_decoding_garbage(monkeypatch):
    class FailedWork:
        def get_future(self):
            fut = torch.futures.Future()
            fut.set_exception(RuntimeError("rank 1 is gone"))
            return fut

    monkeypatch.setattr(comm.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(comm, "all_gather_flat", lambda *args, **kwargs: FailedWork())
    with pytest.raises(RuntimeError, match="rank 1 is gone"):
        comm.allgather_async(torch.ones(4), None).wait()


def test_on_one_rank_the_blocking_collectives_need_no_process_group():
    assert not dist.is_initialized()
    t = torch.arange(3.0)
    assert torch.equal(comm.all_gather(t, None, 1), t.view(1, -1))
    assert comm.broadcast(t, 0, None, 1) is t and comm.all_reduce(t, "max", None, 1) is t
    comm.agree(5, "one rank", None, torch.device("cpu"), 1)  # nothing to compare
