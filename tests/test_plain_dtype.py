"""The ``plain_dtype`` harness option: what travels exactly (a plain all-reduce, ``lgc``'s exact
values on its support) travels in bfloat16, and with error feedback each rank's rounding error
stays in its residual.

On every step and every rank: what the rank sent is its gradient plus the residual it had minus
the residual it keeps (``sent = g + e_before - e_after``), every rank receives the mean of what
was sent (on a plain step in bfloat16, their sum rounded once to bfloat16, halved), and in
bfloat16 what was sent is a bfloat16 number."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_gloo
from torch import nn

from lightning_gradcomp.registry import make_codec

WARMUP, TRAIN = 3, 4  # lgc: steps 0-2 plain, 3-6 stage 2 (exact values on the support)
LGC = dict(
    code="levels",
    warmup_steps=WARMUP,
    ae_train_steps=TRAIN,
    ratio=0.1,
    min_numel=1000,
    dense_layers="none",
)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def _steps(rank: int, world: int, codec: str, options: dict, steps: int) -> list[dict]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    model = _mlp()
    ddp = DDP(model)
    state, hook = make_comm_hook(codec, ddp, stats_every=1, fallback=False, **options)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7 + rank)
    names = [n for n, _ in model.named_parameters()]
    rows = []
    for step in range(steps):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        own = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(model.parameters()))
        before = {k: v.clone() for k, v in state.memory.residuals.items()}
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        after = {k: v.clone() for k, v in state.memory.residuals.items()}
        zero = torch.zeros(0)
        rows.append(
            {
                "stage": state.codec.stage(step) if hasattr(state.codec, "stage") else 1,
                "own": dict(zip(names, (g.reshape(-1).clone() for g in own))),
                "before": {n: before.get(n, zero) for n in names},
                "after": {n: after.get(n, zero) for n in names},
                "grads": {n: p.grad.reshape(-1).clone() for n, p in model.named_parameters()},
                "bytes": state.stats.pop().wire_bytes,
            }
        )
        opt.step()
    return rows


def _sent(row: dict, name: str) -> torch.Tensor:
    g = row["own"][name]
    e0, e1 = row["before"][name], row["after"][name]
    return g + (e0 if e0.numel() else 0) - (e1 if e1.numel() else 0)


def _is_bfloat16(x: torch.Tensor) -> bool:
    return torch.equal(x, x.to(torch.bfloat16).float())


@pytest.fixture(scope="module")
def plain_runs():
    """A codec with a plain warm-up (``topk``, ``start_step=3``) in both dtypes, two ranks."""
    opts = dict(ratio=0.1, min_numel=1000, dense_layers="none", error_feedback=True, start_step=3)
    return {
        dtype: run_gloo(_steps, 2, args=("topk", dict(opts, plain_dtype=dtype), 3)) for dtype in ("float32", "bfloat16")
    }


def test_plain_steps_in_bfloat16_keep_each_ranks_rounding_error(plain_runs):
    fp32, bf16 = plain_runs["float32"], plain_runs["bfloat16"]
    for step in range(3):
        for name in fp32[0][step]["grads"]:
            for ranks in (fp32, bf16):  # identical on both ranks
                torch.testing.assert_close(ranks[0][step]["grads"][name], ranks[1][step]["grads"][name], rtol=0, atol=0)
            # fp32: the mean of the gradients, nothing kept
            assert fp32[0][step]["after"][name].numel() == 0
            mean = (fp32[0][step]["own"][name] + fp32[1][step]["own"][name]) / 2
            torch.testing.assert_close(fp32[0][step]["grads"][name], mean, rtol=1e-6, atol=1e-9)
            # bfloat16: each rank sent a bfloat16 number and kept the rest ...
            sent = [_sent(bf16[r][step], name) for r in range(2)]
            assert all(_is_bfloat16(s) for s in sent)
            assert bf16[0][step]["after"][name].abs().max() > 0  # something was rounded off
            row = bf16[0][step]
            rounded = row["own"][name] + (row["before"][name] if step else 0)  # with the last residual
            assert bool((row["after"][name].abs() <= 2**-8 * rounded.abs()).all())
            # ... and every rank received their sum, rounded once to bfloat16, halved
            expected = (sent[0] + sent[1]).to(torch.bfloat16).float() / 2
            torch.testing.assert_close(bf16[0][step]["grads"][name], expected, rtol=0, atol=0)
    # half the bytes: the bucket and its flag, two bytes a value instead of four
    assert [r["bytes"] for r in bf16[0]] == [r["bytes"] // 2 for r in fp32[0]]


def test_what_a_rank_sent_and_keeps_is_what_it_computed(plain_runs):
    """What a rank sent over the steps plus what it keeps is what it computed.

    The rank adds its residual to its gradient in fp32 (``a = fl(g + e)``, off by at most half an
    ulp of ``a``), sends ``bf16(a)`` and keeps ``a - bf16(a)``, which fp32 holds exactly. So the sum
    telescopes to within those additions' rounding: the check sums in float64 and allows two ulps
    of each step's ``|g| + |e|``, where a lost residual would miss by about 2^-9 of the values."""
    rows = plain_runs["bfloat16"][1]
    for name in rows[0]["own"]:
        f64 = [{k: {name: r[k][name].double()} for k in ("own", "before", "after")} for r in rows]
        sent = sum(_sent(r, name) for r in f64)
        computed = sum(r["own"][name] for r in f64)
        rounding = sum(r["own"][name].abs() + (e.abs() if (e := r["before"][name]).numel() else 0) for r in f64)
        kept = f64[-1]["after"][name]
        assert kept.abs().max() > 0  # there is a residual to keep
        assert bool(((sent + kept - computed).abs() <= 2**-22 * rounding).all())


