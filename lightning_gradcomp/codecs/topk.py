"""``topk``: keep the largest-magnitude entries of each layer, with error feedback.

Gradient dropping (Aji & Heafield, 2017) with memory (Stich et al., 2018): each rank sends the
``ratio`` fraction of its entries with the largest ``|g + e|`` as (value, int32 index) pairs and
keeps the rest in its residual.

Collective: all-gather. Each rank keeps different positions, so payloads cannot be summed by an
all-reduce; every rank gathers every rank's k pairs and scatter-adds them. A rank then receives
``(N - 1) * k`` pairs, so traffic grows with the number of ranks.

The kept fraction is adjustable (:class:`~lightning_gradcomp.codecs.base.AdjustableLevel`): at level
``L`` it is ``light^(1-L) * ratio^L`` with ``light = max(density_warmup_start, ratio)``, so level 1
keeps ``ratio`` and level 0 the density DGC's warm-up starts from (25 % by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.codecs.base import (
    AdjustableLevel,
    Codec,
    CodecOptions,
    DensityWarmup,
    EncodeResult,
    check_density_warmup,
    check_fraction,
    check_seed,
    geometric_level,
)
from lightning_gradcomp.codecs.sampling import seeded_generator, select_top
from lightning_gradcomp.registry import register_codec


@dataclass(frozen=True)
class TopKOptions(CodecOptions):
    ratio: float = 0.01
    sample_fraction: float = 0.01
    seed: int = 0
    density_warmup: int | float = 0
    density_warmup_start: float = 0.25

    def check(self) -> None:
        self._set("ratio", check_fraction("ratio", self.ratio))
        self._set("sample_fraction", check_fraction("sample_fraction", self.sample_fraction, low_open=False))
        self._set("seed", check_seed("seed", self.seed))
        check_density_warmup(self)


@register_codec("topk")
class TopKCodec(AdjustableLevel, Codec):
    """Top-k sparsification.

    Args:
        ratio: fraction of each layer's entries sent (default 0.01, the common 1% setting).
        sample_fraction: size of the random sample that estimates the selection threshold; the
            selection is exact either way, this only changes speed (0: plain ``torch.topk``).
        seed: seed of that sample.
        density_warmup: DGC's warm-up of sparsity: over this many compressed steps (an int) or
            this fraction of the run (a float in (0, 1)) the kept fraction shrinks exponentially
            from ``density_warmup_start`` to ``ratio`` (see :class:`DensityWarmup`). Default 0: off.
        density_warmup_start: the kept fraction the warm-up starts from (default 0.25, DGC's),
            and the one kept at compression level 0.
        **kwargs: the common codec options; error feedback is on by default. Keeping its residual
            in units of the update (``lr_scaled_feedback=True``) helped only under the level
            controller (ResNet-18, one epoch, seeds 0 / 1: 0.582 / 0.593 against 0.571 / 0.578);
            without it, ``topk``'s default, it gave 0.559 / 0.519 against 0.557 / 0.538
            (docs/benchmarks.md), so ask for both together.
    """

    collective = "allgather"
    Options = TopKOptions
    harness_defaults = {"error_feedback": True}
    sparse_local = True  # momentum factor masking applies

    @property
    def kept_fraction(self) -> float:
        """The fraction kept at the level in use, after any warm-up: ``light^(1-L) * ratio^L``."""
        o = self.options
        return geometric_level(max(o.density_warmup_start, o.ratio), o.ratio, self.compression_level)

    def k_for(self, numel: int, step: int | None = None) -> int:
        """Entries kept of a layer of ``numel`` at ``step`` (``None``: after any warm-up)."""
        return DensityWarmup.of(self.options).kept(numel, self.kept_fraction, step, self)

    def encode(self, x: Tensor, key: str, param: Tensor, step: int) -> EncodeResult:
        k = self.k_for(x.numel(), step)
        # exact top-k, found through a sampled threshold (torch.topk over millions of entries
        # costs more than a step's budget on a CPU core; see sampling.select_top)
        gen = seeded_generator(self.options.seed, self.rank, step, key, x.device)
        idx = select_top(x.abs(), k, self.options.sample_fraction, gen)
        values = x[idx]
        local = torch.zeros_like(x)
        local[idx] = values
        return EncodeResult([values, idx.to(torch.int32)], local=local)

    def error_bound(self, x: Tensor) -> float | None:
        """Exact: the error is the norm of everything but the k largest magnitudes,
        ``sqrt(||x||^2 - sum of the k largest x_i^2)`` (at most ``sqrt(1 - k/n) ||x||``)."""
        sq = x.double().pow(2)
        kept = torch.topk(sq, self.k_for(x.numel())).values.sum()
        return float((sq.sum() - kept).clamp_min(0).sqrt()) * (1 + 1e-9)

    def decode(self, payload: list[Tensor], ctx: Any, numel: int, count: int) -> Tensor:
        out = torch.zeros(numel, dtype=torch.float32, device=payload[0].device)
        out.index_add_(0, payload[1].long(), payload[0].float())
        return out

    def aggregate(self, payloads: Sequence[list[Tensor]], ctx: Any, numel: int) -> Tensor:
        values = torch.cat([p[0] for p in payloads]).float()
        idx = torch.cat([p[1] for p in payloads]).long()
        return torch.zeros(numel, dtype=torch.float32, device=values.device).index_add_(0, idx, values)
