"""``none``: plain averaging all-reduce, the reference every other codec is measured against.

It is exactly what DDP does without a hook, plus the one-element non-finite flag that every
message of the package carries.
"""

from __future__ import annotations

from typing import Any

from lightning_gradcomp.codecs.base import Codec
from lightning_gradcomp.registry import register_codec


@register_codec("none")
class NoCompression(Codec):
    """No compression. Collective: all-reduce of the raw fp32 (or bucket-dtype) gradient."""

    collective = "allreduce"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("min_numel", 0)
        super().__init__(**kwargs)
        if self.error_feedback:
            raise ValueError("codec 'none' drops nothing, so error_feedback=True has no meaning")

    def is_compressing(self, step: int) -> bool:
        return False
