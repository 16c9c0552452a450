"""A CIFAR-shaped ResNet on CIFAR-10 with compressed data-parallel gradients.

torchvision's ``resnet18(num_classes=10)`` with the CIFAR stem (``conv1`` 3x3, stride 1,
padding 1; no max-pool), built by ``lightning_gradcomp.zoo.cifar_resnet``: 11,173,962 parameters,
all used, so DDP needs no ``find_unused_parameters``. ``--model.model resnet10`` (one block per stage, 4,903,242
parameters) halves the compute for CPU budgets. Trained with SGD (Nesterov momentum, cosine
schedule) under ``CompressedDDPStrategy``; accuracy with torchmetrics.

The configuration is ``configs/resnet_cifar10.yaml`` (LightningCLI); run it::

    # 2 CPU processes, codec lgc, one epoch
    python recipes/resnet_cifar10.py

    # a short CPU budget: 2,000 training images, 1,000 test images, 30 steps
    python recipes/resnet_cifar10.py --data.train_subset 2000 --data.val_subset 1000 --trainer.max_steps 30

    # one epoch, validated every 50 steps: the accuracy curve lands in the report's "history"
    python recipes/resnet_cifar10.py --trainer.val_check_interval 50 --trainer.check_val_every_n_epoch null \
        --report.metrics_json run.json

    # 4 GPUs, 100 epochs, PowerSGD rank 4; images decoded once, augmented on the GPU
    python recipes/resnet_cifar10.py --trainer.accelerator gpu --trainer.devices 4 --trainer.max_epochs 100 \
        --trainer.strategy.codec powersgd --trainer.strategy.codec_options '{rank: 4}' --data.preload true

    # resume from the last checkpoint
    python recipes/resnet_cifar10.py --ckpt_path lightning_logs/resnet_cifar10/version_0/checkpoints/last.ckpt

Data (``--data.data_dir``), any of:

- a directory in ImageFolder layout, ``train/<class>/*.jpg`` and ``test/<class>/*.jpg``;
- the tarball of that layout (``cifar10-jpeg.tar.gz``): unpacked once into ``--data.cache_dir``
  (default ``~/.cache/lightning_gradcomp``), then read from there;
- a directory with torchvision's own files (``cifar-10-batches-py/``), never downloaded.

Default: ``../shared/data/cifar10-jpeg.tar.gz`` beside the repository, then ``./data/cifar10``.

Logged to TensorBoard: ``train/loss``, ``train/acc``, ``val/loss``, ``val/acc`` and, under
``gradcomp/``, what the codec did each step; the run's configuration is saved beside the logs as
``config.yaml``.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_gradcomp.cli import CompressedTrainingCLI
from lightning_gradcomp.zoo import cifar_resnet

REPO = Path(__file__).resolve().parents[1]
CONFIG = Path(__file__).resolve().parent / "configs" / "resnet_cifar10.yaml"
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10 training-set statistics
DATA_HELP = """\
CIFAR-10 not found (looked in: {tried}).
Expected one of:
  DIR/train/<class>/*.jpg and DIR/test/<class>/*.jpg      (ImageFolder layout, 10 class folders)
  FILE.tar.gz holding that layout                         (unpacked once into --data.cache_dir)
  DIR/cifar-10-batches-py/                                (torchvision's CIFAR-10 files)
Get the python version from https://www.cs.toronto.edu/~kriz/cifar.html (cifar-10-python.tar.gz,
unpack it into DIR) and pass --data.data_dir DIR."""


# ----------------------------------------------------------------------------------------------------
# data
def find_data(given: str | None) -> tuple[str, Path]:
    """``("tarball" | "folder" | "torchvision", path)``; exit 2 with a message when nothing fits."""
    candidates = (
        [Path(given)] if given else [REPO.parent / "shared" / "data" / "cifar10-jpeg.tar.gz", Path("data") / "cifar10"]
    )
    for c in candidates:
        if c.is_dir() and (c / "cifar10-jpeg.tar.gz").is_file() and not (c / "train").is_dir():
            c = c / "cifar10-jpeg.tar.gz"  # a data directory that holds the tarball
        if c.is_file() and c.name.endswith((".tar.gz", ".tgz", ".tar")):
            return "tarball", c
        if (c / "train").is_dir() and (c / "test").is_dir():
            return "folder", c
        if (c / "cifar-10-batches-py").is_dir():
            return "torchvision", c
    print(DATA_HELP.format(tried=", ".join(str(c) for c in candidates)), file=sys.stderr)
    raise SystemExit(2)


def unpacked_path(tarball: Path, cache_dir: Path) -> Path:
    return cache_dir / tarball.name.split(".")[0]


def unpack(tarball: Path, cache_dir: Path) -> Path:
    """Unpack ``tarball`` once into ``cache_dir/<name>``. Safe when several processes race: each
    unpacks into a private temporary directory and the first atomic rename wins."""
    target = unpacked_path(tarball, cache_dir)
    if (target / "train").is_dir():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    print(f"unpacking {tarball} into {target} (once)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".unpack-"))
    with tarfile.open(tarball) as tar:
        tar.extractall(tmp, filter="data")
    root = tmp if (tmp / "train").is_dir() else next(d for d in tmp.iterdir() if (d / "train").is_dir())
    try:
        os.rename(root, target)
    except OSError:  # another process was faster
        pass
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def datasets(kind: str, root: Path) -> tuple[Dataset, Dataset]:
    """Training (random crop with 4-pixel padding, horizontal flip) and test split."""
    from torchvision import datasets as tvd
    from torchvision.transforms import v2

    normalize = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    train_tf = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), *normalize])
    test_tf = v2.Compose(normalize)
    if kind == "torchvision":
        return (
            tvd.CIFAR10(root, train=True, transform=train_tf, download=False),
            tvd.CIFAR10(root, train=False, transform=test_tf, download=False),
        )
    train, test = tvd.ImageFolder(root / "train", train_tf), tvd.ImageFolder(root / "test", test_tf)
    if train.classes != test.classes:
        raise SystemExit(f"train/ and test/ of {root} hold different class folders: {train.classes} vs {test.classes}")
    return train, test


def decoded(kind: str, root: Path, train: bool, workers: int) -> TensorDataset:
    """The whole split decoded once: uint8 images ``(N, 3, 32, 32)`` and labels, in memory."""
    from torchvision import datasets as tvd
    from torchvision.transforms import v2

    if kind == "torchvision":
        ds = tvd.CIFAR10(root, train=train, download=False)
        images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
        return TensorDataset(images, torch.tensor(ds.targets))
    ds = tvd.ImageFolder(root / ("train" if train else "test"), v2.PILToTensor())
    parts = list(DataLoader(ds, 1000, num_workers=workers))
    return TensorDataset(torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))


@functools.cache
def _normalization(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``MEAN`` and ``STD`` as ``(3, 1, 1)`` tensors on ``device``, copied there once, not per batch."""
    return torch.tensor(MEAN, device=device)[:, None, None], torch.tensor(STD, device=device)[:, None, None]


def augment_on_device(images: torch.Tensor, train: bool) -> torch.Tensor:
    """What ``datasets``' transforms do, for a uint8 batch already on its device: for training a
    random 32x32 crop of the zero-padded (4 pixels) image and a horizontal flip, each drawn per
    image; then scaling to [0, 1] and normalizing."""
    if train:
        n = images.shape[0]
        padded = nn.functional.pad(images, (4, 4, 4, 4))
        rows = torch.randint(0, 9, (n, 1), device=images.device) + torch.arange(32, device=images.device)
        cols = torch.randint(0, 9, (n, 1), device=images.device) + torch.arange(32, device=images.device)
        flip = torch.rand(n, device=images.device) < 0.5
        cols = torch.where(flip[:, None], cols.flip(1), cols)
        index = torch.arange(n, device=images.device)[:, None, None, None]
        channel = torch.arange(3, device=images.device)[None, :, None, None]
        images = padded[index, channel, rows[:, None, :, None], cols[:, None, None, :]]
    mean, std = _normalization(images.device)
    return (images.float() / 255 - mean) / std


def subset(ds: Dataset, n: int | None, seed: int) -> Dataset:
    """``n`` random items (the same on every rank: the generator is seeded)."""
    if n is None or n >= len(ds):
        return ds
    idx = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:n]
    return Subset(ds, idx.tolist())


# ----------------------------------------------------------------------------------------------------
# Lightning
class CIFAR10DataModule(L.LightningDataModule):
    """CIFAR-10 from a local folder, tarball or torchvision files (never downloaded).

    Training images get a random 32x32 crop of the 4-pixel padded image and a horizontal flip.
    The data is looked up when the module is built, so a missing data set stops the run before
    any process starts; a tarball is unpacked in ``prepare_data`` (once per machine).

    Args:
        data_dir: ImageFolder directory, its ``.tar.gz``, or torchvision's files (see above);
            default ``../shared/data/cifar10-jpeg.tar.gz`` beside the repository, then ``./data/cifar10``.
        cache_dir: where a tarball is unpacked (default ``~/.cache/lightning_gradcomp``).
        batch_size: per process.
        train_subset: train on this many random images (default: all 50,000).
        val_subset: evaluate on this many random test images (default: all 10,000).
        num_workers: data loader workers per process (0: load in the training process; 4 or so on a GPU).
        preload: decode every image once into memory at setup and crop, flip and normalize each
            batch on the model's device after transfer (``on_after_batch_transfer``): for GPUs,
            where decoding and transforming each image in the workers cannot keep up.
        seed: draws the subsets (the CLI links it to ``seed_everything``; the test subset uses seed + 1).
    """

    def __init__(
        self,
        data_dir: str | None = None,
        cache_dir: str | None = None,
        batch_size: int = 64,
        train_subset: int | None = None,
        val_subset: int | None = None,
        num_workers: int = 0,
        preload: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.kind, self.path = find_data(data_dir)
        self.cache_dir = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "lightning_gradcomp"

    def prepare_data(self) -> None:
        if self.kind == "tarball":
            unpack(self.path, self.cache_dir)

    def setup(self, stage: str) -> None:
        root = unpacked_path(self.path, self.cache_dir) if self.kind == "tarball" else self.path
        kind = "torchvision" if self.kind == "torchvision" else "folder"
        if self.hparams.preload:
            workers = self.hparams.num_workers
            train, test = decoded(kind, root, True, workers), decoded(kind, root, False, workers)
        else:
            train, test = datasets(kind, root)
        self.train = subset(train, self.hparams.train_subset, self.hparams.seed)
        self.test = subset(test, self.hparams.val_subset, self.hparams.seed + 1)

    @property
    def loader_workers(self) -> int:
        """Workers of the training and test loaders: none for preloaded images, nothing to decode."""
        return 0 if self.hparams.preload else self.hparams.num_workers

    def train_dataloader(self) -> DataLoader:
        workers = self.loader_workers
        return DataLoader(
            self.train,
            self.hparams.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=workers,
            persistent_workers=workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.test, 256, num_workers=self.loader_workers)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if not self.hparams.preload:
            return batch
        images, labels = batch
        return augment_on_device(images, train=self.trainer is not None and self.trainer.training), labels


def warmup_cosine(total: int) -> Callable[[int], float]:
    """The rate's factor at optimizer step ``s`` of ``total``: a linear warm-up over the first 5 %
    (at most 500 steps), then a cosine from 1 to 0."""
    warmup = max(1, min(500, total // 20))
    return lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))


class CIFAR10Classifier(L.LightningModule):
    """Cross-entropy training with SGD (Nesterov momentum 0.9, linear warm-up over the first 5 %
    of the steps, at most 500, then cosine decay to 0); top-1 accuracy on the test split.

    With a codec that applies momentum correction (``codec_options: {momentum: 0.9, ...}``) the
    optimizer is plain SGD: the codec adds momentum (and weight decay, if it has it) before
    compressing, and the strategy refuses an optimizer that would add them twice.

    Args:
        model: ``resnet18`` or ``resnet10`` (one block per stage).
        lr: peak learning rate.
        weight_decay: L2 weight decay.
    """

    def __init__(
        self, model: Literal["resnet18", "resnet10"] = "resnet18", lr: float = 0.1, weight_decay: float = 5e-4
    ) -> None:
        super().__init__()
        if model not in ("resnet18", "resnet10"):
            raise ValueError(f"model must be 'resnet18' or 'resnet10', got {model!r}")
        self.save_hyperparameters()
        self.model = cifar_resnet(int(model.removeprefix("resnet")))
        self.loss = nn.CrossEntropyLoss()
        self.train_acc = MulticlassAccuracy(len(CLASSES), average="micro")
        self.val_acc = MulticlassAccuracy(len(CLASSES), average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.loss(logits, y)
        self.train_acc(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.log("val/loss", self.loss(logits, y), sync_dist=True)
        self.log("val/acc", self.val_acc)  # a Metric object: Lightning syncs it across ranks

    def configure_optimizers(self) -> Any:
        codec = getattr(self.trainer.strategy, "codec", None)
        if codec is not None and codec.harness.momentum:
            wd = 0.0 if codec.harness.weight_decay else self.hparams.weight_decay
            opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, weight_decay=wd)
        else:
            opt = torch.optim.SGD(
                self.parameters(),
                lr=self.hparams.lr,
                momentum=0.9,
                nesterov=True,
                weight_decay=self.hparams.weight_decay,
            )
        schedule = warmup_cosine(max(1, int(self.trainer.estimated_stepping_batches)))
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule), "interval": "step"},
        }


def main(args: list[str] | None = None) -> CompressedTrainingCLI:
    return CompressedTrainingCLI(CIFAR10Classifier, CIFAR10DataModule, config=CONFIG, args=args)


if __name__ == "__main__":
    main()
