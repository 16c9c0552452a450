"""``CompressedDDPStrategy``: Lightning's DDP with a gradient codec as the communication hook."""

from __future__ import annotations

import atexit
import inspect
import logging
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.constants import default_pg_timeout
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_gradcomp.codecs.base import Codec, MultiRound
from lightning_gradcomp.codecs.options import check_choice, check_positive_int, harness_defaults_that_apply
from lightning_gradcomp.comm import gather_rank_states
from lightning_gradcomp.hook import (
    NONFINITE_POLICIES,
    CodecHookState,
    codec_hook,
    group_device,
)
from lightning_gradcomp.hook.state import from_bucket_order, read_in_bucket_order
from lightning_gradcomp.registry import resolve_codec  # it lived here: this import path still works

__all__ = ["CompressedDDPStrategy", "resolve_codec"]

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "gradcomp"
_CHECKPOINT_VERSION = 1


def _is_adaptive(param_group: dict[str, Any]) -> bool:
    """Adam and its kin: per-coordinate step sizes from moving averages of their own (``betas``)."""
    return "betas" in param_group


#: how Lightning's DDPStrategy starts the local processes (its ``start_method``)
START_METHODS = ("popen", "spawn", "fork", "forkserver")


class _DestroyProcessGroupAtExit:
    """Destroys the default process group when the interpreter exits, unless the last run failed.

    The hook's futures run Python callbacks on the backend's threads (gloo's workers), and such a
    thread may drop its last reference to a callback just after the step that waited on it. If the
    interpreter is already shutting down then, the thread cannot take the GIL and the process
    aborts ("terminate called without an active exception") after a run that finished. Destroying
    the group at exit, while the interpreter still runs, joins those threads first; Lightning does
    the same for NCCL only. After a failed run it is left alone: a peer may still wait in a
    collective that destroying the group would wait for.
    """

    def __init__(self) -> None:
        self.registered = False
        self.last_run_failed = False

    def register(self) -> None:
        self.last_run_failed = False
        if not self.registered:
            atexit.register(self)
            self.registered = True

    def __call__(self) -> None:
        if not self.last_run_failed and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


_DESTROY_AT_EXIT = _DestroyProcessGroupAtExit()


