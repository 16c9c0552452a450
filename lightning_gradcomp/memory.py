"""Error feedback: what compression dropped is kept per parameter and added to the next step.

With a compressor C, rank i sends C(g_t + e_t) and keeps e_{t+1} = (g_t + e_t) - C(g_t + e_t)
(Stich et al., 2018; Karimireddy et al., 2019). Nothing is lost, only delayed: the sum of what a
rank has sent plus its current residual equals the sum of its gradients.

Residuals are keyed by parameter name, not by DDP bucket index, because DDP rebuilds its buckets
after the first step and the order inside a bucket can change with precision settings. A residual
becomes current only when the step's collective confirmed that no rank saw a non-finite gradient
(:meth:`ResidualMemory.commit`), so a NaN never poisons later steps. A step that is skipped as a
whole can take back what its other buckets committed (:meth:`ResidualMemory.revert_step`): their
residuals return to what they were before the step, as if it had not run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, MutableMapping
from types import MappingProxyType
from typing import Any, Mapping

import torch
from torch import Tensor

__all__ = ["LocksNotPickled", "ResidualMemory", "StepUndo"]


class LocksNotPickled:
    """Picklable although it holds locks (a spawned rank, a deep copy of the strategy): the locks
    named in ``_unpickled_locks`` are left out when pickled, and a copy takes new ones."""

    _unpickled_locks: tuple[str, ...] = ("_lock",)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self._unpickled_locks:
            state.pop(name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name in self._unpickled_locks:
            setattr(self, name, threading.Lock())


class StepUndo:
    """What one step replaced in keyed stores, kept until the step ends, so that a step skipped as
    a whole (the hook's ``nonfinite="skip"``) can put it back.

    The first time a step changes a key, :meth:`keep` records the values the key held in each store
    (``None``: it held none); the first time it changes anything, :meth:`keep_start` records in
    :attr:`started_from` whatever else the caller needs to go back to (counters, a generator's
    state). :meth:`restore` puts the values back in the stores, in the order they were read;
    :meth:`clear` lets them go (the step is final). Stored values are kept by reference: a store
    written in place must hand over a copy.
    """

    def __init__(self) -> None:
        self._kept: dict[Hashable, tuple[Any, ...]] = {}
        self.started_from: Any = None

    def __bool__(self) -> bool:
        return bool(self._kept) or self.started_from is not None

    def keep_start(self, read: Callable[[], Any]) -> None:
        """Record ``read()`` as :attr:`started_from` unless this step already recorded it."""
        if self.started_from is None:
            self.started_from = read()

    def keep(self, key: Hashable, read: Callable[[], tuple[Any, ...]]) -> None:
        """Record ``read()`` for ``key`` unless this step already changed it (``read`` is called
        only then, so a copy costs nothing on a key's later changes)."""
        if key not in self._kept:
            self._kept[key] = read()

    def restore(self, *stores: MutableMapping) -> list[Hashable]:
        """Put every kept key back in ``stores`` as it was before the step; return the keys."""
        keys = list(self._kept)
        for key, values in self._kept.items():
            for store, value in zip(stores, values, strict=True):
                if value is None:
                    store.pop(key, None)
                else:
                    store[key] = value
        self.clear()
        return keys

    def clear(self) -> None:
        self._kept.clear()
        self.started_from = None


class ResidualMemory(LocksNotPickled):
    """Per-parameter residuals of one rank.

    Args:
        revertible: keep what each step's commits and drops replace until :meth:`end_step`, so
            that :meth:`revert_step` can take them back (the hook's ``nonfinite="skip"``); without
            it the replaced residuals are let go at once.
    """

    def __init__(self, revertible: bool = True) -> None:
        self._current: dict[str, Tensor] = {}
        self._pending: dict[str, Tensor] = {}
        self.revertible = revertible
        # what this step's commits and drops replaced, for revert_step
        self._before_step = StepUndo()
        self._lock = threading.Lock()  # decode callbacks of different buckets run on comm threads

    @property
    def residuals(self) -> Mapping[str, Tensor]:
        """The current residuals, read-only (change them with :meth:`set` or :meth:`load_state_dict`)."""
        return MappingProxyType(self._current)

    def get(self, key: str) -> Tensor | None:
        with self._lock:
            return self._current.get(key)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._current

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._current)

    def set(self, key: str, residual: Tensor) -> None:
        """Make ``residual`` the current residual of ``key`` (tests, tools; the hook stages and commits)."""
        with self._lock:
            self._current[key] = residual

    def compensate(self, key: str, x: Tensor) -> Tensor:
        """Return ``x + e`` for the parameter ``key`` (``x`` itself when there is no residual yet)."""
        r = self.get(key)
        if r is None:
            return x
        if r.shape != x.shape or r.device != x.device:
            raise RuntimeError(
                f"residual of {key!r} has shape {tuple(r.shape)} on {r.device} but the gradient has "
                f"{tuple(x.shape)} on {x.device}: the model changed under the codec"
            )
        return x + r

    def stage(self, key: str, residual: Tensor) -> None:
        """Hold the new residual of ``key`` until the step's collective has finished."""
        with self._lock:
            self._pending[key] = residual

    def commit(self, keys: list[str]) -> None:
        with self._lock:
            for k in keys:
                r = self._pending.pop(k, None)
                if r is not None:
                    if self.revertible:
                        self._before_step.keep(k, lambda k=k: (self._current.get(k),))
                    self._current[k] = r

    def mask_pending(self, key: str, keep: Tensor) -> None:
        """Multiply the staged tensor of ``key`` by ``keep`` (momentum factor masking)."""
        with self._lock:
            r = self._pending.get(key)
            if r is not None:
                r.mul_(keep)

    def scale(self, key: str, factor: float) -> None:
        """Multiply the current residual of ``key`` (if any) by ``factor``, in place."""
        with self._lock:
            r = self._current.get(key)
            if r is not None:
                r.mul_(factor)

    def drop(self, keys: list[str]) -> None:
        """Forget the current residuals of ``keys`` (they were sent in full)."""
        with self._lock:
            for k in keys:
                if k in self._current:
                    if self.revertible:
                        self._before_step.keep(k, lambda k=k: (self._current[k],))
                    del self._current[k]

    def end_step(self) -> None:
        """Every bucket of the step has settled: what it committed is final, and the residuals it
        replaced are let go."""
        with self._lock:
            self._before_step.clear()

    def revert_step(self) -> None:
        """Take back this step's commits and drops, and its staged residuals: the residuals are
        those of before the step (a step skipped as a whole)."""
        with self._lock:
            self._before_step.restore(self._current)
            self._pending.clear()

    def discard(self, keys: list[str]) -> None:
        with self._lock:
            for k in keys:
                self._pending.pop(k, None)

    def reset(self) -> None:
        with self._lock:
            self._current.clear()
            self._pending.clear()
            self._before_step.clear()

    def norm(self) -> float:
        return float(sum(r.double().pow(2).sum() for r in self.residuals.values()) ** 0.5) if self.residuals else 0.0

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict[str, Tensor], device: torch.device | None = None) -> None:
        self.reset()
        for k, v in state.items():
            self._current[k] = v.to(device) if device is not None else v.clone()
