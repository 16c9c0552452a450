"""The all-reduce path: payloads that sum (linear codecs) travel in one ring all-reduce per
bucket, with the dense layers and the non-finite flag, in the codec's wire dtype."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.comm import allreduce_async, then_like_caller
from lightning_gradcomp.hook.encode import Encoded, holds_nonfinite
from lightning_gradcomp.timing import Span

__all__ = ["send"]


def send(state, buf: Tensor, enc: Encoded, flag: Tensor, step: int) -> torch.futures.Future:
    codec, world, dtype = state.codec, state.world_size, state.codec.wire_dtype
    msg = torch.cat([t.reshape(-1).to(dtype) for t in enc.payload()] + [enc.dense.to(dtype), flag.to(dtype)])
    nbytes = msg.numel() * msg.element_size()
    fut = allreduce_async(msg, state.process_group)
    enc.t1 = enc.clock.mark()
    enc.record(state, buf, "allreduce", nbytes)

    def finish(fut: torch.futures.Future) -> Tensor:
        t2 = enc.clock.mark()
        state.stats.add(comm_s=Span(enc.clock, enc.t1, t2))
        t = state.received(fut, step)
        # every rank received the same sum, so checking it decides identically everywhere: this
        # also catches an overflow of a narrow wire format (fp16 beyond 65504). The bucket's one
        # host sync: keeping or discarding it is decided on the host.
        if bool((t[-1] > 0).logical_or(holds_nonfinite(t))):
            return enc.settle(state, buf, keep=False)
        off = 0
        for i, ((_, g, x), e) in enumerate(zip(enc.inputs, enc.encoded)):
            summed = []
            for part in e.payload:
                summed.append(t[off : off + part.numel()].view(part.shape).to(part.dtype))
                off += part.numel()
            g.copy_(enc.unscale(i, codec.decode(summed, e.ctx, x.numel(), world)).div_(world).view_as(g))
        enc.write_dense(t[off : off + enc.dense.numel()].float())
        state.stats.add(decode_s=Span(enc.clock, t2, enc.clock.mark()))
        return enc.settle(state, buf, keep=True)

    return then_like_caller(fut, finish)
