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
from types import MappingProxyType
from typing import Mapping

import torch
from torch import Tensor

__all__ = ["ResidualMemory"]


class ResidualMemory:
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
        # what this step's commits and drops replaced (None: nothing), for revert_step
        self._before_step: dict[str, Tensor | None] = {}
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
                        self._before_step.setdefault(k, self._current.get(k))
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
                    dropped = self._current.pop(k)
                    if self.revertible:
                        self._before_step.setdefault(k, dropped)

    def end_step(self) -> None:
        """Every bucket of the step has settled: what it committed is final, and the residuals it
        replaced are let go."""
        with self._lock:
            self._before_step.clear()

    def revert_step(self) -> None:
        """Take back this step's commits and drops, and its staged residuals: the residuals are
        those of before the step (a step skipped as a whole)."""
        with self._lock:
            for k, r in self._before_step.items():
                if r is None:
                    self._current.pop(k, None)
                else:
                    self._current[k] = r
            self._before_step.clear()
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
