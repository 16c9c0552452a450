"""``AdaptiveCompression``: compress lightly in critical regimes, heavily elsewhere (Accordion).

Agarwal, Wang, Lee, Venkataraman and Papailiopoulos, "Accordion: Adaptive Gradient Communication
via Critical Learning Regime Identification", MLSys 2021 (arXiv:2010.16248). Compression hurts
most in *critical regimes*: the first epochs and the steps after a learning-rate drop, which show
as a fast relative change of the gradient's norm. Accordion compresses lightly there and heavily
elsewhere, and reaches the accuracy of light compression with far fewer bytes.

Its rule, as its code (``auto_scale.py``, ``main.py`` of uw-mad-dash/Accordion) applies it: the
gradient is summed over an epoch, and every ``switch_freq`` epochs (10 for CIFAR) the norm of that
sum is compared with the one ``switch_freq`` epochs before; a relative change
``|‖Δ_old‖ − ‖Δ_new‖| / ‖Δ_old‖ >= η`` (η = 0.5) selects the light setting until the next
decision, a smaller one the heavy setting. The first decision is light, and when the learning
rate decays the light setting is taken at once.

Ours differs where our codecs and runs differ (our choices):

* **one level for the whole model**: Accordion decides per layer; our codecs take one level;
* **windows of optimizer steps**: the norm is that of the *mean* aggregated gradient over a window
  of ``interval`` steps (default 50), compared with the previous window's; a mean rather than a
  sum so that a window cut short by a learning-rate drop still compares;
* **a warm-up**: the first ``warmup`` of the run (default 5 %) is light whatever the norms say;
  Accordion's first decision covers its first 10 epochs (3 % of a 300-epoch CIFAR run);
* **a drop is a fall by half**: the rate counts as dropped when one step's rate is at most
  ``lr_drop`` (0.5) times a reference rate. With ``lr_reference="previous"`` (the default) the
  reference is the previous step's rate, so that a step decay triggers and a cosine decay, whose
  steps are small, does not. With ``lr_reference="peak"`` it is the highest rate since the last
  drop, so that a smooth decay (cosine, polynomial) counts as a drop each time it has halved the
  rate: Accordion takes the light setting whenever the rate decays, and a schedule without
  milestones decays all the time. The light setting then holds for at least one full window.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_gradcomp.codecs.base import AdjustableCompression, check_run_steps, run_steps

__all__ = ["LR_REFERENCES", "AdaptiveCompression", "adjustable_codecs"]

#: what ``AdaptiveCompression``'s learning-rate drop is measured against
LR_REFERENCES = ("previous", "peak")

_NO_CAP = 2**62  # a schedule length given as a fraction of the run is not capped here


def adjustable_codecs() -> list[str]:
    """Names of the registered codecs whose compression level can change while training runs."""
    from lightning_gradcomp.registry import available_codecs, codec_class

    members = ("compression_level", "set_level", "compression_limit")
    return [n for n in available_codecs() if all(hasattr(codec_class(n), m) for m in members)]


def check_adjustable(codec: Any, who: str) -> AdjustableCompression:
    """``codec`` itself, or a ``ValueError`` naming the codecs whose level can change."""
    if not isinstance(codec, AdjustableCompression):
        raise ValueError(
            f"{who} needs a codec whose compression level can change while training (AdjustableCompression: "
            f"{', '.join(map(repr, adjustable_codecs()))}); the strategy's codec is {getattr(codec, 'name', None)!r}"
        )
    return codec


def _check_level(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return float(value)


class AdaptiveCompression(Callback):
    """Set the codec's compression level from the gradient's norm, as Accordion does.

    After every optimizer step the aggregated gradient (``p.grad`` in ``on_before_optimizer_step``:
    DDP's hook has averaged it, so it is identical on every rank) is added to the window's sum.
    Every ``interval`` steps the window's mean gradient ``ḡ_w`` is compared with the previous
    window's: the run is in a *critical regime* when

    .. math::  |‖ḡ_{w-1}‖ - ‖ḡ_w‖| / ‖ḡ_{w-1}‖ >= η,

    or when it is in its first ``warmup`` steps, or has no previous window yet, or the learning rate
    dropped (one step's rate at most ``lr_drop`` times the previous step's, for any parameter
    group) less than a window ago. A critical regime gets ``low_level`` (light compression), the
    rest ``high_level``. The level is set with ``codec.set_level`` at the start of every batch, so
    it changes between optimizer steps; the codec applies ``min(level, compression_limit)``, which
    is how :class:`~lightning_gradcomp.callbacks.AccuracyDropRollback` keeps its say.

    **The same on every rank.** The inputs (averaged gradients, learning rates, the global step)
    are identical on every rank, and at each window's end, a step every rank knows from the global
    step alone, one all-reduce (MAX) of the norm and of the verdict, outside the DDP hook, makes
    the decision one for all.

    **A held level.** When ``low_level`` equals the heavy level (``high_level``, or the codec's
    level at fit start), every verdict would give the same level: the callback then sets, logs
    and counts that level and does nothing else (no window, no norm, no all-reduce, no decisions).
    ``CompressedDDPStrategy`` attaches it so for ``gradiveq``, beside SGD and beside an Adam-like
    optimizer.

    Logged: ``gradcomp/level`` (the level in use, every step) and ``gradcomp/grad_change`` (the
    relative change, at each decision). Checkpointed: the level, the window's sum and count, the
    previous norm, the rates, the decisions and the steps run at each level, so a resumed run
    decides as the uninterrupted one would.

    Args:
        eta: the relative change of the norm that marks a critical regime (default 0.5, Accordion's).
        interval: steps per window, an int, or a fraction of the run (a float in (0, 1)); default
            50: short enough for several decisions per epoch of our recipes, long enough that the
            mean of 50 mini-batch gradients is dominated by the true gradient rather than by noise.
        warmup: steps (an int) or a fraction of the run (a float in (0, 1)) that are light from
            the start (default 0.05; 0: none).
        low_level: the level of critical regimes (default 0.0: each codec's light setting).
        high_level: the level elsewhere; ``None`` (default): the codec's level when fit starts,
            which is 1.0 (its configured setting) for every codec but ``fft``, whose level is theta.
        lr_drop: a step's learning rate at most this fraction of the reference rate is a drop
            (default 0.5); ``0`` ignores the learning rate.
        lr_reference: the reference rate of ``lr_drop``: ``"previous"`` (default), the previous
            step's rate (a step decay is a drop, a smooth decay is not), or ``"peak"``, the highest
            rate since the last drop (a smooth decay is a drop each time it has fallen to
            ``lr_drop`` of that rate: for a cosine decay at 50 %, 67 %, 77 % ... of the run).

    Raises:
        ValueError: for an invalid argument; at fit start, for a codec whose level cannot change
            (the message names those that can), for ``low_level`` above ``high_level``, or beside a
            :class:`~lightning_gradcomp.callbacks.ThetaDecay`, which sets the same level.

    Example::

        trainer = Trainer(strategy=CompressedDDPStrategy(codec="topk", codec_options={"ratio": 0.01}),
                          callbacks=[AdaptiveCompression(eta=0.5, interval=50)])
        # or: CompressedDDPStrategy(codec="topk", adaptive_level={"interval": 50})
    """

    def __init__(
        self,
        eta: float = 0.5,
        interval: int | float = 50,
        warmup: int | float = 0.05,
        low_level: float = 0.0,
        high_level: float | None = None,
        lr_drop: float = 0.5,
        lr_reference: str = "previous",
    ) -> None:
        if isinstance(eta, bool) or not (isinstance(eta, (int, float)) and math.isfinite(eta) and eta > 0):
            raise ValueError(f"eta must be a finite number > 0, got {eta!r}")
        interval = check_run_steps("interval", interval)
        if interval == 0:
            raise ValueError("interval must be an integer >= 1 (steps) or a float in (0, 1) (a fraction of the run)")
        self.eta = float(eta)
        self.interval = interval
        self.warmup = check_run_steps("warmup", warmup)
        self.low_level = _check_level("low_level", low_level)
        self.high_level = None if high_level is None else _check_level("high_level", high_level)
        if self.high_level is not None and self.low_level > self.high_level:
            raise ValueError(f"low_level ({low_level}) must not exceed high_level ({high_level})")
        self.lr_drop = _check_level("lr_drop", lr_drop)
        if lr_reference not in LR_REFERENCES:
            raise ValueError(f"lr_reference must be one of {', '.join(map(repr, LR_REFERENCES))}, got {lr_reference!r}")
        self.lr_reference = lr_reference
        # resolved at fit start (and restored from a checkpoint)
        self._high: float | None = None
        self._interval: int | None = None
        self._warmup: int | None = None
        # the rule's state
        self.level: float | None = None  # the level the rule chose
        self._window_sum: dict[str, torch.Tensor] = {}
        self._window_count = 0
        self._window_end = 0  # the decision falls after the step that reaches this many steps
        self._previous_norm: float | None = None
        self._light_until = 0  # a learning-rate drop keeps the light level until this step
        self._last_lrs: list[float] | None = None  # the reference rates, one per parameter group
        self._seen_step = -1
        self.steps_at_level: dict[float, int] = {}
        self.decisions: list[dict[str, Any]] = []

    @property
    def state_key(self) -> str:
        return self._generate_state_key(eta=self.eta, interval=self.interval)

    # ----------------------------------------------------------------------------------------------
    def _codec(self, trainer: pl.Trainer) -> AdjustableCompression:
        return check_adjustable(getattr(trainer.strategy, "codec", None), "AdaptiveCompression")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._codec(trainer)
        from lightning_gradcomp.callbacks.theta_decay import ThetaDecay

        if any(isinstance(cb, ThetaDecay) for cb in trainer.callbacks):
            raise ValueError(
                "AdaptiveCompression and ThetaDecay both set the codec's compression level: use one of them "
                "(AdaptiveCompression(high_level=..., low_level=...) with fft sets theta itself)"
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        codec = self._codec(trainer)
        if self._high is None:  # a resumed run keeps what its first fit resolved
            self._high = float(codec.compression_level) if self.high_level is None else self.high_level
            if self.low_level > self._high:
                raise ValueError(
                    f"AdaptiveCompression: low_level {self.low_level} is above the codec's level {self._high} "
                    "(high_level): critical regimes would compress more"
                )
            total = trainer.estimated_stepping_batches
            total = None if total is None or not math.isfinite(total) else int(total)
            self._interval = max(1, _resolve_steps("interval", self.interval, total))
            self._warmup = _resolve_steps("warmup", self.warmup, total)
            self._window_end = trainer.global_step + self._interval
            self.level = self.low_level  # a first window has nothing to compare with: light

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        codec = self._codec(trainer)
        if self.level is not None:
            codec.set_level(self.level)  # again every batch: a rollback may have restored another
        pl_module.log(
            "gradcomp/level",
            float(codec.compression_level),
            on_step=True,
            on_epoch=False,
            batch_size=1,
            rank_zero_only=True,
        )

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        step = trainer.global_step  # this step's index; the same on every rank
        if step == self._seen_step or self._interval is None:  # one call per step (several optimizers)
            return
        self._seen_step = step
        codec = self._codec(trainer)
        in_use = float(codec.compression_level)
        self.steps_at_level[in_use] = self.steps_at_level.get(in_use, 0) + 1
        if self.low_level == self._high:
            # a held level (gradiveq's default): every verdict gives the same level, so
            # no window is kept, no norm taken and no collective run
            return
        self._add_to_window(pl_module)
        if self._learning_rate_dropped(trainer):
            self.level = self.low_level
            self._light_until = step + 1 + self._interval
        if step + 1 >= self._window_end:
            self._decide(trainer, pl_module, step + 1)

    # ----------------------------------------------------------------------------------------------
    def _add_to_window(self, pl_module: pl.LightningModule) -> None:
        with torch.no_grad():
            for name, p in pl_module.named_parameters():
                if p.grad is None:
                    continue
                g = p.grad.detach()
                total = self._window_sum.get(name)
                if total is None:
                    self._window_sum[name] = g.to(torch.float32, copy=True)
                else:
                    if total.device != g.device:  # restored from a checkpoint on the CPU
                        total = self._window_sum[name] = total.to(g.device)
                    total.add_(g)
        self._window_count += 1

    def _learning_rate_dropped(self, trainer: pl.Trainer) -> bool:
        lrs = [float(g["lr"]) for opt in trainer.optimizers for g in opt.param_groups]
        before = self._last_lrs
        if before is None or len(before) != len(lrs) or self.lr_drop == 0:
            self._last_lrs = lrs
            return False
        dropped = any(now <= self.lr_drop * then for now, then in zip(lrs, before) if then > 0)
        if self.lr_reference == "previous" or dropped:
            self._last_lrs = lrs
        else:  # "peak": the highest rate since the last drop
            self._last_lrs = [max(now, then) for now, then in zip(lrs, before)]
        return dropped

    def _decide(self, trainer: pl.Trainer, pl_module: pl.LightningModule, steps_done: int) -> None:
        """The end of a window, ``steps_done`` steps into the run: a new level, agreed by all ranks."""
        sq = sum((t.double().pow(2).sum() for t in self._window_sum.values()), torch.zeros((), dtype=torch.float64))
        norm = float(sq.sqrt()) / max(self._window_count, 1)
        previous = self._previous_norm
        if previous is None:
            change = math.inf
        else:
            change = abs(previous - norm) / previous if previous > 0 else (math.inf if norm > 0 else 0.0)
        # the level chosen here holds from step ``steps_done`` on
        critical = steps_done < self._warmup or change >= self.eta or steps_done < self._light_until
        norm, critical = _agree_max(trainer, norm, critical)
        self.level = self.low_level if critical else self._high
        self.decisions.append(
            {"step": steps_done, "norm": norm, "change": change, "level": self.level, "critical": critical}
        )
        self._previous_norm = norm
        self._window_sum = {}
        self._window_count = 0
        self._window_end = (steps_done // self._interval + 1) * self._interval
        if math.isfinite(change):
            pl_module.log("gradcomp/grad_change", change, on_step=True, on_epoch=False, batch_size=1)

    # ----------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "high": self._high,
            "interval": self._interval,
            "warmup": self._warmup,
            "level": self.level,
            "window_sum": {k: v.detach().cpu().clone() for k, v in self._window_sum.items()},
            "window_count": self._window_count,
            "window_end": self._window_end,
            "previous_norm": self._previous_norm,
            "light_until": self._light_until,
            "last_lrs": self._last_lrs,
            "seen_step": self._seen_step,
            "steps_at_level": [[level, n] for level, n in sorted(self.steps_at_level.items())],
            "decisions": list(self.decisions),
            "rule": self._rule(),
        }

    def _rule(self) -> dict[str, Any]:
        """The arguments of the rule that the state key does not name: a resumed run decides with
        the ones it started with (as ``EarlyStopping`` restores its ``patience``), so a default
        that changes between versions does not change a run halfway."""
        return {"low_level": self.low_level, "lr_drop": self.lr_drop, "lr_reference": self.lr_reference}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._high = state_dict["high"]
        self._interval = state_dict["interval"]
        self._warmup = state_dict["warmup"]
        self.level = state_dict["level"]
        self._window_sum = dict(state_dict["window_sum"])
        self._window_count = int(state_dict["window_count"])
        self._window_end = int(state_dict["window_end"])
        self._previous_norm = state_dict["previous_norm"]
        self._light_until = int(state_dict["light_until"])
        self._last_lrs = state_dict["last_lrs"]
        self._seen_step = int(state_dict["seen_step"])
        self.steps_at_level = {float(level): int(n) for level, n in state_dict["steps_at_level"]}
        self.decisions = list(state_dict["decisions"])
        rule = state_dict.get("rule")  # absent from checkpoints of earlier versions: the arguments given
        if rule is not None and rule != self._rule():
            # information, not a warning: the strategy's default controller takes its arguments
            # beside Adam only after this (the checkpoint recorded them as the run had them)
            rank_zero_info(
                f"AdaptiveCompression: the checkpoint's run decided with {rule}; it goes on with them, not with "
                f"the arguments given now ({self._rule()})"
            )
            self.low_level = float(rule["low_level"])
            self.lr_drop = float(rule["lr_drop"])
            self.lr_reference = str(rule["lr_reference"])


def _resolve_steps(name: str, value: int | float, total: int | None) -> int:
    if isinstance(value, float) and total is None:
        raise ValueError(f"AdaptiveCompression: the run's length is unknown; give {name} in steps")
    return run_steps(value, total, _NO_CAP)


def _agree_max(trainer: pl.Trainer, norm: float, critical: bool) -> tuple[float, bool]:
    """The largest norm and verdict over the ranks (one all-reduce, outside the DDP hook): the
    inputs are equal on every rank already, this makes sure the level is too."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return norm, critical
    t = torch.tensor([norm, float(critical)], dtype=torch.float64, device=trainer.strategy.root_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), bool(t[1] > 0)
