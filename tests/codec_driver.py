"""Drive one codec on one layer, single process, in the order the hook calls it.

Dense steps show the codec the averaged gradient (``observe_dense``); compressing steps run the
codec's own rounds (``prepare_bucket``), ``encode`` and the decode of the collective it declares for
that step (``decode`` of the sum or ``aggregate`` of the gathered payloads); every step ends with
``on_step_end``. A ``custom`` codec gets a one-rank gloo group and a bucket-like object.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.codecs.base import Codec, CodecContext, EncodeResult, LearnedState, MultiRound, RoundContext


class LayerBucket:
    """The parts of ``torch.distributed.GradBucket`` that a codec's own protocol reads: one flat
    buffer holding the gradients of ``params``, in their order."""

    def __init__(self, buffer: Tensor, params: list[Tensor]) -> None:
        self._buffer, self._params = buffer, params

    def buffer(self) -> Tensor:
        return self._buffer

    def gradients(self) -> list[Tensor]:
        sizes = [p.numel() for p in self._params]
        return [g.view(p.shape) for g, p in zip(self._buffer.split(sizes), self._params)]

    def parameters(self) -> list[Tensor]:
        return self._params

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def one_rank_group() -> None:
    """A one-rank gloo group for codecs that run collectives themselves (torch's PowerSGD)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def set_up(codec: Codec) -> Codec:
    if codec.collective == "custom":
        one_rank_group()
    codec.setup(CodecContext(0, 1, torch.device("cpu")))
    return codec


def round_trip(
    codec: Codec, x: Tensor, key: str, param: Tensor, step: int, rc: RoundContext | None = None
) -> tuple[EncodeResult | None, Tensor]:
    """One compressing step: ``(encoding, what the other ranks decode from this payload alone)``.
    ``rc``: the step's round context (its statistics sink, whether it may be skipped), if not a plain one."""
    rc = RoundContext(step, codec.context) if rc is None else rc
    if codec.collective_at(step) == "custom":
        assert isinstance(codec, MultiRound)
        grad = x.clone()
        fut = codec.communicate_bucket(LayerBucket(grad, [param]), [(key, grad, param)], torch.zeros(1), rc)
        return None, fut.wait().reshape(-1)
    if isinstance(codec, MultiRound):
        prepared = codec.prepare_bucket([(key, x, param)], rc).per_layer.get(key)
        enc = codec.encode(x, key, param, step, prepared=prepared)
    else:
        enc = codec.encode(x, key, param, step)
    payload = [p.clone() for p in enc.payload]
    if codec.collective_at(step) == "allreduce":
        return enc, codec.decode(payload, enc.ctx, x.numel(), 1)
    return enc, codec.aggregate([payload], enc.ctx, x.numel())


def warm_up(codec: Codec, x: Tensor, key: str, param: Tensor, ready: Callable[[Codec, int], bool]) -> int:
    """Run steps until ``ready(codec, step)`` holds on a compressing step; return that step."""
    for step in range(200):
        compressing = step >= 2 and codec.is_compressing(step)
        if compressing and ready(codec, step):
            return step
        if compressing:
            round_trip(codec, x, key, param, step)
        elif isinstance(codec, LearnedState):
            codec.observe_dense(key, x, step)
        if isinstance(codec, LearnedState):
            codec.on_step_end(step)
    raise AssertionError(f"codec {codec.name!r} never reached its compressing phase")
