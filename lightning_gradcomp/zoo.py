"""The models of the recipes, the benchmarks and the tests, each defined once.

- :func:`cifar_resnet`: torchvision's ResNet in CIFAR shape (3x3 stride-1 stem, no max-pool);
- :func:`pspnet`: segmentation-models-pytorch's PSPNet with the encoder stages it never runs
  removed (:func:`prune_unused`), so DDP needs no ``find_unused_parameters``;
- :func:`mlp`: a fully connected classifier with ReLU between its layers.

torchvision and segmentation-models-pytorch are imported inside the functions that need them:
the package itself does not depend on them.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

__all__ = ["CIFAR_RESNET_BLOCKS", "cifar_resnet", "mlp", "prune_unused", "pspnet"]

#: basic blocks per stage of each depth: 18 and 34 are torchvision's, 10 has one block per stage
CIFAR_RESNET_BLOCKS = {10: [1, 1, 1, 1], 18: [2, 2, 2, 2], 34: [3, 4, 6, 3]}


def cifar_resnet(depth: int = 18, num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet with the CIFAR stem: ``conv1`` 3x3, stride 1, padding 1; no max-pool.

    With ``depth=18`` this is ``torchvision.models.resnet18(num_classes=10)`` (the same parameter
    names, and the same initial weights for a given seed) with the stem swapped: 11,173,962
    parameters. ``depth=10`` (one block per stage) has 4,903,242.
    """
    from torchvision.models import ResNet
    from torchvision.models.resnet import BasicBlock

    if depth not in CIFAR_RESNET_BLOCKS:
        raise ValueError(f"depth must be one of {sorted(CIFAR_RESNET_BLOCKS)}, got {depth!r}")
    model = ResNet(BasicBlock, CIFAR_RESNET_BLOCKS[depth], num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def pspnet(encoder: str = "resnet18", num_classes: int = 11, encoder_weights: str | None = None) -> nn.Module:
    """smp's PSPNet with ``encoder`` (random init, or a local state dict), unused stages removed.

    ``encoder_weights`` is a file holding the encoder's state dict (a torchvision ResNet's does:
    keys the encoder lacks, such as ``fc``, are ignored); nothing is downloaded. With ``resnet18``
    and 11 classes the model holds 882,475 parameters: the stem, ``layer1`` and ``layer2`` of the
    encoder (683,072), the pyramid pooling decoder (148,704) and the segmentation head (50,699).
    """
    import segmentation_models_pytorch as smp

    model = smp.PSPNet(encoder_name=encoder, encoder_weights=None, classes=num_classes)
    if encoder_weights:
        state = torch.load(encoder_weights, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state)
        state = {k.removeprefix("encoder."): v for k, v in state.items()}
        own = model.encoder.state_dict()
        usable = {k: v for k, v in state.items() if k in own}
        if not usable:
            raise ValueError(f"encoder_weights {encoder_weights}: no key matches the {encoder} encoder")
        model.encoder.load_state_dict(usable, strict=False)  # smp's override returns nothing: count ourselves
        missing = sorted(set(own) - set(usable))
        if missing:
            warnings.warn(f"encoder_weights left {len(missing)} encoder tensors at random init, e.g. {missing[0]}")
    return prune_unused(model)


def prune_unused(model: nn.Module, size: int = 64) -> nn.Module:
    """Replace every sub-module that gets no gradient in a forward/backward with ``nn.Identity``.

    Such modules are never run (smp builds all encoder stages, PSPNet reads the first three), so
    this changes no output; it lets DDP run without ``find_unused_parameters``.
    """
    was_training = model.training
    model.eval()  # batch statistics of a random batch must not leak into BatchNorm buffers
    model(torch.randn(1, 3, size, size)).sum().backward()

    def walk(module: nn.Module) -> None:
        for name, child in module.named_children():
            params = list(child.parameters())
            if params and all(p.grad is None for p in params):
                setattr(module, name, nn.Identity())
            elif params:
                walk(child)

    walk(model)
    model.zero_grad(set_to_none=True)
    model(torch.randn(1, 3, size, size)).sum().backward()  # every parameter left must now be used
    unused = [n for n, p in model.named_parameters() if p.grad is None]
    if unused:
        raise RuntimeError(f"parameters without gradient after pruning: {unused[:5]}")
    model.zero_grad(set_to_none=True)
    return model.train(was_training)


def mlp(in_features: int = 64, hidden: int = 256, num_classes: int = 10, hidden_layers: int = 2) -> nn.Sequential:
    """``hidden_layers`` linear layers of width ``hidden`` with ReLU, then the classifier; parameters
    are named ``0.weight``, ``0.bias``, ``2.weight``, ... (85,002 with the defaults)."""
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(hidden_layers):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)
