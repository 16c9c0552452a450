"""Logs the hook's per-step compression statistics under ``gradcomp/``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_gradcomp.codecs.options import check_bool

__all__ = ["CompressionMonitor"]


class CompressionMonitor(Callback):
    """Log what the gradient codec did at each optimizer step.

    ``CompressedDDPStrategy`` attaches one automatically. Logged through the trainer's logger
    (TensorBoard by default), per rank-0 step:

    - ``gradcomp/compression_ratio``: bytes a plain all-reduce would transmit / bytes transmitted,
      both under ring algorithms, this step (also in the progress bar as ``ratio``);
    - ``gradcomp/compression_ratio_run``: the same over the whole run so far, warm-up included
      (what a run of this length really saved);
    - ``gradcomp/bytes_sent``: bytes this rank transmitted this step (ring estimate, see
      :func:`lightning_gradcomp.comm.wire_bytes`); ``payload_bytes``: bytes handed to collectives;
    - ``gradcomp/rel_error``: ``||x - x_hat|| / ||x||`` of this rank's compressed layers, on steps
      sampled every ``stats_every``;
    - ``gradcomp/encode_ms``, ``decode_ms``, ``comm_ms`` (per step, summed over buckets);
    - ``gradcomp/phase``: 0 while sending uncompressed (warm-up), 1 when compressing;
    - ``gradcomp/<name>`` for every scalar a :class:`~lightning_gradcomp.codecs.base.LearnedState`
      codec reports in :meth:`~lightning_gradcomp.codecs.base.LearnedState.scalars` of the step
      (``lgc``: ``lgc_stage``, ``ae_loss``, ...; ``gradiveq``: ``pca_phase``, ``pca_k``,
      ``explained_variance``), on every batch once a step has run, as rank 0 holds them.

    Scalars of a schedule callback (``theta``, ``level``) are logged by that callback.

    Args:
        prog_bar: show the compression ratio in the progress bar.
    """

    def __init__(self, prog_bar: bool = True) -> None:
        self.prog_bar = check_bool("prog_bar", prog_bar)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        state = getattr(trainer.strategy, "hook_state", None)
        if state is None:
            return
        # what the codec learned, identical on every rank (empty before the first step)
        learned = {f"gradcomp/{k}": v for k, v in state.codec_scalars().items()}
        step = state.stats.pop()
        if step is None:  # an accumulation micro-batch: nothing was communicated
            if learned:
                pl_module.log_dict(learned, on_step=True, on_epoch=False, batch_size=1)
            return
        scalars = {**learned, **{f"gradcomp/{k}": v for k, v in step.as_scalars().items()}}
        totals = state.stats.totals
        if totals.wire_bytes > 0:
            scalars["gradcomp/compression_ratio_run"] = totals.compression_ratio
        scalars["gradcomp/nonfinite_steps"] = float(state.nonfinite_steps)
        pl_module.log_dict(scalars, on_step=True, on_epoch=False, batch_size=1)
        if self.prog_bar:
            pl_module.log(
                "ratio", step.compression_ratio, prog_bar=True, on_step=True, on_epoch=False, logger=False, batch_size=1
            )
