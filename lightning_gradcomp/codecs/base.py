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

import fnmatch
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Literal, Sequence

import torch
from torch import Tensor

__all__ = [
    "Codec",
    "DensityWarmup",
    "CodecContext",
    "EncodeResult",
    "check_fraction",
    "check_positive_int",
    "check_choice",
    "check_run_steps",
    "run_steps",
    "weight_layer_ends",
]

Collective = Literal["allreduce", "allgather", "custom"]


@dataclass
class CodecContext:
    """What a codec may know about the run it is in; set by the hook before the first call."""

    rank: int
    world_size: int
    device: torch.device


@dataclass
class EncodeResult:
    """One layer's encoding.

    Attributes:
        payload: the tensors that travel (all ranks must produce the same shapes and dtypes).
        local: the codec's own reconstruction of its input from this payload alone, used for the
            error-feedback residual and for ``rel_error``. ``None`` lets the hook call
            :meth:`Codec.decode_local`.
        ctx: anything the codec needs at decode time that stays on this rank.
        sent: what this rank's payload really stands for, when it differs from ``local`` (a codec
            that keeps part of its own error out of the residual); ``rel_error`` compares the
            input with it, so that every lossy stage is counted. ``None``: ``local``.
    """

    payload: list[Tensor]
    local: Tensor | None = None
    ctx: Any = None
    sent: Tensor | None = None


