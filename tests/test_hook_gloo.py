"""The hook in real 2-process gloo runs with plain DDP (make_comm_hook), rank-dependent data."""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_utils import run_gloo
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import available_codecs, make_comm_hook

CODECS = ["none", "fp16", "topk", "qsgd", "terngrad", "powersgd"]
STEPS = 6
# every registered codec, with options that reach its compressing phase within STEPS steps
SUBGROUP_CODECS = sorted(available_codecs())
SUBGROUP_OPTIONS = {
    "gradiveq": {"warmup_steps": 2},
    "lgc": {"warmup_steps": 2, "ae_train_steps": 2, "ae_width": 4, "ae_epochs": 1, "ae_samples": 3},
    "iwp": {"keep_fraction": 0.05},
}
COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def train(rank: int, codec: str | None, process_group=None, **options):
    model = make_model()
    # several buckets, so bucket order and rebuild matter
    ddp = DDP(model, bucket_cap_mb=0.2, process_group=process_group)
    state = None
    if codec is not None:
        state, hook = make_comm_hook(codec, ddp, process_group=process_group, **options)
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
    # every codec again, in a group made with new_group: any collective that a codec or the hook
    # runs outside it (on the default group) is recorded, by name, through wrappers of dist's
    # collectives, which torch's own PowerSGD hook and our comm module look up at call time
    sub = dist.new_group([0, 1])
    strays: list[tuple[str, str]] = []
    current = [""]
    originals = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}

    def recording(fn_name):
        def call(*args, **kwargs):
            if kwargs.get("group") is not sub:
                strays.append((current[0], fn_name))
            return originals[fn_name](*args, **kwargs)

        return call

    subgroup = {}
    for name in SUBGROUP_CODECS:
        current[0] = name
        for fn_name in originals:
            setattr(dist, fn_name, recording(fn_name))
        try:
            subgroup[name] = train(rank, name, process_group=sub, **SUBGROUP_OPTIONS.get(name, {}))
        finally:
            for fn_name, fn in originals.items():
                setattr(dist, fn_name, fn)
    out["subgroup"] = subgroup
    out["strays"] = strays
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


def test_every_codec_keeps_ranks_identical_and_compresses_in_a_subgroup(runs):
    r0, r1 = runs
    assert sorted(r0["subgroup"]) == SUBGROUP_CODECS
    for name in SUBGROUP_CODECS:
        w0, stats, hook_name, steps = r0["subgroup"][name]
        assert torch.equal(w0, r1["subgroup"][name][0]), f"{name}: ranks diverged in the subgroup"
        assert hook_name == "codec_hook" and steps == STEPS, name
        assert torch.isfinite(w0).all(), name
        if name != "none":
            assert stats[-1][3] and stats[-1][0] > 1.5, (name, stats[-1])


def test_no_collective_leaves_the_given_process_group(runs):
    for rank_out in runs:
        assert rank_out["strays"] == [], "collectives on a group other than the one given: " + str(
            sorted(set(rank_out["strays"]))
        )


class Layouts(nn.Module):
    """One parameter in each memory layout DDP meets: C-contiguous, ``channels_last``, a
    transposed matrix (dense, not contiguous) and a strided slice (not dense). The loss is
    ``sum(p * coef[p])``, so each gradient is exactly its ``coef``, entry by entry."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.conv = nn.Parameter(torch.randn(4, 3, 2, 2, generator=g))
        self.conv_cl = nn.Parameter(torch.randn(4, 3, 2, 2, generator=g).contiguous(memory_format=torch.channels_last))
        self.transposed = nn.Parameter(torch.randn(5, 6, generator=g).t())
        self.strided = nn.Parameter(torch.randn(6, 10, generator=g)[:, ::2])
        self.coef = {name: torch.randn(p.shape, generator=g) for name, p in self.named_parameters()}

    def forward(self) -> torch.Tensor:
        return sum((p * self.coef[name]).sum() for name, p in self.named_parameters())


def layouts_worker(rank: int, world: int):
    from lightning_gradcomp.hook.state import in_parameter_order

    model = Layouts()
    names = {id(p): n for n, p in model.named_parameters()}
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(_, bucket):
        for g, p in zip(bucket.gradients(), bucket.parameters()):
            seen[names[id(p)]] = (g.clone(), in_parameter_order(g, p).clone())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp = DDP(model)
    ddp.register_comm_hook(None, hook)
    ddp().backward()
    layouts = {
        n: (p.is_contiguous(), p.is_contiguous(memory_format=torch.channels_last)) for n, p in model.named_parameters()
    }
    return {"seen": seen, "coef": model.coef, "layouts": layouts}


def test_a_bucket_slice_is_read_in_its_parameters_order_whatever_the_layout():
    out = run_gloo(layouts_worker, 1)[0]
    assert out["layouts"] == {
        "conv": (True, False),
        "conv_cl": (False, True),
        "transposed": (False, False),
        "strided": (False, False),
    }
    for name, (plain_view, ordered) in out["seen"].items():
        assert torch.equal(ordered, out["coef"][name]), name
        # GradBucket.gradients() alone reads the channels_last and transposed slices permuted
        assert torch.equal(plain_view, out["coef"][name]) == (name in ("conv", "strided")), name


def sparse_worker(rank: int, world: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 4, sparse=True), nn.Linear(4, 2))
    ddp = DDP(model)
    state, hook = make_comm_hook("topk")  # no model given: nothing to check it against before the step
    ddp.register_comm_hook(state, hook)
    try:
        ddp(torch.randint(0, 50, (8, 3))).sum().backward()
    except RuntimeError as err:
        return str(err)
    return None


def test_sparse_gradients_are_refused_with_the_modules_that_give_them():
    from lightning_gradcomp.hook.state import check_dense_gradients

    model = nn.Sequential(nn.Embedding(50, 4, sparse=True), nn.Linear(4, 2), nn.EmbeddingBag(9, 4, sparse=True))
    with pytest.raises(
        ValueError, match=r"module\(s\) '0', '2' of this model are embeddings with sparse=True.*sparse=False"
    ):
        check_dense_gradients(model)
    check_dense_gradients(nn.Sequential(nn.Embedding(50, 4), nn.Linear(4, 2)))  # dense: taken
    model[0].requires_grad_(False)
    model[2].sparse = False
    check_dense_gradients(model)  # a frozen table has no gradient at all
    # a sparse gradient from no such module is refused by the hook itself, on every rank alike
    for message in run_gloo(sparse_worker, 2):
        assert message is not None and re.search(
            r"the gradient of \['param\d+'\] reached the hook as a sparse", message
        )
