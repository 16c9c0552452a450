"""Shared pieces of the reliability tests: a tiny Lightning model whose gradient can be made
non-finite on one rank at one step, a callback that records what every rank holds after every
step, and a worker that runs a Lightning fit inside a process started by ``run_gloo``.

Not collected by pytest (no ``test_`` prefix); imported by the test modules and by spawned ranks.
"""

from __future__ import annotations

import io
import math
import os
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import CompressedDDPStrategy

# Options that shorten a codec's warm-up or stages, passed only to codecs that declare them
# (registry.option_names), so a run of a few dozen steps reaches compression.
SHORT_WARMUP: dict[str, Any] = {
    "start_step": 2,
    "warmup_steps": 3,
    "ae_train_steps": 3,
    "min_numel": 256,  # the test model's layers have 1024 and 4096 weights: compress both
}


def short_options(name: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The subset of :data:`SHORT_WARMUP` (plus ``extra``) that codec ``name`` accepts."""
    from lightning_gradcomp.codecs.base import option_names
    from lightning_gradcomp.registry import codec_class

    cls = codec_class(name)
    accepted = set(option_names(cls))
    if "warmup_steps" in accepted:  # the codec's own warm-up schedule replaces the common start_step
        accepted.discard("start_step")
    wanted = dict(SHORT_WARMUP)
    wanted.update(extra or {})
    return {k: v for k, v in wanted.items() if k in accepted}


def make_data(n: int = 64, d: int = 16, classes: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, classes, generator=g)
    return TensorDataset(x, (x @ w).argmax(1))


class Net(pl.LightningModule):
    """A 16-64-64-4 MLP (two layers of >= 1024 entries, so default ``min_numel`` compresses them).

    ``bad_step``/``bad_rank``/``bad_value``: multiply the loss by ``bad_value`` (NaN or Inf) on one
    rank at one optimizer step. ``unused``: a layer that never gets a gradient. ``optimizer``:
    ``"sgd"`` (``lr``, ``momentum``) or ``"adamw"`` (``lr / 10``).
    """

    def __init__(
        self,
        bad_step: int = -1,
        bad_rank: int = 1,
        bad_value: float = float("nan"),
        unused: bool = False,
        lr: float = 0.1,
        momentum: float = 0.0,
        samples: int = 64,
        batch_size: int = 8,
        dtype: str = "float32",
        step_data: bool = False,
        optimizer: str = "sgd",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(1234)
        # a plain attribute, not a buffer: DDP would broadcast a buffer before every forward
        self.teacher = torch.randn(16, 4)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        if unused:
            self.unused = nn.Linear(64, 32)
        if dtype != "float32":
            self.to(getattr(torch, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.hparams.step_data:
            # the batch is a function of (optimizer step, rank, micro-batch) only, so a resumed run
            # sees exactly the data an uninterrupted one sees, whatever the loader's resume rules
            g = torch.Generator().manual_seed(1_000 * self.global_step + 10 * self.global_rank + batch_idx % 8)
            x_host = torch.randn(x.shape, generator=g)
            x, y = x_host.to(x.device), (x_host @ self.teacher).argmax(1).to(y.device)
        x = x.to(self.body[0].weight.dtype)
        loss = F.cross_entropy(self.body(x).float(), y)
        hp = self.hparams
        if self.global_step == hp.bad_step and self.global_rank == hp.bad_rank:
            loss = loss * hp.bad_value
        return loss

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "adamw":  # per-coordinate step sizes: codecs take other defaults
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr / 10)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(self.hparams.samples), batch_size=self.hparams.batch_size)


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in module.parameters()]).clone()


def _tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside a nested dict/list, by path."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().cpu().clone()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


class Recorder(Callback):
    """Records, after every training batch, the weights, residuals and codec state of this rank."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.grads: dict[int, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grads[trainer.global_step] = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().reshape(-1)
                for p in pl_module.parameters()
            ]
        )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        st = trainer.strategy.hook_state
        codec_rank = {k: v for k, v in st.rank_state_dict().items() if k.startswith("codec.")}
        self.rows.append(
            {
                "global_step": trainer.global_step,
                "batch": (trainer.current_epoch, batch_idx, float(batch[0].double().sum())),
                "hook_step": st.step,
                "stage": getattr(trainer.strategy.codec, "stage", lambda step: None)(st.step - 1),  # lgc's
                "weights": flat_params(pl_module),
                "residuals": st.memory.state_dict(),
                "nonfinite_steps": st.nonfinite_steps,
                "codec_state": {**_tensors(st.state_dict()["codec"], "shared"), **_tensors(codec_rank, "rank")},
            }
        )


