"""Batches for the benchmarks: one fixed random batch, a new random one each step, or real images.

Step time does not depend on the pixel values, so timing alone needs one fixed batch. A codec that
learns from the gradients (GradiVeQ's PCA bases, LGC's autoencoder) needs varied gradients to fit
on, and real ones to fit what training sees: ``codecs --fit-steps`` draws a new batch every step,
and ``--data cifar10=PATH`` draws it from CIFAR-10 (the recipes' ``cifar10-jpeg.tar.gz``, a
directory holding it, or an unpacked ``train/<class>/*.jpg`` tree), for the models whose input
the images fit.
"""

from __future__ import annotations

import functools
import io
import itertools
import tarfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from lightning_gradcomp.bench.models import NUM_CLASSES, input_shape, synthetic_batch

__all__ = ["DATASETS", "batches", "load_cifar10", "parse_data"]

#: data set -> the models whose input its images fit
DATASETS = {"cifar10": ("resnet18", "tiny")}
#: CIFAR-10 training-set statistics (as in the recipe)
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def parse_data(spec: str | None) -> dict[str, Path]:
    """``"cifar10=PATH"`` (a comma list of ``NAME=PATH``) as ``{name: path}``."""
    out: dict[str, Path] = {}
    for item in [s for s in (spec or "").split(",") if s]:
        name, sep, path = item.partition("=")
        if not sep or name not in DATASETS:
            raise ValueError(f"--data takes NAME=PATH with NAME one of {list(DATASETS)}, got {item!r}")
        if not Path(path).exists():
            raise ValueError(f"--data {name}: {path} does not exist")
        out[name] = Path(path)
    return out


def _train_class(name: str) -> str | None:
    """The class of ``[...]/train/<class>/<image>.jpg``; None for anything else."""
    parts = name.split("/")
    return parts[-2] if len(parts) >= 3 and parts[-3] == "train" and name.endswith(".jpg") else None


def _decode(raw: bytes) -> Tensor:
    from PIL import Image

    img = Image.open(io.BytesIO(raw)).convert("RGB")
    return torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(img.height, img.width, 3)


@functools.lru_cache(maxsize=2)
def load_cifar10(path: Path, every: int = 25) -> tuple[Tensor, Tensor]:
    """Every ``every``-th training image (2,000 of the 50,000 by default), normalised with the
    training-set statistics; labels number the class folders in sorted order."""
    path = Path(path)
    if path.is_dir() and not (path / "train").is_dir() and (path / "cifar10-jpeg.tar.gz").is_file():
        path = path / "cifar10-jpeg.tar.gz"
    found: list[tuple[str, bytes]] = []
    if path.is_dir():
        files = sorted(path.glob("train/*/*.jpg"))
        found = [(f.parent.name, f.read_bytes()) for f in files[::every]]
    else:
        with tarfile.open(path) as tar:
            members = (m for m in tar if m.isfile() and _train_class(m.name))
            for m in itertools.islice(members, 0, None, every):
                found.append((_train_class(m.name), tar.extractfile(m).read()))
    if not found:
        raise ValueError(f"no training images (train/<class>/*.jpg) in {path}")
    classes = {c: i for i, c in enumerate(sorted({c for c, _ in found}))}
    x = torch.stack([_decode(raw) for _, raw in found]).permute(0, 3, 1, 2).float().div_(255)
    mean, std = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
    return (x - mean) / std, torch.tensor([classes[c] for c, _ in found])


def batches(
    model: str,
    batch_size: int,
    image_size: int | None = None,
    *,
    data: dict[str, Path] | None = None,
    fresh: bool = False,
    seed: int = 0,
) -> tuple[Iterator[tuple[Tensor, Tensor]], str]:
    """Endless batches for ``model`` and the name of their source: real images of a data set in
    ``data`` that fits the model (a random draw each step), else random ones (a new batch each
    step with ``fresh``, else the same batch every step)."""
    name = next((n for n in (data or {}) if model in DATASETS[n]), None)
    if name is not None:
        x_all, y_all = load_cifar10(data[name])
        if NUM_CLASSES[model] < int(y_all.max()) + 1:
            raise ValueError(f"{model} has {NUM_CLASSES[model]} classes, {name} more")
        size = input_shape(model, image_size)[-1]
        if x_all.shape[-1] != size:
            x_all = torch.nn.functional.interpolate(x_all, size=(size, size), mode="bilinear", align_corners=False)
        g = torch.Generator().manual_seed(seed)

        def real() -> Iterator[tuple[Tensor, Tensor]]:
            while True:
                idx = torch.randint(0, len(y_all), (batch_size,), generator=g)
                yield x_all[idx], y_all[idx]

        return real(), name
    if fresh:
        return (synthetic_batch(model, batch_size, image_size, seed=seed + i) for i in itertools.count()), "random"
    return itertools.repeat(synthetic_batch(model, batch_size, image_size, seed=seed)), "fixed random"
