"""``fp16``: cast to half precision before the all-reduce (torch's ``fp16_compress_hook``).

Collective: all-reduce. Half-precision values can be summed, so the payload travels through a
plain ring all-reduce at half the bytes. Each rank divides by the world size *before* the cast,
as torch's hook does, so the sum cannot overflow fp16's range (65504).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.codecs.base import Codec, EncodeResult
from lightning_gradcomp.registry import register_codec


@register_codec("fp16")
class FP16Codec(Codec):
    """Half-precision all-reduce. Options: the common ones (``min_numel`` defaults to 0)."""

    collective = "allreduce"
    wire_dtype = torch.float16

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("min_numel", 0)
        super().__init__(**kwargs)

    def encode(self, x: Tensor, key: str, param: Tensor, step: int) -> EncodeResult:
        half = (x / self.world_size).to(torch.float16)
        return EncodeResult([half], local=half.to(torch.float32) * self.world_size)

    def decode(self, payload: list[Tensor], ctx: Any, numel: int, count: int) -> Tensor:
        # the payload is the sum of pre-divided values: scale back to a sum of gradients
        return payload[0].to(torch.float32) * self.world_size