def lightning_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one Lightning fit on this rank of a process group that ``run_gloo`` started.

    ``LOCAL_RANK`` in the environment tells Lightning the processes exist already, so it launches
    nothing; every rank builds its own strategy, which lets a test give ranks different settings.
    """
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    results = []
    for run in cfg["runs"]:
        results.append(_fit(rank, world, run))
    return to_bytes({"runs": results})


def to_bytes(obj: Any) -> bytes:
    """Tensors cannot cross the result queue of a process that exits at once (torch shares them
    through file descriptors), so results travel serialized."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _fit(rank: int, world: int, run: dict[str, Any]) -> dict[str, Any]:
    codec_options = run.get("codec_options") or {}
    if "rank_options" in run:
        codec_options = {**codec_options, **run["rank_options"][rank]}
    strategy = CompressedDDPStrategy(
        codec=run.get("codec", "topk"),
        codec_options=codec_options,
        nonfinite=run.get("nonfinite", "skip"),
        stats_every=1,
        start_method="popen",
        adaptive_level=run.get("adaptive_level"),
        **run.get("ddp", {}),
    )
    rec = Recorder()
    callbacks: list[Callback] = [rec]
    if run.get("ckpt_dir"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(
            ModelCheckpoint(
                dirpath=run["ckpt_dir"], every_n_train_steps=run.get("ckpt_every", 4), save_top_k=-1, filename="{step}"
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=run.get("max_steps", 8),
        logger=False,
        enable_checkpointing=bool(run.get("ckpt_dir")),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        accumulate_grad_batches=run.get("accumulate", 1),
        precision=run.get("precision", "32-true"),
        deterministic=True,
    )
    model = Net(**run.get("model", {}))
    out: dict[str, Any] = {"error": None}
    try:
        trainer.fit(model, ckpt_path=run.get("ckpt_path"), weights_only=run.get("weights_only"))
        if run.get("second_fit_max_steps"):  # the same trainer and strategy, fitted on for more steps
            trainer.fit_loop.epoch_loop.max_steps = run["second_fit_max_steps"]
            trainer.fit(model)
    except BaseException as err:  # every rank reports its own error
        out["error"] = type(err).__name__
        out["message"] = str(err)
    out["rows"] = rec.rows
    out["grads"] = rec.grads
    out["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    st = strategy.hook_state
    out["hook_step"] = None if st is None else st.step
    out["fallback"] = None if st is None else {**st.fallback.state_dict(), "enabled": st.fallback.enabled}
    out["final"] = flat_params(model)
    out["codec_config"] = strategy.codec.config()
    return out


def all_finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t.float()).all()) for t in tensors.values() if t.is_floating_point())


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


__all__ = [
    "Net",
    "Recorder",
    "lightning_worker",
    "short_options",
    "make_data",
    "flat_params",
    "all_finite",
    "same",
    "math",
]


class DieAt(Callback):
    """Kill this process abruptly (no cleanup, like a crashed node) after optimizer step ``step``."""

    def __init__(self, step: int, stamp: str, hang: bool = False) -> None:
        self.step = step
        self.stamp = stamp
        self.hang = hang

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            with open(self.stamp, "w") as f:
                f.write(repr(time.time()))
            if self.hang:  # alive but silent, like a stalled node: its sockets stay open
                while True:
                    time.sleep(60)
            os._exit(3)


def main(argv: list[str] | None = None) -> None:
    """One rank of a run launched by hand (``subprocess``), used for the killed-rank test."""
    import argparse
    from datetime import timedelta

    from lightning.pytorch.callbacks import ModelCheckpoint

    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=10.0, help="process-group timeout, seconds")
    ap.add_argument("--codec", default="topk")
    ap.add_argument("--die-rank", type=int, default=1)
    ap.add_argument("--die-step", type=int, default=6)
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--hang", action="store_true", help="the failing rank stalls instead of exiting")
    ap.add_argument("--dir", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), LOCAL_RANK=str(a.rank), NODE_RANK="0", WORLD_SIZE=str(a.world)
    )
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=a.dir, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    ]
    if a.rank == a.die_rank:
        callbacks.append(DieAt(a.die_step, os.path.join(a.dir, f"died-{a.rank}"), hang=a.hang))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=a.world,
        strategy=CompressedDDPStrategy(codec=a.codec, timeout=timedelta(seconds=a.timeout), start_method="popen"),
        max_steps=a.max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(Net(samples=4096))


if __name__ == "__main__":
    main()
