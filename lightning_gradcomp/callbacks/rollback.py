"""``AccuracyDropRollback``: undo the steps that lost accuracy and compress less from then on.

The recovery action of Wang et al. (HPDC'20): when accuracy drops, lower the compression (theta for
the FFT codec). The callback is written against
:class:`~lightning_gradcomp.codecs.base.AdjustableCompression`, a small protocol any codec can
implement, not against one codec.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gradcomp.codecs.base import AdjustableCompression
from lightning_gradcomp.codecs.options import check_choice, check_fraction, check_positive_float, check_positive_int

__all__ = ["AdjustableCompression", "AccuracyDropRollback"]


class AccuracyDropRollback(Callback):
    """Restore the last good state and lower the compression when a validation metric drops.

    After every validation run (not the sanity check) the monitored metric is compared with its best
    value so far. Rank 0's value is broadcast, so every rank takes the same decision:

    * the metric did not fall more than ``tolerance`` below its best (above, for ``mode="min"``): the
      state is *good*; each rank snapshots (in CPU memory) the model, the optimizers, the codec's
      shared state (``codec.state_dict()``), its residuals and its per-rank codec state;
    * it fell further for ``patience`` checks in a row: every rank restores its snapshot and sets
      ``codec.compression_limit = max(min_level, factor * level)``, where ``level`` is the
      compression level in use before the restore. Repeated rollbacks compound.

    Learning-rate schedulers, the data order and the global step are not rewound: training goes on
    from the restored weights with the schedule where it is. The hook's step counter is kept too.

    Logged: ``gradcomp/rollbacks`` (their number so far) and ``gradcomp/compression_limit``.

    Args:
        monitor: the validation metric (as logged, e.g. ``"val_acc"``). Log it with
            ``sync_dist=True`` for a decision on the global value; the decision itself is rank 0's.
        mode: ``"max"`` (accuracy-like, default) or ``"min"`` (loss-like).
        tolerance: allowed drop from the best value, ``>= 0`` (default 0.02, i.e. 2 points of accuracy
            as a fraction).
        patience: number of consecutive bad checks that trigger a rollback (default 1).
        factor: the compression level is multiplied by this, in ``[0, 1)`` (default 0.5).
        min_level: floor of the lowered level (default 0.0).
        max_rollbacks: stop rolling back after this many (default 10); later drops only warn.

    Raises:
        ValueError: for an invalid argument.

    Example::

        trainer = Trainer(strategy=CompressedDDPStrategy(codec="fft"),
                          callbacks=[ThetaDecay(), AccuracyDropRollback(monitor="val_acc")])
    """

    def __init__(
        self,
        monitor: str = "val_acc",
        mode: str = "max",
        tolerance: float = 0.02,
        patience: int = 1,
        factor: float = 0.5,
        min_level: float = 0.0,
        max_rollbacks: int = 10,
    ) -> None:
        if not isinstance(monitor, str):
            raise ValueError(f"monitor must be a metric's name (a string), got {monitor!r}")
        check_choice("mode", mode, ("min", "max"))
        tolerance = check_positive_float("tolerance", tolerance, allow_zero=True)
        check_positive_int("patience", patience)
        factor = check_fraction("factor", factor, low_open=False, high_open=True)
        min_level = check_fraction("min_level", min_level, low_open=False)
        check_positive_int("max_rollbacks", max_rollbacks, allow_zero=True)
        self.monitor = monitor
        self.mode = mode
        self.tolerance = tolerance
        self.patience = patience
        self.factor = factor
        self.min_level = min_level
        self.max_rollbacks = max_rollbacks
        self.best: float | None = None
        self.bad_checks = 0
        self.rollbacks = 0
        self.last_good_step: int | None = None
        self._snapshot: dict[str, Any] | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, mode=self.mode)

    # ----------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        codec = getattr(trainer.strategy, "codec", None)
        if stage == "fit" and not isinstance(codec, AdjustableCompression):
            rank_zero_warn(
                f"AccuracyDropRollback: the codec {getattr(codec, 'name', None)!r} does not implement "
                "AdjustableCompression; a rollback restores the last good state but cannot lower the compression"
            )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        codec = getattr(trainer.strategy, "codec", None)
        scalars = {"gradcomp/rollbacks": float(self.rollbacks)}
        if isinstance(codec, AdjustableCompression):
            scalars["gradcomp/compression_limit"] = float(codec.compression_limit)
        pl_module.log_dict(scalars, on_step=True, on_epoch=False, batch_size=1, rank_zero_only=True)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.fast_dev_run:
            return
        value = trainer.callback_metrics.get(self.monitor)
        mine = float("nan") if value is None else float(torch.as_tensor(value).float().mean())
        # every rank decides on rank 0's number, so all ranks restore (or not) together
        current = float(trainer.strategy.broadcast(mine, src=0))
        if math.isnan(current):
            rank_zero_warn(f"AccuracyDropRollback: metric {self.monitor!r} not available or NaN; nothing done")
            return
        sign = 1.0 if self.mode == "max" else -1.0
        if self.best is None or sign * (current - self.best) > 0:
            self.best = current
        drop = sign * (self.best - current)
        if drop <= self.tolerance:
            self.bad_checks = 0
            self._take_snapshot(trainer)
            return
        self.bad_checks += 1
        if self.bad_checks < self.patience:
            return
        if self._snapshot is None or self.rollbacks >= self.max_rollbacks:
            rank_zero_warn(
                f"AccuracyDropRollback: {self.monitor}={current:.4g} is {drop:.4g} below its best {self.best:.4g} "
                + ("but no good state was saved yet" if self._snapshot is None else f"after {self.rollbacks} rollbacks")
            )
            return
        self._rollback(trainer, current, drop)

    # ----------------------------------------------------------------------------------------------
    def _take_snapshot(self, trainer: pl.Trainer) -> None:
        strategy = trainer.strategy
        module = trainer.lightning_module
        snap: dict[str, Any] = {
            "model": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
            "optimizers": [_to_cpu(copy.deepcopy(o.state_dict())) for o in trainer.optimizers],
            "step": trainer.global_step,
        }
        hook = getattr(strategy, "hook_state", None)
        if hook is not None:
            snap["hook"] = hook.snapshot()
        self._snapshot = snap
        self.last_good_step = trainer.global_step

    def _rollback(self, trainer: pl.Trainer, current: float, drop: float) -> None:
        strategy = trainer.strategy
        snap = self._snapshot
        assert snap is not None
        hook = getattr(strategy, "hook_state", None)
        codec = getattr(strategy, "codec", None)
        level = float(codec.compression_level) if isinstance(codec, AdjustableCompression) else None
        trainer.lightning_module.load_state_dict(snap["model"])  # copies into the same parameters
        for opt, state in zip(trainer.optimizers, snap["optimizers"]):
            opt.load_state_dict(copy.deepcopy(state))  # moves tensors to the parameters' device
        if hook is not None and "hook" in snap:
            hook.restore(snap["hook"], strategy.root_device)
        new_limit = None
        if level is not None:
            new_limit = max(self.min_level, min(float(codec.compression_limit), self.factor * level))
            codec.compression_limit = new_limit
        self.rollbacks += 1
        self.bad_checks = 0
        rank_zero_info(
            f"AccuracyDropRollback: {self.monitor}={current:.4g} fell {drop:.4g} below its best {self.best:.4g}; "
            f"restored the state of step {snap['step']}"
            + (f" and lowered the compression level {level:.4g} -> {new_limit:.4g}" if new_limit is not None else "")
        )
        if trainer.logger is not None:
            for logger in trainer.loggers:
                metrics = {"gradcomp/rollbacks": float(self.rollbacks)}
                if new_limit is not None:
                    metrics["gradcomp/compression_limit"] = new_limit
                if trainer.is_global_zero:
                    logger.log_metrics(metrics, step=trainer.global_step)

    # ----------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        # the snapshot itself is not saved (it is the size of the model and optimizer); after a
        # resume the next good validation takes a new one
        return {
            "best": self.best,
            "bad_checks": self.bad_checks,
            "rollbacks": self.rollbacks,
            "last_good_step": self.last_good_step,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict["best"]
        self.bad_checks = int(state_dict["bad_checks"])
        self.rollbacks = int(state_dict["rollbacks"])
        self.last_good_step = state_dict.get("last_good_step")


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
