"""Per-step compression statistics, accumulated by the hook and read by a callback.

The hook runs inside backward (and its decode step on communication threads), where logging is
not possible; it only adds numbers here. :class:`~lightning_gradcomp.callbacks.CompressionMonitor`
pops one step's totals after the optimizer step and logs them under ``gradcomp/``.

Timings and error sums may arrive unresolved (a :class:`~lightning_gradcomp.timing.Span` of CUDA
events, a 0-d tensor on the GPU): reading them would stall the stream inside backward, so they are
kept as they are and turned into numbers when the step's totals are popped.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

from lightning_gradcomp.comm import wire_bytes
from lightning_gradcomp.memory import LocksNotPickled
from lightning_gradcomp.timing import Span, resolve

__all__ = ["StepStats", "StatsAccumulator", "record_bucket"]


@dataclass
class StepStats:
    """Totals of one optimizer step on one rank."""

    buckets: int = 0
    raw_bytes: int = 0  # the gradient as DDP hands it over (bucket dtype)
    payload_bytes: int = 0  # what this rank hands to the collectives
    wire_bytes: float = 0.0  # what this rank transmits under ring algorithms (see comm.wire_bytes)
    raw_wire_bytes: float = 0.0  # the same for a plain all-reduce of the raw gradient
    encode_s: float = 0.0
    decode_s: float = 0.0
    comm_s: float = 0.0
    err_sq: float = 0.0  # ||x - x_hat||^2 of the local input, on sampled steps
    ref_sq: float = 0.0  # ||x||^2 on the same layers
    compressed: bool = False
    nonfinite: bool = False
    extra: dict = field(default_factory=dict)
    #: values added unresolved (spans of CUDA events, device tensors), resolved by ``pop``
    pending: list = field(default_factory=list, repr=False)

    @property
    def compression_ratio(self) -> float:
        return self.raw_wire_bytes / self.wire_bytes if self.wire_bytes > 0 else 1.0

    @property
    def rel_error(self) -> float | None:
        if self.ref_sq <= 0:
            return None
        return math.sqrt(self.err_sq / self.ref_sq)

    def as_scalars(self) -> dict[str, float]:
        """The values logged under ``gradcomp/``."""
        out = {
            "compression_ratio": self.compression_ratio,
            "bytes_sent": self.wire_bytes,
            "payload_bytes": float(self.payload_bytes),
            "raw_bytes": float(self.raw_bytes),
            "encode_ms": 1e3 * self.encode_s,
            "decode_ms": 1e3 * self.decode_s,
            "comm_ms": 1e3 * self.comm_s,
            "phase": 1.0 if self.compressed else 0.0,
        }
        if self.rel_error is not None:
            out["rel_error"] = self.rel_error
        for k, v in self.extra.items():
            out[k] = float(v)
        return out


class StatsAccumulator(LocksNotPickled):
    """Thread-safe accumulation of :class:`StepStats` across the buckets of a step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current = StepStats()
        self.last: StepStats | None = None
        self.totals = StepStats()

    def add(self, **values: float) -> None:
        with self._lock:
            for k, v in values.items():
                if k in ("compressed", "nonfinite"):
                    setattr(self._current, k, getattr(self._current, k) or bool(v))
                elif isinstance(v, (Span, torch.Tensor)):
                    self._current.pending.append((k, v))
                else:
                    setattr(self._current, k, getattr(self._current, k) + v)

    #: the running totals a checkpoint keeps, so that a resumed run's whole-run figures (bytes
    #: sent, compression ratio) count the steps before the resume too
    TOTALS_FIELDS = (
        "buckets",
        "raw_bytes",
        "payload_bytes",
        "wire_bytes",
        "raw_wire_bytes",
        "encode_s",
        "decode_s",
        "comm_s",
    )

    def totals_tensor(self) -> torch.Tensor:
        return torch.tensor([float(getattr(self.totals, f)) for f in self.TOTALS_FIELDS], dtype=torch.float64)

    def load_totals_tensor(self, values: torch.Tensor) -> None:
        for f, v in zip(self.TOTALS_FIELDS, values.tolist()):
            setattr(self.totals, f, type(getattr(self.totals, f))(v))

    def set_extra(self, **values: float) -> None:
        """Codec-specific scalars (a basis's explained variance, theta, an autoencoder's loss)."""
        with self._lock:
            self._current.extra.update(values)

    def pop(self) -> StepStats | None:
        """Return the statistics gathered since the last call, or ``None`` if no bucket ran."""
        with self._lock:
            cur, self._current = self._current, StepStats()
        # outside the lock and outside backward: waiting for the device is harmless here
        for k, v in cur.pending:
            setattr(cur, k, getattr(cur, k) + resolve(v))
        cur.pending = []
        if cur.buckets == 0:
            if cur.extra:  # keep codec scalars for the next step that communicates
                self._current.extra.update(cur.extra)
            return None
        self.last = cur
        for f in fields(StepStats):
            if f.name in ("compressed", "nonfinite", "extra", "pending"):
                continue
            setattr(self.totals, f.name, getattr(self.totals, f.name) + getattr(cur, f.name))
        return cur


def record_bucket(
    add: Callable[..., None],
    buf: torch.Tensor,
    world: int,
    collective: str,
    nbytes: int,
    *,
    extra_bytes: int = 0,
    extra_collective: str = "broadcast",
    compressed: bool = True,
    **more: Any,
) -> None:
    """Record one bucket through ``add`` (:meth:`StatsAccumulator.add`, or a
    :class:`~lightning_gradcomp.codecs.base.RoundContext`'s ``record``), on every path: the bucket
    as DDP handed it over (``buf``), the ``nbytes`` this rank handed to ``collective``, the
    ``extra_bytes`` it sent in a codec's own rounds (on ``extra_collective``), and what a plain all-reduce of ``buf``
    would have sent; ``more`` adds timings and error sums (``encode_s``, ``comm_s``, ``err_sq``...)."""
    raw = buf.numel() * buf.element_size()
    add(
        buckets=1,
        compressed=compressed,
        raw_bytes=raw,
        payload_bytes=nbytes + extra_bytes,
        wire_bytes=wire_bytes(collective, nbytes, world) + wire_bytes(extra_collective, extra_bytes, world),
        raw_wire_bytes=wire_bytes("allreduce", raw, world),
        **more,
    )
