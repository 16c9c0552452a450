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
    harness_defaults = {"min_numel": 0}

    def encode(self, x: Tensor, key: str, param: Tensor, step: int) -> EncodeResult:
        half = (x / self.world_size).to(torch.float16)
        return EncodeResult([half], local=half.to(torch.float32) * self.world_size)

    def error_bound(self, x: Tensor) -> float | None:
        """Round to nearest in fp16: each entry is off by at most 2^-11 of itself (11-bit
        significand), or by half the subnormal spacing (2^-25, scaled back by the world size) for
        values below fp16's normal range. Beyond fp16's range (65504) the value overflows: no bound
        (the hook then finds a non-finite sum and handles the step as non-finite)."""
        w = float(self.world_size)
        if x.numel() and float(x.abs().max()) / w > 65504.0:
            return float("inf")
        # 2^-22: the fp32 division and multiplication around the cast
        per = torch.maximum(
            x.double().abs() * (2.0**-11 + 2.0**-22), torch.full_like(x, 2.0**-25 * w, dtype=torch.float64)
        )
        return float(per.norm())

    def decode(self, payload: list[Tensor], ctx: Any, numel: int, count: int) -> Tensor:
        # the payload is the sum of pre-divided values: scale back to a sum of gradients
        return payload[0].to(torch.float32) * self.world_size
