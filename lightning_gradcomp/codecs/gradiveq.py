"""``gradiveq``: PCA vector quantization whose codes are summed by the ring all-reduce itself.

GradiVeQ (Yu et al., NeurIPS 2018) observes that CNN gradients are strongly linearly correlated.
A layer's flat gradient ``g`` (``M`` values) is cut into ``S = M // d`` slices of length ``d``;
each slice ``g_s`` is replaced by its coordinates in the first ``k`` principal directions of a
basis ``U`` (``d x k``, orthonormal columns) learned from recent gradients:

.. math::  c_s = U^T (g_s - \\mu), \\qquad \\hat g_s = U c_s + \\mu.

The encoder is one fixed affine map, identical on every rank, so the coefficients of ``N`` ranks
can be added by a plain all-reduce and decoded **once**:

.. math::  \\sum_i \\hat g_{i,s} = U \\Big(\\sum_i c_{i,s}\\Big) + N \\mu .

No rank decodes before communicating and nobody gathers anybody's payload: the bytes on the wire
are ``k/d`` of the raw gradient (plus the tail, see below).

What is summed on the wire, per compressed layer (one fp32 all-reduce per DDP bucket, together
with the small layers the codec does not compress and the hook's non-finite flag, and with
quantization one int64 all-reduce of the bucket's packed levels beside it):

* ``coef``: the ``S * k`` coefficients ``c`` in fp32 (``quant_levels=0``), or, with
  ``quant_levels = s > 0``, QSGD-style integer levels packed into int64 words, and the layer's
  shared scales in fp32 (below);
* ``tail``: the last ``M - S d`` values of the layer, raw fp32 (fewer than ``d`` values).

Quantization of ``c`` (``quant_levels = s``). Every rank scales layer ``l`` by the same number
``a_l = max_i ||c_{i,l}||_inf`` (``quant_scale="layer"``, the default; with ``"component"`` one
``a_{l,j} = max_i max_s |c_{i,l,s,j}|`` per principal component ``j``): one all-reduce(MAX) of one
(or ``k``) fp32 per layer, run in :meth:`prepare_bucket` before encoding. It then rounds
``s c / a`` to an integer ``q`` in ``[-s, s]``: stochastically (``quant_rounding="stochastic"``,
the default, QSGD's: unbiased, ``E[q] a / s = c``), or to the nearest (``"nearest"``:
``|q a / s - c| <= a / 2s``, half the mean squared error, biased, error feedback keeping the
rounding error). Measured on real gradients at ``k=4, s=7`` (``bench pcaquant``), the scale per
component and the nearest level halve one step's quantization error of the mean gradient (0.38 of
its norm to 0.17 on PSPNet/CamVid, 0.32 to 0.16 on ResNet-18/CIFAR-10), yet the two together
ended ResNet-18's one-epoch run 4.3 points lower (both seeds) and PSPNet's run on CamVid no
higher (docs/codecs/gradiveq.md): one step's error is not what training pays for, so the
defaults stay unbiased.

The offset levels ``q + s`` in ``[0, 2s]`` are packed ``F`` to an int64 word, in fields of
``b = ceil(log2(2 N s + 1))`` bits, ``F = floor(63 / b)``: the word ``sum_f (q_f + s) 2^{b f}`` is a
non-negative integer below ``2^63``. Summing words adds the fields without carries (a field's sum
is at most ``2 N s`` and fits ``b`` bits), and every partial sum of the ring stays below ``2^63``,
so the integer all-reduce returns the exact packed sums of the levels; decode unpacks
``sum_i q_i = field - N s`` and multiplies by ``a / s``. With two ranks: ``s = 1`` costs 0.38 byte
a coefficient, ``s = 3`` 0.53, ``s = 7`` 0.67, ``s = 15`` 0.8, ``s = 127`` 1.14 bytes. (Until this
version the words were fp32, exact only below ``2^24``: four 5-bit fields a word, 1 byte a
coefficient at ``s = 7``. The decoded sums are the same to the bit; only the bytes differ.)

Learning ``U`` and ``mu`` (identical on every rank). During the warm-up (``warmup_steps``) and
each refresh window (``refresh_window`` steps every ``refresh_every`` compressed steps) the hook
sends gradients uncompressed and shows the *aggregated* gradients, identical on all ranks, to
:meth:`observe_dense`. The codec keeps a bounded random sample of their slices (at most
``max_samples`` per layer, the subset chosen by a generator seeded from the layer name and the
step, never the rank). At the window's end :meth:`on_step_end` fits, in float64 with
``torch.linalg.eigh`` of the ``d x d`` second-moment (or covariance) matrix, the top ``k``
eigenvectors, with a fixed sign (the largest-magnitude entry of each is positive), and checks by
an all-gather of a SHA-256 digest that every rank holds the same bits; it raises if not.

Where the basis comes from (``basis_source``):

``"leader"`` (default, ours)
    Every ``refit_every`` compressed steps one rank (the leader, ``step mod N``) fits each layer's
    ``U`` on the slices of its own *compensated* gradient ``g + e`` of that step, and broadcasts
    the ``d x k`` bases in one message before anyone encodes (``4 d k`` bytes a layer, counted in
    ``bytes_sent``). Error feedback is on: what a basis misses stays in the residual, and since the
    next basis is fitted on gradient plus residual, it turns towards what was left behind. No
    uncompressed warm-up or refresh window is needed.
``"aggregate"`` (the paper's schedule)
    The basis is fitted on the aggregated gradients of uncompressed windows (below) and kept
    fixed in between. Error feedback is off by default, as in the paper: with a fixed basis the
    residual lies in the orthogonal complement of ``span(U)`` and would only be sent by the next
    uncompressed window. On ResNet-18 this schedule dropped most of the gradient energy for good
    and trained clearly worse than plain all-reduce (the measurements: docs/codecs/gradiveq.md).

The number of components is adjustable (:class:`~lightning_gradcomp.codecs.base.AdjustableLevel`):
at level ``L`` it is ``round(min(d, 4k)^(1-L) * k^L)`` for the configured ``k``, so level 1 keeps
``k`` and level 0 up to four times as many. With the ``"leader"`` source the bases of the next step
are fitted with the new count (a refit is forced when it changed); with ``"aggregate"`` the count
applies from the next fit, the bases in between keep theirs (every rank holds the same bases, so
the message sizes agree either way).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_gradcomp.codecs.base import (
    AdjustableLevel,
    Codec,
    CodecContext,
    CodecOptions,
    EncodeResult,
    MultiRound,
    Prepared,
    RoundContext,
    check_bool,
    check_choice,
    check_fraction,
    check_positive_int,
    check_run_steps,
    check_seed,
    geometric_level,
    run_steps,
)
from lightning_gradcomp.codecs.bits import bits_to_hold
from lightning_gradcomp.codecs.sampling import seeded_generator
from lightning_gradcomp.comm import digest
from lightning_gradcomp.memory import LocksNotPickled, StepUndo
from lightning_gradcomp.registry import register_codec

__all__ = ["GradiVeQCodec", "GradiVeQOptions", "fit_pca", "PHASES"]

#: numeric codes of the phases, as logged in ``gradcomp/pca_phase`` (:meth:`GradiVeQCodec.scalars`)
PHASES = {"warmup": 0, "compress": 1, "refresh": 2}
BASIS_SOURCES = ("leader", "aggregate")
QUANT_SCALES = ("component", "layer")
QUANT_ROUNDINGS = ("nearest", "stochastic")
_SHARED = "__shared__"
_EXACT_BITS = 24  # fp32 holds every integer below 2**24 exactly: the decoded level sums
_WORD_BITS = 63  # bits of an int64 word whose sums stay exact and non-negative (below 2**63)
WARMUP_CAP = 100  # a warm-up given as a fraction of the run is at most this many steps
LIGHT_COMPONENTS_FACTOR = 4  # components at compression level 0, as a multiple of the configured k


class _SharedScale(NamedTuple):
    """What :meth:`GradiVeQCodec.prepare_bucket` hands to ``encode`` for one layer (quantization)."""

    scale: Tensor  # max |c| over every rank: ``k`` values (one per component) or one (per layer)
    coefficients: Tensor | None = None  # this rank's coefficients, computed for the scale (reused)


class _LayerContext(NamedTuple):
    """A layer's decode context."""

    basis_key: str  # the key of the basis (the layer's, or the shared one)
    slices: int  # slices of slice_dim values; the rest, the tail, travels raw


