"""Lightning callbacks of the package. Codec-specific ones are imported on first use."""

from __future__ import annotations

import importlib
from typing import Any

from lightning_gradcomp.callbacks.monitor import CompressionMonitor

_LAZY = {
    "PCAWarmup": "lightning_gradcomp.callbacks.pca_warmup",
    "ThetaDecay": "lightning_gradcomp.callbacks.theta_decay",
    "AccuracyDropRollback": "lightning_gradcomp.callbacks.rollback",
    "AutoencoderWarmup": "lightning_gradcomp.callbacks.ae_warmup",
    "CompressionReport": "lightning_gradcomp.callbacks.report",
    "AdaptiveCompression": "lightning_gradcomp.callbacks.adaptive",
}

#: codec name -> the callback that can override its schedule; ``CompressedDDPStrategy`` attaches
#: it (with no arguments it changes nothing; ``AutoencoderWarmup`` prints its end-of-fit summary).
#: The codecs' scalars are logged by ``CompressionMonitor`` (``LearnedState.scalars``).
SCHEDULE_CALLBACKS = {"gradiveq": "PCAWarmup", "lgc": "AutoencoderWarmup"}

__all__ = ["CompressionMonitor", "SCHEDULE_CALLBACKS", "schedule_callbacks", *_LAZY]


def schedule_callbacks(codec: Any) -> list[Any]:
    """The callbacks of ``codec``'s schedule, new instances with default arguments (which leave
    the codec's own settings as they are)."""
    name = SCHEDULE_CALLBACKS.get(codec.name)
    return [] if name is None else [__getattr__(name)()]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
