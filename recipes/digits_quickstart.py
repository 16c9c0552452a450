"""Quick start: real 2-process data-parallel training on CPU with compressed gradients.

The 8x8 handwritten digits that ship inside scikit-learn (1,797 images, nothing to download), a
small MLP (64-256-256-10, 85,002 parameters), and ``CompressedDDPStrategy`` running two gloo
processes on CPU with the package's headline codec, ``lgc`` (Learned Gradient Compression). Its
warm-up is a fraction of the run: dense all-reduce for the first 5 % of the steps, then the largest
0.75 % of each large weight matrix on a support shared by all ranks, sent exactly while ``lgc``
collects samples of them, then the learned code: each value as a sign and one of a few magnitude
levels fitted to those samples (2 bits instead of 32), wherever it reconstructs them well enough; a
layer it cannot carry keeps its exact values. The level controller, on by default, sends the
critical phases (the first window of 50 steps, and each window that follows one in which the norm
of the mean gradient changed by half or more) on a ten times denser support. The end of the run
says how many steps ran at each level, and how many layers and values the learned code carried. The
biases stay below ``min_numel`` (1,024 entries) and travel uncompressed. Ten epochs (230 steps)
take 20 s to a minute on two cores, mostly process start-up; it prints the test accuracy and the
compression ratio, at steady state and over the run. Two processes on one machine talk over
loopback, where plain all-reduce is cheaper than any codec, so the config turns the strategy's
timing fallback off and always compresses.

The configuration is ``configs/digits_quickstart.yaml``; anything in it can be changed on the
command line (LightningCLI)::

    python recipes/digits_quickstart.py
    python recipes/digits_quickstart.py --trainer.strategy.codec topk
    python recipes/digits_quickstart.py --trainer.strategy.codec qsgd --trainer.strategy.codec_options '{levels: 3}'
    python recipes/digits_quickstart.py --print_config        # the whole configuration, as YAML
    tensorboard --logdir lightning_logs                        # loss, accuracy and the gradcomp/ panel
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_gradcomp.cli import CompressedTrainingCLI
from lightning_gradcomp.zoo import mlp

CONFIG = Path(__file__).resolve().parent / "configs" / "digits_quickstart.yaml"


class DigitsDataModule(L.LightningDataModule):
    """80/20 stratified split of scikit-learn's digits, pixels scaled to [0, 1].

    Args:
        batch_size: per process.
        seed: the split's random state (the CLI links it to ``seed_everything``).
    """

    def __init__(self, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.2, random_state=self.hparams.seed, stratify=y)
        as_ds = lambda a, b: TensorDataset(torch.tensor(a, dtype=torch.float32), torch.tensor(b))  # noqa: E731
        self.train, self.test = as_ds(xtr, ytr), as_ds(xte, yte)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.test, 256)


class DigitsMLP(L.LightningModule):
    """A two-hidden-layer MLP trained with SGD (Nesterov momentum 0.9); top-1 accuracy on the
    held-out fifth. SGD rather than Adam: codecs that send a sparse part of each layer and delay
    the rest (``lgc``, ``topk``, ``iwp``) train clearly worse beside Adam's per-coordinate step sizes
    (the strategy warns about it), and the quick start runs ``lgc``.

    Args:
        hidden: width of both hidden layers.
        lr: SGD learning rate.
    """

    def __init__(self, hidden: int = 256, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = mlp(64, hidden, 10)
        self.val_acc = MulticlassAccuracy(10, average="micro")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_acc.update(self.net(x), y)
        self.log("val/acc", self.val_acc, prog_bar=True)  # a Metric object: synced across ranks

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, nesterov=True)


def main(args: list[str] | None = None) -> CompressedTrainingCLI:
    torch.set_num_threads(1)  # two processes on two cores: one thread each
    return CompressedTrainingCLI(DigitsMLP, DigitsDataModule, config=CONFIG, args=args)


if __name__ == "__main__":
    main()
