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
}

__all__ = ["CompressionMonitor", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
