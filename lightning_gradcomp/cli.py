"""Command-line pieces the recipes share: codec options, the trainer, and the final report.

A recipe stays one readable file about its task (data, model, metric); what every recipe does
the same way lives here, so that ``--codec-option``, checkpoints, TensorBoard and the printed
compression summary mean the same thing in each of them::

    parser = argparse.ArgumentParser()
    add_compression_args(parser)
    add_trainer_args(parser)
    args = parser.parse_args()
    check_codec_args(parser, args)          # a bad codec or option: an argparse error, not a traceback
    trainer = build_trainer(args, "my_task", history_metric="val/acc")  # optional: metric per validation
    ...
    result = report(trainer, args, "my_task", metrics, wall_s)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import warnings
from pathlib import Path
from typing import Any

__all__ = [
    "CODEC_CALLBACKS",
    "ValidationHistory",
    "add_compression_args",
    "add_trainer_args",
    "build_trainer",
    "check_codec_args",
    "codec_callbacks",
    "int_or_float",
    "parse_codec_options",
    "print_report",
    "report",
]

#: codec -> the callback that logs its schedule, attached by default (imported lazily, see
#: :func:`codec_callbacks`). These only log and never change what the codec does, so a recipe run
#: trains the codec exactly as ``CompressedDDPStrategy(codec=...)`` alone does. ``ThetaDecay`` is
#: not among them: it lowers fft's compression over the run (to theta 0.5 by default, about 5x),
#: so it is the user's choice to add.
CODEC_CALLBACKS = {"gradiveq": "PCAWarmup", "lgc": "AutoencoderWarmup"}


def add_compression_args(parser: argparse.ArgumentParser, default_codec: str = "topk") -> None:
    """``--codec``, ``--codec-option KEY=VALUE`` (repeatable), ``--codec-options JSON``, ``--stats-every``."""
    g = parser.add_argument_group("compression")
    g.add_argument("--codec", default=default_codec, help=f"registered codec name (default: {default_codec})")
    g.add_argument("--codec-option", action="append", default=[], metavar="KEY=VALUE",
                   help="codec option, repeatable; the value is read as JSON when it parses (ratio=0.01, error_feedback=false)")
    g.add_argument("--codec-options", default=None, metavar="JSON", help='codec options as a JSON object, e.g. \'{"ratio": 0.01}\'')
    g.add_argument("--stats-every", type=int, default=10, help="sample gradcomp/rel_error every N steps (default 10)")
    g.add_argument("--no-codec-callbacks", action="store_true", help="do not attach the callbacks the codec needs")
    g.add_argument("--no-fallback", action="store_true",
                   help="always compress, even where the first steps find plain all-reduce faster (accuracy studies)")


def add_trainer_args(parser: argparse.ArgumentParser, *, checkpoints: bool = True) -> None:
    """Hardware, step budget and outputs: the options every recipe passes to ``lightning.Trainer``."""
    g = parser.add_argument_group("hardware")
    g.add_argument("--accelerator", default="cpu", help="cpu | gpu | auto (default cpu)")
    g.add_argument("--devices", default="2", help="processes per node (default 2)")
    g.add_argument("--num-nodes", type=int, default=1)
    g.add_argument("--num-workers", type=int, default=None, help="data loader workers (default 0 on CPU, 4 otherwise)")
    g.add_argument("--precision", default=None, help="Lightning precision, e.g. 16-mixed on GPU")
    g = parser.add_argument_group("budget")
    g.add_argument("--max-epochs", type=int, default=None, help="default 1 when --max-steps is not given")
    g.add_argument("--max-steps", type=int, default=-1)
    g.add_argument("--limit-train-batches", default=None, help="int (batches) or float (fraction) per epoch")
    g.add_argument("--limit-val-batches", default=None, help="int (batches) or float (fraction)")
    g.add_argument("--val-every-n-epochs", type=int, default=1)
    g.add_argument("--val-every-n-steps", type=int, default=None, metavar="N",
                   help="validate every N optimizer steps, counted across epochs (Lightning's val_check_interval=N "
                        "with check_val_every_n_epoch=None); replaces --val-every-n-epochs")
    g.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("outputs")
    g.add_argument("--log-dir", default="lightning_logs", help="TensorBoard root (default ./lightning_logs)")
    g.add_argument("--log-every-n-steps", type=int, default=10)
    if checkpoints:
        g.add_argument("--ckpt-every-n-steps", type=int, default=None, help="checkpoint every N steps instead of every epoch end")
        g.add_argument("--ckpt-path", default=None, help="checkpoint to resume from (e.g. .../checkpoints/last.ckpt)")
    g.add_argument("--metrics-json", default=None, metavar="PATH", help="write final metrics, bytes sent and compression ratio")


def parse_codec_options(json_text: str | None, pairs: list[str]) -> dict[str, Any]:
    """``--codec-options '{...}'`` merged with repeated ``--codec-option key=value``."""
    opts = json.loads(json_text) if json_text else {}
    if not isinstance(opts, dict):
        raise ValueError("--codec-options must be a JSON object")
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--codec-option expects KEY=VALUE, got {pair!r}")
        try:
            opts[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            opts[key.strip()] = value  # a bare string such as mode=exact
    return opts


def check_codec_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Merge the codec options into ``args.codec_options`` and build the codec once, before any
    process starts, so an unknown name or option ends in a usage message naming the valid choices."""
    if getattr(args, "max_epochs", 0) is None:
        args.max_epochs = 1 if args.max_steps == -1 else -1
    try:
        args.codec_options = parse_codec_options(args.codec_options, args.codec_option)
        from lightning_gradcomp import make_codec

        make_codec(args.codec, **args.codec_options)
    except (KeyError, ValueError, TypeError) as err:
        parser.error(str(err).strip("'\""))