def test_without_error_feedback_bfloat16_plain_steps_keep_nothing():
    opts = dict(ratio=0.1, min_numel=1000, start_step=3, plain_dtype="bfloat16", error_feedback=False)
    ranks = run_gloo(_steps, 2, args=("topk", opts, 2))
    for step in range(2):
        assert all(e.numel() == 0 for e in ranks[0][step]["after"].values())
        for name, g in ranks[0][step]["grads"].items():  # bf16_compress_hook's: rounded, summed, halved
            own = [ranks[r][step]["own"][name].to(torch.bfloat16) for r in range(2)]
            torch.testing.assert_close(g, (own[0] + own[1]).float() / 2, rtol=0, atol=0)


@pytest.mark.parametrize("support", ["leader", "union"])
def test_lgc_stage_two_gathers_its_exact_values_in_bfloat16(support):
    steps = WARMUP + TRAIN
    runs = {
        dtype: run_gloo(_steps, 2, args=("lgc", dict(LGC, support=support, plain_dtype=dtype), steps))
        for dtype in ("float32", "bfloat16")
    }
    big = [n for n, p in _mlp().named_parameters() if p.numel() >= 1000]
    for dtype, ranks in runs.items():
        stage2 = [i for i, r in enumerate(ranks[0]) if r["stage"] == 2]
        assert stage2 == list(range(WARMUP, steps))
        for i in stage2:
            for name in big:
                sent = [_sent(ranks[r][i], name) for r in range(2)]
                assert 0 < int((sent[0] != 0).sum()) < sent[0].numel()  # a support, not the layer
                # every rank receives the mean of what the ranks sent, summed in fp32
                mean = (sent[0] + sent[1]) / 2
                for r in range(2):
                    torch.testing.assert_close(ranks[r][i]["grads"][name], mean, rtol=1e-6, atol=1e-9)
                # fp32: the support's values exactly; bfloat16: rounded, the rest kept
                assert all(_is_bfloat16(s) for s in sent) == (dtype == "bfloat16")
    fp32, bf16 = runs["float32"][0], runs["bfloat16"][0]
    for i in range(steps):  # fewer bytes on every step: the plain ones and stage 2
        assert bf16[i]["bytes"] < fp32[i]["bytes"]


def test_plain_dtype_is_checked():
    with pytest.raises(ValueError, match=r"plain_dtype must be one of \['float32', 'bfloat16'\]"):
        make_codec("lgc", plain_dtype="float16")
    assert make_codec("topk").harness.plain_dtype == "float32"


def test_lgc_stage_three_on_a_union_support_gives_every_rank_the_mean_of_what_the_ranks_sent():
    """In stage 3 each rank sends its own names in the leader's levels and the other ranks' names
    in the others' levels; whatever the code dropped stays in the rank's residual. So what a rank
    sent, ``g + e_before - e_after``, is what the code decoded, and every rank receives the mean of
    those: a receiver that read a part with the wrong levels would not."""
    steps = WARMUP + TRAIN + 3
    ranks = run_gloo(_steps, 2, args=("lgc", dict(LGC, support="union"), steps))
    big = [n for n, p in _mlp().named_parameters() if p.numel() >= 1000]
    stage3 = [i for i, r in enumerate(ranks[0]) if r["stage"] == 3]
    assert stage3 == list(range(WARMUP + TRAIN, steps))
    for i in stage3:
        assert ranks[0][i]["bytes"] < ranks[0][WARMUP]["bytes"] / 2  # the values coded: 2 bits, not 32
        for name in big:
            sent = [_sent(ranks[r][i], name) for r in range(2)]
            for r in range(2):  # the code dropped something, which the residual keeps
                assert ranks[r][i]["after"][name].abs().max() > 0
            mean = (sent[0] + sent[1]) / 2
            for r in range(2):
                torch.testing.assert_close(ranks[r][i]["grads"][name], mean, rtol=1e-5, atol=1e-8)
