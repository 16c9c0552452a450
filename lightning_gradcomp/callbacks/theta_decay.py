"""``ThetaDecay``: a diminishing schedule for the FFT codec's drop fraction theta.

Wang et al. (HPDC'20) prove convergence with a diminishing compression ratio; the exact schedule of
the paper is not known to us, so the shape is configurable (our choice: cosine by default).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_gradcomp.codecs.base import AdjustableCompression

__all__ = ["ThetaDecay", "SCHEDULES", "theta_at"]

SCHEDULES = ("cosine", "linear", "step")


def theta_at(
    step: int, total: int, start: float, end: float, schedule: str, milestones: Sequence[float] = (0.5, 0.75)
) -> float:
    """theta at optimizer step ``step`` of ``total``: from ``start`` down to ``end``.

    * ``cosine``: ``end + (start - end) (1 + cos(pi t)) / 2`` with ``t = min(step / total, 1)``;
    * ``linear``: ``start + (end - start) t``;
    * ``step``: piecewise constant, dropping by ``(start - end) / len(milestones)`` at each milestone
      (fractions of ``total`` if below 1, else step numbers); ``end`` after the last one.
    """
    t = min(max(step, 0) / max(total, 1), 1.0)
    if schedule == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * t))
    if schedule == "linear":
        return start + (end - start) * t
    passed = sum(1 for m in milestones if step >= (m * total if m < 1 else m))
    return start + (end - start) * passed / len(milestones)


class ThetaDecay(Callback):
    """Lower the FFT codec's theta over the optimizer steps, the same way on every rank.

    theta is set (``codec.set_level``) in ``on_train_batch_start`` from ``trainer.global_step`` (the number of optimizer
    steps taken, identical on all ranks and unchanged by gradient accumulation), so every rank sends
    messages of the same size at every step. The value in use (``codec.compression_level``, which an
    :class:`~lightning_gradcomp.callbacks.AccuracyDropRollback` may have capped) is logged as
    ``gradcomp/theta``.

    Args:
        theta_start: theta at step 0; ``None`` (default) takes the codec's level at the start of fit.
        theta_end: theta at the end of the schedule (default 0.5), ``<= theta_start``.
        schedule: ``"cosine"`` (default), ``"linear"`` or ``"step"``.
        total_steps: steps over which theta goes from start to end; ``None`` (default) uses
            ``trainer.estimated_stepping_batches``.
        milestones: for ``"step"``: when theta drops, as fractions of ``total_steps`` (values < 1)
            or step numbers (default ``(0.5, 0.75)``).

    Raises:
        ValueError: for an invalid argument, or when the codec's level cannot change (at setup).

    Example::

        trainer = Trainer(strategy=CompressedDDPStrategy(codec="fft", codec_options={"theta": 0.95}),
                          callbacks=[ThetaDecay(theta_end=0.6, schedule="step")])
    """

    def __init__(
        self,
        theta_start: float | None = None,
        theta_end: float = 0.5,
        schedule: str = "cosine",
        total_steps: int | None = None,
        milestones: Sequence[float] = (0.5, 0.75),
    ) -> None:
        for name, val in (("theta_start", theta_start), ("theta_end", theta_end)):
            if val is not None and not (isinstance(val, (int, float)) and 0 <= val < 1):
                raise ValueError(f"{name} must be in [0, 1), got {val!r}")
        if theta_start is not None and theta_end > theta_start:
            raise ValueError(f"theta_end ({theta_end}) must not exceed theta_start ({theta_start}): theta diminishes")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
        if total_steps is not None and (
            isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1
        ):
            raise ValueError(f"total_steps must be None or an integer >= 1, got {total_steps!r}")
        milestones = tuple(float(m) for m in milestones)
        if not milestones or any(m <= 0 for m in milestones) or list(milestones) != sorted(milestones):
            raise ValueError(
                f"milestones must be a non-empty increasing sequence of positive numbers, got {milestones!r}"
            )
        self.theta_start = theta_start
        self.theta_end = float(theta_end)
        self.schedule = schedule
        self.total_steps = total_steps
        self.milestones = milestones
        self._start: float | None = None  # resolved theta_start
        self._total: int | None = None  # resolved total_steps
        self.theta: float | None = None  # last value set

    @property
    def state_key(self) -> str:
        return self._generate_state_key(schedule=self.schedule, theta_end=self.theta_end)

    def _codec(self, trainer: pl.Trainer) -> AdjustableCompression:
        codec = getattr(trainer.strategy, "codec", None)
        if not isinstance(codec, AdjustableCompression):
            raise ValueError(
                "ThetaDecay needs a codec whose compression level can change while training "
                f"(AdjustableCompression: codec 'fft'); the strategy's codec is {getattr(codec, 'name', None)!r}"
            )
        return codec

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        codec = self._codec(trainer)
        if self._start is None:
            self._start = float(codec.compression_level) if self.theta_start is None else float(self.theta_start)
            if self.theta_end > self._start:
                rank_zero_warn(
                    f"ThetaDecay: theta_end {self.theta_end} is above the codec's theta {self._start}: theta will rise"
                )
        if self._total is None:
            total = self.total_steps if self.total_steps is not None else trainer.estimated_stepping_batches
            if not math.isfinite(total):
                raise ValueError("ThetaDecay: the number of training steps is unknown; pass total_steps")
            self._total = max(1, int(total))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        codec = self._codec(trainer)
        assert self._start is not None and self._total is not None
        self.theta = theta_at(
            trainer.global_step, self._total, self._start, self.theta_end, self.schedule, self.milestones
        )
        codec.set_level(self.theta)
        pl_module.log(
            "gradcomp/theta",
            float(codec.compression_level),
            on_step=True,
            on_epoch=False,
            batch_size=1,
            rank_zero_only=True,
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"start": self._start, "total": self._total, "theta": self.theta}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._start = state_dict["start"]
        self._total = state_dict["total"]
        self.theta = state_dict["theta"]
