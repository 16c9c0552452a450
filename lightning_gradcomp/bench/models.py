"""Models and synthetic batches shared by the benchmarks.

Step time does not depend on the pixel values, so the timing benchmarks feed one fixed random
batch; the accuracy benchmark runs the recipes on real data instead.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["DEFAULT_BATCH", "MODELS", "build_model", "loss_fn", "synthetic_batch"]

MODELS = ("resnet18", "resnet50", "pspnet", "tiny")
#: per-rank batch used when none is given: ResNet-18 as in the reference measurements
DEFAULT_BATCH = {"resnet18": 32, "resnet50": 32, "pspnet": 8, "tiny": 16}
#: CamVid has 11 classes plus "void"; CIFAR-10 has 10; ImageNet 1000
NUM_CLASSES = {"resnet18": 10, "resnet50": 1000, "pspnet": 12, "tiny": 10}


def build_model(name: str) -> nn.Module:
    """``resnet18``: torchvision's ResNet-18 in CIFAR shape (3x3 stride-1 stem, no max-pool,
    11,181,642 parameters); ``pspnet``: segmentation-models-pytorch's PSPNet with its default
    ResNet-34 encoder (no pretrained weights, 12 classes; the encoder stages it does not use are
    frozen); ``resnet50``: torchvision's ResNet-50 in ImageNet shape (25,557,032 parameters);
    ``tiny``: a small CNN for tests."""
    if name == "resnet18":
        from torchvision.models import resnet18

        model = resnet18(num_classes=NUM_CLASSES[name])
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
        return model
    if name == "resnet50":
        from torchvision.models import resnet50

        return resnet50(num_classes=NUM_CLASSES[name])
    if name == "pspnet":
        import segmentation_models_pytorch as smp

        model = smp.PSPNet(encoder_weights=None, classes=NUM_CLASSES[name])
        # PSPNet reads only the first encoder_depth (3) stages, but the encoder keeps the deeper
        # ones: freeze what gets no gradient, or DDP waits for gradients that never come.
        model(torch.randn(2, 3, 64, 64)).sum().backward()
        for p in model.parameters():
            if p.grad is None:
                p.requires_grad_(False)
            p.grad = None
        return model
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
    raise ValueError(f"model must be one of {list(MODELS)}, got {name!r}")


def synthetic_batch(name: str, batch_size: int, image_size: int | None = None, seed: int = 0) -> tuple[Tensor, Tensor]:
    """One fixed random batch of the model's input shape and labels."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}, got {name!r}")
    g = torch.Generator().manual_seed(seed)
    size = image_size or {"resnet18": 32, "resnet50": 224, "pspnet": 128, "tiny": 16}[name]
    x = torch.randn(batch_size, 3, size, size, generator=g)
    if name == "pspnet":
        y = torch.randint(0, NUM_CLASSES[name], (batch_size, size, size), generator=g)
    else:
        y = torch.randint(0, NUM_CLASSES[name], (batch_size,), generator=g)
    return x, y


def loss_fn(out: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy for classification and (per pixel) segmentation alike."""
    return nn.functional.cross_entropy(out, y)
