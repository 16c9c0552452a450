"""The collectives codecs call in their process group, and the digest the ranks compare."""

from __future__ import annotations

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