class Codec:
    """Base class of all codecs. Subclasses set the class attributes and override the methods.

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
            Karimireddy et al. 2019 keep ``lr_t * g_t`` in the memory). Without it a residual
            held through a decaying schedule is applied at the later, smaller rate. The strategy
            reads the rates from the optimizers before each backward; with ``make_comm_hook`` call
            ``state.rescale_residuals({name: lr})`` before each backward. Default False (``lgc``: True).
    """

    #: registry name, set by ``register_codec``
    name: ClassVar[str] = "codec"
    #: how payloads are combined across ranks, see the module docstring
    collective: ClassVar[Collective] = "allgather"
    #: whether the codec sends anything lossy at all (``none`` and ``fp16`` are exact or nearly)
    default_error_feedback: ClassVar[bool] = False
    #: whether the hook's per-layer choice (:meth:`should_compress`) applies; codecs that wrap a
    #: third-party hook choose their layers themselves
    supports_dense_layers: ClassVar[bool] = True
    #: whether the hook may apply momentum correction (codecs that wrap a third-party hook cannot)
    supports_momentum: ClassVar[bool] = True
    #: whether this codec's reconstruction is zero outside the coordinates it sent (sparsifiers),
    #: which is where momentum factor masking applies
    sparse_local: ClassVar[bool] = False

    def __init__(
        self,
        *,
        error_feedback: bool | None = None,
        min_numel: int = 1024,
        start_step: int = 2,
        dense_layers: str | Sequence[str] = "auto",
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        momentum_masking: bool = True,
        lr_scaled_feedback: bool = False,
    ) -> None:
        check_positive_int("min_numel", min_numel, allow_zero=True)
        check_positive_int("start_step", start_step, allow_zero=True)
        self.error_feedback = self.default_error_feedback if error_feedback is None else bool(error_feedback)
        self.min_numel = int(min_numel)
        self.start_step = int(start_step)
        self.dense_layers = _check_dense_layers(dense_layers, self.supports_dense_layers)
        self.momentum = check_fraction("momentum", momentum, low_open=False, high_open=True)
        if self.momentum and not self.supports_momentum:
            raise ValueError(
                "this codec keeps its own state per bucket and cannot take momentum correction (momentum must be 0)"
            )
        if not (isinstance(weight_decay, (int, float)) and math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
        if (nesterov or weight_decay) and not self.momentum:
            raise ValueError("nesterov and weight_decay are part of momentum correction: set momentum > 0 too")
        self.nesterov = bool(nesterov)
        self.weight_decay = float(weight_decay)
        self.momentum_masking = bool(momentum_masking)
        if lr_scaled_feedback and not self.error_feedback:
            raise ValueError("lr_scaled_feedback rescales the error-feedback residual: it needs error_feedback=True")
        self.lr_scaled_feedback = bool(lr_scaled_feedback)
        self.context: CodecContext | None = None
        self._dense_keys: frozenset[str] = frozenset()  # resolved by plan_layers()
        self._run_total_steps: int | None = None  # set by fit_to_run()

    # ----------------------------------------------------------------------------------------------
    # life cycle
    def setup(self, context: CodecContext) -> None:
        """Called once on every rank after the process group exists and before the first step."""
        self.context = context

    @property
    def world_size(self) -> int:
        return 1 if self.context is None else self.context.world_size

    @property
    def rank(self) -> int:
        return 0 if self.context is None else self.context.rank

    def options(self) -> dict[str, Any]:
        """The hyper-parameters that define this codec; compared across ranks at setup."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_") and k != "context" and _is_plain(v)}

    def config_hash(self) -> int:
        """A 62-bit digest of the codec's name and options, identical on ranks that agree."""
        text = json.dumps({"codec": self.name, "options": self.options()}, sort_keys=True, default=str)
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2

    def plan_layers(self, named_parameters: Iterable[tuple[str, Tensor]]) -> frozenset[str]:
        """Resolve ``dense_layers`` against the model; called once with the model's
        ``named_parameters()`` before the first step. Returns the names kept dense.

        Raises:
            ValueError: a pattern matches no trainable parameter (the message lists some names).
        """
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        names = [n for n, _ in named]
        dense: set[str] = set()
        for pattern in self.dense_layers:
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

    # ----------------------------------------------------------------------------------------------
    # per-step control
    def is_compressing(self, step: int) -> bool:
        """Whether step ``step`` (0-based optimizer steps) compresses. Plain all-reduce otherwise."""
        return step >= self.start_step

    def should_compress(self, key: str, param: Tensor) -> bool:
        """Whether this parameter is compressed: small ones and those of the layer policy
        (``dense_layers``) travel in the fp32 all-reduce."""
        return param.numel() >= max(self.min_numel, 1) and key not in self._dense_keys

    def observe_dense(self, key: str, mean_grad: Tensor, step: int) -> None:
        """Sees each aggregated, uncompressed gradient of a compressed-size layer on steps that do
        not compress (warm-up). Identical on all ranks; learned codecs fit on it."""

    def prepare_bucket(self, layers: list[tuple[str, Tensor, Tensor]], step: int) -> int:
        """Runs in the hook body before a bucket's layers are encoded, with ``(key, input, param)``
        of each compressed layer. It may run blocking collectives (a broadcast of a shared index
        set); it must not be called from a ``.then`` callback. Returns the bytes this rank sent."""
        return 0

    def communicate_bucket(self, state: Any, bucket: Any, layers: list, flag: Tensor, step: int) -> Any:
        """``custom`` codecs: run the whole protocol for one bucket and return a future of the
        averaged bucket. ``flag`` is a one-element fp32 tensor on the bucket's device, 1.0 when
        this rank's bucket is not finite (a tensor, so that reading it is the codec's choice)."""
        raise NotImplementedError(f"codec {self.name!r} declares collective 'custom' but has no protocol")

    def on_step_end(self, step: int) -> None:
        """Called by the hook after the last bucket of optimizer step ``step`` was launched."""

    # ----------------------------------------------------------------------------------------------
    # the codec proper
    def encode(self, x: Tensor, key: str, param: Tensor, step: int) -> EncodeResult:
        """Compress one layer. ``x`` is flat fp32 (the gradient plus the residual)."""
        raise NotImplementedError

    def decode_local(self, enc: EncodeResult, numel: int) -> Tensor:
        """Reconstruct this rank's own input from its payload (for residuals and ``rel_error``)."""
        return self.decode([p.clone() for p in enc.payload], enc.ctx, numel, count=1)

    def decode(self, payload: list[Tensor], ctx: Any, numel: int, count: int) -> Tensor:
        """Turn a payload into a flat fp32 gradient.

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
        """An upper bound on ``||x - decode_local(encode(x))||_2`` that the codec guarantees for
        this input, or ``None`` when it states none (the default). Property tests check it."""
        return None

    # ----------------------------------------------------------------------------------------------
    # checkpointing: state identical on every rank (bases, learned weights, schedules)
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"codec {self.name!r} keeps no state but was given {sorted(state)}")

    # checkpointing: state that differs per rank, beyond the residuals the hook keeps
    def rank_state_dict(self) -> dict[str, Tensor]:
        return {}

    def load_rank_state_dict(self, state: dict[str, Tensor]) -> None:
        if state:
            raise ValueError(f"codec {self.name!r} keeps no per-rank state but was given {sorted(state)}")

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in sorted(self.options().items()))
        return f"{type(self).__name__}({opts})"


class DensityWarmup:
    """DGC's warm-up of sparsity for codecs that keep a fraction of the entries (``topk``, ``iwp``).

    For the first ``steps`` compressed steps the kept fraction shrinks exponentially from ``start``
    to the codec's own fraction: ``start ** (1 - t) * target ** t`` with ``t`` the share of the
    warm-up done (DGC: 25 %, 6.25 %, 1.56 %, 0.4 %, 0.1 % over four epochs). It is a function of the
    step alone, so every rank keeps the same number of entries. ``steps`` may be a fraction of the
    run (see :func:`run_steps`, capped at ``cap``); 0 turns it off.
    """

    def __init__(self, steps: int | float, start: float, cap: int = 2000) -> None:
        self.steps = check_run_steps("density_warmup", steps)
        self.start = check_fraction("density_warmup_start", start)
        self.cap = cap

    def fraction(self, target: float, step: int, first_step: int, total_steps: int | None) -> float:
        """The kept fraction at optimizer ``step`` for a codec whose own fraction is ``target``."""
        length = run_steps(self.steps, total_steps, self.cap)
        if length <= 0 or self.start <= target or step >= first_step + length:
            return target
        t = max(0.0, (step - first_step) / length)
        return self.start ** (1.0 - t) * target**t


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


def _check_dense_layers(value: str | Sequence[str], supported: bool) -> list[str]:
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if items is None or not all(isinstance(v, str) and v for v in items):
        raise ValueError(f"dense_layers must be 'auto', 'none' or a list of parameter-name patterns, got {value!r}")
    if not supported and items != ["none"]:
        raise ValueError("this codec chooses its compressed layers itself: dense_layers must be 'none'")
    return items


def _is_plain(v: Any) -> bool:
    return isinstance(v, (bool, int, float, str, type(None))) or (
        isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v)
    )
