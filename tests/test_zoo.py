"""The model zoo: the shapes, names and parameter counts the recipes, benchmarks and docs rely on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gradcomp import zoo


def test_cifar_resnet18_is_torchvision_resnet18_with_the_cifar_stem():
    from torchvision.models import resnet18

    torch.manual_seed(0)
    model = zoo.cifar_resnet(18)
    torch.manual_seed(0)
    reference = resnet18(num_classes=10)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert list(ours) == list(theirs)
    # the same initial weights for a seed, the stem apart
    assert all(torch.equal(ours[k], theirs[k]) for k in ours if not k.startswith("conv1."))
    assert model.conv1.weight.shape == (64, 3, 3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
    assert sum(p.numel() for p in model.parameters()) == 11_173_962
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_cifar_resnet10_has_one_block_per_stage_and_other_depths_are_refused():
    model = zoo.cifar_resnet(10, num_classes=100)
    assert [len(getattr(model, f"layer{i}")) for i in range(1, 5)] == [1, 1, 1, 1]
    assert sum(p.numel() for p in zoo.cifar_resnet(10).parameters()) == 4_903_242
    assert model.fc.out_features == 100
    with pytest.raises(ValueError, match="depth must be one of"):
        zoo.cifar_resnet(50)


def test_pspnet_pruning_keeps_the_function():
    """Pruned PSPNet = the full one on the same weights; only the used stages remain."""
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    pruned = zoo.pspnet("resnet18", num_classes=11)
    full = smp.PSPNet("resnet18", encoder_weights=None, classes=11)
    missing = full.load_state_dict(pruned.state_dict(), strict=False).missing_keys
    assert missing and all(k.startswith(("encoder.layer3.", "encoder.layer4.")) for k in missing)
    assert isinstance(pruned.encoder.layer3, nn.Identity) and isinstance(pruned.encoder.layer4, nn.Identity)
    assert sum(p.numel() for p in pruned.parameters()) == 882_475  # the count the docstrings state
    x = torch.randn(2, 3, 64, 96)
    pruned.eval(), full.eval()
    with torch.no_grad():
        torch.testing.assert_close(pruned(x), full(x))


def test_pspnet_loads_local_encoder_weights_and_refuses_a_file_that_fits_no_encoder(tmp_path):
    """A torchvision state dict fits the encoder (its ``fc`` and the pruned stages are ignored)."""
    import torchvision

    torch.manual_seed(1)
    reference = torchvision.models.resnet18()
    torch.save(reference.state_dict(), tmp_path / "r18.pth")
    model = zoo.pspnet("resnet18", encoder_weights=str(tmp_path / "r18.pth"))
    torch.testing.assert_close(model.encoder.conv1.weight, reference.conv1.weight, rtol=0, atol=0)
    torch.testing.assert_close(model.encoder.layer2[1].conv2.weight, reference.layer2[1].conv2.weight, rtol=0, atol=0)
    torch.save({"unrelated.weight": torch.zeros(3)}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="no key matches"):
        zoo.pspnet("resnet18", encoder_weights=str(tmp_path / "bad.pth"))


def test_mlp_names_and_size():
    model = zoo.mlp()
    assert [n for n, _ in model.named_parameters()] == [f"{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias")]
    assert sum(p.numel() for p in model.parameters()) == 85_002
    assert zoo.mlp(32, 8, 3, hidden_layers=1)(torch.randn(5, 32)).shape == (5, 3)


def test_the_link_benchmark_pspnet18_is_the_segmentation_recipes_model_and_batch():
    """``bench link --model pspnet18`` times what ``recipes/pspnet_camvid.py`` trains and sends."""
    import importlib.util
    from pathlib import Path

    from lightning_gradcomp.bench import models

    spec = importlib.util.spec_from_file_location(
        "recipe_pspnet_camvid", Path(__file__).resolve().parents[1] / "recipes" / "pspnet_camvid.py"
    )
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    model = models.build_model("pspnet18")
    ours, theirs = model.state_dict(), recipe.PSPNetSegmenter().model.state_dict()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert sum(p.numel() for p in model.parameters()) == 882_475
    data = recipe.CamVidDataModule()
    x, y = models.synthetic_batch("pspnet18", models.DEFAULT_BATCH["pspnet18"])
    assert x.shape == (data.hparams.batch_size, 3, data.hparams.crop_size, data.hparams.crop_size)
    assert y.shape == x.shape[:1] + x.shape[2:] and int(y.max()) < len(recipe.CLASSES)
