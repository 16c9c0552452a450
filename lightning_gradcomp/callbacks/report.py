"""What a compressed training run achieved, printed at the end and written as JSON."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import override

from lightning_gradcomp.callbacks.adaptive import AdaptiveCompression
from lightning_gradcomp.codecs.options import check_bool

__all__ = ["CompressionReport"]


class CompressionReport(Callback):
    """Sum up a run: the metric it reached and what the codec saved to reach it.

    At the end of ``fit``, rank 0 prints the compression ratio at steady state (the last step)
    and over the whole run (dense warm-up steps included), the bytes it sent against plain
    all-reduce, and where the TensorBoard logs are; with ``metrics_json`` it also writes these
    numbers, the final ``val/*`` metrics, the run's seed and the history of ``monitor`` to a file
    (the input of ``python -m lightning_gradcomp.bench accuracy``).

    Four things make the numbers comparable between runs:

    - **a validation at the last step.** When the step budget ends between two validations
      (``val_check_interval`` does not divide it), the report asks Lightning to validate once more
      at the last step (through ``trainer.should_stop``, as early stopping does), so the final
      metric belongs to the final weights;
    - **the steps at each compression level**, when an
      :class:`~lightning_gradcomp.callbacks.AdaptiveCompression` sets it (``level_steps``);
    - **the history of** ``monitor``: its value at the global step of every validation, saved in
      checkpoints so that a resumed run keeps the earlier points (the curve behind time to
      accuracy);
    - **hyper-parameters in TensorBoard:** at the start of ``fit`` the LightningModule's and
      DataModule's hyper-parameters, the codec and its options and the world size are logged to
      every logger; TensorBoard gets them with the metric ``hp/<monitor>`` (its final value is
      logged at the end), so runs with different codecs line up in the HPARAMS tab.

    Args:
        monitor: the metric to follow (a key of ``trainer.callback_metrics``, e.g. ``"val/acc"``);
            ``None``: no history and no HPARAMS metric.
        metrics_json: where rank 0 writes the report (a JSON object); ``None``: print only.
        validate_last_step: validate at the last optimizer step when no validation falls on it.

    Example::

        trainer = Trainer(strategy=CompressedDDPStrategy(codec="lgc"),
                          callbacks=[CompressionReport(monitor="val/acc", metrics_json="run.json")])
    """

    def __init__(
        self, monitor: str | None = None, metrics_json: str | None = None, validate_last_step: bool = True
    ) -> None:
        if monitor is not None and not isinstance(monitor, str):
            raise ValueError(f"monitor must be a metric's name (a string) or None, got {monitor!r}")
        if metrics_json is not None and not isinstance(metrics_json, (str, os.PathLike)):
            raise ValueError(f"metrics_json must be a path or None, got {metrics_json!r}")
        self.monitor = monitor
        self.metrics_json = metrics_json
        self.validate_last_step = check_bool("validate_last_step", validate_last_step)
        self.history: list[dict[str, Any]] = []
        self._started: float | None = None
        self._last_step = float("inf")
        self._check_val_every_n_epoch: int | None = None  # the trainer's, while lifted at the last step

    @property
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor)

    # ----------------------------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = _hyperparameters(trainer, pl_module)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and self.monitor is not None:
                logger.log_hyperparams(params, {self.hp_metric: -1.0})  # -1: not measured yet
            else:
                logger.log_hyperparams(params)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started = time.perf_counter()
        try:
            self._last_step = float(trainer.estimated_stepping_batches)
        except Exception:  # a data loader without a length and no max_steps: no known last step
            self._last_step = float("inf")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.validate_last_step and trainer.global_step >= self._last_step:
            trainer.should_stop = True  # Lightning then validates after this batch
            every = trainer.check_val_every_n_epoch
            if every is not None and (trainer.current_epoch + 1) % every:
                # an epoch that would not validate: lift the epoch rule for this last batch
                self._check_val_every_n_epoch = every
                trainer.check_val_every_n_epoch = None

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero or self.monitor not in trainer.callback_metrics:
            return
        point = {"step": int(trainer.global_step), "metric": float(trainer.callback_metrics[self.monitor])}
        if self._started is not None:  # wall-clock seconds since fit started: time to accuracy, measured
            point["wall_s"] = time.perf_counter() - self._started
        state = getattr(getattr(trainer, "strategy", None), "hook_state", None)
        if state is not None:  # bytes sent so far, and what fp32 all-reduce would have sent: time to
            totals = state.stats.totals  # accuracy on another link, charging each step what it sent
            point["bytes_sent"], point["raw_bytes"] = float(totals.wire_bytes), float(totals.raw_wire_bytes)
        if self.history and self.history[-1]["step"] == point["step"]:
            self.history[-1] = point  # validated twice at one step: the later value counts
        else:
            self.history.append(point)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._check_val_every_n_epoch is not None:
            trainer.check_val_every_n_epoch, self._check_val_every_n_epoch = self._check_val_every_n_epoch, None
        wall_s = time.perf_counter() - self._started if self._started is not None else 0.0
        result = self.result(trainer, pl_module, wall_s)
        if self.monitor is not None and self.monitor in result["metrics"]:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.log_metrics({self.hp_metric: result["metrics"][self.monitor]}, step=trainer.global_step)
        if trainer.is_global_zero:
            print(self.summary(trainer, result), flush=True)
            if self.metrics_json:
                path = Path(self.metrics_json)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(result, indent=2))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))

    # ----------------------------------------------------------------------------------------------
    @property
    def hp_metric(self) -> str:
        return f"hp/{self.monitor}"

    def result(self, trainer: pl.Trainer, pl_module: pl.LightningModule, wall_s: float) -> dict[str, Any]:
        """The report as a JSON-ready dict (bytes are this rank's, ring estimate)."""
        strategy = trainer.strategy
        codec = getattr(strategy, "codec", None)
        state = getattr(strategy, "hook_state", None)
        totals = state.stats.totals if state is not None else None
        last = state.stats.last if state is not None else None
        hparams = {**_module_hparams(trainer.datamodule), **_module_hparams(pl_module)}
        seed = os.environ.get("PL_GLOBAL_SEED")
        result: dict[str, Any] = {
            "module": type(pl_module).__name__,
            "codec": codec.name if codec is not None else None,
            "codec_options": dict(codec.config()) if codec is not None else {},
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            # how Lightning found the ranks: LightningEnvironment, TorchElasticEnvironment, SLURMEnvironment, ...
            "cluster_environment": _class_name(getattr(strategy, "cluster_environment", None)),
            "steps": trainer.global_step,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("val/", "test/"))},
            "bytes_sent": float(totals.wire_bytes) if totals else 0.0,
            "raw_bytes": float(totals.raw_wire_bytes) if totals else 0.0,  # what plain fp32 all-reduce would have sent
            "compression_ratio": totals.compression_ratio if totals else 1.0,
            "compression_ratio_last": last.compression_ratio if last is not None else 1.0,
            "fallback_buckets": len(state.fallback.fallback) if state is not None else 0,
            "wall_s": wall_s,
            "seed": int(seed) if seed is not None else None,
            "model": hparams.get("model"),
            "batch_size": hparams.get("batch_size"),
        }
        adaptive = _adaptive(trainer)
        hook_codec = state.codec if state is not None else None
        report_lines = getattr(hook_codec, "report_lines", None)
        if report_lines is not None:  # what a codec that chooses (auto) chose
            result["codec_report"] = list(report_lines())
        values_run = getattr(hook_codec, "values_run", None)
        if values_run is not None:  # lgc: support values its learned code carried, of those sent, by support size
            result["learned_code_values"] = {name: list(tally) for name, tally in values_run.items()}
        if adaptive is not None:
            # optimizer steps run at each compression level, as AdaptiveCompression set it
            result["level_steps"] = {f"{level:g}": n for level, n in sorted(adaptive.steps_at_level.items())}
        if self.monitor is not None:
            result["monitor"] = self.monitor
            result["history"] = list(self.history)
        return result

    def summary(self, trainer: pl.Trainer, result: dict[str, Any]) -> str:
        """The lines printed at the end of ``fit``."""
        lines = []
        if self.monitor is not None and self.monitor in result["metrics"]:
            lines.append(
                f"{self.monitor} {result['metrics'][self.monitor]:.4f} after {result['steps']} steps "
                f"on {result['world_size']} processes ({result['wall_s']:.0f} s)"
            )
        lines.append(
            f"codec {result['codec']}: compression ratio {result['compression_ratio_last']:.1f} at steady state "
            f"(last step), {result['compression_ratio']:.1f} over the run; {result['bytes_sent'] / 1e6:.2f} MB sent by "
            f"rank 0 instead of {result['raw_bytes'] / 1e6:.2f} MB"
        )
        if result["fallback_buckets"]:
            lines.append(
                f"fallback: {result['fallback_buckets']} gradient bucket(s) went back to plain all-reduce, which the "
                "first steps timed faster on this link (strategy option fallback: false always compresses)"
            )
        lines += result.get("codec_report", [])
        if result.get("level_steps"):
            counts = ", ".join(f"{n} at {level}" for level, n in result["level_steps"].items())
            lines.append(f"adaptive compression level (steps at each level, 1 = the codec's setting): {counts}")
        if trainer.logger is not None and trainer.logger.log_dir:
            lines.append(f"TensorBoard: tensorboard --logdir {trainer.logger.log_dir}")
        return "\n".join(lines)


def _adaptive(trainer: pl.Trainer) -> AdaptiveCompression | None:
    # a trainer stand-in (a benchmark's, a test's) may have no callbacks
    return next((cb for cb in getattr(trainer, "callbacks", ()) if isinstance(cb, AdaptiveCompression)), None)


def _class_name(obj: Any) -> str | None:
    return None if obj is None else type(obj).__name__


def _module_hparams(module: Any) -> dict[str, Any]:
    return dict(getattr(module, "hparams", None) or {})


def _hyperparameters(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """What distinguishes one run from another: model, data, codec, world size."""
    codec = getattr(trainer.strategy, "codec", None)
    params: dict[str, Any] = {
        **{f"data/{k}": v for k, v in _module_hparams(trainer.datamodule).items()},
        **{f"model/{k}": v for k, v in _module_hparams(pl_module).items()},
        "world_size": trainer.world_size,
        "codec": codec.name if codec is not None else "ddp",
    }
    if codec is not None:
        params.update({f"codec_options/{k}": v for k, v in codec.config().items()})
    return params
