"""The codec contract shared by every gradient compressor in the package.

A codec turns one layer's gradient (a flat fp32 tensor) into a *payload*, a short list of tensors
that travels over the network, and turns payloads back into a gradient. Everything else that every
codec needs (walking the DDP bucket, error feedback, the collective, statistics, non-finite
detection, warm-up before DDP rebuilds its buckets) lives once in :mod:`lightning_gradcomp.hook`,
:mod:`lightning_gradcomp.memory` and :mod:`lightning_gradcomp.comm`.

A codec declares how its payloads are combined across ranks with :attr:`Codec.collective`:

``"allreduce"``
    The payload is a linear function of the gradient (fp16 casts, PCA projections, anything on a
    shared support), so the sum of payloads is the payload of the sum. The hook all-reduces the
    payload itself and calls :meth:`Codec.decode` once on the sum.
``"allgather"``
    Payloads cannot be summed (each rank keeps different positions, or scales its values with
    its own norm). Every rank gathers every rank's fixed-size payload and calls
    :meth:`Codec.aggregate` on the list. Traffic grows with the number of ranks.
``"custom"``
    The codec runs its own protocol (several dependent rounds, or a wrapped third-party hook)
    through :meth:`Codec.communicate_bucket`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Literal, Mapping, Sequence

import torch
from torch import Tensor

from lightning_gradcomp import comm

# Re-exported from where they moved, so that every import of them from here keeps working (lgc.py,
# the callbacks, user codecs): the opt-in extensions to codecs/extensions.py, the options and their
# checks to codecs/options.py, DGC's density warm-up to codecs/sampling.py, and the layer policy
# (weight_layer_ends) to hook/layers.py, loaded on first use (see __getattr__ at the end).
from lightning_gradcomp.codecs.extensions import (  # noqa: F401
    AdjustableCompression,
    AdjustableLevel,
    BucketRouter,
    LearnedState,
    MultiRound,
    Prepared,
    geometric_level,
)
from lightning_gradcomp.codecs.options import (  # noqa: F401
    CodecOptions,
    HarnessOptions,
    check_bool,
    check_choice,
    check_fraction,
    check_positive_float,
    check_positive_int,
    check_run_steps,
    check_seed,
    harness_defaults_that_apply,
    run_steps,
)
from lightning_gradcomp.codecs.sampling import DensityWarmup, check_density_warmup  # noqa: F401

__all__ = [
    "Codec",
    "CodecOptions",
    "HarnessOptions",
    "LearnedState",
    "MultiRound",
    "Prepared",
    "AdjustableCompression",
    "AdjustableLevel",
    "BucketRouter",
    "geometric_level",
    "DensityWarmup",
    "check_density_warmup",
    "CodecContext",
    "RoundContext",
    "EncodeResult",
    "check_fraction",
    "check_bool",
    "check_seed",
    "check_positive_int",
    "check_choice",
    "check_positive_float",
    "check_run_steps",
    "run_steps",
    "weight_layer_ends",  # noqa: F822 (see __getattr__)
]

Collective = Literal["allreduce", "allgather", "custom"]
COLLECTIVES = ("allreduce", "allgather", "custom")


# --------------------------------------------------------------------------------------------------
# what a codec may know about its run, and the collectives it may run
@dataclass
class CodecContext:
    """The codec's view of the run, set by the hook before the first step (:meth:`Codec.setup`).

    ``group`` is the process group the hook communicates in (``None``: the default group). Every
    collective a codec runs goes through the methods below, which use that group and take ranks
    *within* it (``src=0`` is the group's first rank, whatever its global rank).
    """

    rank: int
    world_size: int
    device: torch.device
    group: Any = None

    # a process group cannot be pickled (spawned ranks): it is dropped, as the hook state drops its own
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "group": None}

    def __deepcopy__(self, memo: dict) -> CodecContext:  # a copy of a codec stays in its group
        return CodecContext(self.rank, self.world_size, self.device, self.group)

    def broadcast(self, t: Tensor, src: int) -> Tensor:
        """Broadcast ``t`` in place from group rank ``src``; blocking (hook body or step end only)."""
        return comm.broadcast(t, src, self.group, self.world_size)

    def all_gather(self, t: Tensor) -> Tensor:
        """Every group rank's equal-sized 1-D ``t`` as a ``(world_size, n)`` tensor; blocking."""
        return comm.all_gather(t, self.group, self.world_size)

    def all_reduce(self, t: Tensor, op: str = "sum") -> Tensor:
        """Reduce ``t`` in place over the group (``op``: "sum" or "max"); blocking."""
        return comm.all_reduce(t, op, self.group, self.world_size)

    def agree(self, value: int, what: str) -> None:
        """Raise on every rank unless every rank holds the same 62-bit ``value`` (a
        :func:`~lightning_gradcomp.comm.digest`); ``what`` names it in the message."""
        comm.agree(value, what, self.group, self.device, self.world_size)


@dataclass
class RoundContext:
    """What a :class:`MultiRound` codec gets for one bucket of one step, and nothing more.

    Attributes:
        step: the optimizer step (0-based).
        comm: the codec's :class:`CodecContext` (its group, device and collectives).
        sample: whether this step samples the error statistics (they cost a local decode).
        record: the statistics sink, ``record(err_sq=..., ...)``; the names are those of
            :class:`~lightning_gradcomp.stats.StepStats`. A ``custom`` codec records its bucket
            with :meth:`record_bucket`.
        discard: ``discard(buf)`` zeroes the bucket, drops this step's staged residuals and asks for
            the step to be skipped (a non-finite gradient on some rank); it returns ``buf``.
        revertible: a step with a non-finite bucket is skipped as a whole (``nonfinite="skip"``):
            a codec that changes its own state for a bucket keeps what it replaced until
            :meth:`MultiRound.end_step`, which may have to put it back.
    """

    step: int
    comm: CodecContext
    sample: bool = False
    record: Callable[..., None] = lambda **stats: None
    discard: Callable[[Tensor], Tensor] = lambda buf: buf.zero_()
    revertible: bool = False

    def record_bucket(self, buf: Tensor, collective: str, nbytes: int, **more: Any) -> None:
        """Record the bucket ``buf`` as every path does (:func:`lightning_gradcomp.stats.record_bucket`):
        ``nbytes`` handed to ``collective``; ``more``: timings and error sums."""
        from lightning_gradcomp.stats import record_bucket

        record_bucket(self.record, buf, self.comm.world_size, collective, nbytes, **more)


@dataclass
class EncodeResult:
    """One layer's encoding.

    Attributes:
        payload: the tensors that travel (all ranks must produce the same shapes and dtypes).
        local: the codec's own reconstruction of its input from this payload alone, used for the
            error-feedback residual and for ``rel_error``. ``None``: the hook decodes the payload
            alone (``decode(payload, ctx, numel, count=1)``).
        ctx: anything the codec needs at decode time that stays on this rank.
        sent: what this rank's payload really stands for, when it differs from ``local`` (a codec
            that keeps part of its own error out of the residual); ``rel_error`` compares the
            input with it, so that every lossy stage is counted. ``None``: ``local``.
    """

    payload: list[Tensor]
    local: Tensor | None = None
    ctx: Any = None
    sent: Tensor | None = None


# --------------------------------------------------------------------------------------------------
# the contract
class Codec:
    """Base class of all codecs: a compressor of one layer's flat fp32 gradient.

    A codec **must** write :meth:`encode` and :meth:`decode`. It **may** set:

    - :attr:`collective` (how payloads combine, see the module docstring), :attr:`Options` (its
      hyper-parameters), :attr:`harness_defaults`, :attr:`wire_dtype`, :attr:`sparse_local`,
      :attr:`adaptive_by_default`, :attr:`adaptive_optimizer_defaults`,
      :attr:`adaptive_optimizer_controller`, :attr:`adaptive_harness_defaults`;
    - :meth:`aggregate` (``allgather`` codecs, to be faster than decoding one payload at a time),
      :meth:`error_bound` (checked by the property tests), :meth:`is_compressing` (a warm-up),
      :meth:`check_harness` (refuse a harness option it cannot run with).

    Learned or adjustable state and codec-run collectives are opt-in: :class:`LearnedState`,
    :class:`MultiRound`, :class:`AdjustableCompression`. Everything else on this class belongs to
    the harness and is not meant to be overridden.

    Options are keyword arguments: the fields of :attr:`Options`, then those of
    :class:`HarnessOptions`. They are frozen; :meth:`config` is what ranks compare, checkpoints
    record and reports show.
    """

    #: registry name, set by ``register_codec``
    name: ClassVar[str] = "codec"
    #: how payloads are combined across ranks, see the module docstring
    collective: ClassVar[Collective] = "allgather"
    #: the codec's own hyper-parameters
    Options: ClassVar[type[CodecOptions]] = CodecOptions
    #: defaults of harness options that differ for this codec (``{"error_feedback": True}``)
    harness_defaults: ClassVar[Mapping[str, Any]] = {}
    #: ``allreduce`` codecs: the dtype their payloads are summed in
    wire_dtype: ClassVar[torch.dtype] = torch.float32
    #: whether the reconstruction is zero outside the coordinates sent (sparsifiers), which is
    #: where momentum factor masking applies
    sparse_local: ClassVar[bool] = False
    #: whether ``CompressedDDPStrategy`` attaches the level controller (``AdaptiveCompression``)
    #: unless told otherwise (``adaptive_level=None``): for codecs measured to need it to train.
    #: ``True``: with the controller's defaults; a mapping: with these of its arguments
    adaptive_by_default: ClassVar[bool | Mapping[str, Any]] = False
    #: options (the codec's own or the harness's) that ``CompressedDDPStrategy`` sets in place of
    #: their defaults when the run's optimizer scales each coordinate's step by its own running
    #: gradient scale (Adam and its kin) and the user did not set them: for codecs measured to
    #: need another level there
    adaptive_optimizer_defaults: ClassVar[Mapping[str, Any]] = {}
    #: arguments of the level controller that ``CompressedDDPStrategy`` attaches by default
    #: (``adaptive_level=None`` and :attr:`adaptive_by_default`) that differ beside such an
    #: optimizer (``{"lr_reference": "peak"}``)
    adaptive_optimizer_controller: ClassVar[Mapping[str, Any]] = {}
    #: harness options that ``CompressedDDPStrategy`` sets in place of their defaults whenever it
    #: attaches the level controller (by default or on request) and the user did not set them: for
    #: codecs measured to need them together with its light steps (``{"lr_scaled_feedback": True}``)
    adaptive_harness_defaults: ClassVar[Mapping[str, Any]] = {}
    #: options that change only how a message is coded, not what it decodes to (a code of the
    #: positions, the harness's ``deflate``): a run resumed with another value trains as it would have
    lossless_options: ClassVar[frozenset[str]] = frozenset({"deflate"})
    #: the layout of the codec's messages; raised whenever the same options start to send other
    #: bytes (TernGrad's codes went from 2-bit fields to base-3 digits: 2). It is part of
    #: :meth:`config_hash`, so ranks that run versions with different layouts refuse to start
    #: instead of misreading each other's messages
    wire_format: ClassVar[int] = 1

    def __init__(self, **options: Any) -> None:
        own = {f.name for f in dataclasses.fields(self.Options)}
        harness = {f.name for f in dataclasses.fields(HarnessOptions)}
        unknown = sorted(set(options) - own - harness)
        if unknown:
            raise ValueError(
                f"invalid option for codec {self.name!r}: {', '.join(map(repr, unknown))}. "
                f"Valid options: {', '.join(option_names(type(self)))}"
            )
        given = {k: v for k, v in options.items() if k in harness}
        error_feedback = given.get(
            "error_feedback", self.harness_defaults.get("error_feedback", HarnessOptions.error_feedback)
        )
        merged = {**harness_defaults_that_apply(self.harness_defaults, error_feedback), **given}
        self.options = self.Options(**{k: v for k, v in options.items() if k in own})
        self.harness = HarnessOptions(**merged)
        self._check_harness_for_codec()
        self.context: CodecContext | None = None
        self._dense_keys: frozenset[str] = frozenset()  # resolved by plan_layers()
        self._run_total_steps: int | None = None  # set by fit_to_run()

    # ----------------------------------------------------------------------------------------------
    # what a codec writes
    def encode(self, x: Tensor, key: str, param: Tensor, step: int) -> EncodeResult:
        """Compress one layer. ``x`` is flat fp32 (the gradient plus the residual); ``key`` names
        the parameter ``param``; ``step`` is the optimizer step. A :class:`MultiRound` codec's
        ``encode`` also takes ``prepared``, the layer's entry of what its ``prepare_bucket``
        returned (:class:`Prepared`)."""
        raise NotImplementedError

    def decode(self, payload: list[Tensor], ctx: Any, numel: int, count: int) -> Tensor:
        """Turn a payload into a flat fp32 gradient of ``numel`` entries.

        For ``allreduce`` codecs ``payload`` is the element-wise sum of ``count`` ranks' payloads and
        the result must be the *sum* of their gradients (the hook divides by the world size).
        """
        raise NotImplementedError

    def aggregate(self, payloads: Sequence[list[Tensor]], ctx: Any, numel: int) -> Tensor:
        """``allgather`` codecs: the sum of every rank's decoded gradient. Override to be faster."""
        total = torch.zeros(numel, dtype=torch.float32, device=payloads[0][0].device)
        for p in payloads:
            total += self.decode(p, ctx, numel, count=1)
        return total

    def error_bound(self, x: Tensor) -> float | None:
        """An upper bound on ``||x - local||_2`` (``local``: the reconstruction of ``encode(x)``) that
        the codec guarantees for this input, or ``None`` when it states none (the default)."""
        return None

    def is_compressing(self, step: int) -> bool:
        """Whether step ``step`` (0-based optimizer steps) compresses. Plain all-reduce otherwise."""
        return step >= self.harness.start_step

    def collective_at(self, step: int) -> Collective:
        """The collective of step ``step``; :attr:`collective` unless the codec changes it by stage."""
        return self.collective

    def check_harness(self, harness: HarnessOptions) -> None:
        """Raise ``ValueError`` for a harness option this codec cannot run with."""

    # ----------------------------------------------------------------------------------------------
    # identity and options (harness side)
    def setup(self, context: CodecContext) -> None:
        """Called once on every rank after the process group exists and before the first step."""
        self.context = context

    @property
    def world_size(self) -> int:
        return 1 if self.context is None else self.context.world_size

    @property
    def rank(self) -> int:
        return 0 if self.context is None else self.context.rank

    def config(self) -> dict[str, Any]:
        """Harness and codec options as plain JSON values: what ranks compare at setup, what a
        checkpoint records and what reports show. ``make_codec(name, **codec.config())`` rebuilds it."""
        merged = {**dataclasses.asdict(self.harness), **dataclasses.asdict(self.options)}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in merged.items()}

    def wire_formats(self) -> dict[str, int]:
        """The :attr:`wire_format` of every codec whose messages this one sends: its own
        (``auto`` adds its arms', ``lgc`` its stage-1 codec's)."""
        return {self.name: self.wire_format}

    def config_hash(self) -> int:
        """A 62-bit digest of the codec's name, options and :meth:`wire_formats`, identical on
        ranks that agree."""
        described = {"codec": self.name, "options": self.config(), "wire_formats": self.wire_formats()}
        return comm.digest(json.dumps(described, sort_keys=True, default=str))

    def replace_options(self, **changes: Any) -> None:
        """Change some of the codec's own options (checked again, and the harness against them),
        before the strategy sets the hook up: ranks compare :meth:`config` there. What a codec
        built from its options at construction (an autoencoder's shape) is not rebuilt."""
        own = [f.name for f in dataclasses.fields(self.Options)]
        unknown = sorted(set(changes) - set(own))
        if unknown:
            raise ValueError(
                f"codec {self.name!r} has no option {', '.join(map(repr, unknown))} to replace. "
                f"Its own options: {', '.join(own)}"
            )
        before, self.options = self.options, dataclasses.replace(self.options, **changes)
        try:  # a codec may refuse harness options only with some of its own (lgc's warm-up)
            self._check_harness_for_codec()
        except ValueError:
            self.options = before  # a refused value changes nothing
            raise

    def adopt_defaults(self, changes: Mapping[str, Any]) -> None:
        """Set options, the codec's own and the harness's alike, checked again; for
        :attr:`adaptive_optimizer_defaults`, before the first compressed step."""
        harness = {k: v for k, v in changes.items() if k in {f.name for f in dataclasses.fields(HarnessOptions)}}
        own = {k: v for k, v in changes.items() if k not in harness}
        if own:
            self.replace_options(**own)
        if harness:
            before, self.harness = self.harness, dataclasses.replace(self.harness, **harness)
            try:
                self._check_harness_for_codec()
            except ValueError:
                self.harness = before  # a refused value changes nothing
                raise

    def optimizer_defaults(self) -> dict[str, Any]:
        """The :attr:`adaptive_optimizer_defaults` that apply to this codec as configured: all of
        them, unless one depends on another of its options or on error feedback
        (:func:`harness_defaults_that_apply`)."""
        return harness_defaults_that_apply(self.adaptive_optimizer_defaults, self.harness.error_feedback)

    def _check_harness_for_codec(self) -> None:
        """The harness options this codec cannot run with: the harness's own rule, then the codec's."""
        if self.harness.dense_dtype != "float32" and type(self).collective != "allgather":
            raise ValueError(
                f"dense_dtype={self.harness.dense_dtype!r} applies to codecs that gather their payloads; "
                f"codec {self.name!r} sends its dense layers in its own {type(self).collective} "
                "(dense_dtype must be 'float32')"
            )
        self.check_harness(self.harness)

    def plan_layers(self, named_parameters: Iterable[tuple[str, Tensor]]) -> frozenset[str]:
        """Resolve ``dense_layers`` against the model (:func:`lightning_gradcomp.hook.layers.plan_layers`);
        called once with the model's ``named_parameters()`` before the first step. Returns the names
        kept dense."""
        from lightning_gradcomp.hook.layers import plan_layers

        self._dense_keys = plan_layers(self.harness.dense_layers, named_parameters)
        return self._dense_keys

    @property
    def dense_keys(self) -> frozenset[str]:
        """Parameter names that the layer policy keeps dense (empty before :meth:`plan_layers`)."""
        return self._dense_keys

    def should_compress(self, key: str, param: Tensor) -> bool:
        """Whether this parameter is compressed: small ones and those of the layer policy
        (``dense_layers``) travel in the fp32 all-reduce."""
        return param.numel() >= max(self.harness.min_numel, 1) and key not in self._dense_keys

    def compresses_parameter(self, key: str, param: Tensor) -> bool:
        """Whether this codec compresses ``param`` at all, at its most compressed level: what the
        strategy asks at set-up to warn about a model of which it would compress nothing. By
        default :meth:`should_compress`; a codec that picks its layers by a rule of its own says so
        here."""
        return self.should_compress(key, param)

    def nothing_compressed_hint(self, largest: int) -> str:
        """Why no parameter is compressed, and what would compress the largest (``largest``
        entries): the body of the strategy's warning."""
        return (
            f"the largest has {largest:,} entries, below min_numel={self.harness.min_numel}, or the layer policy "
            f"(dense_layers={self.config().get('dense_layers')!r}) keeps them dense, so every gradient is averaged "
            f"whole, in {self.harness.dense_dtype}. To compress small layers give a smaller min_numel, e.g. "
            f"codec_options={{'min_numel': {largest}}}"
        )

    def fit_to_run(self, total_steps: int | None) -> None:
        """Learn the run's length in optimizer steps (Lightning's ``estimated_stepping_batches``;
        ``None`` when unknown), so that schedules given as a fraction of the run resolve
        (:func:`run_steps`). Called on every rank before the first step, with the same value."""
        if total_steps is not None and (not math.isfinite(total_steps) or total_steps <= 0):
            total_steps = None
        self._run_total_steps = None if total_steps is None else int(total_steps)

    @property
    def run_total_steps(self) -> int | None:
        return self._run_total_steps

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in sorted(self.config().items()))
        return f"{type(self).__name__}({opts})"


def option_names(cls: type[Codec]) -> list[str]:
    """The keyword options ``cls`` takes: its own, then the harness's."""
    return [f.name for f in dataclasses.fields(cls.Options)] + [f.name for f in dataclasses.fields(HarnessOptions)]


def __getattr__(name: str) -> Any:
    # the layer policy lives in lightning_gradcomp.hook, whose modules import this one: it is
    # re-exported lazily, on first use, rather than imported above
    if name in ("weight_layer_ends", "AUTO_DENSE_MAX_SHARE"):
        from lightning_gradcomp.hook import layers

        return getattr(layers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