def codec_callbacks(codec: str) -> list:
    """The callbacks ``codec`` needs (e.g. GradiVeQ's PCA warm-up), if the package provides them."""
    name = CODEC_CALLBACKS.get(codec)
    if name is None:
        return []
    try:
        import lightning_gradcomp.callbacks as cbs

        return [getattr(cbs, name)()]
    except (ImportError, AttributeError) as err:
        warnings.warn(f"codec {codec!r} usually runs with the {name} callback, which is unavailable ({err})")
        return []


def int_or_float(value: str | None) -> int | float | None:
    """Lightning's ``limit_*_batches``: an int is a count, a float a fraction."""
    if value is None:
        return None
    return float(value) if "." in value else int(value)


class ValidationHistory:
    """Records ``metric`` (a key of ``trainer.callback_metrics``) with the global step after every
    validation run, on rank 0, for time-to-accuracy curves; :func:`report` adds the points to the
    metrics JSON as ``history: [{"step": int, "metric": float}, ...]``. A validation at a step
    already recorded (the recipes validate once more when the budget ends between validations)
    replaces that point. The points are saved in checkpoints, so a resumed run keeps the earlier ones.

    ``ValidationHistory("val/acc")`` is a ``lightning.pytorch.callbacks.Callback``: the subclass that
    adds the Callback base is made on first use, so that this module imports without Lightning."""

    def __new__(cls, metric: str):
        if cls is ValidationHistory:
            cls = _validation_history_callback()
        return super().__new__(cls)

    def __init__(self, metric: str) -> None:
        self.metric = metric
        self.history: list[dict[str, Any]] = []

    @property
    def state_key(self) -> str:
        return f"ValidationHistory[{self.metric}]"

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero or self.metric not in trainer.callback_metrics:
            return
        point = {"step": int(trainer.global_step), "metric": float(trainer.callback_metrics[self.metric])}
        if self.history and self.history[-1]["step"] == point["step"]:
            self.history[-1] = point
        else:
            self.history.append(point)

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))

    def __reduce__(self):  # copies and pickles rebuild the Callback subclass through ValidationHistory(metric)
        return ValidationHistory, (self.metric,), {"history": list(self.history)}


@functools.cache
def _validation_history_callback() -> type:
    from lightning.pytorch.callbacks import Callback

    return type("ValidationHistory", (ValidationHistory, Callback), {"__module__": __name__})


