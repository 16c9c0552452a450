"""``terngrad``: stochastic ternary gradients (Wen et al., 2017).

Per layer, the gradient is clipped to ``clip`` standard deviations, its scale ``s = max |g|`` is
sent in fp32, and each entry becomes ``s * sign(g) * b`` with ``b ~ Bernoulli(|g| / s)``: unbiased
for the clipped gradient. The ternary values travel five to a byte, as base-3 digits
(:func:`~lightning_gradcomp.codecs.bits.pack_digits`): 1.6 bits a value, 20x fewer bytes than fp32
(the paper's 2-bit field gives 16x; the codes, and so the training, are the same).

Collective: all-gather. Every rank has its own scale, so the ternary codes of different ranks
cannot be summed; sharing one scale (a max all-reduce first) would cost a second round trip and
is known to hurt convergence when done naively.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.codecs.base import Codec, CodecOptions, EncodeResult, check_positive_float, check_seed
from lightning_gradcomp.codecs.bits import pack_digits, unpack_digits
from lightning_gradcomp.codecs.sampling import seeded_generator
from lightning_gradcomp.registry import register_codec


@dataclass(frozen=True)
class TernGradOptions(CodecOptions):
    clip: float = 2.5
    seed: int = 0

    def check(self) -> None:
        note = " (0 disables clipping)"
        self._set("clip", check_positive_float("clip", self.clip, allow_zero=True, allow_inf=True, note=note))
        self._set("seed", check_seed("seed", self.seed))


@register_codec("terngrad")
class TernGradCodec(Codec):
    """TernGrad.

    Args:
        clip: clip each layer at this many standard deviations before ternarizing (the paper's
            2.5); ``0`` disables clipping.
        seed: seed of the stochastic rounding.
    """

    collective = "allgather"
    Options = TernGradOptions
    wire_format = 2  # base-3 digits, five to a byte (1: 2-bit fields)

    def encode(self, x: Tensor, key: str, param: Tensor, step: int) -> EncodeResult:
        if self.options.clip > 0 and x.numel() > 1:
            bound = self.options.clip * x.std()
            x = x.clamp(-bound, bound)
        magnitude = x.abs()  # once: both the scale and the rounding read it
        scale = magnitude.max().reshape(1)
        gen = seeded_generator(self.options.seed, self.rank, step, key, x.device)
        prob = magnitude / scale.clamp_min(torch.finfo(torch.float32).tiny)
        keep = torch.rand(x.shape, generator=gen, device=x.device) < prob
        tern = torch.sign(x).to(torch.int32) * keep
        enc = EncodeResult([scale, pack_digits(tern + 1, 3)])
        enc.local = tern.float() * scale
        return enc

    def decode(self, payload: list[Tensor], ctx: Any, numel: int, count: int) -> Tensor:
        scale, codes = payload
        return (unpack_digits(codes, 3, numel) - 1).float() * scale.float()
