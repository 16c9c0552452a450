"""Randomness and selection shared by several codecs."""

from __future__ import annotations

import math
import zlib

import torch
from torch import Tensor

__all__ = ["seeded_generator", "select_top", "keep_count"]


def seeded_generator(seed: int, rank: int, step: int, key: str, device: torch.device) -> torch.Generator:
    """A generator whose stream depends only on its arguments (reproducible across resumes)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + rank * 10_007 + step * 101 + zlib.crc32(key.encode())) % (2**63))
    return g


def keep_count(fraction: float, numel: int) -> int:
    """Entries kept when a codec keeps ``fraction`` of ``numel``: ``ceil(fraction * numel)``, at
    least one and at most all. A function of its arguments alone, so equal on every rank."""
    return max(1, min(numel, math.ceil(fraction * numel)))


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
