"""Overrides the warm-up and refresh windows of the ``gradiveq`` codec."""

from __future__ import annotations

from lightning_gradcomp.callbacks.schedule import ScheduleOverride

__all__ = ["PCAWarmup"]


class PCAWarmup(ScheduleOverride):
    """Configure the PCA warm-up of ``CompressedDDPStrategy(codec="gradiveq")``.

    The codec itself switches phases on the optimizer step that the communication hook counts
    (the same step on every rank): ``warmup_steps`` uncompressed steps whose aggregated gradients
    are sampled, a fit of the bases (``torch.linalg.eigh`` in float64, verified identical across
    ranks), compression, and every ``refresh_every`` compressed steps a window of
    ``refresh_window`` uncompressed steps followed by a refit. This callback overrides those three
    numbers when given (before the strategy registers its hook, so every rank runs the same
    schedule and the codec's configuration check still compares them).

    It logs nothing: the codec reports ``gradcomp/pca_phase`` (0 warm-up, 1 compressing,
    2 refresh window), ``gradcomp/pca_k`` (mean number of components kept per basis, 0 before the
    first fit) and ``gradcomp/explained_variance`` (mean fraction of the sampled gradient energy
    the bases capture) itself (:meth:`~lightning_gradcomp.codecs.gradiveq.GradiVeQCodec.scalars`),
    and :class:`~lightning_gradcomp.callbacks.CompressionMonitor` logs them, with or without this
    callback.

    With another codec it warns once and does nothing.

    Args:
        warmup_steps: override the codec's ``warmup_steps``: steps (>= 1) or, as the codec takes
            it, a fraction of the run in ``(0, 1)``.
        refresh_every: override ``refresh_every`` (>= 0; 0 never refits).
        refresh_window: override ``refresh_window`` (>= 1).
    """

    codec_name = "gradiveq"
    schedule_options = ("warmup_steps", "refresh_every", "refresh_window")
    other_codec = "warn"

    def __init__(
        self,
        warmup_steps: int | float | None = None,
        refresh_every: int | None = None,
        refresh_window: int | None = None,
    ) -> None:
        self.warmup_steps = warmup_steps
        self.refresh_every = refresh_every
        self.refresh_window = refresh_window
        self._check_overrides()

    @classmethod
    def codec_type(cls) -> type:
        from lightning_gradcomp.codecs.gradiveq import GradiVeQCodec

        return GradiVeQCodec
