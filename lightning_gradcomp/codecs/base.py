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
import fnmatch
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Literal, Mapping, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from lightning_gradcomp import comm

__all__ = [
    "Codec",
    "CodecOptions",
    "HarnessOptions",
    "LearnedState",
    "MultiRound",
    "AdjustableCompression",
    "AdjustableLevel",
    "geometric_level",
    "DensityWarmup",
    "check_density_warmup",
    "CodecContext",
    "RoundContext",
    "EncodeResult",
    "check_fraction",
    "check_positive_int",
    "check_choice",
    "check_run_steps",
    "run_steps",
    "weight_layer_ends",
]

Collective = Literal["allreduce", "allgather", "custom"]
COLLECTIVES = ("allreduce", "allgather", "custom")


# --------------------------------------------------------------------------------------------------
# options: declared, frozen, validated once
@dataclass(frozen=True)
class CodecOptions:
    """A codec's hyper-parameters. Subclass it as a frozen dataclass (one field per option, with
    its default) and validate in :meth:`check`, which runs at construction and on every
    :meth:`Codec.replace_options`. ``check`` may normalise a value with :meth:`_set` (an int given
    as ``3.0`` becomes ``3``), so that equal settings hash equally on every rank."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the option and what it must be."""

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)


@dataclass(frozen=True)
class HarnessOptions(CodecOptions):
    """What the hook does around every codec; each codec takes these as keyword options too.

    A codec changes the defaults with :attr:`Codec.harness_defaults` and refuses values it cannot
    run with in :meth:`Codec.check_harness`.

    Args:
        error_feedback: keep what compression dropped in a per-parameter residual and add it to the
            next step's gradient (Stich et al. 2018, "Sparsified SGD with memory").
        min_numel: layers with fewer elements travel uncompressed in a plain fp32 all-reduce
            (biases and norms cost little and are sensitive).
        start_step: optimizer steps of plain all-reduce before compression starts. DDP rebuilds its
            buckets after the first step (the second with ``static_graph=True``), so the hook
            never compresses before step 2 whatever this says.
        dense_layers: parameters that always travel uncompressed in the fp32 all-reduce, whatever
            their size (their bytes count in ``bytes_sent``). ``"auto"`` (default): the first and
            the last weight layer of the model (the parameters of the modules that hold the first
            and the last parameter with two or more dimensions, in registration order: the stem
            convolution and the classifier of a CNN), each only if it holds at most 5 % of the
            trainable parameters. In a CNN these layers are tiny (0.06 % of ResNet-18 together)
            and compression hurts them most (DGC and SOFF keep them dense too); in a small MLP the
            first layer can be a large share of the model, and then it is compressed. ``"none"``:
            no layer beyond the small ones. A list of ``fnmatch`` patterns of parameter names
            (``["fc.*", "*.downsample.*"]``), which may contain ``"auto"``. A pattern that matches
            no parameter is an error.
        momentum: momentum correction (Lin et al. 2018, "Deep Gradient Compression"): each rank
            keeps its own momentum buffer ``u <- momentum * u + g`` and the codec sends the
            velocity, so what error feedback holds back is velocity, not raw gradient. Default 0
            (off). When on, the optimizer must not add momentum again: use plain SGD
            (``momentum=0``; the strategy refuses an optimizer with momentum). With a lossless
            codec the training is exactly SGD with this momentum.
        nesterov: with ``momentum``: send ``g + momentum * u`` (Nesterov), as ``torch.optim.SGD``.
        weight_decay: with ``momentum``: add ``weight_decay * w`` to the gradient before the
            momentum, as ``torch.optim.SGD`` does; set the optimizer's own to 0 then.
        momentum_masking: with ``momentum``: zero the momentum buffer where this step sent the
            velocity (DGC's momentum factor masking), so stale momentum does not push the sent
            coordinates again. Default True; it applies to codecs that send a sparse subset
            (``topk``, ``iwp``, ``lgc``) and is ignored by the others.
        lr_scaled_feedback: with ``error_feedback``: keep the residual in units of the update
            rather than of the gradient. When the learning rate changes from ``lr_then`` to
            ``lr_now`` the residual is multiplied by ``lr_then / lr_now`` before it is added, so a
            gradient held back while the rate decays is applied with the rate of the step that
            computed it, as in the error feedback of the papers (Stich et al. 2018 and
            Karimireddy et al. 2019 keep ``lr_t * g_t`` in the memory). The strategy reads the
            rates from the optimizers before each backward; with ``make_comm_hook`` call
            ``state.rescale_residuals({name: lr})`` before each backward. Default False (``lgc``:
            True). A codec's default of True applies only when error feedback is on.
    """

    error_feedback: bool = False
    min_numel: int = 1024
    start_step: int = 2
    dense_layers: tuple[str, ...] = ("auto",)
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    momentum_masking: bool = True
    lr_scaled_feedback: bool = False

    def check(self) -> None:
        self._set("error_feedback", bool(self.error_feedback))
        self._set("min_numel", check_positive_int("min_numel", self.min_numel, allow_zero=True))
        self._set("start_step", check_positive_int("start_step", self.start_step, allow_zero=True))
        self._set("dense_layers", _check_dense_layers(self.dense_layers))
        self._set("momentum", check_fraction("momentum", self.momentum, low_open=False, high_open=True))
        wd = self.weight_decay
        if isinstance(wd, bool) or not (isinstance(wd, (int, float)) and math.isfinite(wd) and wd >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {wd!r}")
        if (self.nesterov or wd) and not self.momentum:
            raise ValueError("nesterov and weight_decay are part of momentum correction: set momentum > 0 too")
        self._set("weight_decay", float(wd))
        self._set("nesterov", bool(self.nesterov))
        self._set("momentum_masking", bool(self.momentum_masking))
        if self.lr_scaled_feedback and not self.error_feedback:
            raise ValueError("lr_scaled_feedback rescales the error-feedback residual: it needs error_feedback=True")
        self._set("lr_scaled_feedback", bool(self.lr_scaled_feedback))


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
        record: the statistics sink, ``record(buckets=1, payload_bytes=..., ...)``; the names are
            those of :class:`~lightning_gradcomp.stats.StatsAccumulator`.
        discard: ``discard(buf)`` zeroes the bucket, drops this step's staged residuals and asks for
            the step to be skipped (a non-finite gradient on some rank); it returns ``buf``.
    """

    step: int
    comm: CodecContext
    sample: bool = False
    record: Callable[..., None] = lambda **stats: None
    discard: Callable[[Tensor], Tensor] = lambda buf: buf.zero_()


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
      hyper-parameters), :attr:`harness_defaults`, :attr:`wire_dtype`, :attr:`sparse_local`;
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
        merged = {**self.harness_defaults, **given}
        if "lr_scaled_feedback" not in given and not merged.get("error_feedback", False):
            merged.pop("lr_scaled_feedback", None)  # a codec's default applies with error feedback only
        self.options = self.Options(**{k: v for k, v in options.items() if k in own})
        self.harness = HarnessOptions(**merged)
        self.check_harness(self.harness)
        self.context: CodecContext | None = None
        self._dense_keys: frozenset[str] = frozenset()  # resolved by plan_layers()
        self._run_total_steps: int | None = None  # set by fit_to_run()

    # ----------------------------------------------------------------------------------------------
    # what a codec writes
    def encode(self, x: Tensor, key: str, param: Tensor, step: int) -> EncodeResult:
        """Compress one layer. ``x`` is flat fp32 (the gradient plus the residual); ``key`` names
        the parameter ``param``; ``step`` is the optimizer step."""
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

    def config_hash(self) -> int:
        """A 62-bit digest of the codec's name and options, identical on ranks that agree."""
        return comm.digest(json.dumps({"codec": self.name, "options": self.config()}, sort_keys=True, default=str))

    def replace_options(self, **changes: Any) -> None:
        """Change some of the codec's own options (checked again), before the strategy sets the hook
        up: ranks compare :meth:`config` there. What a codec built from its options at
        construction (an autoencoder's shape) is not rebuilt."""
        own = [f.name for f in dataclasses.fields(self.Options)]
        unknown = sorted(set(changes) - set(own))
        if unknown:
            raise ValueError(
                f"codec {self.name!r} has no option {', '.join(map(repr, unknown))} to replace. "
                f"Its own options: {', '.join(own)}"
            )
        self.options = dataclasses.replace(self.options, **changes)

    def plan_layers(self, named_parameters: Iterable[tuple[str, Tensor]]) -> frozenset[str]:
        """Resolve ``dense_layers`` against the model; called once with the model's
        ``named_parameters()`` before the first step. Returns the names kept dense.

        Raises:
            ValueError: a pattern matches no trainable parameter (the message lists some names).
        """
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        names = [n for n, _ in named]
        dense: set[str] = set()
        for pattern in self.harness.dense_layers:
            if pattern == "none":
                continue
            if pattern == "auto":
                dense.update(weight_layer_ends(named))
                continue
            hits = fnmatch.filter(names, pattern)
            if not hits:
                shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
                raise ValueError(f"dense_layers pattern {pattern!r} matches no trainable parameter (names: {shown})")
            dense.update(hits)
        self._dense_keys = frozenset(dense)
        return self._dense_keys

    @property
    def dense_keys(self) -> frozenset[str]:
        """Parameter names that the layer policy keeps dense (empty before :meth:`plan_layers`)."""
        return self._dense_keys

    def should_compress(self, key: str, param: Tensor) -> bool:
        """Whether this parameter is compressed: small ones and those of the layer policy
        (``dense_layers``) travel in the fp32 all-reduce."""
        return param.numel() >= max(self.harness.min_numel, 1) and key not in self._dense_keys

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


class LearnedState:
    """Extension: state a codec learns during the run or keeps across a restart.

    Mix it into a :class:`Codec` subclass (``class MyCodec(LearnedState, Codec)``) and override
    what applies. :meth:`observe_dense` and :meth:`on_step_end` are called on every rank with the
    same arguments; ``on_step_end`` runs in the hook body of the next step (never in a ``.then``
    callback), so it may run the collectives of :class:`CodecContext`.
    """

    def observe_dense(self, key: str, mean_grad: Tensor, step: int) -> None:
        """Sees each aggregated, uncompressed gradient of a compressed-size layer on steps that do
        not compress (warm-up). Identical on all ranks; learned codecs fit on it."""

    def on_step_end(self, step: int) -> None:
        """After the last bucket of optimizer step ``step`` was launched (and its futures done)."""

    def state_dict(self) -> dict[str, Any]:
        """State identical on every rank (bases, learned weights, schedules)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"codec {self.name!r} keeps no state but was given {sorted(state)}")

    def rank_state_dict(self) -> dict[str, Tensor]:
        """State that differs per rank, beyond the residuals the hook keeps, as CPU copies (a
        checkpoint and a rollback snapshot keep them while training goes on)."""
        return {}

    def load_rank_state_dict(self, state: dict[str, Tensor]) -> None:
        if state:
            raise ValueError(f"codec {self.name!r} keeps no per-rank state but was given {sorted(state)}")


class MultiRound:
    """Extension: a codec that runs collectives of its own for a bucket, in the hook body.

    :meth:`prepare_bucket` runs before the layers of a bucket are encoded (a broadcast of one
    rank's index set); a codec whose :attr:`~Codec.collective` is ``"custom"`` runs the whole
    exchange in :meth:`communicate_bucket`. Both get a :class:`RoundContext`, never the hook's state.
    """

    #: codec state is keyed by DDP bucket index: the hook sends plain all-reduce until DDP has
    #: rebuilt its buckets in the layout the state was made for (a resumed run)
    bucket_keyed_state: ClassVar[bool] = False

    def prepare_bucket(self, layers: list[tuple[str, Tensor, Tensor]], rc: RoundContext) -> int:
        """``(key, input, param)`` of each compressed layer of the bucket. It may run blocking
        collectives through ``rc.comm``. Returns the bytes this rank sent."""
        return 0

    def communicate_bucket(self, bucket: Any, layers: list, flag: Tensor, rc: RoundContext) -> Any:
        """``custom`` codecs: run the whole protocol for a ``torch.distributed.GradBucket`` and
        return a future of the averaged bucket. ``layers`` holds ``(key, gradient view, param)``;
        ``flag`` is a one-element fp32 tensor, 1.0 when this rank's bucket is not finite."""
        raise NotImplementedError(f"codec {self.name!r} declares collective 'custom' but has no protocol")


@runtime_checkable
class AdjustableCompression(Protocol):
    """A codec whose amount of compression can be lowered while training runs.

    ``compression_level`` is the level in use, in ``[0, 1]``: higher compresses more. For the FFT
    codec it is theta, the fraction of frequency coefficients dropped (0: lossless up to the
    quantizer); for the codecs built on :class:`AdjustableLevel` (``topk``, ``iwp``, ``qsgd``,
    ``powersgd``, ``gradiveq``) 1 is the configured setting and 0 a light one. A schedule or a
    controller (:class:`~lightning_gradcomp.callbacks.ThetaDecay`,
    :class:`~lightning_gradcomp.callbacks.AdaptiveCompression`) sets the level with
    :meth:`set_level`; ``compression_limit`` is an upper bound on it that the codec respects
    whatever a schedule sets (lowered by :class:`~lightning_gradcomp.callbacks.AccuracyDropRollback`).
    Both must change only between optimizer steps, at the same step on every rank, and both belong
    in the codec's ``state_dict``.
    """

    @property
    def compression_level(self) -> float: ...

    def set_level(self, level: float) -> None: ...

    @property
    def compression_limit(self) -> float: ...

    @compression_limit.setter
    def compression_limit(self, value: float) -> None: ...


class AdjustableLevel(LearnedState):
    """Extension: :class:`AdjustableCompression` for a codec whose knob (a kept fraction, a rank, a
    number of components or of levels) moves between a light setting and its configured one.

    The level ``L`` in use is ``min(level set, compression_limit)``; 1 (the default) is the codec's
    configured setting, 0 its light setting. A codec maps ``L`` onto its knob with
    :func:`geometric_level` (``light^(1-L) * configured^L``: equal steps of ``L`` scale the bytes
    by equal factors) and recomputes whatever derives from it in :meth:`on_level_change`. The level
    and the limit are saved in :meth:`state_dict`; a codec with state of its own adds
    :meth:`level_state` to its ``state_dict`` and loads through :meth:`load_level_state`.

    Message sizes follow the level, so it must change between optimizer steps, at the same step on
    every rank: a callback sets it from values every rank holds (the global step, the averaged
    gradient), never inside the communication hook.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._level = 1.0  # the level a schedule set last
        self._limit = 1.0

    @property
    def compression_level(self) -> float:
        """The level in use: ``min(level set, compression_limit)``."""
        return min(self._level, self._limit)

    def set_level(self, level: float) -> None:
        """Set the level (1: the configured setting, 0: the light one)."""
        before = self.compression_level
        self._level = check_fraction("level", level, low_open=False)
        if self.compression_level != before:
            self.on_level_change()

    @property
    def compression_limit(self) -> float:
        """Upper bound on the level, whatever a schedule sets; lowered by accuracy-drop rollbacks."""
        return self._limit

    @compression_limit.setter
    def compression_limit(self, value: float) -> None:
        before = self.compression_level
        self._limit = check_fraction("compression_limit", value, low_open=False)
        if self.compression_level != before:
            self.on_level_change()

    def on_level_change(self) -> None:
        """The level in use changed (between two optimizer steps): recompute the knob."""

    def level_state(self) -> dict[str, float]:
        return {"level": self._level, "compression_limit": self._limit}

    def load_level_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Apply the level entries of ``state`` (absent from checkpoints written before the codec
        was adjustable: the level stays) and return the other entries."""
        rest = dict(state)
        limit = rest.pop("compression_limit", None)
        level = rest.pop("level", None)
        if limit is not None:
            self.compression_limit = limit
        if level is not None:
            self.set_level(level)
        return rest

    def state_dict(self) -> dict[str, Any]:
        return self.level_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rest = self.load_level_state(state)
        if rest:
            raise ValueError(f"codec {self.name!r} does not know the state entries {sorted(rest)}")


def geometric_level(light: float, configured: float, level: float) -> float:
    """The knob at ``level``: ``light^(1-level) * configured^level`` (``light`` at 0, ``configured``
    at 1), so that each step of the level multiplies the knob by the same factor."""
    return light ** (1.0 - level) * configured**level


def option_names(cls: type[Codec]) -> list[str]:
    """The keyword options ``cls`` takes: its own, then the harness's."""
    return [f.name for f in dataclasses.fields(cls.Options)] + [f.name for f in dataclasses.fields(HarnessOptions)]


class DensityWarmup:
    """DGC's warm-up of sparsity for codecs that keep a fraction of the entries (``topk``, ``iwp``).

    For the first ``steps`` compressed steps the kept fraction shrinks exponentially from ``start``
    to the codec's own fraction: ``start ** (1 - t) * target ** t`` with ``t`` the share of the
    warm-up done (DGC: 25 %, 6.25 %, 1.56 %, 0.4 %, 0.1 % over four epochs). It is a function of the
    step alone, so every rank keeps the same number of entries. ``steps`` may be a fraction of the
    run (see :func:`run_steps`, capped at ``cap``); 0 turns it off. A codec that offers it declares
    the options ``density_warmup`` and ``density_warmup_start`` and checks them with
    :func:`check_density_warmup`.
    """

    def __init__(self, steps: int | float, start: float, cap: int = 2000) -> None:
        self.steps = check_run_steps("density_warmup", steps)
        self.start = check_fraction("density_warmup_start", start)
        self.cap = cap

    @classmethod
    def of(cls, options: Any) -> DensityWarmup:
        return cls(options.density_warmup, options.density_warmup_start)

    def fraction(self, target: float, step: int, first_step: int, total_steps: int | None) -> float:
        """The kept fraction at optimizer ``step`` for a codec whose own fraction is ``target``."""
        length = run_steps(self.steps, total_steps, self.cap)
        if length <= 0 or self.start <= target or step >= first_step + length:
            return target
        t = max(0.0, (step - first_step) / length)
        return self.start ** (1.0 - t) * target**t

    def kept(self, numel: int, target: float, step: int | None, codec: Codec) -> int:
        """Entries ``codec`` keeps of a layer of ``numel`` at ``step`` (``None``: after the warm-up)."""
        from lightning_gradcomp.codecs.sampling import keep_count

        if step is not None:
            target = self.fraction(target, step, codec.harness.start_step, codec.run_total_steps)
        return keep_count(target, numel)


def check_density_warmup(options: CodecOptions) -> None:
    """Check and normalise the ``density_warmup`` and ``density_warmup_start`` options."""
    warmup = DensityWarmup.of(options)
    options._set("density_warmup", warmup.steps)
    options._set("density_warmup_start", warmup.start)


# --------------------------------------------------------------------------------------------------
# validation helpers: each names the option and what it must be
def check_fraction(name: str, value: float, *, low_open: bool = True, high_open: bool = False) -> float:
    value = float(value)
    ok_low = value > 0 if low_open else value >= 0
    ok_high = value < 1 if high_open else value <= 1
    if not (math.isfinite(value) and ok_low and ok_high):
        lo = "(0" if low_open else "[0"
        hi = "1)" if high_open else "1]"
        raise ValueError(f"{name} must be in {lo}, {hi}, got {value}")
    return value


def check_positive_int(name: str, value: int, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_run_steps(name: str, value: int | float) -> int | float:
    """A schedule length: an integer number of optimizer steps (>= 0), or a float in ``(0, 1)``,
    a fraction of the run (see :func:`run_steps`)."""
    if isinstance(value, float) and 0 < value < 1:
        return value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{name} must be an integer >= 0 (steps) or a float in (0, 1) (a fraction of the run), got {value!r}"
        )
    return value


def run_steps(value: int | float, total_steps: int | None, cap: int) -> int:
    """Steps of a schedule given as steps (an int, returned as is) or as a fraction of the run (a
    float): ``round(value * total_steps)``, at least 1 and at most ``cap`` (the paper's step count,
    so that long runs do not stay uncompressed for thousands of steps). When the run's length is
    unknown (plain DDP without Lightning, an open-ended run) a fraction resolves to ``cap``."""
    if isinstance(value, int):
        return value
    if total_steps is None:
        return cap
    return max(1, min(cap, round(value * total_steps)))


#: ``dense_layers="auto"`` keeps an end layer dense only up to this share of the parameters
AUTO_DENSE_MAX_SHARE = 0.05


def weight_layer_ends(
    named_parameters: Sequence[tuple[str, Tensor]], max_share: float = AUTO_DENSE_MAX_SHARE
) -> set[str]:
    """Names of the parameters of the first and the last weight layer: the modules (name prefixes)
    that hold the first and the last parameter with two or more dimensions, each only when its
    parameters are at most ``max_share`` of all the given parameters."""
    weights = [n for n, p in named_parameters if p.dim() >= 2]
    if not weights:
        return set()
    total = sum(p.numel() for _, p in named_parameters)
    out: set[str] = set()
    for module in {weights[0].rpartition(".")[0], weights[-1].rpartition(".")[0]}:
        names = {n for n, _ in named_parameters if n.rpartition(".")[0] == module}
        if sum(p.numel() for n, p in named_parameters if n in names) <= max_share * total:
            out |= names
    return out


def _check_dense_layers(value: str | Sequence[str]) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if items is None or not all(isinstance(v, str) and v for v in items):
        raise ValueError(f"dense_layers must be 'auto', 'none' or a list of parameter-name patterns, got {value!r}")
    return tuple(items)
