"""``LightningCLI`` for compressed training: what the recipes add to Lightning's own CLI.

Everything else (``--config``, ``--print_config``, ``--trainer.*``, ``--model.*``, ``--data.*``,
``--ckpt_path``, saving ``config.yaml`` beside the logs) is LightningCLI's. This adds three things:

- **``fit`` when no subcommand is given**, with the recipe's YAML as the default configuration:
  ``python recipes/resnet_cifar10.py`` trains, ``python recipes/resnet_cifar10.py validate ...``
  still works;
- **the codec checked before any process starts:** the strategy in the configuration is built
  once at parse time, so an unknown codec, an option the codec does not have or a value out of
  range ends in a usage error that names the valid choices, not in a traceback on every rank;
- **``--report.*``**: a :class:`~lightning_gradcomp.callbacks.CompressionReport` added to the
  trainer's callbacks (``--report.metrics_json run.json``, ``--report.monitor val/acc``).

Example (a recipe's whole entry point)::

    def main(args=None):
        CompressedTrainingCLI(MyModule, MyDataModule, config=Path(__file__).parent / "configs/my.yaml", args=args)
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningCLI

from lightning_gradcomp.callbacks.report import CompressionReport

__all__ = ["CompressedTrainingCLI"]

SUBCOMMANDS = ("fit", "validate", "test", "predict")


class CompressedTrainingCLI(LightningCLI):
    """``LightningCLI`` with ``fit`` as the default subcommand, a default config file, the codec
    validated at parse time and ``--report.*`` options.

    Args:
        model_class, datamodule_class: as for ``LightningCLI``.
        config: YAML file(s) read as defaults by every subcommand (``--config`` files and
            command-line options override them).
        args: the command line without the program name (default ``sys.argv[1:]``); a list that
            does not start with a subcommand runs ``fit``.
        **kwargs: passed to ``LightningCLI``.
    """

    def __init__(
        self,
        model_class: Any = None,
        datamodule_class: Any = None,
        *,
        config: str | Path | Sequence[str | Path] | None = None,
        args: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        self._subcommands = kwargs.get("run", True)  # run=False: one parser, no subcommands
        if config is not None:
            files = [str(c) for c in ([config] if isinstance(config, (str, Path)) else config)]
            given = kwargs.pop("parser_kwargs", {})
            if self._subcommands:
                parser_kwargs = {sub: {"default_config_files": files} for sub in SUBCOMMANDS}
                for sub, extra in given.items():
                    parser_kwargs.setdefault(sub, {}).update(extra)
            else:
                parser_kwargs = {"default_config_files": files, **given}
            kwargs["parser_kwargs"] = parser_kwargs
        super().__init__(model_class, datamodule_class, args=args, **kwargs)

    def parse_arguments(self, parser: Any, args: Any) -> None:
        if self._subcommands and (args is None or isinstance(args, (list, tuple))):
            argv = list(sys.argv[1:] if args is None else args)
            if not argv or argv[0] not in SUBCOMMANDS:
                argv = ["fit", *argv]  # the subcommand a recipe is run for
            # parsed here rather than through LightningCLI, which warns when args and sys.argv
            # are both given (a recipe run from the shell with its subcommand filled in)
            self.config = parser.parse_args(argv)
            return
        super().parse_arguments(parser, args)

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(CompressionReport, "report")
        # a DataModule that draws random subsets takes the run's seed, so that --seed_everything
        # changes the data order and the subset together
        if self.datamodule_class is not None and "seed" in inspect.signature(self.datamodule_class).parameters:
            parser.link_arguments("seed_everything", "data.seed")

    def instantiate_classes(self) -> None:
        # a constructor that refuses a value (crop_size not a multiple of 8, ...) is a usage error
        try:
            super().instantiate_classes()
        except ValueError as err:
            self.parser.error(str(err))

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        strategy = config.get("trainer", {}).get("strategy")
        class_path = getattr(strategy, "class_path", None)
        if class_path is None:
            return
        from jsonargparse import Namespace

        from lightning_gradcomp.strategy import CompressedDDPStrategy

        module, _, name = class_path.rpartition(".")
        cls = getattr(importlib.import_module(module), name, None) if module else None
        if not (isinstance(cls, type) and issubclass(cls, CompressedDDPStrategy)):
            return
        init_args = strategy.get("init_args") or Namespace()
        init_args = init_args.as_dict() if isinstance(init_args, Namespace) else dict(init_args)
        try:
            cls(**init_args)  # builds the codec: checks its name, options and their ranges
        except (KeyError, ValueError, TypeError) as err:
            message = str(err).strip("'\"")  # a KeyError's text comes quoted
            self.parser.error(f"trainer.strategy ({cls.__name__}): {message}")
