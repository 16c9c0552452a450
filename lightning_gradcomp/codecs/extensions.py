"""The opt-in extensions of the codec contract (:mod:`lightning_gradcomp.codecs.base`): mix one
into a :class:`~lightning_gradcomp.codecs.base.Codec` subclass when the codec needs it.

- :class:`LearnedState`: state learned during the run or kept across a restart;
- :class:`MultiRound`: collectives of the codec's own, in the hook body;
- :class:`BucketRouter`: a codec that hands each bucket to one of several codecs it holds;
- :class:`AdjustableCompression`: the protocol of a compression level that callbacks drive, and
  :class:`AdjustableLevel`, that protocol for a knob between a light and the configured setting.

All are re-exported by :mod:`lightning_gradcomp.codecs.base`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Protocol, runtime_checkable

from torch import Tensor

from lightning_gradcomp.codecs.options import check_fraction

if TYPE_CHECKING:
    from lightning_gradcomp.codecs.base import RoundContext

__all__ = [
    "LearnedState",
    "MultiRound",
    "BucketRouter",
    "Prepared",
    "AdjustableCompression",
    "AdjustableLevel",
    "geometric_level",
]


class LearnedState:
    """Extension: state a codec learns during the run or keeps across a restart.

    Mix it into a :class:`Codec` subclass (``class MyCodec(LearnedState, Codec)``) and override
    what applies. :meth:`observe_dense` and :meth:`on_step_end` are called on every rank with the
    same arguments; ``on_step_end`` runs in the hook body of the next step (never in a ``.then``
    callback), so it may run the collectives of :class:`CodecContext`.

    A codec that learns reports what it learned in :meth:`scalars`, and
    :class:`~lightning_gradcomp.callbacks.CompressionMonitor` logs it: no callback of its own.
    """

    def observe_dense(self, key: str, mean_grad: Tensor, step: int) -> None:
        """Sees each aggregated, uncompressed gradient of a compressed-size layer on steps that do
        not compress (warm-up). Identical on all ranks; learned codecs fit on it."""

    def on_step_end(self, step: int) -> None:
        """After the last bucket of optimizer step ``step`` was launched (and its futures done)."""

    def scalars(self, step: int, compressing: bool) -> dict[str, float]:
        """What the codec learned or where its schedule stands after optimizer step ``step``, by
        name without the ``gradcomp/`` prefix (``{"pca_k": 4.0}``); empty by default.

        :class:`~lightning_gradcomp.callbacks.CompressionMonitor` logs each entry as
        ``gradcomp/<name>`` after every optimizer step (rank 0's values; the entries are meant to
        be identical on every rank), and the ``codecs`` benchmark reads what a codec fitted from
        it. ``compressing`` is whether the hook compressed ``step``: it stays False during DDP's
        first steps even where :meth:`~Codec.is_compressing` says True. A value not learned yet
        is left out, or 0 where its curve should start at 0 (``gradiveq``'s ``pca_k``), never NaN.
        Called between steps, on every rank: read attributes, run no collective.
        """
        return {}

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


@dataclass(frozen=True)
class Prepared:
    """What :meth:`MultiRound.prepare_bucket` returns for one bucket.

    Attributes:
        nbytes: the bytes this rank sent in the codec's own rounds (counted in the statistics).
        per_layer: what ``encode`` needs of those rounds, by layer key (a shared support, a shared
            scale); the hook passes ``per_layer.get(key)`` to ``encode`` as ``prepared``. It lives
            for this bucket only: nothing is kept on the codec between the two calls.
        collective: how those bytes travelled, for the wire count: ``"broadcast"`` (one rank's
            message, default) or ``"allgather"`` (every rank's ``nbytes``).
    """

    nbytes: int = 0
    per_layer: Mapping[str, Any] = field(default_factory=dict)
    collective: str = "broadcast"


class MultiRound:
    """Extension: a codec that runs collectives of its own for a bucket, in the hook body.

    :meth:`prepare_bucket` runs before the layers of a bucket are encoded (a broadcast of one
    rank's index set) and returns a :class:`Prepared`: the bytes it sent and each layer's context.
    The hook then calls the codec's ``encode(x, key, param, step, prepared=...)`` with that layer's
    entry (``None`` where there is none), so a ``MultiRound`` codec's ``encode`` takes the
    keyword ``prepared`` (single-round codecs keep ``encode(x, key, param, step)``). A codec whose
    :attr:`~Codec.collective` is ``"custom"`` runs the whole exchange in
    :meth:`communicate_bucket` instead. Both get a :class:`RoundContext`, never the hook's state.
    """

    #: codec state is keyed by DDP bucket index: the hook sends plain all-reduce until DDP has
    #: rebuilt its buckets in the layout the state was made for (a resumed run)
    bucket_keyed_state: ClassVar[bool] = False

    def prepare_bucket(self, layers: list[tuple[str, Tensor, Tensor]], rc: RoundContext) -> Prepared:
        """``(key, input, param)`` of each compressed layer of the bucket. It may run blocking
        collectives through ``rc.comm``. Returns the bytes this rank sent and, per layer key, what
        ``encode`` gets as ``prepared``."""
        return Prepared()

    def communicate_bucket(self, bucket: Any, layers: list, flag: Tensor, rc: RoundContext) -> Any:
        """``custom`` codecs: run the whole protocol for a ``torch.distributed.GradBucket`` and
        return a future of the averaged bucket. ``layers`` holds ``(key, gradient view, param)``;
        ``flag`` is a one-element fp32 tensor, 1.0 when this rank's bucket is not finite."""
        raise NotImplementedError(f"codec {self.name!r} declares collective 'custom' but has no protocol")

    def end_step(self, discarded: bool) -> None:
        """Every bucket of the step has settled. ``discarded``: the step is skipped (a non-finite
        bucket on some rank under ``nonfinite="skip"``), so whatever the codec changed for its
        finite buckets is put back as it was before the step; the optimizer does not step either.
        Called on every rank alike, once a step or more (again it changes nothing)."""


class BucketRouter:
    """Extension: a codec that hands each whole bucket to one of several codecs it holds (``auto``).

    The hook calls :meth:`send_bucket` for every bucket of every step, warm-up included, instead of
    choosing a path itself; the router sends the bucket through the hook's paths with the codec it
    chose, and the fallback policy stays off (plain all-reduce is one of the router's choices).
    """

    def send_bucket(self, state: Any, bucket: Any, layers: list, flag: Tensor, step: int, key: str, compress: bool):
        """Send ``bucket`` (``layers``: ``(key, gradient view, param)``; ``key``: the bucket's
        name; ``compress``: whether the hook would compress this step) and return the future of
        the averaged bucket."""
        raise NotImplementedError

    def end_step(self, discarded: bool) -> None:
        """As :meth:`MultiRound.end_step`, for the codecs the router holds."""


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
