"""The uncompressed path: warm-up steps, buckets the fallback sends plainly, and codecs that
never compress. Residuals left from compressed steps are flushed into the bucket, so nothing is
lost, and a learning codec observes the averaged gradients. With ``plain_dtype="bfloat16"`` the
bucket travels in half the bytes and, with error feedback, each rank's rounding error becomes its
residual. With ``deflate`` and two ranks the two messages are compressed without loss and gathered,
and each rank sums them as the all-reduce would have (two addends in the message's dtype: the same
bits whichever rank adds)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.codecs.base import LearnedState
from lightning_gradcomp.comm import DeflatedRows, allgather_deflated_async, allreduce_async, then_like_caller
from lightning_gradcomp.hook.encode import velocity
from lightning_gradcomp.stats import record_bucket
from lightning_gradcomp.timing import Span, clock_for

__all__ = ["send"]


def send(state, buf: Tensor, layers: list, flag: Tensor, step: int) -> torch.futures.Future:
    """Plain averaging all-reduce of the bucket (the flag travels as its last element)."""
    codec, memory, world = state.codec, state.memory, state.world_size
    if codec.harness.momentum:
        for k, g, p in layers:
            g.copy_(velocity(state, k, g.reshape(-1).to(torch.float32), p).view_as(g))
    all_keys = [k for k, _, _ in layers]
    flushed = []
    for k, g, _ in layers:
        if k in memory:  # a residual left from earlier compressed steps travels now
            g.copy_(memory.compensate(k, g.reshape(-1).float()).view_as(g))
            flushed.append(k)
    n = buf.numel()
    plain = getattr(torch, codec.harness.plain_dtype)
    rounded = plain != buf.dtype and buf.dtype == torch.float32
    rounding_keys = []
    if rounded:
        # ``plain_dtype``: each rank's values rounded once, summed in that dtype, averaged in fp32
        # after the sum; with error feedback each rank keeps its own rounding error for the next
        # step. The sum's own rounding, identical on every rank, is not kept: no rank knows it
        msg = torch.empty(n + 1, dtype=plain, device=buf.device)
        msg[:n] = buf.reshape(-1)
        if codec.harness.error_feedback:
            for k, g, _ in layers:
                flat = g.reshape(-1)
                memory.stage(k, flat.float() - flat.to(plain).float())
                rounding_keys.append(k)
    else:
        msg = torch.empty(n + 1, dtype=buf.dtype, device=buf.device)
        torch.div(buf.reshape(-1), world, out=msg[:n])
    msg[n:] = flag
    clock = clock_for(buf.device)
    if world == 2 and state.deflating(msg):
        # a ring all-reduce of N ranks sends 2 (N - 1) / N of the message, a gather of compressed
        # ones N - 1 times their size: the gather sends less for two ranks only
        fut, nbytes = allgather_deflated_async(msg.view(torch.uint8), state.process_group, word=msg.element_size())
        record_bucket(state.stats.add, buf, world, "allgather", nbytes, compressed=False)
    else:
        fut = allreduce_async(msg, state.process_group)
        record_bucket(state.stats.add, buf, world, "allreduce", msg.numel() * msg.element_size(), compressed=False)
    launched = clock.mark()
    observe = [(k, g) for k, g, p in layers if codec.should_compress(k, p)] if isinstance(codec, LearnedState) else []

    def finish(fut: torch.futures.Future) -> Tensor:
        t = state.received(fut, step)
        state.stats.add(comm_s=Span(clock, launched, clock.mark()))
        if isinstance(t, DeflatedRows):
            rows = t.rows().view(msg.dtype)
            t = rows[0] + rows[1]
        # the one host sync of the bucket: whether to keep it is decided on the host
        if float(t[n]) > 0:
            return state.settle(buf, False, rounding_keys or flushed, all_keys)
        if rounded:
            buf.copy_(t[:n].float().div_(world).view_as(buf))
        else:
            buf.copy_(t[:n].view_as(buf))
        if rounding_keys:  # the rounding errors replace whatever residual travelled in the bucket
            state.settle(buf, True, rounding_keys, all_keys)
        else:
            state.settle(buf, True, flushed, all_keys, flushed=True)
        for k, g in observe:
            codec.observe_dense(k, g.reshape(-1), step)
        return buf

    return then_like_caller(fut, finish)