def build_trainer(args: argparse.Namespace, name: str, *, history_metric: str | None = None, **trainer_options: Any):
    """A ``lightning.Trainer`` with ``CompressedDDPStrategy(args.codec)``, the codec's callbacks,
    TensorBoard under ``args.log_dir/name`` and, when the recipe takes ``--ckpt-*``, a
    ``ModelCheckpoint`` that keeps ``last.ckpt``. With ``history_metric`` (e.g. ``"val/acc"``), a
    :class:`ValidationHistory` of that metric. ``--val-every-n-steps N`` validates every N steps
    across epochs. ``trainer_options`` override the defaults."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_gradcomp import CompressedDDPStrategy

    callbacks: list = []
    checkpoints = hasattr(args, "ckpt_every_n_steps")
    if checkpoints:
        callbacks.append(ModelCheckpoint(filename="{epoch}-{step}", save_last=True, every_n_train_steps=args.ckpt_every_n_steps))
    if not args.no_codec_callbacks:
        callbacks += codec_callbacks(args.codec)
    if history_metric is not None:
        callbacks.append(ValidationHistory(history_metric))
    options: dict[str, Any] = dict(
        accelerator=args.accelerator,
        devices=int(args.devices) if args.devices.isdigit() else args.devices,
        num_nodes=args.num_nodes,
        strategy=CompressedDDPStrategy(
            codec=args.codec,
            codec_options=args.codec_options,
            stats_every=args.stats_every,
            fallback=False if getattr(args, "no_fallback", False) else None,
        ),
        precision=args.precision,
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        limit_train_batches=int_or_float(args.limit_train_batches),
        limit_val_batches=int_or_float(args.limit_val_batches),
        check_val_every_n_epoch=args.val_every_n_epochs,
        logger=TensorBoardLogger(args.log_dir, name=name, default_hp_metric=False),
        log_every_n_steps=args.log_every_n_steps,
        callbacks=callbacks,
        enable_checkpointing=checkpoints,
        num_sanity_val_steps=0,  # CPU budgets are short; the final validation runs anyway
        enable_progress_bar=sys.stdout.isatty(),  # no bar in log files
    )
    val_every_n_steps = getattr(args, "val_every_n_steps", None)
    if val_every_n_steps:  # Lightning counts an int interval across epochs only without an epoch rule
        options.update(val_check_interval=val_every_n_steps, check_val_every_n_epoch=None)
    options.update(trainer_options)
    return L.Trainer(**options)


def report(trainer: Any, args: argparse.Namespace, recipe: str, metrics: dict[str, float], wall_s: float) -> dict[str, Any]:
    """Final numbers: task metrics and what the codec sent (this rank's bytes, ring estimate), the
    run's seed, model and batch size per process where the recipe has them, and the
    :class:`ValidationHistory` when the trainer records one."""
    state = trainer.strategy.hook_state
    totals = state.stats.totals if state is not None else None
    last = state.stats.last if state is not None else None
    sent = float(totals.wire_bytes) if totals else 0.0
    raw = float(totals.raw_wire_bytes) if totals else 0.0  # what plain fp32 all-reduce would have sent
    result = {
        "recipe": recipe,
        "codec": args.codec,
        "codec_options": args.codec_options,
        "world_size": trainer.world_size,
        "steps": trainer.global_step,
        "metrics": metrics,
        "bytes_sent": sent,
        "raw_bytes": raw,
        "compression_ratio": raw / sent if sent > 0 else 1.0,
        "compression_ratio_last": last.compression_ratio if last is not None else 1.0,
        "fallback_buckets": len(state.fallback.fallback) if state is not None else 0,
        "wall_s": wall_s,
    }
    result.update({k: getattr(args, k) for k in ("seed", "model", "batch_size") if hasattr(args, k)})
    history = next((cb for cb in trainer.callbacks if isinstance(cb, ValidationHistory)), None)
    if history is not None:
        result["history"] = history.history
    return result


def print_report(trainer: Any, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """On rank 0: the compression summary, where TensorBoard logs went, and ``--metrics-json``."""
    if not trainer.is_global_zero:
        return
    opts = f" {json.dumps(args.codec_options)}" if args.codec_options else ""
    print(
        f"codec {args.codec}{opts}: compression ratio {result['compression_ratio']:.2f} overall, "
        f"{result['compression_ratio_last']:.2f} at the last step; {result['bytes_sent'] / 1e6:.2f} MB sent by rank 0 "
        f"instead of {result['raw_bytes'] / 1e6:.2f} MB in {result['steps']} steps ({result['wall_s']:.0f} s)"
    )
    if result.get("fallback_buckets"):
        print(
            f"fallback: {result['fallback_buckets']} gradient bucket(s) went back to plain all-reduce, which the first "
            "steps timed faster on this link (--no-fallback always compresses)"
        )
    print(f"TensorBoard: tensorboard --logdir {trainer.logger.log_dir}")
    if args.metrics_json:
        Path(args.metrics_json).write_text(json.dumps(result, indent=2))
