"""The hook in real 2-process gloo runs with plain DDP (make_comm_hook), rank-dependent data."""

import pytest
import torch
import torch.nn as nn
from dist_utils import run_gloo
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import make_comm_hook

CODECS = ["none", "fp16", "topk", "qsgd", "terngrad", "powersgd"]
STEPS = 6


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def train(rank: int, codec: str | None, **options):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.2)  # several buckets, so bucket order and rebuild matter
    state = None
    if codec is not None:
        state, hook = make_comm_hook(codec, ddp, **options)
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)  # every rank sees different data
    stats = []
    for _ in range(STEPS):
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if state is not None:
            s = state.stats.pop()
            stats.append((s.compression_ratio, s.raw_bytes, s.payload_bytes, s.compressed, s.buckets))
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    hook_name = ddp._get_ddp_logging_data().get("comm_hook")
    return weights, stats, hook_name, (state.step if state else None)


def worker(rank: int, world: int):
    out = {"reference": train(rank, None)}
    for name in CODECS:
        out[name] = train(rank, name)
    out["topk_10"] = train(rank, "topk", ratio=0.1, stats_every=1)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_gloo(worker, 2)


def test_every_codec_keeps_ranks_identical_and_compresses(runs):
    r0, r1 = runs
    ref = r0["reference"][0]
    for name in CODECS + ["topk_10"]:
        w0, stats, hook_name, steps = r0[name]
        w1 = r1[name][0]
        assert torch.equal(w0, w1), f"{name}: ranks diverged"
        assert hook_name == "codec_hook", name
        assert steps == STEPS
        assert torch.isfinite(w0).all()
        # the first two steps are plain all-reduce (DDP rebuilds its buckets after step 0)
        assert [s[3] for s in stats[:2]] == [False, False], name
        if name == "none":
            assert not any(s[3] for s in stats)
            assert all(abs(s[0] - 1.0) < 1e-3 for s in stats)
        else:
            assert all(s[3] for s in stats[2:]), name
            assert all(s[0] > 1.5 for s in stats[2:]), (name, stats)
            assert all(s[2] < s[1] for s in stats[2:]), name
    # no compression is exactly DDP's own averaging
    assert torch.equal(r0["none"][0], ref)
    # fp16 stays close to it; lossy codecs move the weights but not wildly
    assert torch.allclose(r0["fp16"][0], ref, atol=1e-3)
    for name in ["topk", "qsgd", "terngrad", "powersgd"]:
        assert not torch.equal(r0[name][0], ref)
        assert (r0[name][0] - ref).norm() < 0.5 * ref.norm()


def test_topk_wire_bytes_match_the_kept_fraction(runs):
    r0, _ = runs
    stats = r0["topk_10"][1]
    ratio, raw, payload = stats[-1][:3]
    # 2 ranks: a pair (fp32 value, int32 index) per kept entry = 8 bytes per 10 entries of 4 bytes,
    # plus the uncompressed small layers (biases, < 1024 entries) and one flag per bucket
    assert 4.0 < ratio < 5.0
