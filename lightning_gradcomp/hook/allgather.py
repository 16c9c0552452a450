"""The all-gather path: payloads that do not sum (each rank keeps its own positions or scales)
are packed into one byte message per rank, gathered (compressed without loss with ``deflate``),
and aggregated by the codec."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.comm import (
    DeflatedRows,
    allgather_async,
    allgather_deflated_async,
    pack,
    then_like_caller,
    unpack,
)
from lightning_gradcomp.hook.encode import Encoded, holds_nonfinite
from lightning_gradcomp.timing import Span

__all__ = ["send"]


def send(state, buf: Tensor, enc: Encoded, flag: Tensor, step: int) -> torch.futures.Future:
    codec, world = state.codec, state.world_size
    dense = enc.dense.to(getattr(torch, codec.harness.dense_dtype))
    msg, layout = pack(enc.payload() + [dense, flag], buf.device)
    if state.deflating(msg):
        # words of 2 bytes: a bfloat16 value's sign and exponent byte, or an fp32 value's upper half
        fut, nbytes = allgather_deflated_async(msg, state.process_group, word=2)
    else:
        fut, nbytes = allgather_async(msg, state.process_group), layout.payload_bytes
    enc.t1 = enc.clock.mark()
    enc.record(state, buf, "allgather", nbytes)

    def finish(fut: torch.futures.Future) -> Tensor:
        t2 = enc.clock.mark()
        state.stats.add(comm_s=Span(enc.clock, enc.t1, t2))
        gathered = state.received(fut, step)
        if isinstance(gathered, DeflatedRows):
            gathered = gathered.rows()
        rows = [unpack(r, layout) for r in gathered]
        # host sync 1 of 2: every rank's flag, before any decode sees a non-finite payload
        if bool(torch.stack([r[-1][0] for r in rows]).sum() > 0):
            return enc.settle(state, buf, keep=False)
        off = 0
        for i, ((_, g, x), e) in enumerate(zip(enc.inputs, enc.encoded)):
            m = len(e.payload)
            total = enc.unscale(i, codec.aggregate([r[off : off + m] for r in rows], e.ctx, x.numel()))
            torch.div(total.view_as(g), world, out=g)  # the mean, written into the bucket in one pass
            off += m
        if enc.dense_grads:
            enc.write_dense(torch.stack([r[-2].float() for r in rows]).sum(0))
        # host sync 2 of 2: an overflow in decoding; decoded from identical rows, so the verdict
        # is the same everywhere
        if bool(holds_nonfinite(buf)):
            return enc.settle(state, buf, keep=False)
        state.stats.add(decode_s=Span(enc.clock, t2, enc.clock.mark()))
        return enc.settle(state, buf, keep=True)

    return then_like_caller(fut, finish)
