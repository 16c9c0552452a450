"""Options: a codec's own (:class:`CodecOptions`), the harness's around every codec
(:class:`HarnessOptions`), and the checks a codec's ``Options.check`` runs on its values. Each check
names the option and what it must be, and returns the value normalised, so that equal settings
compare and hash equally on every rank."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = [
    "CodecOptions",
    "HarnessOptions",
    "harness_defaults_that_apply",
    "check_fraction",
    "check_bool",
    "check_seed",
    "check_positive_int",
    "check_positive_float",
    "check_choice",
    "check_run_steps",
    "run_steps",
    "check_dense_layers",
    "DENSE_DTYPES",
]

#: the ``dense_dtype`` and ``plain_dtype`` harness options' choices (names of torch dtypes)
DENSE_DTYPES = ("float32", "bfloat16")


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
        precondition: compress the gradient in the optimizer's own coordinates. With an optimizer
            that keeps a per-coordinate second moment ``v`` (``exp_avg_sq``: Adam, AdamW and their
            kin), each compressed layer's input ``x`` (after error-feedback compensation) is
            divided by ``d = max(sqrt(v), 0.01 * mean(sqrt(v)))`` before the codec sees it, and the
            aggregate the codec decodes is multiplied by ``d`` again; the residual stays in units of
            the gradient. Adam moves every coordinate by about the learning rate whatever its
            gradient's scale, so a support chosen by ``|x| / d`` picks the coordinates that the
            optimizer would move most, where one chosen by ``|x|`` keeps sending the layer's
            large-gradient channels and leaves the others waiting. ``v`` comes from the all-reduced
            gradients, so ``d`` is the same on every rank. Layers without a second moment (an SGD
            optimizer, the steps before its first step) are compressed as they are. The strategy
            reads ``v`` from the optimizers before each backward; with ``make_comm_hook`` call
            ``state.set_second_moments({name: v})`` there. Default False. Codecs that run their own
            exchange (``powersgd``, ``auto``) refuse it.
        dense_dtype: the dtype in which the layers that travel uncompressed (small ones and
            ``dense_layers``) are gathered on a compressed step of a codec that gathers its
            payloads: ``"float32"`` (default, exact) or ``"bfloat16"`` (half the bytes, a relative
            rounding error of at most 2^-8 per value, summed in fp32 after the gather, as torch's
            ``bf16_compress_hook`` sends whole buckets). In a sparse codec's message these layers
            are most of the bytes (ResNet-18 with ``lgc``: 66 of 213 kB a step; PSPNet: about
            half). Codecs that send their dense layers in their own all-reduce (``gradiveq``,
            ``iwp``, ``fp16``, ``powersgd``, ...) refuse anything but ``"float32"``; ``lgc``'s
            autoencoder with ``variant="rar"`` sums its latents in stage 3, and its dense layers
            travel in fp32 there.
        plain_dtype: the dtype of what travels exactly because nothing compresses it: the plain
            all-reduce of the steps and buckets sent uncompressed (the warm-up before
            ``start_step`` or a codec's own, such as ``lgc``'s stage 1, and buckets the fallback
            sends plainly), and the exact values that ``lgc`` gathers on its support (its stage 2,
            and the layers its run-time guard sends exactly). ``"float32"`` (default, exact) or
            ``"bfloat16"``: half the bytes, each rank's values rounded to bfloat16 and summed in
            bfloat16 as torch's ``bf16_compress_hook`` does (``lgc``'s gathered values are summed
            in fp32); with ``error_feedback`` each rank's rounding error stays in its residual and
            travels with the next step, so what a rank sends plus what it keeps is what it
            computed. Only the rounding of the plain all-reduce's bfloat16 sum itself (at most
            2^-8 of it, the same on every rank) is not kept. Gradients that are not fp32 travel in
            their own dtype. ``lgc`` beside an Adam-like optimizer takes ``"bfloat16"`` by default
            when error feedback is on (its ``adaptive_optimizer_defaults``).
        deflate: messages on the CPU travel compressed without loss: split into byte planes and
            compressed by zlib, each rank's size all-gathered first (``lightning_gradcomp.comm``).
            What the ranks receive is unchanged to the bit, so training is too; what it saves is
            the redundancy of values that travel exactly (a bfloat16 gradient's planes compress to
            about two thirds), at a CPU cost of 15-20 ms a megabyte (zlib level 1, one core).
            It applies to the all-gathered messages and, with two ranks, to the plain all-reduce
            (gathered and summed as the all-reduce sums, in the same dtype; with more ranks a ring
            all-reduce sends less than a gather of compressed messages). On a GPU messages travel
            as they are (a copy to the host would cost more than the link it saves). Default
            False: on the segmentation recipe ``lgc`` sent 23 % fewer bytes with it and reached
            the same weights, but over a 10 Mbit/s link it was slower, since its CPU cost fell on
            the steps whose messages the link carried nearly free (docs/codecs/lgc.md, "Beside
            Adam: the messages compressed without loss").
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
    precondition: bool = False
    dense_dtype: str = "float32"
    plain_dtype: str = "float32"
    deflate: bool = False

    def check(self) -> None:
        self._set("error_feedback", check_bool("error_feedback", self.error_feedback))
        self._set("min_numel", check_positive_int("min_numel", self.min_numel, allow_zero=True))
        self._set("start_step", check_positive_int("start_step", self.start_step, allow_zero=True))
        self._set("dense_layers", check_dense_layers(self.dense_layers))
        self._set("momentum", check_fraction("momentum", self.momentum, low_open=False, high_open=True))
        self._set("weight_decay", check_positive_float("weight_decay", self.weight_decay, allow_zero=True))
        if (self.nesterov or self.weight_decay) and not self.momentum:
            raise ValueError("nesterov and weight_decay are part of momentum correction: set momentum > 0 too")
        self._set("nesterov", check_bool("nesterov", self.nesterov))
        self._set("momentum_masking", check_bool("momentum_masking", self.momentum_masking))
        if self.lr_scaled_feedback and not self.error_feedback:
            raise ValueError("lr_scaled_feedback rescales the error-feedback residual: it needs error_feedback=True")
        self._set("lr_scaled_feedback", check_bool("lr_scaled_feedback", self.lr_scaled_feedback))
        self._set("precondition", check_bool("precondition", self.precondition))
        check_choice("dense_dtype", self.dense_dtype, DENSE_DTYPES)
        check_choice("plain_dtype", self.plain_dtype, DENSE_DTYPES)
        check_bool("deflate", self.deflate)


#: harness options that a codec sets by default only where error feedback is on: a default
#: ``lr_scaled_feedback`` rescales the residual, and a default ``plain_dtype="bfloat16"`` relies on
#: it to keep each rank's rounding
NEED_ERROR_FEEDBACK = frozenset({"lr_scaled_feedback", "plain_dtype"})


def harness_defaults_that_apply(defaults: Mapping[str, Any], error_feedback: bool) -> dict[str, Any]:
    """The options a codec sets by default (``harness_defaults``, those it takes with the level
    controller, ``adaptive_harness_defaults``, or beside an Adam-like optimizer,
    ``adaptive_optimizer_defaults``) that apply to a run with or without ``error_feedback``:
    without it, those of :data:`NEED_ERROR_FEEDBACK` are dropped. A user's own
    ``lr_scaled_feedback=True`` without error feedback is not passed through here and fails
    :meth:`HarnessOptions.check`; a user's own ``plain_dtype`` is taken as given."""
    if error_feedback:
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k not in NEED_ERROR_FEEDBACK}


