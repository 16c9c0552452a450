"""The layer policy: which parameters travel uncompressed whatever the codec (``dense_layers``).

Resolved once per run against the model's ``named_parameters()`` (:meth:`Codec.plan_layers
<lightning_gradcomp.codecs.base.Codec.plan_layers>` delegates here), before the first step; the
hook then sends those parameters in the fp32 all-reduce with the small layers.
"""

from __future__ import annotations

import fnmatch
from typing import Iterable, Sequence

from torch import Tensor

__all__ = ["AUTO_DENSE_MAX_SHARE", "weight_layer_ends", "plan_layers"]

#: ``dense_layers="auto"`` keeps an end layer dense only up to this share of the parameters
AUTO_DENSE_MAX_SHARE = 0.05


def weight_layer_ends(
    named_parameters: Sequence[tuple[str, Tensor]], max_share: float = AUTO_DENSE_MAX_SHARE
) -> set[str]:
    """Names of the parameters of the first and the last weight layer: the modules (name prefixes)
    that hold the first and the last parameter with two or more dimensions, each only when its
    parameters are at most ``max_share`` of all the given parameters."""
    weights = [n for n, p in named_parameters if p.dim() >= 2]
    if not weights:
        return set()
    total = sum(p.numel() for _, p in named_parameters)
    out: set[str] = set()
    for module in {weights[0].rpartition(".")[0], weights[-1].rpartition(".")[0]}:
        names = {n for n, _ in named_parameters if n.rpartition(".")[0] == module}
        if sum(p.numel() for n, p in named_parameters if n in names) <= max_share * total:
            out |= names
    return out


def plan_layers(patterns: Sequence[str], named_parameters: Iterable[tuple[str, Tensor]]) -> frozenset[str]:
    """Names of the trainable parameters that ``patterns`` (the ``dense_layers`` option: ``"auto"``,
    ``"none"`` or ``fnmatch`` patterns of parameter names) keep dense.

    Raises:
        ValueError: a pattern matches no trainable parameter (the message lists some names).
    """
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    names = [n for n, _ in named]
    dense: set[str] = set()
    for pattern in patterns:
        if pattern == "none":
            continue
        if pattern == "auto":
            dense.update(weight_layer_ends(named))
            continue
        hits = fnmatch.filter(names, pattern)
        if not hits:
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise ValueError(f"dense_layers pattern {pattern!r} matches no trainable parameter (names: {shown})")
        dense.update(hits)
    return frozenset(dense)
