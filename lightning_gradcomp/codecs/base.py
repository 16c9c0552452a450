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

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Sequence

import torch
from torch import Tensor

__all__ = ["Codec", "CodecContext", "EncodeResult", "check_fraction", "check_positive_int", "check_choice"]

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
    """

    payload: list[Tensor]
    local: Tensor | None = None
    ctx: Any = None


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
    """

    #: registry name, set by ``register_codec``
    name: ClassVar[str] = "codec"
    #: how payloads are combined across ranks, see the module docstring
    collective: ClassVar[Collective] = "allgather"
    #: whether the codec sends anything lossy at all (``none`` and ``fp16`` are exact or nearly)
    default_error_feedback: ClassVar[bool] = False

    def __init__(self, *, error_feedback: bool | None = None, min_numel: int = 1024, start_step: int = 2) -> None:
        check_positive_int("min_numel", min_numel, allow_zero=True)
        check_positive_int("start_step", start_step, allow_zero=True)
        self.error_feedback = self.default_error_feedback if error_feedback is None else bool(error_feedback)
        self.min_numel = int(min_numel)
        self.start_step = int(start_step)
        self.context: CodecContext | None = None

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

    # ----------------------------------------------------------------------------------------------
    # per-step control
    def is_compressing(self, step: int) -> bool:
        """Whether step ``step`` (0-based optimizer steps) compresses. Plain all-reduce otherwise."""
        return step >= self.start_step

    def should_compress(self, key: str, param: Tensor) -> bool:
        """Whether this parameter is compressed; small ones travel in the fp32 all-reduce."""
        return param.numel() >= max(self.min_numel, 1)

    def observe_dense(self, key: str, mean_grad: Tensor, step: int) -> None:
        """Sees each aggregated, uncompressed gradient of a compressed-size layer on steps that do
        not compress (warm-up). Identical on all ranks; learned codecs fit on it."""

    def prepare_bucket(self, layers: list[tuple[str, Tensor, Tensor]], step: int) -> int:
        """Runs in the hook body before a bucket's layers are encoded, with ``(key, input, param)``
        of each compressed layer. It may run blocking collectives (a broadcast of a shared index
        set); it must not be called from a ``.then`` callback. Returns the bytes this rank sent."""
        return 0

    def communicate_bucket(self, state: Any, bucket: Any, layers: list, flag: float, step: int) -> Any:
        """``custom`` codecs: run the whole protocol for one bucket and return a future of the
        averaged bucket. ``flag`` is 1.0 when this rank's bucket is not finite."""
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


def _is_plain(v: Any) -> bool:
    return isinstance(v, (bool, int, float, str, type(None))) or (
        isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v)
    )
