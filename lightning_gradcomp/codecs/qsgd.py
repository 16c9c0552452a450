"""``qsgd``: stochastic uniform quantization onto ``levels`` levels per sign (Alistarh et al., 2017).

Each chunk of ``chunk_size`` entries is sent as its L2 norm (fp32) and, per entry, a sign and a
level ``l`` in ``[0, s]`` drawn so that ``E[norm * sign * l / s] = x`` (unbiased). The signed
levels, ``2s + 1`` symbols, travel as base-``(2s + 1)`` digits, as many to a byte as fit
(:func:`~lightning_gradcomp.codecs.bits.pack_digits`): 1.6 bits a value for ``s = 1``, 2.67 for
``s = 2``, 4 for ``s <= 7``, 8 for ``s <= 127``. We do not apply QSGD's Elias coding of the levels;
the size is fixed so every rank's message has the same size.

Collective: all-gather. Every rank scales by its own norms, so payloads cannot be summed without
decoding; a QSGD inside a ring all-reduce would have to re-quantize at every hop, which changes
the method. Random draws come from a generator seeded by (seed, rank, step, layer), so a resumed
run draws the same numbers as an uninterrupted one.

The number of levels is adjustable (:class:`~lightning_gradcomp.codecs.base.AdjustableLevel`): at
level ``L`` it is ``round(127^(1-L) * levels^L)``, so level 1 is the configured ``levels`` and level
0 is 127 levels, the most 8-bit codes hold. The bytes follow the levels: 4 bits a value up to 7
levels, 8 above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.codecs.base import (
    AdjustableLevel,
    Codec,
    CodecOptions,
    EncodeResult,
    check_positive_int,
    check_seed,
    geometric_level,
)
from lightning_gradcomp.codecs.bits import digits_per_byte, pack_digits, unpack_digits
from lightning_gradcomp.codecs.sampling import seeded_generator
from lightning_gradcomp.registry import register_codec

#: levels at compression level 0: the most that 8-bit signed codes hold
LIGHT_LEVELS = 127


@dataclass(frozen=True)
class QSGDOptions(CodecOptions):
    levels: int = 7
    chunk_size: int = 512
    seed: int = 0

    def check(self) -> None:
        check_positive_int("levels", self.levels)
        if self.levels > 127:
            raise ValueError(f"levels must be <= 127 (8-bit signed levels), got {self.levels}")
        check_positive_int("chunk_size", self.chunk_size)
        self._set("seed", check_seed("seed", self.seed))


@register_codec("qsgd")
class QSGDCodec(AdjustableLevel, Codec):
    """QSGD.

    Args:
        levels: s, the number of quantization levels per sign, 1..127 (default 7: 4 bits).
        chunk_size: entries sharing one norm (default 512, the paper's bucket size).
        seed: seed of the stochastic rounding.
    """

    collective = "allgather"
    Options = QSGDOptions
    wire_format = 2  # base-(2s + 1) digits (1: bit fields of a power-of-two width)

    @property
    def levels(self) -> int:
        """s in use: ``round(127^(1-L) * levels^L)`` at compression level ``L`` (the option at 1)."""
        configured = self.options.levels
        return round(geometric_level(max(LIGHT_LEVELS, configured), configured, self.compression_level))

    @property
    def bits(self) -> float:
        """Bits of one signed level on the wire: 8 over the base-``(2s + 1)`` digits a byte holds
        (1.6 for ``levels=1``, 8 / 3 for 2, 4 up to 7, else 8)."""
        return 8 / digits_per_byte(2 * self.levels + 1)

    def encode(self, x: Tensor, key: str, param: Tensor, step: int) -> EncodeResult:
        n, c = x.numel(), self.options.chunk_size
        pad = (-n) % c
        xc = torch.cat([x, x.new_zeros(pad)]).view(-1, c) if pad else x.view(-1, c)
        # scale by the chunk's largest magnitude first: a plain sum of squares overflows fp32 for
        # entries beyond ~1e19 and the norm would come back inf (and the decode NaN)
        magnitude = xc.abs()  # once: both the scale and the rounding read it
        amax = magnitude.amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        norms = (xc / amax).norm(dim=1) * amax.squeeze(1)
        scaled = magnitude / norms.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1) * self.levels
        gen = seeded_generator(self.options.seed, self.rank, step, key, x.device)
        lower = scaled.floor()
        level = lower + (torch.rand(scaled.shape, generator=gen, device=x.device) < (scaled - lower)).float()
        signed = (torch.sign(xc) * level).reshape(-1)[:n].to(torch.int32)
        codes = pack_digits(signed + self.levels, 2 * self.levels + 1)
        enc = EncodeResult([norms, codes], ctx=None)
        enc.local = self._dequantize(norms, signed, n)
        return enc

    def _dequantize(self, norms: Tensor, signed: Tensor, n: int) -> Tensor:
        c = self.options.chunk_size
        pad = (-n) % c
        s = torch.cat([signed, signed.new_zeros(pad)]) if pad else signed
        return (s.view(-1, c).float() * (norms.unsqueeze(1) / self.levels)).reshape(-1)[:n]

    def decode(self, payload: list[Tensor], ctx: Any, numel: int, count: int) -> Tensor:
        norms, codes = payload
        signed = unpack_digits(codes, 2 * self.levels + 1, numel) - self.levels
        return self._dequantize(norms.float(), signed, numel)
