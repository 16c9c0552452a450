"""``FrozenAdamVariance``: Adam's second moment held fixed once compression starts (1-bit Adam).

Error feedback assumes that the optimizer is linear in the gradient: what a codec delays is applied
later, as if it had been applied then. Adam is not: it divides each coordinate's step by the root
of a running mean of that coordinate's squared gradients, ``v``. Under a sparse codec a coordinate
receives nothing for dozens of steps and then its whole accumulated gradient at once; squared,
that spike inflates ``v`` and shrinks the coordinate's steps for hundreds of steps after.

1-bit Adam (Tang et al., ICML 2021) observed that ``v`` settles early in training and froze it
after a warm-up, so that Adam becomes momentum SGD with a fixed per-coordinate preconditioner,
which is linear and so compatible with error feedback. This callback does the same for any
optimizer whose parameter groups have ``betas`` and whose per-parameter state holds ``exp_avg_sq``
and ``step`` (``torch.optim.Adam`` and ``AdamW``): from the freeze step on, before every optimizer
step it sets ``exp_avg_sq`` so that, after the optimizer's own update
``v <- beta2 v + (1 - beta2) g^2``, the bias-corrected ``v / (1 - beta2^t)`` equals its value at the
freeze. The pre-step value is ``(v_hat (1 - beta2^t) - (1 - beta2) g^2) / beta2``, clamped at 0: a
gradient more than ``1 / sqrt(1 - beta2)`` times the frozen scale (about 32x at ``beta2 = 0.999``)
still enlarges its own denominator for that one step, which bounds the step instead of letting one
accumulated spike through undamped. The gradient ``g`` is the averaged one, identical on every rank
(plus ``weight_decay * p`` for Adam's coupled weight decay), so every rank keeps the same ``v``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_gradcomp.codecs.options import check_run_steps, run_steps

__all__ = ["FrozenAdamVariance"]

#: a step count at which beta^t is 0 in float for any beta < 0.9999 (and exact in float32)
_PAST_BIAS_CORRECTION = 1_000_000.0


class FrozenAdamVariance(Callback):
    """Hold Adam's bias-corrected second moment fixed from ``freeze_step`` on.

    Args:
        freeze_step: the optimizer step (an int) or the fraction of the run (a float in (0, 1))
            from which the variance is frozen; ``None`` (default) takes the step at which the
            strategy's codec starts to compress (``lgc``'s end of the dense warm-up, the harness's
            ``start_step`` otherwise).
        floor: each frozen value is at least ``floor`` times its tensor's mean frozen value
            (default 0.01, so a step is at most 10x the tensor's typical one). Without it a
            coordinate that received no gradient before the freeze keeps a variance of about 0
            and, once a gradient reaches it, steps by ``lr * m / eps``: on PSPNet/CamVid (``lgc``,
            AdamW) such a run trained well for six epochs and then collapsed (docs/callbacks.md).

    Logged: ``gradcomp/adam_variance_frozen`` (0 or 1). The frozen values are in the callback's
    ``state_dict``, so a resumed run keeps them.
    """

    def __init__(self, freeze_step: int | float | None = None, floor: float = 0.01) -> None:
        self.freeze_step = None if freeze_step is None else check_run_steps("freeze_step", freeze_step)
        if not (isinstance(floor, (int, float)) and 0 <= floor <= 1):
            raise ValueError(f"floor must be a number in [0, 1], got {floor!r}")
        self.floor = float(floor)
        self._frozen: dict[int, torch.Tensor] = {}  # index of the parameter in the optimizer -> v_hat
        self._freeze_at: int | None = None

    def _resolve(self, trainer: pl.Trainer) -> int:
        if self._freeze_at is None:
            if self.freeze_step is not None:
                total = trainer.estimated_stepping_batches
                self._freeze_at = run_steps(self.freeze_step, int(total) if total != float("inf") else None, 10**9)
            else:
                codec = getattr(trainer.strategy, "codec", None)
                start = getattr(codec, "warmup_end", None)
                if start is None:
                    start = codec.harness.start_step if codec is not None else 0
                self._freeze_at = int(start)
        return self._freeze_at

    @staticmethod
    def _adam_params(optimizer: torch.optim.Optimizer):
        index = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if "betas" in group:
                    yield index, p, group
                index += 1

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if trainer.global_step < self._resolve(trainer):
            return
        for i, p, group in self._adam_params(optimizer):
            state = optimizer.state.get(p, {})
            if p.grad is None or "exp_avg_sq" not in state or "step" not in state or group.get("amsgrad"):
                continue
            # Adam adds weight decay to the gradient, AdamW decays the weights apart
            coupled = not (isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False))
            beta1, beta2 = group["betas"]
            v = state["exp_avg_sq"]
            if i not in self._frozen:
                # the first step of the freeze: fold the bias corrections into the moments and move
                # the step count past the point where beta^t is 0, so that from now on
                # v_hat = v and m_hat = m (the update Adam computes is unchanged by this)
                t = float(state["step"])
                state["exp_avg"].div_(1.0 - beta1**t)
                v.div_(1.0 - beta2**t)
                state["step"].fill_(_PAST_BIAS_CORRECTION)
                # a coordinate that saw (almost) no gradient before the freeze would keep a
                # denominator of ~eps and step without bound once a gradient arrives: floor it
                v.clamp_(min=self.floor * float(v.mean()))
                self._frozen[i] = v.detach().clone()
            g = p.grad.detach()
            if coupled and group.get("weight_decay", 0.0):
                g = g + group["weight_decay"] * p.detach()
            frozen = self._frozen[i].to(v.device)
            v.copy_(((frozen - (1.0 - beta2) * g.pow(2)) / beta2).clamp_(min=0.0))
        pl_module.log("gradcomp/adam_variance_frozen", 1.0, on_step=True, on_epoch=False, batch_size=1)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"freeze_at": self._freeze_at, "frozen": {str(k): v.cpu() for k, v in self._frozen.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._freeze_at = state_dict.get("freeze_at")
        self._frozen = {int(k): v for k, v in state_dict.get("frozen", {}).items()}
