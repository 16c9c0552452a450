"""The custom path: a codec that runs its own exchange (several dependent rounds, or a wrapped
third-party hook) gets the bucket and a :class:`~lightning_gradcomp.codecs.base.RoundContext`."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.codecs.base import MultiRound

__all__ = ["send"]


def send(state, bucket, layers: list, flag: Tensor, step: int) -> torch.futures.Future:
    codec = state.codec
    if not isinstance(codec, MultiRound):
        raise TypeError(f"codec {codec.name!r} declares collective 'custom' but is not a MultiRound codec")
    rc = state.round_context(step, [], [k for k, _, _ in layers])
    return codec.communicate_bucket(bucket, layers, flag, rc)
