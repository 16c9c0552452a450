"""Overrides the stage lengths of the ``lgc`` codec (Learned Gradient Compression) and says at
the end of ``fit`` what its learned code carried."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_gradcomp.callbacks.schedule import ScheduleOverride

__all__ = ["AutoencoderWarmup"]


class AutoencoderWarmup(ScheduleOverride):
    """Stage lengths and end-of-fit summary of :class:`~lightning_gradcomp.codecs.lgc.LGCCodec`.

    The codec switches stages on the global optimizer step, identically on every rank: dense
    all-reduce for ``warmup_steps``, shared-support top-k while gradients are collected for
    ``ae_train_steps``, then the frozen learned code. It is trained once at the switch (inside the
    gradient hook, so every rank takes part in the broadcast of its weights); its weights are in
    the codec's state and so in the checkpoint.

    This callback overrides the two lengths when given (before the strategy registers its hook)
    and prints on rank 0, at the end of ``fit``, one line saying which stage the run reached and
    what the learned code carried (:meth:`summary`). It logs nothing: the codec reports
    ``gradcomp/lgc_stage``, ``gradcomp/ae_loss``, ``gradcomp/ae_recon_error``,
    ``gradcomp/ae_train_s``, ``gradcomp/ae_layers``, ``gradcomp/ae_layers_eligible`` and
    ``gradcomp/ae_params`` itself (:meth:`~lightning_gradcomp.codecs.lgc.LGCCodec.scalars`), and
    :class:`~lightning_gradcomp.callbacks.CompressionMonitor` logs them, with or without this
    callback. With another codec it raises ``ValueError``.

    Args:
        warmup_steps: if given, overrides the codec's ``warmup_steps`` before training starts:
            steps (>= 0) or, as the codec takes it, a fraction of the run in ``(0, 1)``.
        ae_train_steps: if given, overrides the codec's ``ae_train_steps``: steps (>= 1) or a
            fraction of the run.

    Example::

        trainer = Trainer(strategy=CompressedDDPStrategy(codec="lgc"), callbacks=[AutoencoderWarmup(warmup_steps=20)])
    """

    codec_name = "lgc"
    schedule_options = ("warmup_steps", "ae_train_steps")
    other_codec = "raise"

    def __init__(self, warmup_steps: int | float | None = None, ae_train_steps: int | float | None = None) -> None:
        self.warmup_steps = warmup_steps
        self.ae_train_steps = ae_train_steps
        self._check_overrides()

    @classmethod
    def codec_type(cls) -> type:
        from lightning_gradcomp.codecs.lgc import LGCCodec

        return LGCCodec

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        codec, state = self._codec(trainer), getattr(trainer.strategy, "hook_state", None)
        if codec is None or state is None or not trainer.is_global_zero:
            return
        print(self.summary(codec, state.step, fell_back=bool(state.fallback.fallback)), flush=True)

    @staticmethod
    def _over_the_run(codec: Any) -> str:
        """The share of the support values the code carried over the run's learned-code steps, at
        the configured support and at a denser one (the level controller's light steps)."""
        parts = [
            f"{100 * carried / total:.0f} % of {total:,} at the {where} support"
            for where, (carried, total) in codec.values_run.items()
            if total
        ]
        return "; over the run it carried " + " and ".join(parts) if parts else ""

    @staticmethod
    def summary(codec: Any, steps: int, fell_back: bool = False) -> str:
        """One line: which stage the run reached and what the learned code carried (``fell_back``:
        some gradient buckets went back to plain all-reduce, the strategy's ``fallback``)."""
        if steps == 0 or codec.stage(steps - 1) == 1:
            return f"lgc: still in the dense warm-up after {steps} steps (warmup_steps ends at step {codec.warmup_end})"
        if not codec.ae_trained:
            return (
                f"lgc: shared-support top-k from step {codec.warmup_end}; the autoencoder is trained at step "
                f"{codec.ae_start_step}, after this run's {steps} steps"
            )
        used, eligible = codec.ae_layers_used
        carried, support, code_bytes = codec.values_used
        name = f"autoencoder ({codec.options.variant})"
        if codec.options.code == "levels":
            bits, light = codec.options.code_bits, codec.denser_code_bits
            name = f"{bits}-bit levels" + (f" ({light}-bit at the denser support)" if light not in (None, bits) else "")
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
            if codec.refits:
                how += f"; the levels were fitted again {codec.refits} time(s) after the switch"
            how += AutoencoderWarmup._over_the_run(codec)
        elif eligible:
            how = (
                f"the run-time guard sent all {eligible} layer(s) that passed the gate exactly at the last step "
                f"(the {name} reconstructed the leader's values with an error above max_recon_error "
                f"{codec.options.max_recon_error})"
            ) + AutoencoderWarmup._over_the_run(codec)
        elif codec.ae_layers:  # layers passed the gate, but none went through lgc at the last step
            how = (
                f"the {name} passed the gate on {len(codec.ae_layers)} layer(s) at the switch (held-out error "
                f"{codec.ae_recon_error:.2f}), but no compressed layer went through lgc at the last step"
            )
            if fell_back:
                how += (
                    ": their gradient buckets went back to plain all-reduce, which the first steps timed faster "
                    "on this link (fallback=False always compresses)"
                )
        elif math.isfinite(codec.ae_recon_error):
            how = (
                f"no layer passed the gate (held-out error of the {name} {codec.ae_recon_error:.2f} > "
                f"max_recon_error {codec.options.max_recon_error}), so the exact values of the shared support were sent"
            )
        else:
            how = (
                f"no layer passed the gate (too few stage-2 samples to measure the error of the {name}), so the "
                "exact values of the shared support were sent"
            )
        return f"lgc: learned code from step {codec.ae_start_step}: {how}"
