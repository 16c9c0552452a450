"""The DDP communication hook that runs any :class:`~lightning_gradcomp.codecs.base.Codec`.

One state object (:class:`CodecHookState`) and one hook function (:func:`codec_hook`), in the
manner of torch's ``powerSGD_hook``. For each bucket DDP hands over, the hook

1. counts optimizer steps (on the bucket with ``is_last()``; hooks do not run inside ``no_sync``,
   so micro-batches of gradient accumulation are not counted);
2. before compression starts (the codec's warm-up, and always the first two steps, during which
   DDP rebuilds its buckets; three with ``static_graph=True``) sends the bucket uncompressed and
   shows each aggregated layer gradient to a learning codec (:mod:`.dense`);
3. otherwise walks the bucket layer by layer (:mod:`.encode`): layers the codec does not compress
   (small ones) are averaged in fp32; each other layer is compensated with its residual, encoded,
   and its new residual staged; the payloads of all layers travel in **one** collective per
   bucket, all-reduce (:mod:`.allreduce`) or all-gather (:mod:`.allgather`) as the codec
   declares, or the codec's own exchange (:mod:`.custom`);
4. decodes once the collective has finished (in a ``.then`` callback that never waits on another
   collective), divides by the world size, and writes the result into the bucket.

With momentum correction (the ``momentum`` harness option, DGC), every layer's gradient first
becomes this rank's velocity, ``u <- momentum * u + g`` (plus weight decay, Nesterov as
``torch.optim.SGD``), on every step and every path; the momentum buffers follow the residuals'
stage/commit rule, and sparsifying codecs zero them where they sent (momentum factor masking).

Every message carries a one-element flag that says whether any rank's bucket held a NaN or an
Inf, so all ranks detect a non-finite gradient together without an extra round trip. Such a
bucket is zeroed on every rank, its residuals are not updated, learned codec state does not see
it, and the state asks the strategy to skip the optimizer step (``nonfinite="skip"``, default),
to step with the zeroed gradient (``"zero"``) or to stop (``"raise"``).
"""

from lightning_gradcomp.hook.consistency import check_codec_consistency, group_device, make_context
from lightning_gradcomp.hook.state import NONFINITE_POLICIES, CodecHookState, codec_hook

__all__ = [
    "CodecHookState",
    "codec_hook",
    "check_codec_consistency",
    "make_context",
    "group_device",
    "NONFINITE_POLICIES",
]
