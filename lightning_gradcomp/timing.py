"""Clocks for work that may run asynchronously on a GPU.

On a CPU a kernel has finished when the call returns, so ``time.perf_counter`` around it measures
it. On CUDA the call only enqueues the kernel: ``perf_counter`` would measure the launch, and
reading a result early would stall the stream that backward is using. A :class:`Clock` therefore
hands out *marks*: a ``perf_counter`` reading on a CPU, a ``torch.cuda.Event`` recorded on the
current stream on CUDA. Marks are turned into seconds later (:meth:`Clock.seconds`,
:class:`Span`), when the statistics are read or a decision needs them, never in the hot path.

One clock exists per device (:func:`clock_for`), so objects that must pickle (hook state, codec
state) keep only a device and look the clock up.
"""

from __future__ import annotations

import threading
import time
from typing import Union

import torch

__all__ = ["Clock", "Mark", "Span", "clock_for", "resolve"]

#: a ``perf_counter`` reading (CPU) or a recorded ``torch.cuda.Event`` (CUDA)
Mark = Union[float, "torch.cuda.Event"]


class Clock:
    """Marks on one device's timeline; see the module docstring.

    Args:
        device: the device whose work is timed; CUDA events are used only for a CUDA device.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        device = torch.device("cpu") if device is None else torch.device(device)
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        if self.cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._epoch: torch.cuda.Event | None = None
        self._lock = threading.Lock()

    def mark(self) -> Mark:
        """Now: a host reading on a CPU; on CUDA an event recorded on the current stream, which the
        GPU reaches once the work enqueued before it has run."""
        if not self.cuda:
            return time.perf_counter()
        with self._lock:
            if self._epoch is None:  # the origin every event is measured from
                self._epoch = torch.cuda.Event(enable_timing=True)
                self._epoch.record(torch.cuda.current_stream(self.device))
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def seconds(self, mark: Mark) -> float:
        """The mark's position in seconds on this clock's axis (only differences mean anything).
        On CUDA this waits for the event, so call it outside the hot path."""
        if isinstance(mark, (int, float)):
            return float(mark)
        mark.synchronize()
        assert self._epoch is not None
        return self._epoch.elapsed_time(mark) / 1e3

    def elapsed(self, start: Mark, end: Mark) -> float:
        """Seconds from ``start`` to ``end`` (waits for ``end`` on CUDA)."""
        if isinstance(start, (int, float)) and isinstance(end, (int, float)):
            return float(end) - float(start)
        end.synchronize()
        start.synchronize()
        return start.elapsed_time(end) / 1e3

    def synchronize(self) -> None:
        """Wait for the device's work (a no-op on a CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)


_CLOCKS: dict[str, Clock] = {}
_CLOCKS_LOCK = threading.Lock()


def clock_for(device: torch.device | str | None) -> Clock:
    """The clock of ``device`` (one per device, shared)."""
    key = str(torch.device("cpu") if device is None else torch.device(device))
    with _CLOCKS_LOCK:
        clock = _CLOCKS.get(key)
        if clock is None:
            clock = _CLOCKS[key] = Clock(device)
        return clock


class Span:
    """The time between two marks of one clock, read when needed (:meth:`seconds`)."""

    __slots__ = ("clock", "start", "end")

    def __init__(self, clock: Clock, start: Mark, end: Mark) -> None:
        self.clock, self.start, self.end = clock, start, end

    def seconds(self) -> float:
        return self.clock.elapsed(self.start, self.end)

    def __repr__(self) -> str:
        return f"Span({self.clock.device}, start={self.start!r}, end={self.end!r})"


def resolve(value: object) -> float:
    """A number from a float, a :class:`Span` or a 0-d tensor (statistics kept lazily)."""
    if isinstance(value, Span):
        return value.seconds()
    return float(value)  # type: ignore[arg-type]
