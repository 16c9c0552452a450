"""Drives and reports the warm-up and refresh windows of the ``gradiveq`` codec."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_gradcomp.codecs.base import check_positive_int

__all__ = ["PCAWarmup"]


class PCAWarmup(Callback):
    """Configure the PCA warm-up of ``CompressedDDPStrategy(codec="gradiveq")`` and log its state.

    The codec itself switches phases on the optimizer step that the communication hook counts
    (the same step on every rank): ``warmup_steps`` uncompressed steps whose aggregated gradients
    are sampled, a fit of the bases (``torch.linalg.eigh`` in float64, verified identical across
    ranks), compression, and every ``refresh_every`` compressed steps a window of
    ``refresh_window`` uncompressed steps followed by a refit. This callback

    - overrides those three numbers when given (before the strategy registers its hook, so every
      rank runs the same schedule and the codec's configuration check still compares them);
    - logs after every optimizer step ``gradcomp/pca_phase`` (0 warm-up, 1 compressing,
      2 refresh window), ``gradcomp/pca_k`` (mean number of components kept per basis, 0 before
      the first fit) and ``gradcomp/explained_variance`` (mean fraction of the sampled gradient
      energy the bases capture).

    With another codec it warns once and does nothing.

    Args:
        warmup_steps: override the codec's ``warmup_steps`` (>= 1).
        refresh_every: override ``refresh_every`` (>= 0; 0 never refits).
        refresh_window: override ``refresh_window`` (>= 1).
    """

    def __init__(
        self, warmup_steps: int | None = None, refresh_every: int | None = None, refresh_window: int | None = None
    ) -> None:
        if warmup_steps is not None:
            check_positive_int("warmup_steps", warmup_steps)
        if refresh_every is not None:
            check_positive_int("refresh_every", refresh_every, allow_zero=True)
        if refresh_window is not None:
            check_positive_int("refresh_window", refresh_window)
        self.warmup_steps = warmup_steps
        self.refresh_every = refresh_every
        self.refresh_window = refresh_window

    @staticmethod
    def _codec(trainer: pl.Trainer) -> Any:
        from lightning_gradcomp.codecs.gradiveq import GradiVeQCodec

        codec = getattr(trainer.strategy, "codec", None)
        return codec if isinstance(codec, GradiVeQCodec) else None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        codec = self._codec(trainer)
        if codec is None:
            rank_zero_warn("PCAWarmup only acts on CompressedDDPStrategy(codec='gradiveq'); it does nothing here")
            return
        # runs on every rank before the strategy registers the hook (and compares codec options)
        given = {"warmup_steps": self.warmup_steps, "refresh_every": self.refresh_every}
        given["refresh_window"] = self.refresh_window
        codec.replace_options(**{k: v for k, v in given.items() if v is not None})

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        from lightning_gradcomp.codecs.gradiveq import PHASES

        codec = self._codec(trainer)
        state = getattr(trainer.strategy, "hook_state", None)
        if codec is None or state is None or state.step == 0:
            return
        step = state.step - 1  # the optimizer step that just communicated
        phase = codec.phase_at(step)
        if phase == "compress" and not state.compressing(step):  # no basis yet, or DDP's first steps
            phase = "warmup"
        pl_module.log_dict(
            {
                "gradcomp/pca_phase": float(PHASES[phase]),
                "gradcomp/pca_k": float(codec.k),
                "gradcomp/explained_variance": float(codec.explained_variance),
            },
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )
