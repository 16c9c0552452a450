"""A CIFAR-shaped ResNet on CIFAR-10 with compressed data-parallel gradients.

torchvision's ``resnet18(num_classes=10)`` with the CIFAR stem (``conv1`` 3x3, stride 1,
padding 1; no max-pool): 11,173,962 parameters, all used, so DDP needs no
``find_unused_parameters``. ``--model resnet10`` (one block per stage, 4,903,242 parameters)
halves the compute for CPU budgets. Trained with SGD (Nesterov momentum, cosine schedule) under
``CompressedDDPStrategy``; accuracy with torchmetrics.

Run it::

    # 2 CPU processes, codec "topk" (1% of each layer, error feedback), one epoch
    python recipes/resnet_cifar10.py

    # a short CPU budget: 2,000 training images, 1,000 test images, 30 steps
    python recipes/resnet_cifar10.py --train-subset 2000 --val-subset 1000 --max-steps 30

    # one epoch, validated every 50 steps: the accuracy curve lands in --metrics-json as "history"
    python recipes/resnet_cifar10.py --max-epochs 1 --val-every-n-steps 50 --metrics-json run.json

    # 4 GPUs, 100 epochs, PowerSGD rank 4, metrics for the benchmark tool
    python recipes/resnet_cifar10.py --accelerator gpu --devices 4 --max-epochs 100 \\
        --codec powersgd --codec-option rank=4 --metrics-json r18.json

Data (``--data-dir``), any of:

- a directory in ImageFolder layout, ``train/<class>/*.jpg`` and ``test/<class>/*.jpg``;
- the tarball of that layout (``cifar10-jpeg.tar.gz``): unpacked once into ``--cache-dir``
  (default ``~/.cache/lightning_gradcomp``), then read from there;
- a directory with torchvision's own files (``cifar-10-batches-py/``), never downloaded.

Default: ``../shared/data/cifar10-jpeg.tar.gz`` beside the repository, then ``./data/cifar10``.

Logged to TensorBoard (``--log-dir``): ``train/loss``, ``train/acc``, ``val/loss``, ``val/acc``
and, under ``gradcomp/``, what the codec did each step. ``--metrics-json`` also holds ``history``:
``val/acc`` at the global step of every validation run, the curve behind time to accuracy.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_gradcomp import cli

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10 training-set statistics
DATA_HELP = """\
CIFAR-10 not found (looked in: {tried}).
Expected one of:
  DIR/train/<class>/*.jpg and DIR/test/<class>/*.jpg      (ImageFolder layout, 10 class folders)
  FILE.tar.gz holding that layout                         (unpacked once into --cache-dir)
  DIR/cifar-10-batches-py/                                (torchvision's CIFAR-10 files)
Get the python version from https://www.cs.toronto.edu/~kriz/cifar.html (cifar-10-python.tar.gz,
unpack it into DIR) and pass --data-dir DIR."""


# ----------------------------------------------------------------------------------------------------
# options
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_compression_args(p)
    cli.add_trainer_args(p)
    g = p.add_argument_group("data and model")
    g.add_argument("--data-dir", default=None, help="ImageFolder dir, its .tar.gz, or torchvision files (see above)")
    g.add_argument("--cache-dir", default=None, help="where a tarball is unpacked (default ~/.cache/lightning_gradcomp)")
    g.add_argument("--model", default="resnet18", choices=["resnet18", "resnet10"])
    g.add_argument("--train-subset", type=int, default=None, metavar="N", help="train on N random images (default all)")
    g.add_argument("--val-subset", type=int, default=None, metavar="N", help="evaluate on N random test images")
    g = p.add_argument_group("optimizer")
    g.add_argument("--batch-size", type=int, default=64, help="per process (default 64)")
    g.add_argument("--lr", type=float, default=0.1, help="SGD learning rate, cosine decay (default 0.1)")
    g.add_argument("--weight-decay", type=float, default=5e-4)
    args = p.parse_args(argv)
    cli.check_codec_args(p, args)
    return args


# ----------------------------------------------------------------------------------------------------
# data
def find_data(given: str | None, cache_dir: str | None) -> tuple[str, Path]:
    """``("folder" | "torchvision", path)``, unpacking a tarball first; exit 2 when nothing fits."""
    candidates = [Path(given)] if given else [REPO.parent / "shared" / "data" / "cifar10-jpeg.tar.gz", Path("data") / "cifar10"]
    for c in candidates:
        if c.is_dir() and (c / "cifar10-jpeg.tar.gz").is_file() and not (c / "train").is_dir():
            c = c / "cifar10-jpeg.tar.gz"  # a data directory that holds the tarball
        if c.is_file() and c.name.endswith((".tar.gz", ".tgz", ".tar")):
            return "folder", unpack(c, Path(cache_dir) if cache_dir else Path.home() / ".cache" / "lightning_gradcomp")
        if (c / "train").is_dir() and (c / "test").is_dir():
            return "folder", c
        if (c / "cifar-10-batches-py").is_dir():
            return "torchvision", c
    print(DATA_HELP.format(tried=", ".join(str(c) for c in candidates)), file=sys.stderr)
    raise SystemExit(2)


def unpack(tarball: Path, cache_dir: Path) -> Path:
    """Unpack ``tarball`` once into ``cache_dir/<name>``. Safe when several processes race: each
    unpacks into a private temporary directory and the first atomic rename wins."""
    target = cache_dir / tarball.name.split(".")[0]
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
        return (tvd.CIFAR10(root, train=True, transform=train_tf, download=False),
                tvd.CIFAR10(root, train=False, transform=test_tf, download=False))
    train, test = tvd.ImageFolder(root / "train", train_tf), tvd.ImageFolder(root / "test", test_tf)
    if train.classes != test.classes:
        raise SystemExit(f"train/ and test/ of {root} hold different class folders: {train.classes} vs {test.classes}")
    return train, test


def subset(ds: Dataset, n: int | None, seed: int) -> Dataset:
    """``n`` random items (the same on every rank: the generator is seeded)."""
    if n is None or n >= len(ds):
        return ds
    idx = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:n]
    return Subset(ds, idx.tolist())


# ----------------------------------------------------------------------------------------------------
# model
def build_model(name: str, num_classes: int = 10) -> nn.Module:
    """torchvision ResNet with the CIFAR stem: 3x3 stride-1 first convolution, no max-pool."""
    from torchvision.models import ResNet, resnet18
    from torchvision.models.resnet import BasicBlock

    model = resnet18(num_classes=num_classes) if name == "resnet18" else ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def make_module(args: argparse.Namespace):
    import lightning as L
    from torchmetrics.classification import MulticlassAccuracy

    class ClassifierModule(L.LightningModule):
        """Cross-entropy training; top-1 accuracy on the test split."""

        def __init__(self, model: str, lr: float, weight_decay: float) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.model = build_model(model)
            self.loss = nn.CrossEntropyLoss()
            self.train_acc = MulticlassAccuracy(len(CLASSES), average="micro")
            self.val_acc = MulticlassAccuracy(len(CLASSES), average="micro")
            self.validated_at = -1  # global step of the last validation

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

        def on_validation_epoch_end(self) -> None:
            self.validated_at = self.global_step

        def configure_optimizers(self) -> Any:
            codec = getattr(self.trainer.strategy, "codec", None)
            if codec is not None and getattr(codec, "momentum", 0):
                # momentum correction: the codec applies momentum (and weight decay, if it has it)
                # before compressing, so the optimizer must not apply them again
                wd = 0.0 if codec.weight_decay else self.hparams.weight_decay
                opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, weight_decay=wd)
            else:
                opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, nesterov=True,
                                      weight_decay=self.hparams.weight_decay)
            total = max(1, int(self.trainer.estimated_stepping_batches))
            warmup = max(1, min(500, total // 20))
            cosine = lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))  # noqa: E731
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, cosine), "interval": "step"}}

    return ClassifierModule(args.model, args.lr, args.weight_decay)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    kind, root = find_data(args.data_dir, args.cache_dir)
    import lightning as L

    L.seed_everything(args.seed, workers=True)
    workers = args.num_workers if args.num_workers is not None else (0 if args.accelerator == "cpu" else 4)
    train, test = datasets(kind, root)
    train, test = subset(train, args.train_subset, args.seed), subset(test, args.val_subset, args.seed + 1)
    train_loader = DataLoader(train, args.batch_size, shuffle=True, drop_last=True, num_workers=workers, persistent_workers=workers > 0)
    val_loader = DataLoader(test, 256, num_workers=workers)
    module = make_module(args)
    trainer = cli.build_trainer(args, "resnet_cifar10", history_metric="val/acc")  # "history" in --metrics-json
    start = time.perf_counter()
    trainer.fit(module, train_loader, val_loader, ckpt_path=args.ckpt_path)
    wall = time.perf_counter() - start
    if module.validated_at != trainer.global_step:  # the budget ended between validations
        trainer.validate(module, val_loader, verbose=False)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    result = cli.report(trainer, args, "resnet_cifar10", metrics, wall)
    if trainer.is_global_zero:
        print(f"\naccuracy {metrics.get('val/acc', float('nan')):.4f}  val loss {metrics.get('val/loss', float('nan')):.4f}"
              f"  ({len(test)} test images)")
    cli.print_report(trainer, args, result)
    return result


if __name__ == "__main__":
    main()
