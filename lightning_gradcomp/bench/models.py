"""Models and synthetic batches shared by the benchmarks.

Step time does not depend on the pixel values, so the timing benchmarks feed one fixed random
batch; the accuracy benchmark runs the recipes on real data instead, and ``codecs --data`` feeds
real images (:mod:`.data`) where a codec learns from the gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["DEFAULT_BATCH", "MODELS", "NUM_CLASSES", "build_model", "input_shape", "loss_fn", "synthetic_batch"]

MODELS = ("resnet18", "resnet50", "pspnet", "pspnet18", "tiny", "mlp")
#: per-rank batch used when none is given: ResNet-18 as in the reference measurements
DEFAULT_BATCH = {"resnet18": 32, "resnet50": 32, "pspnet": 8, "pspnet18": 4, "tiny": 16, "mlp": 32}
#: CamVid has 11 classes plus "void"; CIFAR-10 has 10; ImageNet 1000
NUM_CLASSES = {"resnet18": 10, "resnet50": 1000, "pspnet": 12, "pspnet18": 11, "tiny": 10, "mlp": 10}
#: input features of ``mlp``
MLP_FEATURES = 32


def build_model(name: str) -> nn.Module:
    """``resnet18``: torchvision's ResNet-18 in CIFAR shape (:func:`lightning_gradcomp.zoo.cifar_resnet`,
    11,173,962 parameters); ``pspnet``: segmentation-models-pytorch's PSPNet with its default
    ResNet-34 encoder (no pretrained weights, 12 classes; the encoder stages it does not use are
    removed, :func:`lightning_gradcomp.zoo.pspnet`); ``pspnet18``: the segmentation recipe's model
    (``recipes/pspnet_camvid.py``: PSPNet with a ResNet-18 encoder, 11 classes, 882,475 parameters;
    with its 4 images of 256 x 256 per rank by default); ``resnet50``: torchvision's ResNet-50 in
    ImageNet shape (25,557,032 parameters); ``tiny``: a small CNN for tests; ``mlp``: a
    32-256-256-10 perceptron (:func:`lightning_gradcomp.zoo.mlp`) for long runs."""
    from lightning_gradcomp import zoo

    if name == "resnet18":
        return zoo.cifar_resnet(18, num_classes=NUM_CLASSES[name])
    if name == "resnet50":
        from torchvision.models import resnet50

        return resnet50(num_classes=NUM_CLASSES[name])
    if name == "pspnet":
        return zoo.pspnet("resnet34", num_classes=NUM_CLASSES[name])
    if name == "pspnet18":
        return zoo.pspnet("resnet18", num_classes=NUM_CLASSES[name])
    if name == "tiny":
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(32 * 16, 1024),  # 2 MB of gradient: more than tc's 256 kB burst
            nn.ReLU(),
            nn.Linear(1024, NUM_CLASSES[name]),
        )
    if name == "mlp":
        return zoo.mlp(MLP_FEATURES, 256, NUM_CLASSES[name])
    raise ValueError(f"model must be one of {list(MODELS)}, got {name!r}")


def input_shape(name: str, image_size: int | None = None) -> tuple[int, ...]:
    """One sample's input shape: ``(3, S, S)`` images, or ``mlp``'s feature vector."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}, got {name!r}")
    if name == "mlp":
        return (MLP_FEATURES,)
    size = image_size or {"resnet18": 32, "resnet50": 224, "pspnet": 128, "pspnet18": 256, "tiny": 16}[name]
    return (3, size, size)


def synthetic_batch(name: str, batch_size: int, image_size: int | None = None, seed: int = 0) -> tuple[Tensor, Tensor]:
    """One fixed random batch of the model's input shape and labels."""
    shape = input_shape(name, image_size)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, *shape, generator=g)
    if name in ("pspnet", "pspnet18"):
        y = torch.randint(0, NUM_CLASSES[name], (batch_size, *shape[1:]), generator=g)
    else:
        y = torch.randint(0, NUM_CLASSES[name], (batch_size,), generator=g)
    return x, y


def loss_fn(out: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy for classification and (per pixel) segmentation alike."""
    return nn.functional.cross_entropy(out, y)
