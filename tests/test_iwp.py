"""Importance-weighted pruning (``iwp``): position codes, selection, and real 2-rank gloo runs."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_gradcomp.codecs.base import CodecContext, RoundContext
from lightning_gradcomp.codecs.iwp import IWPCodec, _splitmix64, importance, root_rank
from lightning_gradcomp.codecs.positions import (
    ENCODINGS,
    choose_encoding,
    decode_positions,
    encode_positions,
    encoded_nbytes,
    union_of,
    union_slots,
)
from lightning_gradcomp.codecs.sampling import named_count, select_top
from lightning_gradcomp.comm import wire_bytes
from lightning_gradcomp.registry import make_codec
from tests.dist_utils import run_gloo


# --------------------------------------------------------------------------------------------------
# position codes
@st.composite
def position_sets(draw):
    n = draw(st.integers(1, 3000))
    k = draw(st.integers(1, n))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    return n, torch.randperm(n, generator=g)[:k].sort().values


@settings(max_examples=150, deadline=None)
@given(position_sets(), st.sampled_from(["delta", "bitmap"]))
def test_codes_round_trip_exactly(case, encoding):
    n, pos = case
    data = encode_positions(pos, n, encoding)
    assert data.dtype == torch.uint8
    assert data.numel() == encoded_nbytes(encoding, pos.numel(), n)
    assert torch.equal(decode_positions(data, pos.numel(), n, encoding), pos)


@pytest.mark.parametrize("encoding", ["delta", "bitmap"])
def test_position_codes_round_trip_at_the_edges_of_the_range(encoding):
    n = 1 << 20
    for pos in ([0], [n - 1], [0, n - 1], [0, 1, 2, 3], list(range(n - 70, n, 7))):
        p = torch.tensor(pos)
        assert torch.equal(decode_positions(encode_positions(p, n, encoding), len(pos), n, encoding), p)


def test_code_sizes_and_auto_choice():
    n = 11_181_642  # ResNet-18 in CIFAR shape
    k = math.ceil(n / 64)
    # Elias-Fano: l = floor(log2 64) = 6 low bits + about 2 high bits a position: one byte each
    assert encoded_nbytes("delta", k, n) == -(-k * 6 // 8) + -(-(k + ((n - 1) >> 6) + 1) // 8)
    assert encoded_nbytes("delta", k, n) < 1.01 * k < encoded_nbytes("bitmap", k, n) == -(-n // 8)
    assert choose_encoding("auto", k, n) == "delta"
    assert choose_encoding("auto", n // 2, n) == "bitmap"  # dense sets: the bitmap is smaller
    for frac in (0.001, 0.01, 0.1, 0.3, 0.5, 0.9):
        kk = math.ceil(frac * n)
        auto = encoded_nbytes(choose_encoding("auto", kk, n), kk, n)
        assert auto == min(encoded_nbytes("delta", kk, n), encoded_nbytes("bitmap", kk, n))
    assert encoded_nbytes("delta", n, n) == encoded_nbytes("bitmap", n, n) == 0  # all kept: nothing to say


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 2000), st.integers(1, 19), st.integers(0, 2**31 - 1))
def test_union_of_equals_the_sorted_union_and_its_membership(n, ranks, seed):
    # lgc's union support: the sorted union of every rank's named set and who named each position
    g = torch.Generator().manual_seed(seed)
    names = [
        torch.randperm(n, generator=g)[: int(torch.randint(0, n + 1, (1,), generator=g))].sort().values
        for _ in range(ranks)
    ]
    support, named = union_of(names, n)
    expected = torch.unique(torch.cat(names))
    assert torch.equal(support, expected) and support.dtype == torch.int64
    assert named.shape == (ranks, expected.numel()) and named.dtype == torch.bool
    for r, pos in enumerate(names):
        assert torch.equal(named[r], torch.isin(expected, pos))
        assert torch.equal(support[named[r]], pos)  # each rank's set, back in its order
    # the same membership as indices into the support, once for every use in a step
    owns, rests = union_slots(names, n, support, named)
    for r, pos in enumerate(names):
        assert torch.equal(support[owns[r]], pos) and owns[r].dtype == torch.int64  # in the set's order
        assert torch.equal(support[rests[r]], expected[~torch.isin(expected, pos)])
    # the order within a set does not matter (lgc's sample cut passes top-k picks unsorted)
    flipped = [pos.flip(0) for pos in names]
    unsorted = union_of(flipped, n)
    assert torch.equal(unsorted[0], support) and torch.equal(unsorted[1], named)
    assert all(torch.equal(a, b.flip(0)) for a, b in zip(union_slots(flipped, n, *unsorted)[0], owns))


# --------------------------------------------------------------------------------------------------
# importance, selection, root
def test_importance_formula_and_zero_weights():
    a = torch.tensor([1.0, -2.0, 3.0, 0.5])
    w = torch.tensor([0.5, -1.0, 0.0, 2.0])
    eps_l = 1e-3 * w.abs().mean()
    expected = a.abs() / (w.abs() + eps_l)
    assert torch.allclose(importance(a, w, 1e-3), expected)
    assert torch.isfinite(importance(a, torch.zeros(4), 1e-6)).all()  # all-zero layer: eps_l = eps
    assert int(importance(a, w, 1e-6).argmax()) == 2  # w = 0 ranks first
    for dtype in (torch.float16, torch.bfloat16):  # half-precision parameters are read in fp32
        assert torch.allclose(importance(a, w.to(dtype), 1e-3), expected)
    # an infinite weight leaves the guard at eps: the layer's other entries still rank by |a| / |w|
    w_inf = w.clone()
    w_inf[1] = float("inf")
    s = importance(a, w_inf, 1e-3)
    assert float(s[1]) == 0.0 and torch.allclose(s[[0, 2, 3]], a.abs()[[0, 2, 3]] / (w.abs()[[0, 2, 3]] + 1e-3))


def test_sampled_selection_equals_exact_topk():
    g = torch.Generator().manual_seed(0)
    s = torch.rand(300_000, generator=g)
    for k in (1, 100, 4688, 30_000):
        got = select_top(s, k, 0.01, torch.Generator().manual_seed(1))
        assert torch.equal(got, torch.topk(s, k).indices.sort().values)


def test_selection_with_ties_keeps_exactly_k_sorted():
    s = torch.zeros(200_000)
    s[::3] = 1.0  # 66,667 entries tie at the top
    for k in (1000, 66_667, 70_000):
        got = select_top(s, k, 0.01, torch.Generator().manual_seed(2))
        assert got.numel() == k and bool((got[1:] > got[:-1]).all())
        kth = torch.topk(s, k).values[-1]
        assert bool((s[got] >= kth).all())
    nan = torch.rand(200_000)
    nan[5] = float("nan")
    assert select_top(nan, 500, 0.01).numel() == 500


def test_each_rank_names_its_share_of_a_union_support_rounded_up():
    # rounded down, a layer that keeps one entry would have no rank name any position
    assert [named_count(k, 2) for k in (1, 7, 8)] == [1, 4, 4]
    assert [named_count(k, 4) for k in (1, 9, 12)] == [1, 3, 3]


def test_root_hash_is_splitmix64():
    # SplitMix64's first three outputs from state 0, the published reference values; the state
    # wraps at 2^64, so the hash is the same whatever the platform's integer width
    gamma = 0x9E3779B97F4A7C15
    assert [_splitmix64(i * gamma % 2**64) for i in range(3)] == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]
    assert _splitmix64(2**64 - gamma) == 0


def test_root_is_shared_function_of_seed_and_step():
    roots = [root_rank(t, 4, "random", seed=7) for t in range(400)]
    assert roots == [root_rank(t, 4, "random", seed=7) for t in range(400)]
    assert set(roots) == {0, 1, 2, 3} and max(roots.count(r) for r in range(4)) < 140
    assert roots != [root_rank(t, 4, "random", seed=8) for t in range(400)]
    assert [root_rank(t, 3, "round_robin") for t in range(6)] == [0, 1, 2, 0, 1, 2]
    assert root_rank(5, 1, "random") == 0


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"keep_fraction": 0}, "keep_fraction"),
        ({"keep_fraction": 1.5}, "keep_fraction"),
        ({"index_encoding": "varint"}, "index_encoding must be one of"),
        ({"root": "fixed"}, "root must be one of"),
        ({"scope": "model"}, "scope must be one of"),
        ({"eps": 0.0}, "eps"),
        ({"seed": 1.5}, "seed"),
        ({"sample_fraction": 2.0}, "sample_fraction"),
        ({"min_numel": -1}, "min_numel"),
    ],
)
def test_invalid_options_name_the_option(opts, match):
    with pytest.raises(ValueError, match=match):
        make_codec("iwp", **opts)


def test_sample_fraction_zero_is_the_exact_selection():
    codec = make_codec("iwp", keep_fraction=0.01, sample_fraction=0)
    x, w = torch.randn(50_000), torch.randn(50_000)
    kept = codec.encode(x, "w", w, step=3).ctx
    assert torch.equal(kept, torch.topk(importance(x, w, codec.options.eps), 500).indices.sort().values)


def test_a_single_process_counts_no_index_bytes():
    # one rank sends nothing: the positions it picked never leave it
    codec = make_codec("iwp", keep_fraction=0.1)
    x = torch.randn(5000)
    prepared = codec.prepare_bucket([("w", x, x)], RoundContext(3, CodecContext(0, 1, x.device)))
    assert prepared.nbytes == 0 and codec.last_index_bytes > 0
    assert prepared.per_layer["w"].numel() == 500
    # distributed, the positions must come from the root's broadcast, never from a local pick
    codec.setup(CodecContext(0, 2, x.device))
    with pytest.raises(RuntimeError, match="prepare_bucket"):
        codec.encode(x, "w", x, step=3)


def test_the_position_code_changes_the_bytes_not_what_is_sent():
    x, w = torch.randn(20_000), torch.randn(20_000)
    encs = {e: make_codec("iwp", keep_fraction=0.05, index_encoding=e).encode(x, "w", w, step=3) for e in ENCODINGS}
    assert all(torch.equal(enc.local, encs["auto"].local) for enc in encs.values())
    # so a resumed run that codes its positions otherwise is told so, not warned (strategy.py)
    assert "index_encoding" in make_codec("iwp").lossless_options


def test_single_process_keeps_the_most_important_entries():
    codec = make_codec("iwp", keep_fraction=0.1)
    assert codec.options.keep_fraction == 0.1 and codec.harness.error_feedback
    x = torch.randn(5000)
    w = torch.randn(50, 100)
    enc = codec.encode(x, "w", w, step=3)
    k = math.ceil(0.1 * 5000)
    assert enc.payload[0].numel() == k
    assert torch.equal(enc.local, codec.decode(enc.payload, enc.ctx, 5000, count=1))
    kept = torch.topk(importance(x, w, codec.options.eps), k).indices
    assert torch.equal(enc.local[kept], x[kept]) and int((enc.local != 0).sum()) == k


# --------------------------------------------------------------------------------------------------
# real gloo runs
class RecordingIWP(IWPCodec):
    """Records each layer's encoder input and index set (module level: it is pickled to workers)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.log: list[dict] = []

    def encode(self, x, key, param, step, prepared=None):
        enc = super().encode(x, key, param, step, prepared=prepared)
        self.log.append({"step": step, "key": key, "x": x.clone(), "idx": enc.ctx.clone(), "root": self.last_root})
        return enc


