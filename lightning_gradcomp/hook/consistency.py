"""Setup checks of the hook: every rank runs the same codec, in the group it was given."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_gradcomp import comm
from lightning_gradcomp.codecs.base import Codec, CodecContext

__all__ = ["check_codec_consistency", "make_context", "group_device"]


def group_device(process_group: dist.ProcessGroup | None) -> torch.device:
    """Where tensors for the group's collectives live: the current GPU for NCCL, else the CPU."""
    backend = dist.get_backend(process_group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_context(process_group: dist.ProcessGroup | None, device: torch.device) -> CodecContext:
    """The codec's view of the group: its rank and size there, the device, the group itself."""
    if dist.is_available() and dist.is_initialized():
        return CodecContext(
            dist.get_rank(process_group), dist.get_world_size(process_group), device, group=process_group
        )
    return CodecContext(0, 1, device)


def check_codec_consistency(codec: Codec, process_group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if the ranks were started with different codec settings.

    A digest of the codec's name, options and message layouts (:meth:`Codec.config_hash`) is
    all-gathered (8 bytes a rank) and compared.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(process_group) == 1:
        return
    comm.agree(
        codec.config_hash(),
        "ranks were started with different gradient-compression settings "
        f"(this rank, {dist.get_rank(process_group)}, has {codec!r}); start every rank with the same codec "
        "name and options, and the same version of lightning_gradcomp (the layout of a codec's messages is "
        "part of the setting)",
        process_group,
        group_device(process_group),
        dist.get_world_size(process_group),
    )
