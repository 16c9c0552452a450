"""Codecs for plain PyTorch ``DistributedDataParallel`` (and Lightning Fabric), outside the strategy."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.codecs.base import Codec
from lightning_gradcomp.hook import CodecHookState, codec_hook
from lightning_gradcomp.registry import resolve_codec

__all__ = ["make_comm_hook"]


def make_comm_hook(
    codec: str | Codec,
    model: torch.nn.Module | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    static_graph: bool = False,
    stats_every: int = 10,
    nonfinite: str = "zero",
    fallback: bool | None = None,
    total_steps: int | None = None,
    **codec_options: Any,
) -> tuple[CodecHookState, Callable]:
    """Build ``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``.

    Args:
        codec: a registered codec name or a codec object.
        model: the model (or its DDP wrapper); its parameter names key the codec state, which makes
            that state checkpointable (``state.memory.state_dict()``, ``state.state_dict()``).
        process_group: the group to communicate in (default: the default group).
        static_graph: pass DDP's ``static_graph`` flag; it delays the bucket rebuild by one step.
        stats_every: sample the relative error every this many steps (``state.stats``).
        nonfinite: ``"zero"`` (default here) zeroes buckets in which any rank had a NaN/Inf and
            sets ``state.skip_requested``; call ``state.consume_skip()`` before ``optimizer.step()``
            to skip the step yourself. ``"skip"`` says you will: the step's finite buckets then
            take back the residuals they committed too, as if the step had not run (with
            ``"zero"`` they keep them, since their gradients are applied). The Lightning strategy
            skips the optimizer step for you.
        fallback: send a bucket plainly when compressing it costs more than it saves (timed over
            the first compressed steps; see :mod:`lightning_gradcomp.fallback`).
        total_steps: the run's length in optimizer steps, if known: warm-ups given as a fraction
            of the run resolve against it (unknown: they take their caps, the papers' step counts).
        **codec_options: hyper-parameters of a named codec.

    Must be called on every rank after ``init_process_group`` (it checks that all ranks agree on
    the codec and its options).

    Example::

        >>> ddp = DistributedDataParallel(model)
        >>> state, hook = make_comm_hook("topk", ddp, ratio=0.01)
        >>> ddp.register_comm_hook(state, hook)
    """
    state = CodecHookState.for_model(
        resolve_codec(codec, codec_options or None),
        model.module if isinstance(model, DistributedDataParallel) else model,
        process_group=process_group,
        total_steps=total_steps,
        static_graph=static_graph,
        stats_every=stats_every,
        nonfinite=nonfinite,
        fallback=fallback,
    )
    return state, codec_hook
