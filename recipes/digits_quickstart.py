"""Quick start: real 2-process data-parallel training on CPU with compressed gradients.

The 8x8 handwritten digits that ship inside scikit-learn (1,797 images, nothing to download),
a small MLP (64-256-256-10, 85,002 parameters), and ``CompressedDDPStrategy`` running two gloo
processes on CPU. The default codec, ``topk``, sends the largest 1% of each weight matrix's
gradient (the rest waits in an error-feedback residual); the biases stay below ``min_numel``
(1,024 entries) and travel uncompressed. The first two steps are dense while DDP rebuilds its
buckets. It takes 20 s to a minute on two cores (mostly process start-up: 10 epochs, 230 steps)
and prints test accuracy (about 0.97) and the compression ratio (about 38 per compressed step).
Two processes on one machine talk over loopback, where plain all-reduce is cheaper than any
codec, so the quick start turns the strategy's timing fallback off and always compresses.

Run it::

    python recipes/digits_quickstart.py
    python recipes/digits_quickstart.py --codec qsgd --codec-option levels=3
    tensorboard --logdir lightning_logs     # loss, accuracy and the gradcomp/ panel
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import cli



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_compression_args(p)
    cli.add_trainer_args(p, checkpoints=False)
    g = p.add_argument_group("optimizer")
    g.add_argument("--batch-size", type=int, default=32, help="per process (default 32)")
    g.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate (default 5e-3)")
    g.add_argument("--fallback", dest="no_fallback", action="store_false",
                   help="let the strategy send plain all-reduce where it times faster (off here: see above)")
    # one machine's loopback is fast enough that plain all-reduce would win; the quick start is
    # here to show the codec at work, so it always compresses
    p.set_defaults(max_epochs=10, log_every_n_steps=5, no_fallback=True)
    args = p.parse_args(argv)
    cli.check_codec_args(p, args)
    return args


def digits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """80/20 stratified split of scikit-learn's digits, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.2, random_state=seed, stratify=y)
    as_ds = lambda a, b: TensorDataset(torch.tensor(a, dtype=torch.float32), torch.tensor(b))  # noqa: E731
    return as_ds(xtr, ytr), as_ds(xte, yte)


def make_module(lr: float):
    import lightning as L
    from torchmetrics.classification import MulticlassAccuracy

    class DigitsMLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
            self.val_acc = MulticlassAccuracy(10, average="micro")
            self.lr = lr

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
            return torch.optim.Adam(self.parameters(), lr=self.lr)

    return DigitsMLP()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import lightning as L

    torch.set_num_threads(1)  # two processes on two cores: one thread each
    L.seed_everything(args.seed)
    train, test = digits(args.seed)
    trainer = cli.build_trainer(args, "digits_quickstart")
    module = make_module(args.lr)
    start = time.perf_counter()
    trainer.fit(module, DataLoader(train, args.batch_size, shuffle=True), DataLoader(test, 256))
    wall = time.perf_counter() - start
    trainer.validate(module, DataLoader(test, 256), verbose=False)
    accuracy = float(trainer.callback_metrics["val/acc"])
    result = cli.report(trainer, args, "digits_quickstart", {"val/acc": accuracy}, wall)
    if trainer.is_global_zero:
        print(f"\ntest accuracy {accuracy:.4f} after {trainer.global_step} steps on {trainer.world_size} processes ({wall:.0f} s)")
    cli.print_report(trainer, args, result)
    return result


if __name__ == "__main__":
    main()
