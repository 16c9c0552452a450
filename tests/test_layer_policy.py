"""The layer policy (``dense_layers``): which layers every codec keeps uncompressed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_gloo
from torch import nn

from lightning_gradcomp.codecs.base import weight_layer_ends
from lightning_gradcomp.registry import available_codecs, make_codec
from lightning_gradcomp.zoo import cifar_resnet, mlp


def test_auto_keeps_the_stem_and_the_classifier_of_resnet18():
    codec = make_codec("topk")
    dense = codec.plan_layers(cifar_resnet(18).named_parameters())
    assert dense == {"conv1.weight", "fc.weight", "fc.bias"}
    assert not codec.should_compress("fc.weight", torch.zeros(5120))
    assert codec.should_compress("layer4.1.conv2.weight", torch.zeros(2_359_296))


def test_patterns_none_and_frozen_parameters():
    model = cifar_resnet(18)
    codec = make_codec("topk", dense_layers=["auto", "layer4.*.conv2.weight"])
    assert codec.plan_layers(model.named_parameters()) == {
        "conv1.weight", "fc.weight", "fc.bias", "layer4.0.conv2.weight", "layer4.1.conv2.weight"
    }  # fmt: skip
    assert make_codec("topk", dense_layers="none").plan_layers(model.named_parameters()) == frozenset()
    # frozen parameters never reach the hook: the first trainable weight layer counts as the first
    model.conv1.requires_grad_(False)
    assert "layer1.0.conv1.weight" in make_codec("topk").plan_layers(model.named_parameters())
    assert weight_layer_ends([]) == set()


def test_bad_policies_are_rejected_with_the_choices():
    with pytest.raises(ValueError, match="dense_layers must be 'auto', 'none' or a list"):
        make_codec("topk", dense_layers=3)
    with pytest.raises(ValueError, match=r"pattern 'head\.\*' matches no trainable parameter \(names: conv1.weight"):
        make_codec("iwp", dense_layers=["head.*"]).plan_layers(cifar_resnet(18).named_parameters())
    with pytest.raises(ValueError, match="chooses its compressed layers itself"):
        make_codec("powersgd", dense_layers="auto")


@pytest.mark.parametrize("name", sorted(set(available_codecs()) - {"powersgd"}))
def test_every_codec_takes_the_policy(name):
    codec = make_codec(name)
    assert codec.config()["dense_layers"] == ["auto"]
    # the first layer is 19 % of this MLP, more than an end layer may be to stay dense
    assert codec.plan_layers(mlp().named_parameters()) == {"4.weight", "4.bias"}


def _dense_layers_exact(rank: int, world: int, codec: str) -> list[dict]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    torch.manual_seed(0)
    model = mlp()
    ddp = DDP(model)
    policy = ["0.*", "4.*"]  # the first and the last layer, by name
    state, hook = make_comm_hook(
        codec, ddp, min_numel=1000, dense_layers=policy, **({"ratio": 0.01} if codec == "topk" else {})
    )
    ddp.register_comm_hook(state, hook)
    gen = torch.Generator().manual_seed(11 + rank)  # different data on every rank
    rows = []
    for step in range(5):
        x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        ref = mlp()
        ref.load_state_dict(model.state_dict())
        nn.functional.cross_entropy(ref(x), y).backward()
        mean = [p.grad.clone() for p in ref.parameters()]
        for t in mean:
            dist.all_reduce(t)
            t /= world
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        names = [n for n, _ in model.named_parameters()]
        rows.append(
            {
                "compressing": state.compressing(step),
                "err": {n: float((p.grad - m).abs().max()) for n, p, m in zip(names, model.parameters(), mean)},
                "nonzero": {n: int((p.grad != 0).sum()) for n, p in zip(names, model.parameters())},
            }
        )
    return rows


def _dense_layers_exact_for_each(rank: int, world: int) -> dict:
    return {codec: _dense_layers_exact(rank, world, codec) for codec in ("topk", "iwp")}


@pytest.fixture(scope="module")
def dense_layer_runs():
    return run_gloo(_dense_layers_exact_for_each, world_size=2)[0]


@pytest.mark.parametrize("codec", ["topk", "iwp"])
def test_dense_layers_travel_exactly_on_two_ranks(dense_layer_runs, codec):
    rows = dense_layer_runs[codec]
    compressed = [r for r in rows if r["compressing"]]
    assert compressed, "the run never reached a compressed step"
    for r in compressed:
        for name in ("0.weight", "4.weight"):  # the first and the last layer: the exact mean
            assert r["err"][name] < 1e-6, (name, r["err"][name])
        # the middle layer (65,536 values) really is compressed: sparse and not the mean
        assert r["nonzero"]["2.weight"] < 0.1 * 65536
        assert r["err"]["2.weight"] > 1e-4
