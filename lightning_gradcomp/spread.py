"""Spreading sparse arrivals over the steps they stand for (the ``spread_steps`` harness option).

A sparsifying codec with error feedback delivers a coordinate rarely: its gradient builds up in
the sender's residual and arrives as one value, ``k`` steps' worth, every ``k`` steps. SGD moves
the same distance either way. Adam does not: it divides each coordinate's step by the root of its
running mean of squared gradients, so ``k * g`` once and zero ``k - 1`` times makes that mean
``k`` times the dense one (``k^2 g^2 / k``) and the coordinate travels ``sqrt(k)`` times less
than with ``g`` every step (a coordinate sent every 100 steps: 11.5 times less over 460 steps of
``torch.optim.Adam``, docs/benchmarks.md, "Segmentation").

So what arrives is handed to the optimizer as it would have come without compression: a
coordinate that arrives ``k`` steps after its previous arrival (at most ``max_steps``) is given to
the optimizer in ``k`` equal parts, one at this step and one at each of the next ``k - 1``. A
coordinate that arrives while parts of an earlier arrival are still owed has them added to the new
value before it is divided. Nothing is lost or invented: at every step the parts given plus those
still owed equal what arrived, and the last part is the exact remainder.

The state (owed value, parts left, step of the last arrival) is computed from the averaged
gradient, which every rank holds alike, so it is identical on every rank, and checkpointed once.
A coordinate is taken to have arrived when its averaged gradient is non-zero, which is what a
sparsifier leaves where it sent nothing; every coordinate of a dense layer arrives every step and
passes through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["ArrivalSpread"]


class ArrivalSpread:
    """Per-parameter spreading of sparse arrivals over the steps since the previous arrival.

    Args:
        max_steps: the most parts an arrival is divided into (its age is capped at this).
    """

    def __init__(self, max_steps: int) -> None:
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"spread_steps must be an integer >= 1, got {max_steps!r}")
        self.max_steps = max_steps
        self.applied_step = -1  # the optimizer step last spread (a step with several optimizers spreads once)
        # key -> (owed value, parts left, step of the last arrival), all float32 of the parameter's size
        self._state: dict[str, tuple[Tensor, Tensor, Tensor]] = {}

    def apply(self, key: str, grad: Tensor, step: int) -> None:
        """Replace ``grad`` (the averaged gradient of parameter ``key`` at optimizer ``step``) in
        place by the part of what arrived so far that is due at this step."""
        flat = grad.detach().view(-1)
        entry = self._state.get(key)
        if entry is None or entry[0].shape != flat.shape or entry[0].device != flat.device:
            owed = torch.zeros_like(flat, dtype=torch.float32)
            parts = torch.zeros_like(owed)
            last = torch.full_like(owed, float(step - 1))  # a first arrival counts one step
            entry = self._state[key] = (owed, parts, last)
        owed, parts, last = entry
        arrived = flat != 0
        owed.add_(flat.float())
        age = (float(step) - last).clamp_(1, self.max_steps)
        torch.where(arrived, age, parts, out=parts)
        last.masked_fill_(arrived, float(step))
        # owed / parts stays the same from one step to the next (each step takes one part), so the
        # part need not be stored; with one part left it is the exact remainder
        due = torch.where(parts > 0, owed / parts.clamp(min=1), torch.zeros_like(owed))
        owed.sub_(due)
        parts.sub_(1).clamp_(min=0)
        flat.copy_(due)

    def owed(self, key: str) -> Tensor | None:
        """What arrived for ``key`` and is not yet given to the optimizer (a copy)."""
        entry = self._state.get(key)
        return None if entry is None else entry[0].clone()

    def state_dict(self) -> dict[str, Any]:
        return {
            "max_steps": self.max_steps,
            "applied_step": self.applied_step,
            "state": {k: torch.stack([t.detach().cpu() for t in v]) for k, v in self._state.items()},
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        if int(state["max_steps"]) != self.max_steps:
            raise ValueError(
                f"the checkpoint spread arrivals over at most {state['max_steps']} steps, this run over "
                f"{self.max_steps}: resume with spread_steps={state['max_steps']}"
            )
        self.applied_step = int(state.get("applied_step", -1))
        self._state = {
            k: tuple(t.to(device or t.device).clone() for t in v.unbind(0)) for k, v in state["state"].items()
        }
