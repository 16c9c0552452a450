"""The collectives every codec shares, written once.

All functions launch asynchronously and return a :class:`torch.futures.Future`. Nothing here ever
waits inside a ``.then`` callback: with gloo those callbacks run on the process group's worker
threads, and a callback that blocks on another collective can starve the thread that collective
needs (torch's own PowerSGD hook was seen to deadlock that way with two buckets). Codecs that need
several dependent rounds run the early rounds in the hook body (see ``Codec.prepare_bucket``).

Decoding in a callback: which thread runs a ``.then`` callback depends on timing (a gloo worker
thread, or the caller's own thread when the collective has already finished), and threads can
differ in their math settings: ``torch.set_num_threads``, which Lightning's launchers call at run
time, sets OpenMP's and MKL's thread counts for the calling thread only, and MKL then splits a
matrix product differently on a worker thread and rounds some entries differently. Two ranks
decoding the same sum on different kinds of thread would end one rounding step apart, and the
replicas would drift. :func:`then_like_caller` runs a callback under the thread settings of the
thread that registered it, so every rank decodes with the same arithmetic.

Payload packing: an ``allgather`` message is a byte string made of the codec's tensors, each
aligned to 8 bytes, so that every rank can cut every other rank's message back into tensors of the
same (fixed) shapes and dtypes without any metadata on the wire.

DEFLATE on the wire (``deflate=True``, a harness option): a message on the CPU travels as its
bytes split into planes by their place in a 2- or 4-byte word and compressed by zlib (level 1),
each rank's size all-gathered first (an all-gather moves equal sizes, so every rank pads to the
longest). Lossless: every rank decodes the same bytes it would have received, so training is
unchanged to the bit. What it saves is the redundancy of floating-point values that travel
exactly: a bfloat16 gradient's high bytes (sign and exponent) hold about 3 bits of information,
so its planes compress to about two thirds (PSPNet's gradient: 0.68; the values of its top half:
0.61), where the packed codes of a compressed step do not compress at all (a rank whose message
would grow sends it as it is).
"""

from __future__ import annotations

import hashlib
import threading
import zlib
from typing import Any, Callable, Sequence

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
    "allgather_deflated_async",
    "deflate",
    "inflate",
    "wire_bytes",
    "completed_future",
    "then_like_caller",
    "broadcast",
    "all_reduce",
    "digest",
    "agree",
    "mean_over_ranks",
    "gather_rank_states",
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


_thread_settings = threading.local()


def _use_thread_count(n: int) -> None:
    """Give the calling thread ``n`` intra-op threads, as ``torch.set_num_threads(n)`` gives them
    to its caller (OpenMP's and MKL's per-thread counts); once per thread and count."""
    if getattr(_thread_settings, "count", None) != n:
        torch.set_num_threads(n)
        _thread_settings.count = n


def then_like_caller(fut: torch.futures.Future, fn: Callable[[torch.futures.Future], Any]) -> torch.futures.Future:
    """``fut.then(fn)``, with ``fn`` run under the intra-op thread count of the thread that calls
    this (see the module docstring: otherwise the ranks' decodes can differ in their last bit)."""
    n = torch.get_num_threads()

    def run(f: torch.futures.Future) -> Any:
        _use_thread_count(n)
        return fn(f)

    return fut.then(run)


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


#: zlib's level on the wire: level 1 is within 4 % of level 6 on gradients at a third of the time
DEFLATE_LEVEL = 1


def deflate(msg: Tensor, word: int) -> Tensor:
    """The bytes of the 1-D uint8 CPU tensor ``msg`` split into ``word`` planes (every word's first
    byte, then every second byte, ...: the sign and exponent bytes of floats of that size fall in
    one plane) and compressed by zlib. Inverse: :func:`inflate` with ``msg.numel()``."""
    data = msg.numpy()
    pad = -data.size % word
    if pad:
        data = torch.cat([msg, msg.new_zeros(pad)]).numpy()
    planes = data.reshape(-1, word).T.tobytes()
    return torch.frombuffer(bytearray(zlib.compress(planes, DEFLATE_LEVEL)), dtype=torch.uint8)


def inflate(data: Tensor, nbytes: int, word: int) -> Tensor:
    """Inverse of :func:`deflate`: the ``nbytes`` bytes of the message (a uint8 CPU tensor)."""
    if nbytes == 0:  # torch.frombuffer takes no empty buffer
        return torch.empty(0, dtype=torch.uint8)
    planes = torch.frombuffer(bytearray(zlib.decompress(data.numpy().tobytes())), dtype=torch.uint8)
    return planes.view(word, -1).t().reshape(-1)[:nbytes]


class DeflatedRows:
    """What :func:`allgather_deflated_async` gathered: every rank's padded message and its size
    (the message's own size: it travelled as it is). :meth:`rows` inflates them."""

    def __init__(self, gathered: Tensor, sizes: list[int], own: Tensor, rank: int, word: int) -> None:
        self.gathered, self.sizes, self.own, self.rank, self.word = gathered, sizes, own, rank, word

    def rows(self) -> Tensor:
        """Every rank's message, ``(world_size, n)`` uint8 (this rank's is its own, not decoded)."""
        n = self.own.numel()
        out = torch.empty(len(self.sizes), n, dtype=torch.uint8)
        for r, size in enumerate(self.sizes):
            if r == self.rank:
                out[r] = self.own
            elif size == n:
                out[r] = self.gathered[r, :n]
            else:
                out[r] = inflate(self.gathered[r, :size], n, self.word)
        return out


