"""Momentum correction: the codec sends velocity; with a lossless codec training is exactly SGD."""

from __future__ import annotations

import warnings

import pytest
import torch
from dist_utils import run_gloo
from torch import nn

from lightning_gradcomp import CompressedDDPStrategy
from lightning_gradcomp.registry import make_codec

LR, MOMENTUM, WD = 0.05, 0.9, 5e-3


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def _train(rank: int, world: int, codec: str, nesterov: bool, steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    model, ref = _mlp(), _mlp()
    ddp, ddp_ref = DDP(model), DDP(ref)
    options = dict(momentum=MOMENTUM, nesterov=nesterov, weight_decay=WD, min_numel=1000, dense_layers="none")
    if codec == "topk":
        options["ratio"] = 0.05
    elif codec == "iwp":  # each layer its own count, so the layer below keeps ceil(0.05 * 4096)
        options.update(keep_fraction=0.05, scope="layer")
    state, hook = make_comm_hook(codec, ddp, **options)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)  # momentum and weight decay live in the codec
    opt_ref = torch.optim.SGD(ddp_ref.parameters(), lr=LR, momentum=MOMENTUM, nesterov=nesterov, weight_decay=WD)
    gen = torch.Generator().manual_seed(3 + rank)
    masked = []
    for step in range(steps):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        for m, o in ((ddp, opt), (ddp_ref, opt_ref)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
        if state.compressing(step) and codec != "none":
            key = "2.weight"  # 4,096 values, compressed: where this rank sent, its momentum restarts
            residual = state.memory.residuals[key]
            buffer = state.momentum_buffers.residuals[key]
            sent = residual == 0
            masked.append((int(sent.sum()), float(buffer[sent].abs().max()), float(buffer[~sent].abs().max())))
    gap = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    return {"gap": gap, "masked": masked}


def _train_all(rank: int, world: int) -> dict:
    """Every run of this module in one spawn of two ranks."""
    runs = {
        "none-heavy-ball": ("none", False, 8),
        "none-nesterov": ("none", True, 8),
        "topk": ("topk", True, 6),
        "iwp": ("iwp", True, 6),
    }
    return {name: _train(rank, world, *args) for name, args in runs.items()}


@pytest.fixture(scope="module")
def momentum_runs():
    return run_gloo(_train_all, 2)


@pytest.mark.parametrize("run", ["none-heavy-ball", "none-nesterov"])
def test_lossless_codec_with_momentum_correction_is_sgd_with_momentum(momentum_runs, run):
    for ranks in momentum_runs:
        assert ranks[run]["gap"] < 1e-5, ranks[run]["gap"]


@pytest.mark.parametrize("codec", ["topk", "iwp"])
def test_sparse_codecs_mask_the_momentum_where_they_sent(momentum_runs, codec):
    r = momentum_runs[0][codec]
    assert r["masked"], "no compressed step"
    for sent, on_sent, elsewhere in r["masked"]:
        assert sent >= 205  # ceil(0.05 * 4096) positions sent
        assert on_sent == 0.0 and elsewhere > 0.0
    assert r["gap"] > 1e-4  # lossy: not the same trajectory as dense SGD


def test_momentum_options_are_checked_and_refused_where_they_cannot_apply():
    with pytest.raises(ValueError, match="momentum must be in"):
        make_codec("topk", momentum=1.0)
    with pytest.raises(ValueError, match="set momentum > 0 too"):
        make_codec("topk", nesterov=True)
    with pytest.raises(ValueError, match="set momentum > 0 too"):  # decay without momentum would be dropped
        make_codec("topk", weight_decay=5e-4)
    with pytest.raises(ValueError, match="cannot take momentum correction"):
        make_codec("powersgd", momentum=0.9)


def test_strategy_refuses_an_optimizer_that_adds_momentum_again():
    strategy = CompressedDDPStrategy(codec="topk", codec_options={"momentum": 0.9, "weight_decay": 5e-4})
    params = [nn.Parameter(torch.zeros(3))]
    strategy.optimizers = [torch.optim.SGD(params, lr=0.1, momentum=0.9)]
    with pytest.raises(ValueError, match="optimizer must not add its own: SGD has momentum=0.9"):
        strategy._check_optimizer_momentum()
    strategy.optimizers = [torch.optim.SGD(params, lr=0.1, weight_decay=5e-4)]
    with pytest.raises(ValueError, match="weight_decay=0"):
        strategy._check_optimizer_momentum()
    strategy.optimizers = [torch.optim.AdamW(params, lr=0.1, weight_decay=0.0)]  # momentum of its own
    with pytest.raises(ValueError, match=r"AdamW keeps its own moment estimates \(betas=\(0.9, 0.999\)\)"):
        strategy._check_optimizer_momentum()
    strategy.optimizers = [torch.optim.SGD(params, lr=0.1)]
    strategy._check_optimizer_momentum()


def test_strategy_refuses_momentum_correction_with_a_loss_scaler():
    # 16-mixed puts loss-scaled gradients in the bucket: the velocity would mix scales
    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = CompressedDDPStrategy(codec="topk", codec_options={"momentum": 0.9})
    strategy.optimizers = [torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)]
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="16-mixed"):
        strategy._check_optimizer_momentum()
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    strategy._check_optimizer_momentum()


def test_strategy_warns_when_a_sparse_codec_meets_an_adaptive_optimizer():
    from types import SimpleNamespace

    from lightning_gradcomp.callbacks import AdaptiveCompression

    params = [nn.Parameter(torch.zeros(3))]
    bare = SimpleNamespace(callbacks=[])
    for codec in ("topk", "iwp", "lgc"):
        strategy = CompressedDDPStrategy(codec=codec)
        strategy.optimizers = [torch.optim.AdamW(params, lr=0.1)]
        with pytest.warns(
            UserWarning, match=rf"codec '{codec}' sends a sparse part .* with AdamW.*adaptive_level=True"
        ):
            strategy._warn_sparse_codec_with_adaptive_optimizer(bare)
    # with the level controller attached (lgc's default) the warning says it is on
    strategy = CompressedDDPStrategy(codec="lgc")
    strategy.optimizers = [torch.optim.AdamW(params, lr=0.1)]
    with pytest.warns(UserWarning, match=r"the level controller \(on here\)"):
        strategy._warn_sparse_codec_with_adaptive_optimizer(SimpleNamespace(callbacks=[AdaptiveCompression()]))
    quiet = [
        ("topk", {}, torch.optim.SGD(params, lr=0.1, momentum=0.9)),  # SGD: what the codecs were measured with
        ("topk", {"error_feedback": False}, torch.optim.AdamW(params, lr=0.1)),  # nothing delayed
        ("powersgd", {}, torch.optim.AdamW(params, lr=0.1)),  # a dense (low-rank) update
        ("fft", {}, torch.optim.Adam(params, lr=0.1)),
    ]
    for codec, options, opt in quiet:
        strategy = CompressedDDPStrategy(codec=codec, codec_options=options)
        strategy.optimizers = [opt]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            strategy._warn_sparse_codec_with_adaptive_optimizer(bare)
