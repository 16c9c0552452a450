"""The shared base of the callbacks that override a learned codec's warm-up lengths."""

from __future__ import annotations

from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

__all__ = ["ScheduleOverride"]


class ScheduleOverride(Callback):
    """Replace some of a codec's schedule options (warm-up lengths) before training starts.

    :meth:`setup` runs on every rank before the strategy registers its hook, so every rank runs
    the same schedule and the strategy's cross-rank check of the codec's options compares the new
    values. Options given as ``None`` keep the codec's own. The codec reports its schedule and
    what it learned itself (:meth:`~lightning_gradcomp.codecs.base.LearnedState.scalars`, logged
    by :class:`~lightning_gradcomp.callbacks.CompressionMonitor`): a subclass logs nothing.

    Subclasses (:class:`~lightning_gradcomp.callbacks.AutoencoderWarmup`,
    :class:`~lightning_gradcomp.callbacks.PCAWarmup`) keep their own names and explicit arguments,
    which YAML configs (``class_path`` and ``init_args``) are checked against.
    """

    #: the registered name of the codec this callback configures
    codec_name: ClassVar[str] = ""
    #: the codec options it may override, held as attributes of the same names (``None``: keep)
    schedule_options: ClassVar[tuple[str, ...]] = ()
    #: with another codec: ``"raise"`` a ``ValueError``, or ``"warn"`` once and do nothing
    other_codec: ClassVar[str] = "warn"

    @classmethod
    def codec_type(cls) -> type:
        """The codec class this callback configures (imported on first use)."""
        raise NotImplementedError

    @classmethod
    def _codec(cls, trainer: pl.Trainer) -> Any:
        codec = getattr(trainer.strategy, "codec", None)
        return codec if isinstance(codec, cls.codec_type()) else None

    def _check_overrides(self) -> None:
        """Check the given values as the codec checks its own options (its ``Options`` with these
        values and the defaults for the rest), so that the callback takes what the codec takes (a
        fraction of the run where the codec does) and refuses it with the codec's message."""
        self.codec_type().Options(**self.overrides())

    def overrides(self) -> dict[str, Any]:
        """The options this callback replaces: those given, not ``None``."""
        given = {name: getattr(self, name) for name in self.schedule_options}
        return {k: v for k, v in given.items() if v is not None}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        codec = self._codec(trainer)
        if codec is None:
            if self.other_codec == "raise":
                raise ValueError(
                    f"{type(self).__name__} needs CompressedDDPStrategy(codec={self.codec_name!r}); "
                    f"the strategy is {type(trainer.strategy).__name__} "
                    f"with codec {getattr(trainer.strategy, 'codec', None)!r}"
                )
            rank_zero_warn(
                f"{type(self).__name__} only acts on CompressedDDPStrategy(codec={self.codec_name!r}); "
                "it does nothing here"
            )
            return
        overrides = self.overrides()
        if overrides:
            codec.replace_options(**overrides)
