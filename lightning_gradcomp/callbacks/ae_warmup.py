"""Drives and logs the three stages of the ``lgc`` codec (Learned Gradient Compression)."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_gradcomp.codecs.base import check_positive_int

__all__ = ["AutoencoderWarmup"]


class AutoencoderWarmup(Callback):
    """Stage schedule and logging of :class:`~lightning_gradcomp.codecs.lgc.LGCCodec`.

    The codec switches stages on the global optimizer step, identically on every rank: dense
    all-reduce for ``warmup_steps``, shared-support top-k while gradients are collected for
    ``ae_train_steps``, then the frozen autoencoder. The autoencoder is trained once at the switch
    (inside the gradient hook, so every rank takes part in the broadcast of its weights); its
    weights are in the codec's state and so in the checkpoint.

    Logged at every optimizer step (rank 0's values, the same on every rank):

    - ``gradcomp/lgc_stage``: 1, 2 or 3;
    - ``gradcomp/ae_loss``: the autoencoder's last-epoch training loss, once trained;
    - ``gradcomp/ae_recon_error``: ``||v_hat - v|| / ||v||`` of the decoded aggregate on held-out
      stage-2 samples, once trained;
    - ``gradcomp/ae_train_s``: how long the switch took on this rank;
    - ``gradcomp/ae_layers``: in stage 3, how many layers the AE carried at this step (the
      run-time guard sends a layer's exact values when the leader's own values do not come back
      through the AE within ``max_recon_error``), and ``gradcomp/ae_layers_eligible``, how many
      passed the gate at the switch.

    Args:
        warmup_steps: if given, overrides the codec's ``warmup_steps`` before training starts.
        ae_train_steps: if given, overrides the codec's ``ae_train_steps``.

    Example::

        trainer = Trainer(strategy=CompressedDDPStrategy(codec="lgc"), callbacks=[AutoencoderWarmup()])
    """

    def __init__(self, warmup_steps: int | None = None, ae_train_steps: int | None = None) -> None:
        if warmup_steps is not None:
            check_positive_int("warmup_steps", warmup_steps, allow_zero=True)
        if ae_train_steps is not None:
            check_positive_int("ae_train_steps", ae_train_steps)
        self.warmup_steps = warmup_steps
        self.ae_train_steps = ae_train_steps

    @staticmethod
    def _codec(trainer: pl.Trainer) -> Any:
        from lightning_gradcomp.codecs.lgc import LGCCodec

        codec = getattr(trainer.strategy, "codec", None)
        return codec if isinstance(codec, LGCCodec) else None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        codec = self._codec(trainer)
        if codec is None:
            raise ValueError(
                "AutoencoderWarmup needs CompressedDDPStrategy(codec='lgc'); "
                f"the strategy is {type(trainer.strategy).__name__} "
                f"with codec {getattr(trainer.strategy, 'codec', None)!r}"
            )
        # runs on every rank before the strategy registers the hook (and compares codec options)
        given = {"warmup_steps": self.warmup_steps, "ae_train_steps": self.ae_train_steps}
        codec.replace_options(**{k: v for k, v in given.items() if v is not None})

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        codec, state = self._codec(trainer), getattr(trainer.strategy, "hook_state", None)
        if codec is None or state is None or state.step == 0:
            return
        scalars = {"gradcomp/lgc_stage": float(codec.stage(state.step - 1))}
        if codec.ae_trained and math.isfinite(codec.ae_loss):
            scalars["gradcomp/ae_loss"] = codec.ae_loss
            scalars["gradcomp/ae_recon_error"] = codec.ae_recon_error
            scalars["gradcomp/ae_train_s"] = codec.ae_train_s
            used, eligible = codec.ae_layers_used
            scalars["gradcomp/ae_layers"] = float(used)
            scalars["gradcomp/ae_layers_eligible"] = float(eligible)
        pl_module.log_dict(scalars, on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        codec, state = self._codec(trainer), getattr(trainer.strategy, "hook_state", None)
        if codec is None or state is None or not trainer.is_global_zero:
            return
        print(self.summary(codec, state.step), flush=True)

    @staticmethod
    def summary(codec: Any, steps: int) -> str:
        """One line: which stage the run reached and what the learned code carried."""
        if steps == 0 or codec.stage(steps - 1) == 1:
            return f"lgc: still in the dense warm-up after {steps} steps (warmup_steps ends at step {codec.warmup_end})"
        if not codec.ae_trained:
            return (
                f"lgc: shared-support top-k from step {codec.warmup_end}; the autoencoder is trained at step "
                f"{codec.ae_start_step}, after this run's {steps} steps"
            )
        used, eligible = codec.ae_layers_used
        carried, support, code_bytes = codec.values_used
        name = (
            f"{codec.options.code_bits}-bit levels"
            if codec.options.code == "levels"
            else f"autoencoder ({codec.options.variant})"
        )
        if used:
            how = (
                f"the {name} carried {used} of {eligible} layer(s) at the last step, {carried:,} of the "
                f"{support:,} support values ({100 * carried / max(support, 1):.0f} %), in {code_bytes:,} bytes "
                f"instead of {4 * carried:,} (x{4 * carried / max(code_bytes, 1):.1f} on top of the support); "
                f"held-out error "
                f"{codec.ae_recon_error:.2f} at the switch"
            )
            if used < eligible:
                how += "; the run-time guard sent the other layers' values exactly"
        elif eligible:
            how = (
                f"the run-time guard sent all {eligible} layer(s) that passed the gate exactly at the last step "
                f"(the {name} reconstructed the leader's values with an error above max_recon_error "
                f"{codec.options.max_recon_error})"
            )
        elif math.isfinite(codec.ae_recon_error):
            how = (
                f"no layer passed the gate (held-out error of the {name} {codec.ae_recon_error:.2f} > "
                f"max_recon_error {codec.options.max_recon_error}), so the exact values of the shared support were sent"
            )
        else:
            how = (
                f"no layer passed the gate (too few stage-2 samples to measure the {name}'s error), so the "
                "exact values of the shared support were sent"
            )
        return f"lgc: learned code from step {codec.ae_start_step}: {how}"