# --------------------------------------------------------------------------------------------------
# the checks
def check_fraction(name: str, value: float, *, low_open: bool = True, high_open: bool = False) -> float:
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok_low = number and (value > 0 if low_open else value >= 0)
    ok_high = number and (value < 1 if high_open else value <= 1)
    if not (number and math.isfinite(value) and ok_low and ok_high):
        lo = "(0" if low_open else "[0"
        hi = "1)" if high_open else "1]"
        raise ValueError(f"{name} must be in {lo}, {hi}, got {value!r}")
    return float(value)


def check_bool(name: str, value: bool) -> bool:
    """``True`` or ``False`` and nothing else: a YAML or JSON string such as ``"false"`` would
    otherwise read as true."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_seed(name: str, value: int) -> int:
    """A seed every generator of the package takes: an integer in ``[0, 2**32)`` (numpy's bound)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < 2**32:
        raise ValueError(f"{name} must be an integer in [0, 2**32), got {value!r}")
    return int(value)


def check_positive_int(name: str, value: int, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return value


def check_positive_float(
    name: str, value: float, *, allow_zero: bool = False, allow_inf: bool = False, note: str = ""
) -> float:
    """A real number ``> 0`` (``>= 0`` with ``allow_zero``), finite unless ``allow_inf``, as a float.
    ``note`` follows the bound in the message (what 0 means, the unit)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (value >= 0 if allow_zero else value > 0) and (allow_inf or math.isfinite(value))
    if not ok:
        finite = "" if allow_inf else "finite "
        raise ValueError(f"{name} must be a {finite}number {'>=' if allow_zero else '>'} 0{note}, got {value!r}")
    return float(value)


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


def check_dense_layers(value: str | Sequence[str]) -> tuple[str, ...]:
    """The ``dense_layers`` option as a tuple of patterns (resolved by :mod:`lightning_gradcomp.hook.layers`)."""
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if items is None or not all(isinstance(v, str) and v for v in items):
        raise ValueError(f"dense_layers must be 'auto', 'none' or a list of parameter-name patterns, got {value!r}")
    return tuple(items)