class CompressedDDPStrategy(DDPStrategy):
    """Distributed data parallel training with compressed gradient communication.

    A :class:`~lightning.pytorch.strategies.DDPStrategy` whose gradient all-reduce is replaced by a
    codec, on CPU (gloo) and GPU (nccl) alike: Lightning's own strategy registers communication
    hooks only on CUDA, this one always does. When the interpreter exits after a run that
    finished, it destroys the default process group, whatever the backend (Lightning does so for
    NCCL only), so that no backend thread still holds one of the hook's callbacks then.

    Args:
        codec: a registered codec name (see :func:`lightning_gradcomp.available_codecs`) or a
            :class:`~lightning_gradcomp.codecs.base.Codec` object.
        codec_options: hyper-parameters of the named codec (``make_codec(codec, **codec_options)``).
            Beside an Adam-like optimizer a named codec takes its ``adaptive_optimizer_defaults``
            for the options not given here (``lgc``: ``ratio=0.14, light_ratio=0.5, dense_layers="none",
            max_recon_error=0.35, support="union"``).
        stats_every: sample the relative compression error every this many steps.
        nonfinite: what happens when any rank's gradient holds a NaN or an Inf: ``"skip"`` the
            optimizer step on every rank (default), step with the bad buckets ``"zero"``-ed, or
            ``"raise"`` a ``FloatingPointError`` on every rank.
        fallback: time plain and compressed steps (and each bucket) over the first compressed
            steps, and send plainly when compression costs more than it saves (decided together
            by all ranks, logged as ``gradcomp/fallback_buckets``; see
            :mod:`lightning_gradcomp.fallback`). ``False`` always compresses; ``None`` (default)
            is on unless ``LIGHTNING_GRADCOMP_FALLBACK=0``.
        adaptive_level: set the codec's compression level from the gradient's norm
            (:class:`~lightning_gradcomp.callbacks.AdaptiveCompression`, Accordion's rule): ``False``:
            off; ``True``: on with the callback's defaults; a dict: the callback's arguments
            (``{"eta": 0.5, "interval": 50}``); ``None`` (default): on for ``codec="lgc"``,
            ``codec="gradiveq"`` and ``codec="iwp"`` (measured to train clearly better with it,
            docs/benchmarks.md; ``gradiveq`` holding its light level (``high_level=0``: 16
            components on every step), beside SGD and beside an Adam-like optimizer (the codec's
            ``adaptive_optimizer_controller``), ``lgc`` and ``iwp`` with ``lr_reference="peak"``
            beside an Adam-like optimizer; ``iwp``
            with ``lr_scaled_feedback=True`` whenever the controller runs: its
            ``adaptive_harness_defaults``) and
            ``codec="auto"`` (its accuracy budget: no heavy arm in a critical regime), off for every
            other codec. The codec must be adjustable (``topk``, ``iwp``, ``qsgd``, ``powersgd``,
            ``gradiveq``, ``fft``, ``lgc``, ``auto``). An ``AdaptiveCompression`` among the trainer's callbacks is
            kept as given instead.
        **kwargs: everything else :class:`~lightning.pytorch.strategies.DDPStrategy` takes
            (``process_group_backend``, ``timeout``, ``start_method``, ...) and the options of
            :class:`torch.nn.parallel.DistributedDataParallel` (``find_unused_parameters``,
            ``static_graph``, ``bucket_cap_mb``, ...).

    Raises:
        ValueError: for an unknown codec name, an invalid codec option, DDP hook arguments
            (this strategy owns the hook), or an ``adaptive_level`` the codec cannot follow or whose
            arguments are invalid, before any process starts.

    Example::

        from lightning.pytorch import Trainer
        from lightning_gradcomp import CompressedDDPStrategy

        trainer = Trainer(accelerator="cpu", devices=2, strategy=CompressedDDPStrategy(codec="topk"))
    """

    strategy_name = "compressed_ddp"

    def __init__(
        self,
        codec: str | Codec = "none",
        codec_options: dict[str, Any] | None = None,
        *,
        stats_every: int = 10,
        nonfinite: str = "skip",
        fallback: bool | None = None,
        adaptive_level: bool | dict[str, Any] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        for owned in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
            if kwargs.get(owned) is not None:
                raise ValueError(
                    f"CompressedDDPStrategy registers its own communication hook; {owned!r} is not accepted. "
                    "Pick a codec instead (codec=...), or use lightning's DDPStrategy for a custom hook."
                )
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {list(NONFINITE_POLICIES)}, got {nonfinite!r}")
        check_positive_int("stats_every", stats_every)
        if fallback is not None and not isinstance(fallback, bool):
            raise ValueError(f"fallback must be True, False or None (the environment decides), got {fallback!r}")
        check_choice("start_method", start_method, START_METHODS)
        if timeout is not None and not isinstance(timeout, timedelta):
            raise ValueError(f"timeout must be a datetime.timedelta or None, got {timeout!r}")
        self.codec = resolve_codec(codec, codec_options)
        # the options a user set (all of them for a codec object): adaptive_optimizer_defaults
        # replace only the others
        self._options_given = None if not isinstance(codec, str) else frozenset(codec_options or ())
        self.stats_every = stats_every
        self.nonfinite = nonfinite
        self.fallback = fallback
        self.adaptive_level = adaptive_level
        # check now too what setup may change on the controller beside an Adam-like optimizer
        self._adaptive_callback = _adaptive_callback(
            adaptive_level, self.codec, optimizer_controller=self._sets_optimizer_controller
        )
        if self._adaptive_callback is not None and self._options_given is not None:
            # options a codec takes together with the controller's light steps, where not given
            # (a codec object is kept as it is); the codec has seen no process yet
            defaults = harness_defaults_that_apply(
                self.codec.adaptive_harness_defaults, self.codec.harness.error_feedback
            )
            taken = {k: v for k, v in defaults.items() if k not in self._options_given}
            if taken:
                self.codec.adopt_defaults(taken)
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
            **kwargs,
        )
        self.hook_state: CodecHookState | None = None
        self._pending_checkpoint: dict[str, Any] | None = None
        # the gradcomp part of the checkpoint this run resumed from (its codec's options, and what
        # that run took beside an Adam-like optimizer), kept until setup has used it
        self._resumed_from: dict[str, Any] | None = None
        # what this run took beside an Adam-like optimizer; its checkpoints record it
        self._optimizer_defaults: dict[str, dict[str, Any]] = {"options": {}, "controller": {}}

    @property
    def _sets_optimizer_controller(self) -> bool:
        """Whether setup, beside an Adam-like optimizer, sets the codec's
        ``adaptive_optimizer_controller`` on the level controller: only on the one this strategy
        attaches by default to a codec named by a string (a user's ``adaptive_level`` and a codec
        object are kept as given)."""
        return self.adaptive_level is None and self._options_given is not None

    # ----------------------------------------------------------------------------------------------
    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        # the level controller that adaptive_level asks for is attached here, the first moment the
        # strategy sees the trainer: before the callbacks' setup hooks, and before Lightning restores
        # the callbacks' state from a checkpoint (a resumed run goes on at the level it recorded);
        # a user's instance is kept as given
        trainer = getattr(model, "_trainer", None)
        callback = self._adaptive_callback
        if trainer is not None and callback is not None:
            if not any(isinstance(cb, type(callback)) for cb in trainer.callbacks):
                trainer.callbacks.append(callback)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        # the hook can only count; a callback turns its numbers, and the scalars a learned codec
        # reports (LearnedState.scalars), into logged scalars. The codec's own schedule callbacks
        # come too (lgc's end-of-fit summary): with no arguments they change nothing, so a run
        # with or without them trains the same; a user's instance is kept as given
        from lightning_gradcomp.callbacks import schedule_callbacks
        from lightning_gradcomp.callbacks.monitor import CompressionMonitor

        for callback in [CompressionMonitor(), *schedule_callbacks(self.codec)]:
            if not any(isinstance(cb, type(callback)) for cb in trainer.callbacks):
                trainer.callbacks.append(callback)
        self._check_optimizer_momentum()
        self._adopt_adaptive_optimizer_defaults()
        self._warn_options_differ_from_checkpoint()
        self._resumed_from = None
        self._warn_sparse_codec_with_adaptive_optimizer(trainer)
        self._warn_nothing_to_compress()

    def _warn_nothing_to_compress(self) -> None:
        """Warn once when the codec would compress none of the model's trainable parameters (all
        smaller than ``min_numel``, or kept dense by the layer policy): the run then trains as
        plain DDP while its logs name a codec. Checked after the Adam-like defaults, which may
        change the layer policy."""
        codec, module = self.codec, self.lightning_module
        if self.hook_state is None or codec.name == "none" or module is None:
            return
        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not trainable or any(codec.compresses_parameter(n, p) for n, p in trainable):
            return
        largest = max(p.numel() for _, p in trainable)
        rank_zero_warn(
            f"codec {codec.name!r} compresses none of this model's {len(trainable)} trainable parameters: "
            f"{codec.nothing_compressed_hint(largest)}."
        )

    def _adopt_adaptive_optimizer_defaults(self) -> None:
        """Beside an Adam-like optimizer, set the codec's ``adaptive_optimizer_defaults`` for the
        options the user did not give, and its ``adaptive_optimizer_controller`` on the level
        controller this strategy attached by default (a codec given as an object is kept as it
        is, with its controller). The optimizers exist only now, after the hook was set up and
        the ranks compared the codec's options, but before the first step; every rank builds the
        same optimizers, so every rank makes the same change. A resumed run takes what its
        checkpoint recorded instead (for a checkpoint of an earlier version, which recorded only
        its options: their values, and the controller's default rule), so that a run goes on with
        the settings it started with when a later version changes these defaults."""
        self._optimizer_defaults = {"options": {}, "controller": {}}
        if self._options_given is None or self.hook_state is None:
            return
        if not any(_is_adaptive(g) for opt in self.optimizers for g in opt.param_groups):
            return
        defaults = self.codec.optimizer_defaults()
        controller = dict(self.codec.adaptive_optimizer_controller)
        resumed = self._resumed_from
        if resumed is not None:
            # a resumed run takes what the run that wrote its checkpoint took, even where this
            # version's defaults differ: the run goes on as it started
            recorded = resumed.get("optimizer_defaults")
            if recorded is not None:
                defaults, controller = dict(recorded["options"]), dict(recorded["controller"])
            else:
                # written before checkpoints recorded it: the values that run had for the options
                # this version adopts, and the controller's arguments of then (its default rule)
                saved = resumed.get("options", {})
                defaults, controller = {k: saved[k] for k in defaults if k in saved}, {}
        # config() holds the values as a checkpoint records them (a layer policy as a list)
        current = self.codec.config()
        changes = {k: v for k, v in defaults.items() if k not in self._options_given and current.get(k) != v}
        if changes:
            self.codec.adopt_defaults(changes)
            if "dense_layers" in changes and isinstance(self.model, DistributedDataParallel):
                # the layer plan was made when the hook was registered; no bucket has been sent
                self.codec.plan_layers(self.model.module.named_parameters())
            log.info(f"{type(self).__name__}: codec {self.codec.name!r} beside an Adam-like optimizer: {changes}")
        config = self.codec.config() if changes else current
        taken = {k: config[k] for k in defaults if k not in self._options_given}
        self._optimizer_defaults["options"] = taken
        callback = self._adaptive_callback
        if controller and self._sets_optimizer_controller and callback is not None:
            # only the controller this strategy attached by default; a user's arguments are kept
            for name, value in controller.items():
                setattr(callback, name, value)
            self._optimizer_defaults["controller"] = controller
            log.info(f"{type(self).__name__}: its level controller beside an Adam-like optimizer: {controller}")

    def _warn_options_differ_from_checkpoint(self) -> None:
        """A run resumed with codec options other than those its checkpoint recorded goes on with
        its own (the residuals and learned state are restored all the same); say which differ, so
        that a change of settings, or of a default between versions, is not silent."""
        saved = (self._resumed_from or {}).get("options")
        if not saved:
            return
        current = self.codec.config()
        differ = sorted(k for k in saved.keys() & current.keys() if saved[k] != current[k])

        def both(keys: list[str]) -> str:
            return ", ".join(f"{k}={saved[k]!r} there, {current[k]!r} here" for k in keys)

        # an option that only codes the messages otherwise trains the same: information, not a warning
        coding = [k for k in differ if k in self.codec.lossless_options]
        differ = [k for k in differ if k not in self.codec.lossless_options]
        if coding:
            rank_zero_info(
                f"the checkpoint's codec {self.codec.name!r} coded its messages otherwise: {both(coding)}. "
                "That changes the bytes, not what the ranks receive, so the run trains as it would have."
            )
        if differ:
            rank_zero_warn(
                f"the checkpoint's codec {self.codec.name!r} ran with other options than this run: {both(differ)}. "
                "The run goes on with this run's options; give the checkpoint's in codec_options to continue "
                "as it ran."
            )
        # an option the checkpoint recorded and this version does not have (removed or renamed):
        # it cannot be given back, so the run cannot continue exactly as it ran; say so once
        unknown = sorted(saved.keys() - current.keys())
        if unknown:
            pairs = ", ".join(f"{k}={saved[k]!r}" for k in unknown)
            rank_zero_warn(
                f"the checkpoint's codec {self.codec.name!r} ran with options this version does not have: "
                f"{pairs}. They are ignored; the run goes on with this version's options."
            )

    def _warn_sparse_codec_with_adaptive_optimizer(self, trainer: pl.Trainer) -> None:
        """Warn once when a sparsifying codec with error feedback meets Adam-like optimizers.

        Such a codec sends a few entries of each layer and delays the rest in its residual, so a
        coordinate arrives every few dozen steps as one large, stale gradient (letting Adam move it
        as far as a dense one made ``topk`` worse, docs/codecs/lgc.md). On PSPNet/CamVid
        with AdamW this cost 5-7 points of mIoU where codecs that send a dense update lost about
        one; ``adaptive_level=True`` narrowed it to about four for ``lgc`` with its learned code
        carrying the values, and ``lgc``'s defaults beside Adam (its
        ``adaptive_optimizer_defaults``: a union support of 14 %, half of each layer at the
        light steps, the end layers compressed, the controller's peak rule, the guard at 0.35)
        to 1.3 over eight seeds, where PowerSGD under the same controller and rule lost 0.6
        (since then what travels exactly goes in bfloat16 there too: -0.07 against fp32 on four
        fresh seeds)
        (docs/codecs/lgc.md, "Beside Adam"). SGD with
        momentum is no remedy there: the same
        recipe with SGD lost 13.6 points with ``lgc``. A warning, not an error: nothing is wrong,
        it is a measured loss of accuracy the user should know of.
        """
        codec = self.codec
        if not (codec.sparse_local and codec.harness.error_feedback):
            return
        adaptive = sorted({type(opt).__name__ for opt in self.optimizers for g in opt.param_groups if _is_adaptive(g)})
        if adaptive:
            from lightning_gradcomp.callbacks.adaptive import AdaptiveCompression

            controlled = any(isinstance(cb, AdaptiveCompression) for cb in trainer.callbacks)
            remedy = (
                "the level controller (on here) compresses lightly in the critical phases; with it, a 14 % union "
                "support and light steps at half of each layer (lgc's defaults beside Adam) lgc measured -1.3 over "
                "eight seeds, PowerSGD -0.6, and with the light steps' values scaled per output channel (this "
                "version's defaults) -0.4 and -1.1 over eight seeds on each of two machines"
                if controlled
                else "compressing lightly in the critical phases (adaptive_level=True) with a 14 % union support "
                "(lgc's defaults beside Adam, where its controller is on) brought lgc to -1.3 over eight seeds, and "
                "with codec_options={'lr_scaled_feedback': True} topk to -2.7 over two (iwp's defaults, with both: "
                "-2.8 over six)"
            )
            rank_zero_warn(
                f"codec {codec.name!r} sends a sparse part of each layer and delays the rest (error feedback); "
                f"with {', '.join(adaptive)} (per-coordinate step sizes) this trained clearly worse than plain "
                "all-reduce in our measurements (PSPNet/CamVid, AdamW: lgc -5.8 mIoU), while codecs that send a "
                f"dense update ('powersgd', 'fft') stayed close; {remedy}. See docs/benchmarks.md, 'Segmentation'."
            )

    def _check_optimizer_momentum(self) -> None:
        """With momentum correction the codec owns momentum (and weight decay): an optimizer that
        adds its own would apply them twice, so refuse it before the first step."""
        codec = self.codec
        momentum, weight_decay = codec.harness.momentum, codec.harness.weight_decay
        if not momentum:
            return
        if getattr(self.precision_plugin, "scaler", None) is not None:
            # the bucket then holds gradients times the loss scale, which changes during the run:
            # the velocity would mix scales and the codec's weight decay would shrink by it
            raise ValueError(
                "momentum correction needs unscaled gradients in the hook: precision='16-mixed' scales the loss "
                "(GradScaler). Use precision='bf16-mixed' or '32-true', or momentum=0 in the codec."
            )
        for opt in self.optimizers:
            for group in opt.param_groups:
                if _is_adaptive(group):
                    raise ValueError(
                        f"the codec applies momentum correction (momentum={momentum}), which is SGD momentum "
                        f"moved into the codec; {type(opt).__name__} keeps its own moment estimates (betas="
                        f"{group['betas']}) and would apply momentum twice. Use torch.optim.SGD(params, lr, "
                        "momentum=0), or momentum=0 in the codec."
                    )
                if group.get("momentum", 0) or (weight_decay and group.get("weight_decay", 0)):
                    raise ValueError(
                        f"the codec applies momentum correction (momentum={momentum}"
                        f"{f', weight_decay={weight_decay}' if weight_decay else ''}), so the optimizer "
                        f"must not add its own: {type(opt).__name__} has momentum={group.get('momentum', 0)}, "
                        f"weight_decay={group.get('weight_decay', 0)}. Use torch.optim.SGD(params, lr, momentum=0"
                        f"{', weight_decay=0' if weight_decay else ''}) and give them to the codec."
                    )

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        _DESTROY_AT_EXIT.register()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        _DESTROY_AT_EXIT.last_run_failed = True

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning's DDPStrategy registers hooks only when the device is CUDA; we always do.
        assert isinstance(self.model, DistributedDataParallel)
        state = CodecHookState.for_model(
            self.codec,
            self.model.module,
            process_group=None,  # the default (WORLD) group; resolved inside the hook so the state pickles
            device=self.root_device,
            # schedules given as a fraction of the run (warm-ups) resolve against Lightning's estimate
            # of the run's optimizer steps, identical on every rank, before the ranks compare options
            total_steps=self._estimated_total_steps(),
            static_graph=bool(self._ddp_kwargs.get("static_graph", False)),
            stats_every=self.stats_every,
            nonfinite=self.nonfinite,
            fallback=self.fallback,
        )
        if self.hook_state is not None:  # a second fit() in the same process
            state.continue_from(self.hook_state)
        if self._pending_checkpoint is not None:
            self._apply_checkpoint(state, self._pending_checkpoint)
            self._pending_checkpoint = None
        if state.step > 0 and isinstance(self.codec, MultiRound) and self.codec.bucket_keyed_state:
            # this DDP wrapper will rebuild its buckets again: bucket-keyed state must wait
            state.first_compress_step = state.step + state.first_compress_step
        self.hook_state = state
        self.model.register_comm_hook(state, codec_hook)
        log.debug(f"{type(self).__name__}: registered {self.codec!r} on {self.root_device}")

    def _estimated_total_steps(self) -> int | None:
        """The run's optimizer steps as Lightning estimates them, or ``None`` outside ``fit`` or
        for an open-ended run (``max_steps=-1, max_epochs=-1``)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn != "fit":
            return None
        try:
            total = trainer.estimated_stepping_batches
        except Exception as err:  # no train dataloader length (an iterable dataset): say so, go on
            log.info(f"{type(self).__name__}: run length unknown ({err}); fraction schedules use their caps")
            return None
        return int(total) if total is not None and total != float("inf") else None

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        state = self.hook_state
        if state is not None and state.codec.harness.lr_scaled_feedback:
            # before the backward whose hook adds the residuals, in automatic and manual
            # optimization alike; again for every accumulated micro-batch, which changes nothing
            rates: dict[str, float] = {}
            for opt in self.optimizers:
                rates.update(_learning_rates(opt, state.param_names))
            state.rescale_residuals(rates)
        if state is not None and state.codec.harness.precondition:
            moments: dict[str, torch.Tensor] = {}
            for opt in self.optimizers:
                moments.update(_second_moments(opt, state.param_names))
            state.set_second_moments(moments)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        state = self.hook_state
        if state is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # Run forward and backward first, so the hook's verdict on non-finite gradients (which
        # every rank received in the same collective) is known before the optimizer steps.
        result: list[Any] = []

        def closure_once() -> Any:
            if not result:
                result.append(closure())
            return result[0]

        closure_once()
        if state.consume_skip():
            if self.nonfinite == "raise":
                raise FloatingPointError(
                    f"non-finite gradient at optimizer step {state.step - 1} on at least one rank "
                    "(CompressedDDPStrategy(nonfinite='raise'))"
                )
            if self.nonfinite == "skip":
                rank_zero_warn(f"non-finite gradient at step {state.step - 1}: optimizer step skipped on all ranks")
                return result[0]
        return super().optimizer_step(optimizer, closure_once, model, **kwargs)

    # ----------------------------------------------------------------------------------------------
    # checkpoints: Lightning has no hook for strategy state, so the strategy adds its own key
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.hook_state is not None:
            checkpoint[CHECKPOINT_KEY] = self.gradcomp_state_dict()  # a collective: runs on every rank
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning passes None through to torch.load, whose default an environment variable can
        # flip; our checkpoints hold only tensors and plain values, so load them safely unless the
        # caller asks otherwise (trainer.fit(..., weights_only=False) for a trusted file)
        if weights_only is None:
            weights_only = True
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._pending_checkpoint = checkpoint.get(CHECKPOINT_KEY)
        self._warn_controller_missing_from_checkpoint(checkpoint)
        return checkpoint

    def _warn_controller_missing_from_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A run resumed from a checkpoint whose run had no level controller, with the one this
        strategy attaches by default, goes on with it (from the level the codec recorded): say so,
        so that a codec that took the controller by default in a later version does not change a
        resumed run silently."""
        callback = self._adaptive_callback
        saved = checkpoint.get(CHECKPOINT_KEY)
        if self.adaptive_level is not None or callback is None or not saved or saved.get("codec") != self.codec.name:
            return
        if any(str(key).startswith(type(callback).__name__) for key in checkpoint.get("callbacks") or {}):
            return
        rank_zero_warn(
            f"the checkpoint's run had no level controller (AdaptiveCompression); codec {self.codec.name!r} takes "
            "one by default, so this run goes on with it from here, starting at the level the checkpoint recorded. "
            "adaptive_level=False continues as the checkpoint's run did."
        )

    def gradcomp_state_dict(self) -> dict[str, Any]:
        """The codec state of every rank: shared state once, per-rank residuals gathered.

        Must be called on every rank (it all-gathers the residuals).
        """
        state = self.hook_state
        assert state is not None
        ranks = gather_rank_states(state.rank_state_dict(), group_device(state.process_group), state.process_group)
        return {
            "version": _CHECKPOINT_VERSION,
            "codec": self.codec.name,
            "options": self.codec.config(),
            "optimizer_defaults": self._optimizer_defaults,
            "world_size": len(ranks),
            # per-parameter tensors are in each parameter's own order (hook.state.in_parameter_order)
            "parameter_order": True,
            "shared": state.state_dict(),
            "ranks": ranks,
        }

    def _apply_checkpoint(self, state: CodecHookState, saved: dict[str, Any]) -> None:
        if saved.get("codec") != self.codec.name:
            rank_zero_warn(
                f"the checkpoint's gradient codec was {saved.get('codec')!r}, this run uses {self.codec.name!r}: "
                "the codec starts fresh (no residuals, no learned state)"
            )
            return
        self._resumed_from = saved
        state.load_state_dict(saved["shared"])
        world = dist.get_world_size() if dist.is_initialized() else 1
        if saved["world_size"] != world:
            rank_zero_warn(
                f"the checkpoint was written by {saved['world_size']} ranks and this run has {world}: "
                "per-rank residuals cannot be mapped to the new ranks and start from zero; shared codec "
                "state (bases, learned weights, schedules, step) is restored"
            )
            return
        rank_state = saved["ranks"][dist.get_rank() if dist.is_initialized() else 0]
        if not saved.get("parameter_order"):
            rank_state = self._put_in_parameter_order(rank_state)
        state.load_rank_state_dict(rank_state, self.root_device)

    def _put_in_parameter_order(self, rank_state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint written before the hook read gradients in their parameters' order holds
        the residual and momentum of a dense, non-contiguous parameter (a ``channels_last``
        weight) in the order of its memory: put them in the parameter's order, and say that what
        a codec learned of such a layer stays as it was learned."""
        module = self.lightning_module
        moved = {n: p for n, p in module.named_parameters() if read_in_bucket_order(p)} if module is not None else {}
        if not moved:
            return rank_state
        rank_state = dict(rank_state)
        converted = set()
        for key, value in rank_state.items():
            kind, _, name = key.partition(".")
            if kind in ("residual", "momentum") and name in moved:
                rank_state[key] = from_bucket_order(value, moved[name])
                converted.add(name)
        if converted:  # a codec without error feedback or momentum saved nothing to put in order
            names = sorted(converted)
            rank_zero_warn(
                f"the checkpoint was written before the hook read each gradient in its parameter's order: the "
                f"residuals and momentum of the {len(names)} parameter(s) held in another memory order (e.g. "
                f"channels_last: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) were put in that order; "
                f"what codec {self.codec.name!r} learned of them is kept as it was learned"
            )
        return rank_state

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "compressed_ddp", cls, description="DDP with gradient compression (CompressedDDPStrategy)"
        )
        strategy_registry.register(
            "compressed_ddp_spawn",
            cls,
            description="DDP with gradient compression, processes started with spawn",
            start_method="spawn",
        )
        from lightning_gradcomp.registry import available_codecs

        for name in available_codecs():  # Trainer(strategy="compressed_ddp_topk") and the like
            strategy_registry.register(
                f"compressed_ddp_{name}", cls, description=f"DDP with the {name!r} gradient codec", codec=name
            )


def _adaptive_callback(
    adaptive_level: bool | dict[str, Any] | None, codec: Codec, optimizer_controller: bool = False
) -> Any:
    """The ``AdaptiveCompression`` that ``adaptive_level`` asks for (``None``: the codec's
    ``adaptive_by_default``, on for ``lgc``, ``gradiveq`` and ``auto``), built and checked against the codec now,
    before any process starts; with ``optimizer_controller`` also with the codec's
    ``adaptive_optimizer_controller`` on top, the arguments it takes beside an Adam-like optimizer."""
    if adaptive_level is None:
        adaptive_level = codec.adaptive_by_default  # a mapping: on, with the arguments measured for this codec
    if adaptive_level is False:
        return None
    if adaptive_level is True:
        arguments: dict[str, Any] = {}
    elif isinstance(adaptive_level, Mapping):
        arguments = dict(adaptive_level)
    else:
        raise ValueError(
            f"adaptive_level must be False, None, True or a dict of AdaptiveCompression's arguments, "
            f"got {adaptive_level!r}"
        )
    from lightning_gradcomp.callbacks.adaptive import AdaptiveCompression, check_adjustable

    check_adjustable(codec, "adaptive_level (AdaptiveCompression)")
    known = list(inspect.signature(AdaptiveCompression).parameters)
    unknown = sorted(set(arguments) - set(known))
    if unknown:
        raise ValueError(
            f"adaptive_level: AdaptiveCompression has no argument {', '.join(map(repr, unknown))}. "
            f"Its arguments: {', '.join(known)}"
        )
    if optimizer_controller and codec.adaptive_optimizer_controller:
        AdaptiveCompression(**{**arguments, **codec.adaptive_optimizer_controller})
    return AdaptiveCompression(**arguments)


def _named_parameters(optimizer: Any, param_names: dict[int, str]) -> Iterator[tuple[str, Any, dict, dict]]:
    """``(name, parameter, its group, its optimizer state)`` for every named parameter the
    optimizer steps (a LightningOptimizer is unwrapped to the torch one)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = param_names.get(id(p))
            if name is not None:
                yield name, p, group, optimizer.state.get(p, {})


def _learning_rates(optimizer: Any, param_names: dict[int, str]) -> dict[str, float]:
    """The learning rate of every named parameter the optimizer steps (per parameter group)."""
    return {name: float(group["lr"]) for name, _, group, _ in _named_parameters(optimizer, param_names)}


def _second_moments(optimizer: Any, param_names: dict[int, str]) -> dict[str, torch.Tensor]:
    """The per-coordinate second moment (``exp_avg_sq``: Adam and its kin) of every named
    parameter the optimizer has stepped; parameters without one are left out."""
    moments: dict[str, torch.Tensor] = {}
    for name, p, _, state in _named_parameters(optimizer, param_names):
        v = state.get("exp_avg_sq")
        if isinstance(v, torch.Tensor) and v.shape == p.shape:
            moments[name] = v
    return moments


if "compressed_ddp" not in StrategyRegistry:
    CompressedDDPStrategy.register_strategies(StrategyRegistry)