def fit_pca(x: Tensor, k: int | None, explained_variance: float | None, center: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Principal directions of the rows of ``x`` (``S x d``), deterministically.

    Args:
        x: samples, one per row.
        k: number of directions to keep (an upper bound when ``explained_variance`` is given).
        explained_variance: keep the fewest directions whose eigenvalues sum to at least this
            fraction of the total.
        center: subtract the sample mean first (PCA proper); otherwise the directions are those of
            the uncentred second moment ``x^T x / S`` and the mean is zero.

    Returns:
        ``(U, mu, ev)``: ``U`` (``d x k``, float64, orthonormal columns, each column's
        largest-magnitude entry positive), ``mu`` (``d``, float64) and ``ev`` the fraction of the
        sample's (centred) energy that ``span(U)`` captures.
    """
    x = x.to(torch.float64)
    d = x.shape[1]
    mu = x.mean(0) if center else x.new_zeros(d)
    xc = x - mu
    cov = xc.T @ xc / max(x.shape[0], 1)
    evals, evecs = torch.linalg.eigh(cov)  # ascending
    evals = evals.flip(0).clamp_min(0)
    evecs = evecs.flip(1)
    total = float(evals.sum())
    kmax = d if k is None else min(k, d)
    if explained_variance is not None and total > 0:
        cum = torch.cumsum(evals, 0) / total
        k_ev = int(torch.searchsorted(cum, torch.tensor(explained_variance - 1e-12, dtype=cum.dtype)).item()) + 1
        kk = max(1, min(kmax, k_ev))
    else:
        kk = kmax
    u = evecs[:, :kk].clone()
    # sign convention: the entry of largest magnitude (first one on ties) is positive
    idx = u.abs().argmax(0)
    signs = torch.sign(u[idx, torch.arange(kk)])
    signs[signs == 0] = 1
    u *= signs
    ev = torch.tensor(float(evals[:kk].sum()) / total if total > 0 else 1.0, dtype=torch.float64)
    return u, mu, ev


def _max_magnitude(x: Tensor, dim: int | None = None) -> Tensor:
    """``x.abs().max()`` (or ``.amax(dim)``), exactly, without the copy ``|x|``: the larger of
    ``max x`` and ``-min x``. A NaN propagates as it does through ``abs().max()``."""
    lo, hi = torch.aminmax(x) if dim is None else torch.aminmax(x, dim=dim)
    return torch.maximum(hi, -lo)


def _scaled_gram(x: Tensor) -> Tensor:
    """The ``d x d`` second moment ``x^T x`` of ``x`` (``S x d``) in float64, whose eigenvectors are
    the right singular directions of ``x`` (cheap for small ``d``).

    ``x`` is scaled by its largest magnitude first: the directions do not change, and the fp32
    products cannot overflow (values near 1e20 would square past fp32's range)."""
    amax = _max_magnitude(x)
    x = x / torch.where((amax > 0) & torch.isfinite(amax), amax, torch.ones_like(amax))  # no host sync
    return (x.T @ x).to(torch.float64)


def _directions(vecs: Tensor, k: int) -> Tensor:
    """The ``k`` leading eigenvectors from ``eigh``'s ascending ``vecs`` as fp32 columns
    (``d x k``), each column's largest-magnitude entry positive."""
    u = vecs[:, -k:].flip(1)
    idx = u.abs().argmax(0)
    signs = torch.sign(u[idx, torch.arange(k, device=u.device)])
    signs[signs == 0] = 1
    return (u * signs).to(torch.float32)


@functools.lru_cache(maxsize=None)
def _field_shifts(b: int, f: int, device: torch.device) -> Tensor:
    """``b i`` for ``i < f`` in int64 on ``device``, made once (a copy to a GPU waits)."""
    return (torch.arange(f, dtype=torch.int64) * b).to(device)


def _pack(levels: Tensor, b: int, f: int) -> Tensor:
    """int64 words of ``f`` fields of ``b`` bits, ``sum_i levels[f w + i] 2^(b i)``, from one
    rank's offset levels (fp32 integers in ``[0, 2^b)``, a multiple of ``f`` of them).

    The fields are first summed in fp32, ``g = floor(24 / b)`` of them to a chunk: every partial
    sum is an integer below ``2^24``, exact in fp32 in any order, so only the ``ceil(f / g)``
    chunks a word are widened to int64 and shifted into place, not every field: on ResNet-18's
    2.8 M coefficients at 16 components about half the time on one core."""
    g = _EXACT_BITS // b
    fields = levels.view(-1, f)
    word = None
    for lo in range(0, f, g):
        hi = min(lo + g, f)
        chunk = fields[:, lo] if hi - lo == 1 else torch.add(fields[:, lo], fields[:, lo + 1], alpha=2.0**b)
        for i in range(lo + 2, hi):
            chunk.add_(fields[:, i], alpha=2.0 ** (b * (i - lo)))
        part = chunk.to(torch.int64)
        if lo:
            part <<= b * lo
        word = part if word is None else word.add_(part)
    return word


@dataclass(frozen=True)
class GradiVeQOptions(CodecOptions):
    """The options of :class:`GradiVeQCodec` (documented there)."""

    slice_dim: int = 64
    num_components: int | None = None
    basis_source: str = "leader"
    refit_every: int = 1
    variance_target: float | None = None
    warmup_steps: int | float = 0.05
    refresh_every: int = 2000
    refresh_window: int = 20
    max_samples: int = 16384
    basis: str = "layer"
    center: bool = False
    quant_levels: int = 7
    quant_fill: bool = False
    quant_scale: str = "layer"
    quant_rounding: str = "stochastic"
    seed: int = 0

    def check(self) -> None:
        check_choice("basis_source", self.basis_source, BASIS_SOURCES)
        check_positive_int("refit_every", self.refit_every)
        slice_dim = self.slice_dim
        check_positive_int("slice_dim", slice_dim)
        if slice_dim < 2:
            raise ValueError(f"slice_dim must be an integer >= 2, got {slice_dim!r}")
        num_components = self.num_components
        if num_components is not None:
            check_positive_int("num_components", num_components)
            if num_components > slice_dim:
                raise ValueError(f"num_components must be in [1, slice_dim={slice_dim}], got {num_components}")
        if self.variance_target is not None:
            self._set("variance_target", check_fraction("variance_target", self.variance_target))
        check_positive_int("max_samples", self.max_samples)
        check_choice("basis", self.basis, ["layer", "shared"])
        if self.variance_target is not None and self.basis_source == "leader":
            raise ValueError("variance_target needs basis_source='aggregate' (the leader keeps a fixed k)")
        if self.basis == "shared" and self.basis_source == "leader":
            raise ValueError("basis='shared' needs basis_source='aggregate' (the leader fits one basis per layer)")
        self._set("center", check_bool("center", self.center))
        quant_levels = self.quant_levels
        check_positive_int("quant_levels", quant_levels, allow_zero=True)
        if 2 * quant_levels + 1 > 2**_EXACT_BITS // 2:
            raise ValueError(
                f"quant_levels must be in [0, {2 ** (_EXACT_BITS - 2) - 1}] (0 = no quantization), got {quant_levels}"
            )
        self._set("quant_fill", check_bool("quant_fill", self.quant_fill))
        check_choice("quant_scale", self.quant_scale, QUANT_SCALES)
        check_choice("quant_rounding", self.quant_rounding, QUANT_ROUNDINGS)
        self._set("seed", check_seed("seed", self.seed))
        warmup_steps = check_run_steps("warmup_steps", self.warmup_steps)
        if warmup_steps == 0:
            raise ValueError("warmup_steps must be >= 1 (the first basis is fitted on it), or a fraction of the run")
        self._set("warmup_steps", warmup_steps)
        check_positive_int("refresh_every", self.refresh_every, allow_zero=True)
        check_positive_int("refresh_window", self.refresh_window)


@register_codec("gradiveq")
class GradiVeQCodec(AdjustableLevel, MultiRound, Codec, LocksNotPickled):
    """GradiVeQ: project slices of each layer's gradient onto a shared PCA basis, all-reduce the codes.

    Args:
        slice_dim: d, the slice length (default 64; our choice by measurement on ResNet-18, the
            paper's value is not confirmed).
        num_components: k, principal components kept, ``1 <= k <= d`` (default 4 when
            ``variance_target`` is not given, i.e. ``d / k = 16``; our choice). With
            ``variance_target`` it is the upper bound of the k picked (default ``d``). The level
            controller that ``CompressedDDPStrategy`` attaches by default holds the light level,
            ``min(d, 4k)`` components on every step (16 for the defaults), beside SGD
            (:attr:`adaptive_by_default`) as beside an Adam-like optimizer
            (:attr:`adaptive_optimizer_controller`).
        variance_target: if given, in ``(0, 1]``: each fit picks per layer the smallest k whose
            components explain this fraction of the sampled gradient energy (the paper picks k by
            explained variance; the value is ours to choose).
        warmup_steps: L, uncompressed all-reduce steps whose aggregated gradients feed the first
            fit: steps (an int) or a fraction of the run (a float in (0, 1), at most 100 steps;
            default 0.05, our choice), resolved by the strategy against Lightning's
            ``estimated_stepping_batches`` (100 when the run's length is unknown). The hook never
            compresses before step 2.
        refresh_every: T, compressed steps between refits; 0 never refits (default 2000; our choice).
        refresh_window: uncompressed steps collected for each refit (default 20; our choice).
        max_samples: at most this many slices per layer are kept for a fit (default 16384; ours).
        basis: ``"layer"`` (one U per layer, default, chosen by measurement) or ``"shared"``
            (one U for all layers, fitted on their pooled samples; ``"aggregate"`` source only).
        basis_source: ``"leader"`` (default): the leader fits the bases on its compensated
            gradient every ``refit_every`` steps and broadcasts them, with error feedback;
            ``"aggregate"``: the paper's schedule, fitted on uncompressed windows (see the module
            docstring).
        refit_every: ``"leader"`` source: compressed steps between fits (default 1, every step).
        center: fit on centred samples and transmit ``U^T (g - mu)`` (default False: the paper
            describes plain projection; with ``mu = 0`` the map is linear rather than affine).
        quant_levels: s, 0 for fp32 coefficients, else integer levels ``[-s, s]`` with shared
            scales, packed summably into int64 words (see the module docstring);
            ``2 * world_size * s + 1 <= 2**24``. Default 7 (QSGD's 4-bit setting; the paper
            stacks GradiVeQ with QSGD, the value is ours): with ``d=64, k=4`` about 95x fewer
            bytes than fp32 for two ranks. Beside an Adam-like optimizer ``CompressedDDPStrategy``
            sets 31 when the user did not set it (:attr:`adaptive_optimizer_defaults`).
        quant_fill: raise ``s`` to the most levels whose sums pack as many fields into a word as
            ``s``'s do for this world size (:meth:`fill_levels`): finer levels at the same bytes
            (in 63-bit words 3, 7, 15 and 31 already fill their fields for two ranks, 50 becomes
            127). Default False: on ResNet-18 with two ranks 15 levels ended 0.32 point below 7
            over six seeds (standard error 0.50), when the words were fp32 and 15 levels cost what
            7 did (docs/benchmarks.md, "Fifteen levels at the bytes of seven").
        quant_scale: ``"layer"`` (default): one shared scale per layer; ``"component"``: one per
            principal component of a layer (measured, not adopted: see the module docstring).
        quant_rounding: ``"stochastic"`` (default; QSGD's unbiased rounding) or ``"nearest"``
            (measured, not adopted: see the module docstring).
        seed: seed of the sampling of slices and of the stochastic rounding.
        error_feedback: keep ``x - x_hat`` per parameter (default: on with the ``"leader"``
            source, off with ``"aggregate"``, see the module docstring).
        min_numel: smaller layers travel in the fp32 all-reduce (default 4096; our choice).
        start_step: no compression before this step either (default 2).
    """

    collective = "allreduce"
    wire_format = 2  # levels packed in int64 words (1: in fp32 words, exact below 2**24)
    _unpickled_locks = ("_sample_lock",)  # the window's samples, written from the hook's callbacks
    Options = GradiVeQOptions
    harness_defaults = {"min_numel": 4096}
    # more components in the critical phases (AdaptiveCompression): on ResNet-18, one epoch, it
    # ended 1.3 points behind plain all-reduce instead of 3.7 (seeds 0 and 1: +2.3 and +2.5), at a
    # whole-run ratio of 34.2 instead of 49.9; counting each halving of the cosine-decayed rate as
    # a drop ("peak") brought it to 0.9 behind (+0.3 and +0.6 more) at 20.7, and on PSPNet/CamVid
    # to 1.0 mIoU behind instead of 1.3 (docs/benchmarks.md, "With the level controller").
    # Beside SGD the same light steps pay more at the start: light for the first half of the
    # run, then heavy unless a window's norm changes by half (the rate ignored), ended 0.56
    # point above the peak rule over six seeds on an Intel Xeon (standard error 0.22; level or
    # above on every seed) with 8 % fewer bytes (docs/benchmarks.md, "Light first, heavy late,
    # beside SGD"), and was the default until the levels travelled in int64 words. Those words
    # cut a 16-component step's bytes by a third, and the light level on every step, 21.2x over
    # the run, ended 0.45 point above that schedule over the same six seeds (standard error 0.07;
    # above on every seed) and 1.00 below plain all-reduce (0.32): by the rule written before
    # its last two seeds, the controller holds the light level beside SGD too ("Seeds 4 and 5
    # of 16 components, with the levels packed in 64-bit integers"). {"warmup": 0.5} gives the
    # schedule back (31.8x in int64 words).
    adaptive_by_default = {"high_level": 0.0}
    # beside Adam the coefficients' quantization costs: on PSPNet/CamVid (AdamW, eight seeds)
    # fp32 coefficients ended 0.89 mIoU above seven levels (standard error 0.25) at 2.7x the
    # bytes, and 31 levels 0.65 above (0.50) at 1.18x, for two ranks (docs/benchmarks.md, "Eight
    # seeds of fp32 coefficients")
    adaptive_optimizer_defaults = {"quant_levels": 31}
    # and so do the heavy steps' 4 components, wherever they fall: on PSPNet/CamVid (AdamW, an
    # Intel Xeon, eight seeds) 16 components on every step ended 0.08 mIoU below plain all-reduce
    # (standard error 0.31) and 0.77 above the peak rule's schedule (0.19; above it on every seed)
    # at 8.5x instead of 12.0x; light first and heavy late had ended where the peak rule did. So
    # the controller holds its light level, 16 components (docs/benchmarks.md, "Sixteen components
    # on every step beside AdamW")
    adaptive_optimizer_controller = {"high_level": 0.0}

    def __init__(self, **options: Any) -> None:
        # error_feedback's default depends on an option: on with the "leader" source, off with
        # "aggregate" (a harness default cannot express that); an explicit value (not None) wins
        if options.get("error_feedback") is None:
            options["error_feedback"] = options.get("basis_source", GradiVeQOptions.basis_source) == "leader"
        super().__init__(**options)
        # learned state, identical on every rank
        self._bases: dict[str, Tensor] = {}  # float64 masters (checkpointed)
        self._means: dict[str, Tensor] = {}
        self._ev: dict[str, Tensor] = {}
        self._u32: dict[str, Tensor] = {}  # fp32 working copies
        self._mu32: dict[str, Tensor] = {}
        self._fits = 0
        self._last_fit_step = -1
        self._current_step = 0  # the latest step seen by observe_dense, prepare_bucket or on_step_end
        # sample buffers of the current window, one tensor a step (checkpointed, so that a run
        # resumed inside a window, or at its end before the fit, fits on what it would have)
        self._samples: dict[str, list[Tensor]] = {}
        self._sample_lock = threading.Lock()
        # nonfinite="skip": the bases a leader's fit replaced this step, for end_step
        self._before_step = StepUndo()

    def setup(self, context: CodecContext) -> None:
        super().setup(context)
        if self.options.quant_levels:
            self._field_bits()  # raises early when the world is too large for the levels

    def replace_options(self, **changes: Any) -> None:
        before = self.options
        super().replace_options(**changes)
        if self.context is not None and self.options.quant_levels:
            # levels adopted after setup (beside Adam) face setup's check of the world size now,
            # before the first step, not at the first step that packs them
            try:
                self._field_bits()
            except ValueError:
                self.options = before  # a refused value changes nothing
                raise

    @property
    def configured_components(self) -> int:
        """k, the option ``num_components`` resolved: by default ``slice_dim`` with
        ``variance_target`` (an upper bound), else ``min(4, slice_dim)``."""
        o = self.options
        if o.num_components is not None:
            return int(o.num_components)
        return o.slice_dim if o.variance_target is not None else min(4, o.slice_dim)

    @property
    def num_components(self) -> int:
        """k at the compression level ``L`` in use: ``round(min(d, 4k)^(1-L) k^L)`` for the
        configured k (:attr:`configured_components`, which level 1 keeps)."""
        k = self.configured_components
        light = min(self.options.slice_dim, LIGHT_COMPONENTS_FACTOR * k)
        return round(geometric_level(light, k, self.compression_level))

    # ----------------------------------------------------------------------------------------------
    # schedule
    @property
    def warmup_end(self) -> int:
        """``warmup_steps`` in steps, resolved against the run's length."""
        return run_steps(self.options.warmup_steps, self.run_total_steps, WARMUP_CAP)

    def phase_at(self, step: int) -> str:
        """``"warmup"``, ``"compress"`` or ``"refresh"`` for optimizer step ``step`` (0-based).

        After ``warmup_steps`` uncompressed steps the codec cycles through ``refresh_every``
        compressed steps and ``refresh_window`` uncompressed ones.
        """
        warmup = self.warmup_end
        if self.options.basis_source == "leader":
            return "compress"
        if step < warmup:
            return "warmup"
        if self.options.refresh_every == 0:
            return "compress"
        u = (step - warmup) % (self.options.refresh_every + self.options.refresh_window)
        return "compress" if u < self.options.refresh_every else "refresh"

    def _fits_after(self, step: int) -> bool:
        """Whether a window ends with step ``step`` (the basis is fitted after it)."""
        if self.options.basis_source == "leader":
            return False
        if step == self.warmup_end - 1:
            return True
        return self.phase_at(step) == "refresh" and self.phase_at(step + 1) != "refresh"

    def is_compressing(self, step: int) -> bool:
        if self.options.basis_source == "leader":  # the first compressed step fits its own bases
            return step >= self.harness.start_step
        return step >= self.harness.start_step and self.phase_at(step) == "compress" and bool(self._bases)

    @property
    def fitted(self) -> bool:
        return bool(self._bases)

    @property
    def k(self) -> float:
        """Mean number of kept components over the fitted bases (0 before the first fit)."""
        if not self._bases:
            return 0.0
        return sum(u.shape[1] for u in self._bases.values()) / len(self._bases)

    @property
    def phase(self) -> str:
        """The phase of the latest step the codec saw (in :meth:`observe_dense`,
        :meth:`prepare_bucket` or :meth:`on_step_end`)."""
        return self.phase_at(self._current_step)

    @property
    def explained_variance(self) -> float:
        """Mean fraction of the sampled gradient energy the bases capture (0 before the first fit)."""
        if not self._ev:
            return 0.0
        return float(torch.stack(list(self._ev.values())).mean())

    @property
    def fits(self) -> int:
        return self._fits

    def scalars(self, step: int, compressing: bool) -> dict[str, float]:
        """``pca_phase`` of ``step`` (:data:`PHASES`: 0 warm-up, 1 compressing, 2 refresh window;
        a compressing phase the hook did not compress, before the first basis or in DDP's first
        steps, counts as warm-up), ``pca_k`` (mean number of components kept per basis, 0 before
        the first fit) and ``explained_variance`` (mean fraction of the sampled gradient energy
        the bases capture, 0 where no fit measured it)."""
        phase = self.phase_at(step)
        if phase == "compress" and not compressing:
            phase = "warmup"
        return {
            "pca_phase": float(PHASES[phase]),
            "pca_k": float(self.k),
            "explained_variance": float(self.explained_variance),
        }

    # ----------------------------------------------------------------------------------------------
    # learning the basis
    def observe_dense(self, key: str, mean_grad: Tensor, step: int) -> None:
        self._current_step = max(self._current_step, step)
        if self.phase_at(step) == "compress":
            return
        d = self.options.slice_dim
        s = mean_grad.numel() // d
        if s == 0:
            return
        warmup = self.warmup_end
        window = warmup if step < warmup else self.options.refresh_window
        m = min(s, -(-self.options.max_samples // window))
        slices = mean_grad[: s * d].detach().view(s, d)
        if m < s:
            # the same rows on every rank: the generator depends on the seed, layer and step only
            gen = seeded_generator(self.options.seed, 0, step, key, torch.device("cpu"))
            rows = torch.randperm(s, generator=gen)[:m].to(slices.device)
            slices = slices.index_select(0, rows)
        sample = slices.to(torch.float32).clone()
        with self._sample_lock:
            buf = self._samples.setdefault(key, [])
            buf.append(sample)
            # keep the newest max_samples rows: memory stays bounded
            total = sum(t.shape[0] for t in buf)
            while total - buf[0].shape[0] >= self.options.max_samples:
                total -= buf.pop(0).shape[0]

    def on_step_end(self, step: int) -> None:
        self._current_step = max(self._current_step, step)
        if self._fits_after(step):
            self.fit(step)

    def fit(self, step: int) -> None:
        """Fit the bases on the samples of the window that just ended, then check all ranks agree."""
        with self._sample_lock:
            samples = {k: torch.cat(v)[-self.options.max_samples :] for k, v in self._samples.items() if v}
            self._samples = {}
        if not samples:
            return
        o, kk = self.options, self.num_components
        if o.basis == "shared":
            pooled = torch.cat([samples[k] for k in sorted(samples)])
            if pooled.shape[0] > o.max_samples:
                gen = seeded_generator(o.seed, 0, step, _SHARED, torch.device("cpu"))
                pooled = pooled[torch.randperm(pooled.shape[0], generator=gen)[: o.max_samples]]
            u, mu, ev = fit_pca(pooled.cpu(), kk, o.variance_target, o.center)
            fitted = {_SHARED: (u, mu, ev)}
        else:
            fitted = {k: fit_pca(x.cpu(), kk, o.variance_target, o.center) for k, x in samples.items()}
        for key, (u, mu, ev) in fitted.items():
            self._bases[key], self._means[key], self._ev[key] = u, mu, ev
        self._refresh_working_copies()
        self._fits += 1
        self._last_fit_step = int(step)
        self.verify_identical()

    def _refresh_working_copies(self) -> None:
        device = self.context.device if self.context is not None else torch.device("cpu")
        self._u32 = {k: u.to(device=device, dtype=torch.float32) for k, u in self._bases.items()}
        self._mu32 = {k: m.to(device=device, dtype=torch.float32) for k, m in self._means.items()}

    def basis_digest(self) -> int:
        """A 62-bit digest of every basis and mean (what must match across ranks)."""
        parts: list[str | Tensor] = []
        for key in sorted(self._bases):
            parts += [key, self._bases[key], self._means[key]]
        return digest(*parts)

    def verify_identical(self) -> None:
        """Compare the basis digest across the group's ranks and raise ``RuntimeError`` on every
        rank if any two differ (nothing to compare on one rank or before :meth:`setup`)."""
        if self.context is None:
            return
        self.context.agree(
            self.basis_digest(),
            f"gradiveq: the PCA bases differ across ranks after the fit at step {self._last_fit_step}; the summed "
            "coefficients would be meaningless. The bases are fitted from the aggregated gradients, so this points "
            "to nondeterministic linear algebra across ranks (different hardware or libraries)",
        )

    # ----------------------------------------------------------------------------------------------
    # the codec proper
    def _basis_key(self, key: str) -> str | None:
        k = _SHARED if self.options.basis == "shared" else key
        return k if k in self._u32 else None

    def _coefficients(self, x: Tensor, bkey: str) -> Tensor:
        d = self.options.slice_dim
        s = x.numel() // d
        g = x[: s * d].view(s, d)
        if self.options.center:
            g = g - self._mu32[bkey]
        return g @ self._u32[bkey]

    @staticmethod
    def fill_levels(levels: int, world_size: int) -> int:
        """The most levels ``s' >= levels`` whose sums over ``world_size`` ranks pack as many
        fields into a 63-bit word as ``levels``' do: a field of ``b`` bits leaves ``63 mod b`` bits
        of each word unused, and the widest field that still packs ``F = floor(63 / b)`` a word,
        ``floor(63 / F)`` bits, holds sums up to ``2 N s' <= 2**floor(63 / F) - 1`` (and, decoded
        in fp32, below ``2**24``)."""
        if levels <= 0:
            return levels
        b = bits_to_hold(2 * world_size * levels)
        if b > _EXACT_BITS:  # too wide: _field_bits says so
            return levels
        widest = min(_WORD_BITS // (_WORD_BITS // b), _EXACT_BITS)
        return max(levels, min((2**widest - 1) // (2 * world_size), 2 ** (_EXACT_BITS - 2) - 1))

    @property
    def levels(self) -> int:
        """s as sent: ``quant_levels``, filled up to its field's width with ``quant_fill``."""
        s = self.options.quant_levels
        return self.fill_levels(s, self.world_size) if self.options.quant_fill else s

    def _field_bits(self) -> tuple[int, int]:
        """(b, F): bits of a packed field and fields per int64 word for this world size."""
        b = bits_to_hold(2 * self.world_size * self.levels)
        if b > _EXACT_BITS:
            raise ValueError(
                f"quant_levels={self.options.quant_levels} with {self.world_size} ranks: level sums need {b} bits, "
                f"more than the {_EXACT_BITS} an fp32 value holds exactly; use quant_levels <= "
                f"{(2**_EXACT_BITS - 1) // (2 * self.world_size)}"
            )
        return b, _WORD_BITS // b

    def _refit_from_leader(self, layers: list[tuple[str, Tensor, Tensor]], step: int, revertible: bool = False) -> int:
        """``"leader"`` source: the leader fits each layer's basis on its own compensated gradient and
        broadcasts them (one message); every rank installs the same bases. Returns the bytes sent.
        ``revertible``: the bases replaced are kept until :meth:`end_step`."""
        d, kk = self.options.slice_dim, min(self.num_components, self.options.slice_dim)
        fitting = [(key, x) for key, x, _ in layers if x.numel() >= d]
        due = (step - self.harness.start_step) % self.options.refit_every == 0
        # a layer without a basis, or whose basis has another count than the level asks for
        due = due or any(key not in self._u32 or self._u32[key].shape[1] != kk for key, _ in fitting)
        if not fitting or not due:
            return 0
        world = self.world_size
        leader = step % world  # a rank of the codec's group
        device = fitting[0][1].device
        msg = torch.empty(len(fitting), d, kk, dtype=torch.float32, device=device)
        if self.rank == leader:
            grams = torch.stack([_scaled_gram(x[: (x.numel() // d) * d].view(-1, d)) for _, x in fitting])
            # a non-finite gradient (a step the hook will skip) must not become a basis: its layers
            # keep their previous basis (the first k unit vectors before any), decided without a
            # host sync, and eigh sees finite input (on CUDA it would raise on NaN, on the leader only)
            finite = torch.isfinite(grams).flatten(1).all(1)
            grams = torch.nan_to_num(grams, nan=0.0, posinf=0.0, neginf=0.0)
            # one batched eigh for the bucket: on CUDA eigh waits for the GPU (it checks for
            # convergence failures on the host), so a call per layer would wait per layer
            _, vecs = torch.linalg.eigh(grams)
            for i, (key, _) in enumerate(fitting):
                previous = self._u32.get(key)
                if previous is None or previous.shape[1] != kk:  # none yet, or a count the level changed
                    previous = torch.eye(d, kk, dtype=torch.float32, device=device)
                msg[i] = torch.where(finite[i], _directions(vecs[i], kk), previous)
        if world > 1:
            self.context.broadcast(msg, leader)
        if revertible:  # the fit is installed now, but the step may yet be skipped
            self._keep_for_revert([key for key, _ in fitting])
        for (key, _), u in zip(fitting, msg):
            self._u32[key] = u.clone()
            self._mu32[key] = torch.zeros(d, dtype=torch.float32, device=device)
            # the fp64 masters stay on the device (no copy to the host per layer); they are moved
            # to the CPU when checkpointed or hashed
            self._bases[key] = u.detach().to(torch.float64)
            self._means[key] = torch.zeros(d, dtype=torch.float64, device=device)
        self._fits += 1
        self._last_fit_step = int(step)
        return msg.numel() * msg.element_size() if world > 1 else 0

    def _keep_for_revert(self, keys: list[str]) -> None:
        """Keep the bases of ``keys`` that a fit is about to replace (they are replaced, never
        written in place) and the fit count, once a step."""
        undo = self._before_step
        undo.keep_start(lambda: (self._fits, self._last_fit_step))
        for key in keys:
            undo.keep(key, lambda key=key: tuple(d.get(key) for d in self._fitted_stores))

    @property
    def _fitted_stores(self) -> tuple[dict[str, Tensor], ...]:
        """What a fit installs per layer: the fp32 working copies and the fp64 masters."""
        return self._u32, self._mu32, self._bases, self._means

    def end_step(self, discarded: bool) -> None:
        """A discarded step (``nonfinite="skip"``, a NaN on another rank than the leader) puts back
        the bases its fits replaced: the next step fits again from where this one started."""
        undo = self._before_step
        if discarded and undo:
            self._fits, self._last_fit_step = undo.started_from
            undo.restore(*self._fitted_stores)
        undo.clear()

    def prepare_bucket(self, layers: list[tuple[str, Tensor, Tensor]], rc: RoundContext) -> Prepared:
        """``"leader"`` source: the bases of this step first (a broadcast, see
        :meth:`_refit_from_leader`). With quantization: one all-reduce(MAX) of ``max |c|`` per
        layer gives the shared scales, which ``encode`` gets as ``prepared``."""
        step = rc.step
        self._current_step = max(self._current_step, step)
        sent = self._refit_from_leader(layers, step, rc.revertible) if self.options.basis_source == "leader" else 0
        if not self.options.quant_levels:
            return Prepared(sent)
        keys, coefs, amax = [], [], []
        for key, x, _ in layers:
            bkey = self._basis_key(key)
            if bkey is None:
                continue
            c = self._coefficients(x, bkey)
            keys.append(key)
            coefs.append(c)
            amax.append(self._local_scale(c))
        if not keys:
            return Prepared(sent)
        sizes = [a.numel() for a in amax]
        vec = torch.cat(amax).to(torch.float32)
        if self.world_size > 1:  # one rank's scale is already the shared one: nothing travels
            self.context.all_reduce(vec, "max")
            sent += vec.numel() * vec.element_size()
        shared = {key: _SharedScale(a, c) for key, a, c in zip(keys, vec.split(sizes), coefs)}
        return Prepared(sent, shared)

    def _local_scale(self, c: Tensor) -> Tensor:
        """This rank's ``max |c|``: per component (``k`` values) or for the whole layer (one)."""
        if self.options.quant_scale == "layer":
            return (_max_magnitude(c) if c.numel() else c.new_zeros(())).reshape(1)
        return _max_magnitude(c, 0) if c.shape[0] else c.new_zeros(c.shape[1])

    def encode(
        self, x: Tensor, key: str, param: Tensor, step: int, prepared: _SharedScale | None = None
    ) -> EncodeResult:
        """``prepared``: the layer's shared scale (and coefficients) from :meth:`prepare_bucket`,
        which quantization needs."""
        bkey = self._basis_key(key)
        if bkey is None:  # no basis for this layer (never observed): it travels raw, still summable
            return EncodeResult([x.clone()], local=x.clone(), ctx=None)
        d = self.options.slice_dim
        s = x.numel() // d
        tail = x[s * d :].clone()
        c = None if prepared is None else prepared.coefficients
        if c is None:
            c = self._coefficients(x, bkey)
        local = None
        if self.options.quant_levels:
            if prepared is None:
                raise RuntimeError("gradiveq: quantized encode without a shared scale (prepare_bucket did not run)")
            gen = seeded_generator(self.options.seed, self.rank, step, key, x.device)
            levels = self._quantize(c, prepared.scale, gen)
            # the scales travel beside the words; identical on all ranks, their sums are N a
            scales = prepared.scale.reshape(-1).to(torch.float32)
            payload = [_pack(levels, *self._field_bits()), scales, tail]
            if self.harness.error_feedback:  # the residual needs it: from the levels, not unpacked from the words
                c_sent = self._from_level_sums(levels[: c.numel()], scales, count=1)
                local = self._synthesize(c_sent, bkey, s, x.numel(), tail, count=1)
        else:
            payload = [c.reshape(-1), tail]
        # otherwise local stays None: the hook decodes it only when error feedback or a statistics sample needs it
        return EncodeResult(payload, local=local, ctx=_LayerContext(bkey, s))

    def _quantize(self, c: Tensor, scale: Tensor, gen: torch.Generator) -> Tensor:
        """The offset levels ``q + s`` in ``[0, 2s]`` of ``c``, fp32, flat, padded with zeros to a
        multiple of the fields a word (:func:`_pack` makes the words: the fields do not overlap, so
        their sum is the word, and every partial sum of the all-reduce stays below ``2^63``)."""
        s = self.levels
        _, f = self._field_bits()
        # the scales stay tensors (no host sync): s / a in fp64 rounded once to fp32; a scale of 0
        # (or NaN) sends zeros. One scale per column of c (a component), or one for all
        a = scale.to(torch.float64)
        factor = (s / torch.where(a > 0, a, torch.ones_like(a))).to(torch.float32)
        y = torch.where(a > 0, c * factor, 0.0).reshape(-1)
        n = y.numel()
        levels = torch.empty(n + (-n) % f, dtype=torch.float32, device=y.device)
        q = levels[:n]
        if self.options.quant_rounding == "nearest":
            torch.round(y, out=q)
        else:  # stochastic rounding: floor(y + u), u ~ U[0, 1), is unbiased
            torch.rand(n, generator=gen, device=y.device, out=q).add_(y).floor_()
        q.clamp_(-s, s).add_(s)
        levels[n:] = 0
        return levels

    def _scale_count(self, k: int) -> int:
        """Shared scales a quantized layer of ``k`` components carries beside its words."""
        return k if self.options.quant_scale == "component" else 1

    def _dequantize(self, words: Tensor, scales: Tensor, n: int, count: int) -> Tensor:
        """The ``n`` coefficients that ``words`` (int64, summed over ``count`` ranks) and ``scales``
        (the shared scales, summed likewise) stand for."""
        b, f = self._field_bits()
        fields = (words.unsqueeze(1) >> _field_shifts(b, f, words.device)) & ((1 << b) - 1)
        return self._from_level_sums(fields.reshape(-1)[:n].to(torch.float32), scales, count)

    def _from_level_sums(self, level_sums: Tensor, scales: Tensor, count: int) -> Tensor:
        """The coefficients that the offset level sums (fp32 integers, ``count`` ranks' levels
        added) and the shared scales (summed likewise) stand for: ``(sum - count s) a / s``."""
        s = self.levels
        m = scales.numel()
        # the shared scales, summed over count ranks (fp64, rounded once to fp32)
        a = scales.to(torch.float64) / count
        qsum = level_sums - count * s  # exact: integers below 2**24
        # slices * k coefficients, row-major: column j is component j
        return (qsum.view(-1, m) * (a / s).to(torch.float32)).reshape(-1)

    def _synthesize(self, c: Tensor, bkey: str, slices: int, numel: int, tail: Tensor, count: int) -> Tensor:
        """The layer (``numel`` values) that the coefficients ``c`` of ``slices`` slices and the raw
        ``tail`` stand for: ``U c`` per slice (plus ``count mu`` when centred)."""
        d, k = self.options.slice_dim, self._u32[bkey].shape[1]
        out = torch.empty(numel, dtype=torch.float32, device=c.device)
        g = out[: slices * d].view(slices, d)
        torch.matmul(c.view(slices, k), self._u32[bkey].T, out=g)  # written in place: no extra copy
        if self.options.center:
            g += count * self._mu32[bkey]
        out[slices * d :] = tail
        return out

    def decode(self, payload: list[Tensor], ctx: Any, numel: int, count: int) -> Tensor:
        if ctx is None:
            return payload[0].to(torch.float32)
        bkey, s = ctx.basis_key, ctx.slices
        k = self._u32[bkey].shape[1]
        if self.options.quant_levels:
            words, scales, tail = payload
            c = self._dequantize(words, scales, s * k, count)
        else:
            coef, tail = payload
            c = coef.to(torch.float32)
        return self._synthesize(c, bkey, s, numel, tail, count)

    def payload_nbytes(self, numel: int) -> int:
        """Bytes this codec puts on the wire for a layer of ``numel`` values (with a basis of k):
        int64 words of packed levels and fp32 scales, or fp32 coefficients; the tail in fp32."""
        d, k = self.options.slice_dim, self.num_components
        s = numel // d
        tail = 4 * (numel - s * d)
        if self.options.quant_levels:
            _, f = self._field_bits()
            return 8 * -(-(s * k) // f) + 4 * self._scale_count(k) + tail
        return 4 * s * k + tail

    # ----------------------------------------------------------------------------------------------
    # checkpointing: identical on every rank
    def state_dict(self) -> dict[str, Any]:
        with self._sample_lock:  # the hook's callbacks add samples from other threads
            samples = {k: [t.detach().cpu().clone() for t in v] for k, v in self._samples.items()}
        return {
            **self.level_state(),
            "bases": {k: v.detach().cpu().clone() for k, v in self._bases.items()},
            "means": {k: v.detach().cpu().clone() for k, v in self._means.items()},
            "explained_variance": {k: v.detach().cpu().clone() for k, v in self._ev.items()},
            "fits": self._fits,
            "last_fit_step": self._last_fit_step,
            "slice_dim": self.options.slice_dim,
            # empty between windows; inside one, up to max_samples rows of slice_dim a layer
            "samples": samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = self.load_level_state(state)
        if not state:
            return
        slice_dim = self.options.slice_dim
        if int(state["slice_dim"]) != slice_dim:
            raise ValueError(
                f"checkpoint bases have slice_dim={state['slice_dim']}, this codec has slice_dim={slice_dim}"
            )
        self._bases = {k: v.to(torch.float64).cpu() for k, v in state["bases"].items()}
        self._means = {k: v.to(torch.float64).cpu() for k, v in state["means"].items()}
        self._ev = {k: v.to(torch.float64).cpu() for k, v in state["explained_variance"].items()}
        self._fits = int(state["fits"])
        self._last_fit_step = int(state["last_fit_step"])
        device = self.context.device if self.context is not None else torch.device("cpu")
        with self._sample_lock:  # absent from checkpoints written before the samples were kept
            self._samples = {str(k): [t.to(device) for t in v] for k, v in state.get("samples", {}).items()}
        self._refresh_working_copies()
