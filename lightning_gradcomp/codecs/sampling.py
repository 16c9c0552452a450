"""Randomness and selection shared by several codecs, and DGC's warm-up of the kept fraction."""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_gradcomp.codecs.options import CodecOptions, check_fraction, check_run_steps, run_steps

if TYPE_CHECKING:
    from lightning_gradcomp.codecs.base import Codec

__all__ = ["seeded_generator", "select_top", "keep_count", "DensityWarmup", "check_density_warmup"]


def seeded_generator(seed: int, rank: int, step: int, key: str, device: torch.device) -> torch.Generator:
    """A generator whose stream depends only on its arguments (reproducible across resumes)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + rank * 10_007 + step * 101 + zlib.crc32(key.encode())) % (2**63))
    return g


def keep_count(fraction: float, numel: int) -> int:
    """Entries kept when a codec keeps ``fraction`` of ``numel``: ``ceil(fraction * numel)``, at
    least one and at most all. A function of its arguments alone, so equal on every rank."""
    return max(1, min(numel, math.ceil(fraction * numel)))


def named_count(k: int, world: int) -> int:
    """Positions each of ``world`` ranks names on a union support of ``k``: ``ceil(k / world)``,
    so that the union holds at most about ``k``, and exactly ``k`` names when no two ranks agree."""
    return -(-k // world)


def select_top(s: Tensor, k: int, sample_fraction: float = 0.01, generator: torch.Generator | None = None) -> Tensor:
    """Sorted positions of the ``k`` largest entries of ``s`` (int64, exactly ``k`` of them).

    Exact top-k over millions of values costs more than a step's budget, so a threshold ``t`` is
    estimated from a random sample (as in DGC) so that somewhat more than ``k`` entries pass,
    then ``s >= t`` gives the candidates and an exact top-k among those fixes the count. When at
    least ``k`` entries pass, the candidates contain the true top ``k``, so the result is the same
    as exact top-k (up to ties); when fewer pass (an unlucky sample, NaN), exact top-k runs.

    On CUDA the exact ``torch.topk`` runs directly and ``sample_fraction`` and ``generator`` are
    not used: counting the candidates needs their number on the host (a sync per call), while
    ``torch.topk`` is fast on a GPU and never waits. The positions are the same up to ties.
    """
    n = s.numel()
    if k >= n:
        return torch.arange(n, device=s.device)
    if s.is_cuda:
        return torch.topk(s, k, sorted=False).indices.sort().values
    m = math.ceil(sample_fraction * n) if sample_fraction > 0 else 0
    if m >= 1024 and m < n:
        # aim at k + 25% + 4 sigma of the sampling noise of the count above the threshold
        target = min(n, math.ceil(1.25 * k + 4.0 * math.sqrt(k)))
        j = max(1, min(m, round(m * target / n)))  # rank from the top inside the sample
        gen_device = generator.device if generator is not None else s.device
        sample = s[torch.randint(n, (m,), device=gen_device, generator=generator).to(s.device)]
        t = sample.kthvalue(m - j + 1).values
        cand = torch.nonzero(s >= t).squeeze(1)
        c = cand.numel()
        if c >= k:
            if c > k:  # keep the k largest candidates, in position order (no sort needed)
                vals = s[cand]
                v = vals.kthvalue(c - k + 1).values  # the k-th largest value
                above = vals > v
                tied = vals == v  # ties at v: the first ones by position fill the count
                cand = cand[above | (tied & (tied.cumsum(0) <= k - int(above.sum())))]
            return cand
    return torch.topk(s, k, sorted=False).indices.sort().values


class DensityWarmup:
    """DGC's warm-up of sparsity for codecs that keep a fraction of the entries (``topk``, ``iwp``).

    For the first ``steps`` compressed steps the kept fraction shrinks exponentially from ``start``
    to the codec's own fraction: ``start ** (1 - t) * target ** t`` with ``t`` the share of the
    warm-up done (DGC: 25 %, 6.25 %, 1.56 %, 0.4 %, 0.1 % over four epochs). It is a function of the
    step alone, so every rank keeps the same number of entries. ``steps`` may be a fraction of the
    run (see :func:`run_steps`, capped at ``cap``); 0 turns it off. A codec that offers it declares
    the options ``density_warmup`` and ``density_warmup_start`` and checks them with
    :func:`check_density_warmup`.
    """

    def __init__(self, steps: int | float, start: float, cap: int = 2000) -> None:
        self.steps = check_run_steps("density_warmup", steps)
        self.start = check_fraction("density_warmup_start", start)
        self.cap = cap

    @classmethod
    def of(cls, options: Any) -> DensityWarmup:
        return cls(options.density_warmup, options.density_warmup_start)

    def length(self, total_steps: int | None) -> int:
        """The warm-up's steps in a run of ``total_steps`` (``None``: unknown, the cap applies)."""
        return run_steps(self.steps, total_steps, self.cap)

    def fraction(self, target: float, step: int, first_step: int, total_steps: int | None) -> float:
        """The kept fraction at optimizer ``step`` for a codec whose own fraction is ``target``."""
        length = self.length(total_steps)
        if length <= 0 or self.start <= target or step >= first_step + length:
            return target
        t = max(0.0, (step - first_step) / length)
        return self.start ** (1.0 - t) * target**t

    def kept(self, numel: int, target: float, step: int | None, codec: Codec) -> int:
        """Entries ``codec`` keeps of a layer of ``numel`` at ``step`` (``None``: after the warm-up)."""
        if step is not None:
            target = self.fraction(target, step, codec.harness.start_step, codec.run_total_steps)
        return keep_count(target, numel)


def check_density_warmup(options: CodecOptions) -> None:
    """Check and normalise the ``density_warmup`` and ``density_warmup_start`` options."""
    warmup = DensityWarmup.of(options)
    options._set("density_warmup", warmup.steps)
    options._set("density_warmup_start", warmup.start)
