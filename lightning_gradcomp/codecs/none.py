"""``none``: plain averaging all-reduce, the reference every other codec is measured against.

It is exactly what DDP does without a hook, plus the one-element non-finite flag that every
message of the package carries.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_gradcomp.codecs.base import Codec, EncodeResult, HarnessOptions
from lightning_gradcomp.registry import register_codec


@register_codec("none")
class NoCompression(Codec):
    """No compression. Collective: all-reduce of the raw fp32 (or bucket-dtype) gradient."""

    collective = "allreduce"
    harness_defaults = {"min_numel": 0}

    def check_harness(self, harness: HarnessOptions) -> None:
        if harness.error_feedback:
            raise ValueError("codec 'none' drops nothing, so error_feedback=True has no meaning")

    def is_compressing(self, step: int) -> bool:
        return False  # every step takes the hook's dense path: exactly DDP's averaging all-reduce

    def encode(self, x: Tensor, key: str, param: Tensor, step: int) -> EncodeResult:
        return EncodeResult([x], local=x)

    def decode(self, payload: list[Tensor], ctx: Any, numel: int, count: int) -> Tensor:
        return payload[0]