_HOOK_LOG: list[dict] = []


def _recording_hook(state, bucket):
    from lightning_gradcomp.hook import codec_hook

    keys = [state.key_of(p) for p in bucket.parameters()]
    comp = [k for k, p in zip(keys, bucket.parameters()) if state.codec.should_compress(k, p)]
    _HOOK_LOG.append(
        {
            "step": state.step,
            "compressed": comp,
            "dense_numel": sum(p.numel() for k, p in zip(keys, bucket.parameters()) if k not in comp),
            "numel": {k: p.numel() for k, p in zip(keys, bucket.parameters())},
            "g": {k: g.detach().reshape(-1).clone() for k, g in zip(keys, bucket.gradients())},
            "w": {k: p.detach().reshape(-1).clone() for k, p in zip(keys, bucket.parameters())},
            "r": {k: state.memory.residuals[k].clone() for k in comp if k in state.memory.residuals},
        }
    )
    return codec_hook(state, bucket)


def _train(rank: int, world: int, codec: IWPCodec, steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    _HOOK_LOG.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 96), torch.nn.ReLU(), torch.nn.Linear(96, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )
    # small buckets: several buckets a step, and one bucket holding two compressed layers
    ddp = DDP(model, bucket_cap_mb=0.04)
    state, _ = make_comm_hook(codec, ddp)
    ddp.register_comm_hook(state, _recording_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    out = {"grads": [], "resid": [], "stats": []}
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(16, 32, generator=g)
        loss = torch.nn.functional.cross_entropy(ddp(x), torch.randint(10, (16,), generator=g))
        loss.backward()
        out["grads"].append({n: p.grad.reshape(-1).clone() for n, p in model.named_parameters()})
        out["resid"].append({k: v.clone() for k, v in state.memory.residuals.items()})
        st_ = state.stats.pop()
        out["stats"].append((st_.payload_bytes, st_.wire_bytes, st_.compressed))
        opt.step()
    out["enc"] = codec.log
    out["hook"] = list(_HOOK_LOG)
    return out


def _iwp_worker(rank: int, world: int) -> bytes:
    out = {
        "main": _train(rank, world, RecordingIWP(keep_fraction=0.05, seed=3, min_numel=1024), steps=6),
        "full": _train(rank, world, RecordingIWP(keep_fraction=1.0, min_numel=1024), steps=4),
        "layer": _train(rank, world, RecordingIWP(keep_fraction=0.05, seed=3, min_numel=1024, scope="layer"), steps=4),
    }
    # plain pickle copies tensor data; the queue's pickler would share memory the exiting worker frees
    return pickle.dumps(out)


@pytest.fixture(scope="module")
def gloo_runs():
    return [pickle.loads(r) for r in run_gloo(_iwp_worker, world_size=2)]


def test_gloo_ranks_share_positions_and_average_them(gloo_runs):
    r0, r1 = (r["main"] for r in gloo_runs)
    steps = sorted({e["step"] for e in r0["enc"]})
    assert steps == [2, 3, 4, 5]  # never before step 2, every step after
    roots = set()
    for step in steps:
        for e0 in (e for e in r0["enc"] if e["step"] == step):
            (e1,) = (e for e in r1["enc"] if e["step"] == step and e["key"] == e0["key"])
            assert torch.equal(e0["idx"], e1["idx"])  # the same positions on every rank
            roots.add(e0["root"])
            assert e0["root"] == e1["root"] == root_rank(step, 2, "random", 3)
            idx, key = e0["idx"], e0["key"]
            out = r0["grads"][step][key]
            assert torch.equal(out, r1["grads"][step][key])
            # the aggregate at the positions is the mean of the error-compensated inputs there
            assert torch.allclose(out[idx], (e0["x"][idx] + e1["x"][idx]) / 2, rtol=0, atol=1e-7)
            rest = torch.ones_like(out, dtype=torch.bool)
            rest[idx] = False
            assert not out[rest].any()
    assert roots == {0, 1}  # the seeded root moved between the ranks


def test_gloo_root_sends_its_most_important_entries(gloo_runs):
    runs = [r["main"] for r in gloo_runs]
    checked = 0
    for b in runs[0]["hook"]:
        if b["step"] < 2 or not b["compressed"]:
            continue
        step = b["step"]
        root = root_rank(step, 2, "random", 3)
        encs = {e["key"]: e for e in runs[root]["enc"] if e["step"] == step}
        s = torch.cat([importance(encs[k]["x"], b["w"][k], 1e-6) for k in b["compressed"]])
        n = s.numel()
        k = math.ceil(0.05 * n)
        got, off = [], 0
        for key in b["compressed"]:
            got.append(encs[key]["idx"] + off)
            off += b["numel"][key]
        got = torch.cat(got)
        assert got.numel() == k  # a fixed count per bucket, cut across its layers
        assert torch.equal(got, torch.topk(s, k).indices.sort().values)
        checked += 1
    assert checked >= 4


def test_gloo_layer_scope_sends_each_layers_own_most_important_entries(gloo_runs):
    runs = [r["layer"] for r in gloo_runs]
    shared = [b for b in runs[0]["hook"] if b["step"] >= 2 and len(b["compressed"]) > 1]
    assert shared  # a bucket holding two compressed layers: two codes in one broadcast
    for b in (b for b in runs[0]["hook"] if b["step"] >= 2):
        step = b["step"]
        root = root_rank(step, 2, "random", 3)
        for key in b["compressed"]:
            (e_root,) = [e for e in runs[root]["enc"] if e["step"] == step and e["key"] == key]
            (e_other,) = [e for e in runs[1 - root]["enc"] if e["step"] == step and e["key"] == key]
            k = math.ceil(0.05 * b["numel"][key])
            expected = torch.topk(importance(e_root["x"], b["w"][key], 1e-6), k).indices.sort().values
            assert torch.equal(e_root["idx"], expected) and torch.equal(e_other["idx"], expected)


def test_gloo_residual_holds_exactly_what_was_not_sent(gloo_runs):
    for run in (r["main"] for r in gloo_runs):
        for e in run["enc"]:
            step, key = e["step"], e["key"]
            (b,) = [b for b in run["hook"] if b["step"] == step and key in b["compressed"]]
            old = b["r"].get(key, torch.zeros_like(e["x"]))
            assert torch.equal(e["x"], b["g"][key] + old)  # the encoder saw gradient + residual
            sent = torch.zeros_like(e["x"])
            sent[e["idx"]] = e["x"][e["idx"]]
            new = run["resid"][step][key]
            assert torch.equal(new + sent, old + b["g"][key])
            assert not new[e["idx"]].any()


def test_gloo_bytes_counted_with_indices(gloo_runs):
    run = gloo_runs[0]["main"]
    for step in (2, 3, 4, 5):
        payload = wire = 0.0
        for b in (b for b in run["hook"] if b["step"] == step):
            n = sum(b["numel"][k] for k in b["compressed"])
            msg = 4 * ((math.ceil(0.05 * n) if n else 0) + b["dense_numel"] + 1)
            idx = encoded_nbytes(choose_encoding("auto", math.ceil(0.05 * n), n), math.ceil(0.05 * n), n) if n else 0
            payload += msg + idx
            wire += wire_bytes("allreduce", msg, 2) + wire_bytes("broadcast", idx, 2)
        assert run["stats"][step][:2] == (payload, wire) and run["stats"][step][2]


def test_gloo_keep_fraction_one_is_the_dense_average(gloo_runs):
    r0, r1 = (r["full"] for r in gloo_runs)
    for step in (2, 3):
        for b0 in (b for b in r0["hook"] if b["step"] == step):
            (b1,) = [b for b in r1["hook"] if b["step"] == step and b["g"].keys() == b0["g"].keys()]
            for key in b0["g"]:
                mean = (b0["g"][key] + b1["g"][key]) / 2
                assert torch.allclose(r0["grads"][step][key], mean, rtol=0, atol=1e-7)
        assert not any(v.any() for v in r0["resid"][step].values())  # nothing left behind
    # all positions kept: no index set travels, the message is as long as the dense one
    assert r0["stats"][2][0] == r0["stats"][0][0] and r0["stats"][2][2]
