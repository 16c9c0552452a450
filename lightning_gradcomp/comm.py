"""The collectives every codec shares, written once.

All functions launch asynchronously and return a :class:`torch.futures.Future`. Nothing here ever
waits inside a ``.then`` callback: with gloo those callbacks run on the process group's worker
threads, and a callback that blocks on another collective can starve the thread that collective
needs (torch's own PowerSGD hook was seen to deadlock that way with two buckets). Codecs that need
several dependent rounds run the early rounds in the hook body (see ``Codec.prepare_bucket``).

Payload packing: an ``allgather`` message is a byte string made of the codec's tensors, each
aligned to 8 bytes, so that every rank can cut every other rank's message back into tensors of the
same (fixed) shapes and dtypes without any metadata on the wire.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "all_gather_flat",
    "Layout",
    "pack",
    "unpack",
    "allreduce_async",
    "allgather_async",
    "wire_bytes",
    "completed_future",
]

_ALIGN = 8


class Layout:
    """Shapes and dtypes of a packed list of tensors, with their byte offsets."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.entries: list[tuple[int, int, torch.dtype, torch.Size]] = []
        offset = 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            self.entries.append((offset, nbytes, t.dtype, t.shape))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.nbytes = offset

    @property
    def payload_bytes(self) -> int:
        """Bytes of real data (without alignment padding)."""
        return sum(e[1] for e in self.entries)


def pack(tensors: Sequence[Tensor], device: torch.device) -> tuple[Tensor, Layout]:
    layout = Layout(tensors)
    out = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    for t, (off, nbytes, _, _) in zip(tensors, layout.entries):
        if nbytes:
            out[off : off + nbytes] = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return out, layout


def unpack(buf: Tensor, layout: Layout) -> list[Tensor]:
    out = []
    for off, nbytes, dtype, shape in layout.entries:
        out.append(buf[off : off + nbytes].view(dtype).reshape(shape))
    return out


def completed_future(value: Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def allreduce_async(t: Tensor, group: dist.ProcessGroup | None) -> torch.futures.Future:
    """Sum ``t`` in place over the group; the future resolves to ``t``."""
    if dist.get_world_size(group) == 1:
        return completed_future(t)
    work = dist.all_reduce(t, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def allgather_async(t: Tensor, group: dist.ProcessGroup | None) -> torch.futures.Future:
    """Gather the equal-sized 1-D tensors of every rank; resolves to a (world_size, n) tensor."""
    n = dist.get_world_size(group)
    if n == 1:
        return completed_future(t.view(1, -1))
    out = torch.empty(n * t.numel(), dtype=t.dtype, device=t.device)
    work = all_gather_flat(out, t, group=group, async_op=True)

    def done(fut: torch.futures.Future) -> Tensor:
        fut.value()  # re-raises a failed collective (a dead or stalled rank): never decode garbage
        return out.view(n, -1)

    return work.get_future().then(done)


def all_gather_flat(out: Tensor, t: Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False):
    """``all_gather_into_tensor`` under its newer name where torch has it."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, t, group=group, async_op=async_op)


def wire_bytes(collective: str, payload_bytes: int, world_size: int) -> float:
    """Bytes one rank transmits for a payload under the bandwidth-optimal ring algorithms.

    A ring all-reduce sends ``2 (N-1)/N`` times the message, a ring all-gather ``N-1`` times it, and
    a broadcast about once (each rank forwards the message once in a pipelined ring or tree).
    With one rank nothing travels; the payload size is reported so ratios stay defined.
    """
    if world_size <= 1:
        return float(payload_bytes)
    if collective == "allreduce":
        return 2.0 * (world_size - 1) / world_size * payload_bytes
    if collective == "allgather":
        return float((world_size - 1) * payload_bytes)
    if collective == "broadcast":
        return float(payload_bytes)
    raise ValueError(f"unknown collective {collective!r}")