def allgather_deflated_async(
    msg: Tensor, group: dist.ProcessGroup | None, word: int
) -> tuple[torch.futures.Future, int]:
    """:func:`allgather_async` of a 1-D uint8 CPU ``msg`` as :func:`deflate` compresses it (see the
    module docstring). Every rank's compressed size is all-gathered first, in the caller's thread
    (the hook body, never a callback); a rank whose message would not shrink sends it as it is.
    Returns the future, which resolves to :class:`DeflatedRows`, and the bytes this rank hands to
    the two all-gathers (its padded message and its size)."""
    world = dist.get_world_size(group)
    n = msg.numel()
    packed = deflate(msg, word)
    payload = packed if packed.numel() < n else msg
    sizes = all_gather(torch.tensor([payload.numel()], dtype=torch.int64), group, world).reshape(-1).tolist()
    longest = max(sizes)
    send = torch.cat([payload, payload.new_zeros(longest - payload.numel())])
    rank = dist.get_rank(group)
    fut = allgather_async(send, group)  # its value re-raises a failed collective
    return fut.then(lambda gathered: DeflatedRows(gathered.value(), sizes, msg, rank, word)), longest + 8


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


# --------------------------------------------------------------------------------------------------
# blocking collectives of the hook body and of step-end work, in the codec's process group
def _global(src: int, group: dist.ProcessGroup | None) -> int:
    """``dist.broadcast`` takes a global rank; codecs speak in ranks of their group."""
    return src if group is None else dist.get_global_rank(group, src)


def broadcast(t: Tensor, src: int, group: dist.ProcessGroup | None, world_size: int) -> Tensor:
    """Broadcast ``t`` in place from rank ``src`` of ``group``; a no-op on one rank."""
    if world_size > 1:
        dist.broadcast(t, src=_global(src, group), group=group)
    return t


def all_gather(t: Tensor, group: dist.ProcessGroup | None, world_size: int) -> Tensor:
    """Every rank's equal-sized 1-D ``t``, as a ``(world_size, n)`` tensor; blocking."""
    if world_size <= 1:
        return t.view(1, -1)
    out = torch.empty(world_size * t.numel(), dtype=t.dtype, device=t.device)
    all_gather_flat(out, t.contiguous(), group=group)
    return out.view(world_size, -1)


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def all_reduce(t: Tensor, op: str, group: dist.ProcessGroup | None, world_size: int) -> Tensor:
    """Reduce ``t`` in place over ``group`` (``op``: "sum" or "max"); a no-op on one rank."""
    if world_size > 1:
        dist.all_reduce(t, op=_OPS[op], group=group)
    return t


def digest(*parts: bytes | str | Tensor) -> int:
    """A 62-bit SHA-256 digest of strings, bytes and tensors (their dtype, shape and bytes): small
    enough for an int64 tensor, the same on every rank for the same inputs."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Tensor):
            t = part.detach().contiguous().cpu()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(part.encode() if isinstance(part, str) else part)
    return int.from_bytes(h.digest()[:8], "little") >> 2


def agree(value: int, what: str, group: dist.ProcessGroup | None, device: torch.device, world_size: int) -> None:
    """Raise on every rank unless every rank of ``group`` holds the same ``value`` (a digest).

    The message names ``what`` and which ranks (of the group) share each value. It costs one
    all-gather of 8 bytes a rank.
    """
    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine, group=group)
    values = [int(v.item()) for v in every]
    if len(set(values)) > 1:
        groups: dict[int, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        raise RuntimeError(f"{what}: " + "; ".join(f"ranks {rs} agree" for rs in groups.values()))


def mean_over_ranks(
    values: list[float],
    keys: Sequence[str],
    what: str,
    group: dist.ProcessGroup | None,
    device: torch.device,
    world_size: int,
) -> list[float]:
    """``values`` averaged entry by entry over the ranks of ``group`` (one all-reduce), once
    :func:`agree` has shown that every rank's entries are of the same ``keys`` in the same order:
    else every rank raises, naming ``what``, before vectors of other lengths or orders meet in the
    reduce (gloo fails on them, NCCL may hang, and equal lengths would mix one key's values with
    another's). The values themselves on one rank."""
    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return list(values)
    agree(digest("\n".join(keys)), what, group, device, world_size)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    all_reduce(t, "sum", group, world_size)
    return (t / world_size).tolist()


def gather_rank_states(
    local: dict[str, Tensor], device: torch.device, group: dist.ProcessGroup | None = None
) -> list[dict[str, Tensor]]:
    """All-gather each rank's tensors (same names, shapes and dtypes on every rank) without pickle.

    Returns one dict a rank of ``group``, on the CPU.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [{k: v.detach().cpu().clone() for k, v in local.items()}]
    names = sorted(local)
    world = dist.get_world_size(group)
    agree(
        digest(repr([(n, tuple(local[n].shape), str(local[n].dtype)) for n in names])),
        "ranks hold different sets of codec state tensors, so the checkpoint would be inconsistent "
        "(this points to ranks that compressed different layers)",
        group,
        device,
        world,
    )
    packed, layout = pack([local[n].to(device) for n in names], device)
    out = torch.empty(world * packed.numel(), dtype=torch.uint8, device=device)
    all_gather_flat(out, packed, group=group)
    rows = out.view(world, -1).cpu()
    return [dict(zip(names, (t.clone() for t in unpack(rows[r].clone(), layout)))) for r in range(world)]
