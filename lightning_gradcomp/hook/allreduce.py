"""The all-reduce path: payloads that sum (linear codecs) travel in one ring all-reduce per
bucket, with the dense layers and the non-finite flag, in the codec's wire dtype.

A codec's integer parts (packed fields of integer levels, whose sums must stay exact to the bit)
travel in a second all-reduce of int64, launched from the hook right after the first: an fp32
word holds integers exactly only below ``2^24``, an int64 word below ``2^63``, so integer parts
would lose bits or space in the wire dtype. Both collectives are launched here, in the same order
on every rank, and the decode waits for both in one callback (never inside another collective's
callback)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.comm import allreduce_async, then_like_caller
from lightning_gradcomp.hook.encode import Encoded, holds_nonfinite
from lightning_gradcomp.timing import Span

__all__ = ["send"]


def _is_integer(t: Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex())


def send(state, buf: Tensor, enc: Encoded, flag: Tensor, step: int) -> torch.futures.Future:
    codec, world, dtype = state.codec, state.world_size, state.codec.wire_dtype
    parts = enc.payload()
    floats = [t.reshape(-1).to(dtype) for t in parts if not _is_integer(t)]
    msg = torch.cat(floats + [enc.dense.to(dtype), flag.to(dtype)])
    ints = [t.reshape(-1).to(torch.int64) for t in parts if _is_integer(t)]
    words = torch.cat(ints) if ints else None
    nbytes = msg.numel() * msg.element_size()
    fut = allreduce_async(msg, state.process_group)
    if words is not None:
        nbytes += words.numel() * words.element_size()
        fut = torch.futures.collect_all([fut, allreduce_async(words, state.process_group)])
    enc.t1 = enc.clock.mark()
    enc.record(state, buf, "allreduce", nbytes)

    def finish(fut: torch.futures.Future) -> Tensor:
        t2 = enc.clock.mark()
        state.stats.add(comm_s=Span(enc.clock, enc.t1, t2))
        t = state.received(fut, step)
        w = None
        if words is not None:  # collect_all resolves to the two futures, each checked for its error
            t, w = (state.received(f, step) for f in t)
        # every rank received the same sum, so checking it decides identically everywhere: this
        # also catches an overflow of a narrow wire format (fp16 beyond 65504). The bucket's one
        # host sync: keeping or discarding it is decided on the host.
        if bool((t[-1] > 0).logical_or(holds_nonfinite(t))):
            return enc.settle(state, buf, keep=False)
        off = woff = 0
        for i, ((_, g, x), e) in enumerate(zip(enc.inputs, enc.encoded)):
            summed = []
            for part in e.payload:
                if _is_integer(part):
                    summed.append(w[woff : woff + part.numel()].view(part.shape).to(part.dtype))
                    woff += part.numel()
                else:
                    summed.append(t[off : off + part.numel()].view(part.shape).to(part.dtype))
                    off += part.numel()
            total = enc.unscale(i, codec.decode(summed, e.ctx, x.numel(), world))
            torch.div(total.view_as(g), world, out=g)  # the mean, written into the bucket in one pass
        enc.write_dense(t[off : off + enc.dense.numel()].float())
        state.stats.add(decode_s=Span(enc.clock, t2, enc.clock.mark()))
        return enc.settle(state, buf, keep=True)

    return then_like_caller(fut, finish)
