"""``randk``: random-k sparsification on positions every rank draws alike, summed by all-reduce.

Each step every rank keeps the same ``k = ceil(ratio * n)`` random positions of a layer, drawn
from a generator seeded by (``seed``, step, layer name) alone, so the positions never travel and
the k values sum in a plain all-reduce (Stich et al. 2018, "Sparsified SGD with memory"). What is
not sent stays in the error-feedback residual (on by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.codecs.base import Codec, CodecOptions, EncodeResult, check_fraction, check_seed
from lightning_gradcomp.codecs.sampling import keep_count, seeded_generator
from lightning_gradcomp.registry import register_codec


@dataclass(frozen=True)
class RandKOptions(CodecOptions):
    ratio: float = 0.01  # fraction of each layer's entries sent
    seed: int = 0  # of the positions; the same on every rank

    def check(self) -> None:
        self._set("ratio", check_fraction("ratio", self.ratio))
        self._set("seed", check_seed("seed", self.seed))


@register_codec("randk")
class RandKCodec(Codec):
    """Random-k. Collective: all-reduce (the positions are shared, so the values sum)."""

    collective = "allreduce"
    Options = RandKOptions
    harness_defaults = {"error_feedback": True}
    sparse_local = True  # momentum factor masking applies

    def encode(self, x: Tensor, key: str, param: Tensor, step: int) -> EncodeResult:
        # rank 0 for every rank: one stream, the same positions everywhere
        gen = seeded_generator(self.options.seed, 0, step, key, x.device)
        k = keep_count(self.options.ratio, x.numel())
        idx = torch.randperm(x.numel(), generator=gen, device=x.device)[:k]
        values = x[idx]
        return EncodeResult([values], local=torch.zeros_like(x).index_put_((idx,), values), ctx=idx)

    def decode(self, payload: list[Tensor], ctx: Any, numel: int, count: int) -> Tensor:
        return torch.zeros(numel, dtype=torch.float32, device=payload[0].device).index_put_((ctx,), payload[0])
