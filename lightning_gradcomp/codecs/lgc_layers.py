"""What ``lgc`` hands from a bucket's first round to each layer's ``encode``, ``decode`` and
``aggregate``: the types that the leader's support (``lgc.py``) and the union support
(``lgc_union.py``) share."""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor

__all__ = ["LayerContext", "LayerPrepared", "TERNARY", "TernaryLayer"]


class LayerPrepared(NamedTuple):
    """What :meth:`~lightning_gradcomp.codecs.lgc.LGCCodec.prepare_bucket` hands to ``encode`` for
    one layer."""

    support: Tensor  # the leader's positions (a union support: every rank's), sorted
    scale: Tensor | float  # the AE's input scale (the leader's RMS); 1.0 otherwise
    leader_latent: Tensor | None  # "ps": the leader's latent
    coded: bool  # the learned code carries the layer this step
    own_code: Any  # the leader's own code, computed for the run-time guard (reused by encode)
    named: Tensor | None = None  # a union support: (N, K) mask, True where that rank named the position
    size: int = 0  # a union support: the support's configured size k (it picks the levels' table)
    slots: tuple[list[Tensor], list[Tensor]] | None = None  # a union support in stage 3: union_slots
    per: int = 0  # entries a channel where the messages scale by channel (light_scale); 0: by message


class LayerContext(NamedTuple):
    """A layer's decode context."""

    support: Tensor
    scale: Tensor | float
    leader_latent: Tensor | None
    step: int
    key: str
    coded: bool
    named: Tensor | None = None
    size: int = 0
    slots: tuple[list[Tensor], list[Tensor]] | None = None
    per: int = 0


class TernaryLayer:
    """A layer of stage 1 with ``warmup_codec="terngrad"``: its ``prepared`` and its decode context
    (TernGrad needs nothing beyond the payload)."""

    __slots__ = ()


TERNARY = TernaryLayer()
