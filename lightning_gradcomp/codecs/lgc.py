"""``lgc``: Learned Gradient Compression (Abrahamyan, Chen, Bekoulis & Deligiannis, TNNLS 2021).

Paper: https://arxiv.org/abs/2103.08870. A code for the values the ranks send is learned from the
run's own gradients early in training: by default scalar magnitude levels, or the paper's 1-D
convolutional autoencoder (AE, :mod:`~lightning_gradcomp.codecs.lgc_autoencoder`). Training runs
in three stages, switched on the same global optimizer step on every rank:

1. ``step < warmup_steps``: dense all-reduce. With ``density_warmup`` (DGC's warm-up of sparsity)
   the next ``density_warmup`` steps already send the shared support of stage 2, but denser: its
   fraction falls exponentially from ``density_warmup_start`` (25 %) to ``ratio``. Steps 0 and 1
   are always dense. With ``warmup_codec="powersgd"`` stage 1 sends PowerSGD's low-rank factors
   from step 2 instead (torch's hook through :class:`~lightning_gradcomp.codecs.powersgd.PowerSGDCodec`,
   rank ``warmup_rank``, four times that at compression level 0); at its last step each rank's
   PowerSGD error memory is kept per layer and sent with the first step of stage 2. With
   ``warmup_codec="terngrad"`` stage 1 sends every layer from step 2 as TernGrad's ternary
   stochastic codes (:class:`~lightning_gradcomp.codecs.terngrad.TernGradCodec`, all-gathered),
   five to a byte, 20 times fewer bytes than fp32; they are unbiased, so no residual is kept. Both are
   :class:`~lightning_gradcomp.codecs.lgc_warmup.StageOneCodecs`' (``lgc_warmup.py``).
2. the next ``ae_train_steps`` steps: top-k on a *shared support* with error
   feedback. Every step a leader (rank ``step % N``) picks each layer's top-k positions ``S``
   (``k = ceil(ratio * numel)``) and broadcasts them; every rank sends its values ``v_i = x_i[S]``
   (all-gather), so each rank sums ``sum_i v_i`` and also sees every ``v_i``: the code's training data.
3. Afterwards: a learned code, fitted at the switch on rank 0 from stage 2's values and
   broadcast (identical on every rank, checked by a hash), compresses ``v_i``. The levels are
   fitted again every ``refit_every`` steps on rank 0's own messages; the autoencoder stays frozen.
   The learned code, its training data, its fits and its checkpoint are
   :class:`~lightning_gradcomp.codecs.lgc_learning.LearnedCode`'s (``lgc_learning.py``); the
   leader's round and its message are :class:`~lightning_gradcomp.codecs.lgc_leader.LeaderSupport`'s
   (``lgc_leader.py``), the union support's round and messages
   :class:`~lightning_gradcomp.codecs.lgc_union.UnionSupport`'s (``lgc_union.py``), and how its
   ranks tell one another the positions they name is ``lgc_names.py``'s. This file holds the
   options, the stages, the run-time guard, the encoding and sums of each layer and the
   collectives.

The learned code (``code``):

``"levels"`` (default)
    Each rank sends its values as a sign bit and ``code_bits - 1`` bits of magnitude on levels that
    Lloyd-Max fitted to stage 2's values (:mod:`~lightning_gradcomp.codecs.levels`), plus their
    RMS, and the messages are all-gathered. Measured on real gradients, this code carries the
    support's values with a small error at 1/16 of their fp32 bytes, where no autoencoder
    variant carried them at all (docs/codecs/lgc.md, "What a code can carry"). Error feedback is
    exact: each rank knows what its message decodes to, and the aggregate is their sum.
``"autoencoder"``
    The paper's autoencoder, in one of two variants (``variant``):

``"rar"`` (ring all-reduce)
    The leader broadcasts ``S`` and a scale ``s`` (the RMS of its own ``v``). Every rank encodes
    ``z_i = E(v_i / s)`` with the same encoder and the latents are **all-reduced** (summed on the
    ring). Every rank decodes once: ``mean_i v_i ~ s * D(sum_i z_i / N)``. Since ``E`` is
    nonlinear, ``D`` is trained on averaged latents: loss ``MSE(D(mean_i z_i), mean_i v_i / s)
    + 0.5 * mean_i MSE(D(z_i), v_i / s)``.
``"ps"`` (parameter server)
    Only the leader's code travels: the leader broadcasts ``S``, ``s`` and ``z = E(v_lead / s)``.
    Every rank adds its *innovation* (its ``k_i = ceil(innovation_ratio * numel)`` largest values
    within ``S``, with their positions) and these small messages are all-gathered. Every rank then
    plays the server: ``v_i ~ s * D(z, u_i)`` for each rank ``i``, with ``u_i`` the innovation
    scattered onto ``S`` and fed to the decoder as an extra channel, and sums. Loss (as in the
    SOFF re-implementation): ``0.5 * mean_i MSE(D(z_r, u_i), v_i / s)`` with a random rank ``r``
    whose latent decodes every rank, plus ``0.5 *`` the mean pairwise MSE between latents.

With ``support="union"`` no rank leads: in stages 2 and 3 each rank names the ``ceil(k / N)``
largest positions of its own gradient, the names are all-gathered, and every rank sends its values
on their union (``lgc_union.py``).

Layers whose ``k`` is below :data:`MIN_AE_LEN` send their values on the shared support without a
learned code (all-gathered sums of ``v_i``, exact). Residual (error feedback): everything outside
``S``; with ``"ps"`` also ``v_i - s * D(z, u_i)``, which every rank knows exactly; with ``"rar"``
and ``ae_error_feedback`` (default) also ``v_i - s * D(E(v_i / s))``, this rank's own account of
what the AE lost. Since ``D`` is nonlinear, the aggregate ``N s D(mean_i z_i)`` is not exactly the
sum of those per-rank reconstructions, so error feedback is exact only up to that difference.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.codecs import levels
from lightning_gradcomp.codecs.base import (
    AdjustableLevel,
    Codec,
    CodecContext,
    CodecOptions,
    Collective,
    EncodeResult,
    HarnessOptions,
    MultiRound,
    Prepared,
    RoundContext,
    check_bool,
    check_choice,
    check_fraction,
    check_positive_float,
    check_positive_int,
    check_run_steps,
    check_seed,
    geometric_level,
    run_steps,
)
from lightning_gradcomp.codecs.lgc_autoencoder import MIN_AE_LEN, GradientAutoencoder
from lightning_gradcomp.codecs.lgc_layers import TERNARY, LayerContext, LayerPrepared, TernaryLayer
from lightning_gradcomp.codecs.lgc_leader import LeaderSupport
from lightning_gradcomp.codecs.lgc_learning import LearnedCode
from lightning_gradcomp.codecs.lgc_union import UnionSupport
from lightning_gradcomp.codecs.lgc_warmup import StageOneCodecs
from lightning_gradcomp.codecs.positions import (
    channel_counts,
    output_channels,
)
from lightning_gradcomp.codecs.sampling import DensityWarmup, check_density_warmup, keep_count, select_top
from lightning_gradcomp.registry import register_codec

__all__ = ["LGCCodec", "LGCOptions", "GradientAutoencoder", "MIN_AE_LEN"]

CODES = ("levels", "autoencoder")
VARIANTS = ("rar", "ps")
SELECTIONS = ("sampled", "exact")
SUPPORTS = ("leader", "union")
LIGHT_SCALES = ("message", "channel")
POSITION_CODES = ("kernel", "rice", "channel", "layer")
WARMUP_CODECS = ("allreduce", "powersgd", "terngrad")
#: the paper's stage lengths (SOFF: 200 dense rounds, 300 collecting), the caps of fractions
WARMUP_CAP, AE_TRAIN_CAP = 200, 300


@dataclass(frozen=True)
class LGCOptions(CodecOptions):
    """The options of :class:`LGCCodec` (documented there)."""

    code: str = "levels"
    code_bits: int = 2
    variant: str = "rar"
    warmup_steps: int | float = 0.05
    ae_train_steps: int | float = 0.1
    ratio: float = 7.5e-3
    support: str = "leader"
    position_code: str = "kernel"
    light_ratio: float | None = None
    light_code_bits: int | None = None
    light_scale: str = "message"
    density_warmup: int | float = 0
    density_warmup_start: float = 0.25
    innovation_ratio: float = 1e-5
    latent_channels: int = 4
    ae_width: int = 16
    ae_lr: float = 1e-3
    ae_epochs: int = 3
    ae_time_budget_s: float = 30.0
    ae_samples: int = 64
    refit_every: int = 100
    code_denser: bool = True
    selection: str = "sampled"
    max_recon_error: float = 0.3
    ae_error_feedback: bool = True
    warmup_codec: str = "allreduce"
    warmup_rank: int = 4
    seed: int = 0

    def check(self) -> None:
        check_choice("code", self.code, CODES)
        for name in ("code_bits", "light_code_bits"):
            bits = getattr(self, name)
            if name == "light_code_bits" and bits is None:
                continue
            if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
                raise ValueError(
                    f"{name} must be an integer in [1, 8] (a sign bit and {name} - 1 of magnitude), got {bits!r}"
                )
        check_choice("variant", self.variant, VARIANTS)
        check_choice("support", self.support, SUPPORTS)
        check_choice("position_code", self.position_code, POSITION_CODES)
        check_choice("light_scale", self.light_scale, LIGHT_SCALES)
        if self.light_scale == "channel" and self.code != "levels":
            raise ValueError(
                "light_scale='channel' scales the messages of code='levels': the autoencoder takes one scale "
                f"a layer, got code={self.code!r}"
            )
        if self.support == "union" and self.code != "levels":
            raise ValueError(
                "support='union' is a support for code='levels': the autoencoder's variants decode "
                f"the leader's support, got code={self.code!r}"
            )
        self._set("warmup_steps", check_run_steps("warmup_steps", self.warmup_steps))
        self._set("ae_train_steps", check_run_steps("ae_train_steps", self.ae_train_steps))
        if self.ae_train_steps == 0:
            raise ValueError("ae_train_steps must be >= 1 step (or a fraction of the run): the AE trains on stage 2")
        self._set("ratio", check_fraction("ratio", self.ratio))
        if self.light_ratio is not None:
            self._set("light_ratio", check_fraction("light_ratio", self.light_ratio))
            if self.light_ratio < self.ratio:
                raise ValueError(
                    f"light_ratio (the support at the light level) must be at least ratio ({self.ratio}), "
                    f"got {self.light_ratio}"
                )
        check_density_warmup(self)
        self._set("innovation_ratio", check_fraction("innovation_ratio", self.innovation_ratio))
        if self.innovation_ratio >= self.ratio:
            raise ValueError(f"innovation_ratio must be below ratio ({self.ratio}), got {self.innovation_ratio}")
        check_positive_int("latent_channels", self.latent_channels)
        check_positive_int("ae_width", self.ae_width)
        self._set("ae_lr", check_positive_float("ae_lr", self.ae_lr))
        check_positive_int("ae_epochs", self.ae_epochs)
        budget = check_positive_float("ae_time_budget_s", self.ae_time_budget_s, allow_inf=True, note=" (seconds)")
        self._set("ae_time_budget_s", budget)
        check_positive_int("ae_samples", self.ae_samples)
        check_positive_int("refit_every", self.refit_every, allow_zero=True)
        check_bool("code_denser", self.code_denser)
        check_choice("selection", self.selection, SELECTIONS)
        self._set("max_recon_error", check_positive_float("max_recon_error", self.max_recon_error, allow_inf=True))
        self._set("ae_error_feedback", check_bool("ae_error_feedback", self.ae_error_feedback))
        check_choice("warmup_codec", self.warmup_codec, WARMUP_CODECS)
        check_positive_int("warmup_rank", self.warmup_rank)
        self._set("seed", check_seed("seed", self.seed))


@register_codec("lgc")
class LGCCodec(LearnedCode, LeaderSupport, UnionSupport, StageOneCodecs, AdjustableLevel, MultiRound, Codec):
    """Learned Gradient Compression with a shared support (see the module docstring).

    Args:
        code: the learned code of stage 3: ``"levels"`` (default; a sign and learned magnitude
            levels, all-gathered) or ``"autoencoder"`` (the paper's AE, in ``variant``).
        code_bits: ``"levels"``: bits a value, a sign bit and ``code_bits - 1`` bits of magnitude
            (default 2: two fitted magnitude levels; 1 sends the sign and the RMS alone).
        variant: ``"autoencoder"`` only: ``"rar"`` (latents summed in a ring all-reduce; default)
            or ``"ps"`` (the leader's latent plus every rank's sparse innovation, decoded on every
            rank as the server).
        warmup_steps: stage 1, dense all-reduce: optimizer steps (an int), or a fraction of the
            run (a float in (0, 1), capped at SOFF's 200 rounds; default 0.05). The strategy
            resolves fractions against Lightning's ``estimated_stepping_batches``, so a run of any
            length reaches the learned code early; where the run's length is unknown they take
            the cap. The hook never compresses before step 2. On PSPNet/CamVid beside AdamW,
            ``warmup_steps=0`` sent a third fewer bytes and ended half a point of mIoU lower over
            eight seeds (docs/codecs/lgc.md, "Beside Adam: without the dense warm-up").
        ae_train_steps: stage 2, shared-support top-k while gradients are collected: steps or a
            fraction of the run (capped at SOFF's 300 rounds; default 0.1). The AE is trained at
            its end.
        density_warmup: DGC's warm-up of sparsity after stage 1: over this many steps (an int) or
            this fraction of the run (a float in (0, 1), capped at 200 steps) the shared support's
            fraction falls exponentially from ``density_warmup_start`` to ``ratio``; stage 2 and
            its collection of the learned code's training data start after it. Default 0: off.
            With ``warmup_steps=0`` it replaces the dense stage 1 (docs/codecs/lgc.md, "The dense
            warm-up").
        density_warmup_start: the support's fraction at the start of the density warm-up
            (default 0.25, DGC's).
        ratio: fraction of each layer's entries on the shared support (default 7.5e-3: a
            ResNet-18 step then sends 300 times fewer bytes than fp32 all-reduce, and its
            accuracy over one epoch was 0.3 points below that of 1e-2; SOFF's rho_g is 1e-3,
            which trained clearly worse than plain all-reduce here, see docs/codecs/lgc.md).
            The support travels as an Elias-Fano code (about ``2 + log2(1/ratio)`` bits a
            position), so the steady ratio stays above 100.
        support: who names the support: ``"leader"`` (default: rank ``step % N`` picks each
            layer's top ``k`` and broadcasts them) or ``"union"`` (every rank names the
            ``ceil(k / N)`` largest positions of its own gradient, the names are all-gathered, and
            every rank sends its values on their union, at most ``k`` positions: no rank's large
            values wait for its turn to lead). ``"union"`` is for ``code="levels"``; each rank's
            values at the positions it named travel on the leader's levels, the rest on the
            others', and the run-time guard passes a layer only where every rank's named values
            pass it. Beside an Adam-like optimizer ``CompressedDDPStrategy`` sets ``"union"``
            unless told otherwise: on PSPNet/CamVid beside AdamW it ended level with the leader's
            support over eight seeds (-0.09 mIoU) at 16 % fewer bytes, and with ``ratio=0.14`` and
            ``light_ratio=0.5`` (the defaults there) +0.96 above it (docs/codecs/lgc.md, "Beside
            Adam: a union support").
        position_code: how each rank's names travel on a union support: ``"kernel"`` (default;
            a convolution with kernels of at most 12 entries names its kernels, the counts of
            named kernels per output channel and then their gaps, and says which entries of each
            kernel: their count and the index of their pattern; other layers as ``"rice"``; a
            gradient's large values crowd into kernels as well as channels), ``"rice"`` (each
            output channel's count, then the gaps between the channel's names in a Rice code
            whose parameter follows from the count; both two all-gathers, the counts and each
            rank's code length first), ``"channel"`` (the counts, then per channel an Elias-Fano code or
            a bitmap, per layer where that is smaller than one code over the layer; two
            all-gathers) or ``"layer"`` (one Elias-Fano code or bitmap over the layer, whose size
            follows from ``k`` alone; one all-gather). Lossless every way: the same names, the
            same training. A gradient's large values crowd into some channels, so the per-channel
            codes are mostly the smaller, and coding the gaps drops each gap's remainder that
            Elias-Fano's high parts keep (docs/codecs/lgc.md, "Beside Adam: the names per
            channel", and "Beside Adam: the names per kernel"). On a link with a long round trip the extra
            all-gather can cost more than the bytes save. The leader's broadcast
            (``support="leader"``) keeps one code over the layer: there, on ResNet-18 at 1 %, the
            counts cost more than the channels saved.
        light_ratio: the support's fraction at compression level 0, the level controller's light
            steps; ``None`` (default): ten times ``ratio``, at most 0.25 (``ratio`` itself when it is
            larger: the light level is never sparser than the heavy one). At 1.0 the light steps
            send every value of a layer and no positions, in ``code_bits`` bits where the run-time
            guard passes the code (on PSPNet/CamVid the 2-bit levels missed its 0.35 on whole
            layers, so those steps went exactly): no coordinate waits for its turn there. Denser
            light steps closed the early gap to plain all-reduce beside AdamW but not the final
            one on the leader's support, and none at all cost 1.6 points (docs/codecs/lgc.md,
            "Beside Adam: light steps denser than 25 % do not pay"); on a union support at 14 %
            light steps at 0.5 did close most of it, so beside an Adam-like optimizer
            ``CompressedDDPStrategy`` sets 0.5 unless told otherwise ("Beside Adam: a union
            support").
        light_code_bits: ``"levels"``: bits a value on a support denser than ``ratio`` (the light
            steps), where stage 2 ran denser and fitted it levels of its own; ``None`` (default):
            ``code_bits``. The number of levels is fixed at the switch: a refit keeps it, and a
            resumed run goes on with the levels its checkpoint holds. At 50 % of a layer the
            values are spread like the whole gradient, and two magnitude levels reconstruct some
            layers with an error above the guard's, which then travel exactly (32 bits a value);
            three bits (four levels) cut that error to 0.54-0.56 of two's on a Gaussian, a
            Laplacian and a cubed Gaussian spread (0.34 to 0.19, 0.42 to 0.23, 0.57 to 0.32). On
            PSPNet/CamVid beside AdamW (the 14 % union, light steps at 50 %, seeds 0-7) three bits
            carried 99.3 % of the compressed values instead of 87.7 %, for 12 % fewer bytes, but
            ended 0.31 mIoU lower (standard error 0.27): the layers the guard had sent exactly
            were worth their bytes, so it is not a default (docs/codecs/lgc.md, "Beside Adam:
            three bits at the light steps").
        light_scale: ``"levels"``: what a message's values on a support denser than ``ratio``
            (the light steps) are measured in before their levels code them: ``"message"``
            (default) one RMS a message; ``"channel"`` the RMS of each output channel's values in
            the message (2 bytes a channel, bfloat16), and the denser support's levels are fitted
            to the values in those units at the switch and at each refit. A convolution's output
            channels differ in scale, and at 50 % of a layer one scale a message is what leaves
            some layers' 2-bit code above the guard (docs/codecs/lgc.md, "Beside Adam: a scale a
            channel at the light steps").
        innovation_ratio: ``"ps"`` only: fraction of each layer's entries sent as innovation
            (SOFF's rho_i: 1e-5); must be below ``ratio``.
        latent_channels: AE code channels; the code is ``latent_channels / 16`` of the kept values
            (SOFF: 4, i.e. 4x).
        ae_width: AE base width (SOFF: 64; default 16 keeps the per-step cost at a few ms).
        ae_lr: Adam learning rate of the AE.
        ae_epochs: passes over the collected samples when the AE is trained.
        ae_time_budget_s: wall-clock cap on AE training (it stalls every rank while it runs).
        ae_samples: how many of stage 2's last steps are kept as training data.
        refit_every: ``"levels"``: every this many stage-3 steps the levels are fitted again, on
            rank 0's own messages since the last fit (its values as the leader and as another
            rank, at each support size), and the gate is applied again; 0: the levels stay as
            fitted at the switch. Default 100: with the levels fixed at the switch (step 117 of
            a one-epoch ResNet-18 run) the code carried all 19 layers at step 160 and 15 of them,
            46 % of the values, at step 600, as the gradients' distribution drifted
            (docs/codecs/lgc.md, "The levels follow the run").
        code_denser: whether the learned code also carries a support denser than ``ratio`` (the
            level controller's light steps, in the critical phases of training); False sends
            those steps' values exactly, so that the code compresses only at the configured level.
        selection: how the leader finds the top-k: ``"sampled"`` (threshold from a random sample,
            then exact top-k among the candidates, as DGC; ~3x cheaper) or ``"exact"``.
        max_recon_error: a layer uses the AE in stage 3 only if the held-out relative error of its
            decoded aggregate is at most this (default 0.3: at 0.7 layers whose code lost half their
            energy passed and then drifted, docs/codecs/lgc.md); other layers keep sending their values on the shared
            support (stage 2's exact sum). The same threshold guards every stage-3 step: the
            leader passes its own values through the AE, and a layer whose relative error is
            above it is sent exactly for that step, on every rank (a code can drift once its own
            error is fed back). Our choice, so that a poor code cannot silently drop the values;
            ``float("inf")`` uses the AE everywhere.
        ae_error_feedback: ``"rar"``: keep the AE's own error on the support,
            ``v - s D(E(v / s))``, in the residual (default True), so what the code misses is sent
            later instead of being lost; False keeps only what is off the support (the paper's
            choice). ``gradcomp/rel_error`` includes the AE's error either way.
        warmup_codec: how stage 1 travels: ``"allreduce"`` (default, the dense gradient),
            ``"powersgd"`` (PowerSGD's rank-``warmup_rank`` factors with its own error feedback,
            the rank four times higher at compression level 0; what it held back at the end of
            stage 1 travels with stage 2's first step; not with ``momentum`` or ``precondition``)
            or ``"terngrad"`` (every layer as TernGrad's scale and ternary stochastic codes,
            five to a byte, all-gathered, with no residual: 20 times fewer bytes than the dense
            stage 1).
        warmup_rank: PowerSGD's rank in stage 1 at compression level 1 (default 4).
        seed: seeds the AE initialization, its training and the sampling.
        **kwargs: the common codec options (``error_feedback`` on by default, ``min_numel``;
            ``lr_scaled_feedback`` and ``dense_dtype="bfloat16"`` are the defaults here, see
            :class:`~lightning_gradcomp.codecs.base.HarnessOptions`).
    """

    # stage 2 gathers every rank's values (the AE's training data); RAR's stage 3 sums latents
    # (collective_at)
    collective = "allgather"
    Options = LGCOptions
    # error feedback in units of the update by default: measured to help this codec under the
    # recipes' cosine schedule (docs/codecs/lgc.md); the base drops it when error feedback is off.
    # The layers that travel uncompressed (about a third of a ResNet-18 step's bytes at 1 %) go in
    # bfloat16: heavy-step ratio 209.5 -> 247.7, and ResNet-18 SGD accuracy unchanged over two
    # seeds (docs/codecs/lgc.md, "Bytes on the wire")
    harness_defaults = {"error_feedback": True, "lr_scaled_feedback": True, "dense_dtype": "bfloat16"}
    sparse_local = True  # momentum factor masking applies
    # a denser support in the critical phases: +1.1 points on ResNet-18, +3.7 mIoU on PSPNet
    # under AdamW, two seeds each (docs/codecs/lgc.md, "The level controller (on by default)")
    adaptive_by_default = True
    # beside Adam a sparse support costs more: a coordinate waits k steps and arrives stale, so
    # the support is denser there (7 %), paid for by compressing the stem too, and the controller
    # counts each halving of a smooth decay as a drop: PSPNet/CamVid, AdamW: -2.1 mIoU against
    # none over seeds 0-7 at a steady ratio of 53.1, against -2.7 at 64.4 for a 3 % support with
    # the stem exact, seeds 0-3. At 7 % the 2-bit levels reconstruct a layer with an error close
    # to 0.3, so the guard's threshold is 0.35 there: the code carries 98.9 % of the values
    # instead of 88.3 %, at -0.22 mIoU paired over the eight seeds (standard error 0.18)
    # (docs/codecs/lgc.md, "Beside Adam")
    # Every rank names its own share of that support there (support="union"): no rank's large
    # values wait for its turn to lead, and each rank's are coded on the levels fitted to them.
    # PSPNet/CamVid, AdamW, seeds 0-7: -0.09 mIoU against the leader's support (standard error
    # 0.31), for 16 % fewer bytes, a fully coded heavy step 74-77x smaller than fp32 (53x), and
    # the code carrying 99.8 % of the values (98.9 %) (docs/codecs/lgc.md, "Beside Adam")
    # On that union a 14 % support (each rank naming 7 %) with light steps at half of each layer
    # (each rank naming a quarter) reaches the coordinates that each rank's own top-k reaches:
    # PSPNet/CamVid, AdamW, seeds 0-7: -1.33 mIoU against none (standard error 0.27), +1.05
    # against the union at 7 % with 25 % light steps (0.33), for 56 % more bytes and a heavy step
    # 44-46x smaller than fp32 (74-77x); neither change alone gained (docs/codecs/lgc.md,
    # "Beside Adam: a union support")
    # What travels exactly there (the dense warm-up of stage 1, the support's values of stage 2,
    # the layers the guard sends exactly) goes in bfloat16, each rank's rounding kept in its
    # residual: the whole run's bytes 37-45 % fewer (PSPNet/CamVid: 140-176 MB a rank against
    # 232-276), which brings lgc level with PowerSGD at 10 Mbit/s. Four fresh seeds decided it
    # under a rule written before them: -0.07 mIoU against the same defaults in fp32 (standard
    # error 0.29), -1.21 against none (docs/codecs/lgc.md, "Fresh seeds decide")
    # The light steps' messages there scale by output channel: the 2-bit code then carries 94-98 %
    # of their values instead of 77-88 % (the guard sent the rest exactly), for 7-19 % fewer bytes
    # over the run; PSPNet/CamVid, AdamW, Xeon, seeds 0-3 and 8-11: -0.44 mIoU against none
    # (standard error 0.35), +0.17 against one scale a message (0.24) (docs/codecs/lgc.md,
    # "Beside Adam: a scale a channel at the light steps")
    adaptive_optimizer_defaults = {
        "dense_layers": "none",
        "max_recon_error": 0.35,
        "support": "union",
        "ratio": 0.14,
        "light_ratio": 0.5,
        "plain_dtype": "bfloat16",
        "light_scale": "channel",
    }
    adaptive_optimizer_controller = {"lr_reference": "peak"}
    lossless_options = Codec.lossless_options | {"position_code"}

    def optimizer_defaults(self) -> dict[str, Any]:
        """The union support and the scale a channel are for the 2-bit levels: beside the
        autoencoder's code, which decodes the leader's support with one scale a layer, the
        leader's support and that scale stay. The light level is never below the support:
        a user's ``ratio`` above the default light level keeps its own light level, and a user's
        ``light_ratio`` below the default support caps the support at it. The exact values go in
        bfloat16 only with error feedback, which keeps each rank's rounding for the next step."""
        defaults = super().optimizer_defaults()
        if self.options.code != "levels":
            del defaults["support"], defaults["light_scale"]
        if self.options.ratio > defaults["light_ratio"]:
            del defaults["light_ratio"]
        light = self.options.light_ratio
        if light is not None and light < defaults["ratio"]:
            defaults["ratio"] = light
        return defaults

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._init_learned_code()
        self._init_stage_one()
        self.last_timing: dict[str, float] = {}

    def check_harness(self, harness: HarnessOptions) -> None:
        # start_step always has a value (the harness default); only another one was asked for
        if harness.start_step != HarnessOptions.start_step:
            raise ValueError("lgc schedules its stages with warmup_steps and ae_train_steps, not start_step")
        if self.options.warmup_codec == "powersgd" and (harness.momentum or harness.precondition):
            raise ValueError(
                "warmup_codec='powersgd' sends stage 1 through PowerSGD, which keeps its own error memory and can "
                "take neither momentum correction nor precondition: use warmup_codec='allreduce' with them"
            )

    def replace_options(self, **changes: Any) -> None:
        warmup = self._stage_one_options()
        super().replace_options(**changes)
        if self._stage_one_options() != warmup:
            self._rebuild_stage_one()  # else a warm-up codec already set up keeps its state

    # ----------------------------------------------------------------------------------------------
    # schedule
    # warmup_steps and ae_train_steps are read here, at use time: AutoencoderWarmup replaces them
    # after construction
    @property
    def warmup_end(self) -> int:
        """First step of stage 2 (``warmup_steps`` resolved against the run's length)."""
        return run_steps(self.options.warmup_steps, self.run_total_steps, WARMUP_CAP)

    @property
    def density_warmup_end(self) -> int:
        """First step after the density warm-up, which follows stage 1 (``warmup_end`` if it is off)."""
        return self.warmup_end + self._density_warmup().length(self.run_total_steps)

    @property
    def ae_start_step(self) -> int:
        """First step of stage 3: ``ae_train_steps`` after the density warm-up, if any."""
        return self.density_warmup_end + max(
            1, run_steps(self.options.ae_train_steps, self.run_total_steps, AE_TRAIN_CAP)
        )

    def stage(self, step: int) -> int:
        """1 (dense), 2 (shared-support top-k, collecting) or 3 (learned code) at ``step``."""
        if step < max(self.warmup_end, 2):
            return 1
        return 2 if step < self.ae_start_step or not self.ae_trained else 3

    def is_compressing(self, step: int) -> bool:
        # with a PowerSGD or TernGrad warm-up, stage 1 compresses too (from the first step the hook
        # allows)
        return self.options.warmup_codec != "allreduce" or step >= self.warmup_end

    def collective_at(self, step: int) -> Collective:
        # stage 2 gathers every rank's values (the learned code's training data); the AE's RAR
        # stage 3 sums latents; the levels' codes do not sum and are gathered, nor do TernGrad's
        # in stage 1 (every rank has its own scale)
        if self._warmup_codec is not None and self.stage(step) == 1:
            return "custom"  # stage 1 through PowerSGD (communicate_bucket)
        rar = self.uses_autoencoder and self.options.variant == "rar"
        return "allreduce" if rar and self.stage(step) == 3 else "allgather"

    def setup(self, context: CodecContext) -> None:
        super().setup(context)
        self.ae.to(context.device)
        self._setup_stage_one(context)

    def _device(self) -> torch.device:
        """The device of the AE (the codec context's once set up)."""
        return next(self.ae.parameters()).device

    @property
    def kept_fraction(self) -> float:
        """The support's fraction at the compression level in use: ``ratio`` at level 1,
        ``light_ratio`` (by default ten times denser, at most 0.25 unless ``ratio`` is larger) at level 0, geometric in
        between (``AdjustableLevel``)."""
        ratio, light = self.options.ratio, self.options.light_ratio
        if light is None:
            # never sparser than the heavy level: a support of more than 25 % stays as it is
            light = max(min(10 * ratio, 0.25), ratio)
        return geometric_level(light, ratio, self.compression_level)

    def k_for(self, numel: int, step: int | None = None) -> int:
        """Size of a layer's shared support at ``step``: ``ceil(f * numel)``, at least 1, with ``f``
        the kept fraction, denser during the density warm-up (``None``: after it)."""
        fraction = self.kept_fraction
        if step is not None:
            fraction = self._density_warmup().fraction(fraction, step, self.warmup_end, self.run_total_steps)
        return keep_count(fraction, numel)

    def _density_warmup(self) -> DensityWarmup:
        # capped like stage 1, which it replaces
        return DensityWarmup(self.options.density_warmup, self.options.density_warmup_start, WARMUP_CAP)

    def innovation_k(self, numel: int) -> int:
        """``"ps"``: innovation values a rank sends for a layer, at most the support's size."""
        return min(self.k_for(numel), keep_count(self.options.innovation_ratio, numel))

    # ----------------------------------------------------------------------------------------------
    # the shared support, named in the hook body: by the leader (lgc_leader.py) or by every rank
    # (lgc_union.py), each through _select
    def _select(self, x: Tensor, k: int, step: int) -> Tensor:
        # exact top-k; "sampled" finds it through a threshold estimated from a 1% sample (DGC-style).
        # On CUDA select_top runs torch.topk and draws nothing, so no generator is made there.
        if x.is_cuda:
            return select_top(x.abs(), k, 0.0)
        g = torch.Generator(device="cpu").manual_seed(self.options.seed * 1_000_003 + step)
        return select_top(x.abs(), k, 0.01 if self.options.selection == "sampled" else 0.0, g)

    def prepare_bucket(self, layers: list[tuple[str, Tensor, Tensor]], rc: RoundContext) -> Prepared:
        """The bucket's support, named once for the bucket (the leader's, or with
        ``support="union"`` every rank's); each layer's :class:`LayerPrepared` is what ``encode``
        gets as ``prepared``. Stage 1 through TernGrad has no round of its own."""
        t0 = time.perf_counter()
        step = rc.step
        stage = self.stage(step)
        if stage == 3 and not self.ae_trained:  # resumed exactly at the switch: train now
            self.train_autoencoder()
            stage = self.stage(step)
        if stage == 1 and self._ternary is not None:  # no rounds of its own: each layer's codes
            return Prepared(0, {key: TERNARY for key, _, _ in layers})
        self._take_handoff(layers)
        if self.options.support == "union" and stage >= 2:
            return self._prepare_union(layers, step, stage, t0)
        return self._prepare_leader(layers, step, stage, t0)

    def _count_layer(
        self, step: int, stage: int, k: int, numel: int, values: int, eligible: bool, coded: bool, code_nbytes: int
    ) -> None:
        """Count one layer of ``step`` for the scalars and the report: whether the code may carry it
        (``eligible``) and did (``coded``), the ``values`` on its support (``k``, the configured
        size, picks the tally; a union support holds at most ``k``) and the bytes of its code."""
        if step != self._ae_count_step:  # counted over the buckets of one step
            self._ae_layers_used, self._values_used, self._ae_count_step = (0, 0), (0, 0, 0), step
        if eligible:
            used, candidates = self._ae_layers_used
            self._ae_layers_used = (used + int(coded), candidates + 1)
        carried, support, code_bytes_sent = self._values_used
        if coded:
            carried, code_bytes_sent = carried + values, code_bytes_sent + code_nbytes
        self._values_used = (carried, support + values, code_bytes_sent)
        if stage == 3:
            tally = self._values_run["denser" if k > keep_count(self.options.ratio, numel) else "configured"]
            tally[0] += values if coded else 0
            tally[1] += values

    def _code_nbytes(self, key: str, k: int, numel: int, per: int = 0) -> int:
        """Bytes a rank sends for a layer of ``k`` support values that the learned code carries
        (``per``: entries a channel where its message scales by channel)."""
        if not self.uses_autoencoder:
            scales = 2 * (numel // per) if per else 0
            return scales + levels.message_nbytes(k, levels.table_bits(self._levels_for(key, k, numel)))
        if self.options.variant == "rar":
            return 4 * self.ae.latent_channels * GradientAutoencoder.latent_len(k)
        return 8 * self.innovation_k(numel)

    def _channel_size(self, param: Tensor, k: int, numel: int) -> int:
        """Entries a channel of a layer whose messages on a support of ``k`` values scale by channel
        (``light_scale="channel"``, a support denser than ``ratio``): a weight's output channels,
        a vector or a one-channel weight one channel; 0 where they scale by message."""
        if self.options.light_scale != "channel" or k <= keep_count(self.options.ratio, numel):
            return 0
        return numel // output_channels(param)

    def _within_gate(self, v: Tensor, rec: Tensor) -> Tensor:
        """The run-time guard, on the leader: 1.0 when its own values ``v`` came back through the AE
        as ``rec`` with a relative error of at most ``max_recon_error``, else 0.0 (exact values this
        step).

        The gate at the switch measures held-out stage-2 values; afterwards the values change
        (training moves on, and with ``ae_error_feedback`` the AE's own error returns in them), and
        a code that drifts would send more noise than signal every step. An all-zero ``v`` goes
        exactly too: the code of zero decodes to the AE's bias times the tiny scale, not to zero.
        A 0-d tensor: no sync."""
        norm = v.norm()
        error = (v - rec).norm() / norm.clamp_min(1e-30)
        return ((error <= self.options.max_recon_error) & (norm > 0)).to(torch.float32)

    def _rar_code(self, v: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
        """RAR: this rank's latent ``E(v / s)`` and what it stands for, ``s D(E(v / s))``."""
        z = self.ae.encode((v / s).unsqueeze(0))
        return z, s * self.ae.decode(z, v.numel())[0]

    # ----------------------------------------------------------------------------------------------
    # encode / decode
    def encode(
        self, x: Tensor, key: str, param: Tensor, step: int, prepared: LayerPrepared | None = None
    ) -> EncodeResult:
        """``prepared``: the layer's :class:`LayerPrepared`, from :meth:`prepare_bucket` (required)."""
        if prepared is None:
            raise RuntimeError(f"lgc.encode of {key!r} needs the layer's context from prepare_bucket")
        if isinstance(prepared, TernaryLayer):
            return self._encode_ternary(x, key, param, step)
        if prepared.named is not None:
            return self._encode_union(x, key, step, prepared)
        idx, s, z_lead, coded, own_code = prepared[:5]
        per = prepared.per
        v = x[idx]
        local = torch.zeros_like(x)
        k = idx.numel()
        if self._keeps_refit_sample(key, step):  # the values as the message scales them
            sample = levels.normalize_by_channel(v, idx // per, x.numel() // per)[0] if per else v
            self._stage_for_refit(key, step, sample, k > keep_count(self.options.ratio, x.numel()))
        if not coded:  # stage 2, a layer the code does not carry, or one the guard sent exactly
            sent = self._exact(v, step)
            local[idx] = sent.to(local.dtype)
            return EncodeResult([sent], local=local, ctx=LayerContext(idx, s, None, step, key, False, per=per))
        ctx = LayerContext(idx, s, z_lead, step, key, True, per=per)
        if not self.uses_autoencoder:
            # the levels: what this rank's message decodes to is exactly its share of the sum
            if own_code is not None:
                message, rec = own_code
            else:
                table = self._levels_for(key, k, x.numel(), self._role(step))
                message, rec = levels.encode_at(v, table, idx, x.numel(), per)
            local[idx] = rec
            return EncodeResult(message, local=local, ctx=ctx)
        with torch.no_grad():
            if self.options.variant == "rar":
                # what this rank's code stands for: its own values through the AE (the leader
                # computed it for the guard already). The summed code decodes to the aggregate, so
                # this is the best per-rank account of what was sent.
                z, rec = own_code if own_code is not None else self._rar_code(v, s)
                sent = torch.zeros_like(x)
                sent[idx] = rec
                if self.options.ae_error_feedback:
                    local = sent  # the residual keeps the AE's error on the support too
                else:
                    local[idx] = v  # the residual keeps only what is off the support
                return EncodeResult([z.reshape(-1)], local=local, ctx=ctx, sent=sent)
            # ps: send the innovation; what the server will reconstruct for this rank is known here
            pos, u = self._innovation(v / s, x.numel())
            local[idx] = s * self.ae.decode(z_lead, k, u.unsqueeze(0))[0]
            return EncodeResult([v[pos], pos.to(torch.int32)], local=local, ctx=ctx)

    def _exact(self, v: Tensor, step: int) -> Tensor:
        """Values that travel exactly, in the harness's ``plain_dtype`` where they are gathered
        (summed in fp32 after the gather); ``local`` takes them as sent, so with error feedback the
        rounding error stays in the residual. RAR's stage 3 sums its payloads and keeps fp32."""
        plain = getattr(torch, self.harness.plain_dtype)
        if plain == v.dtype or self.collective_at(step) != "allgather":
            return v
        return v.to(plain)

    def decode(self, payload: list[Tensor], ctx: Any, numel: int, count: int) -> Tensor:
        # allreduce (RAR stage 3): payload is the sum over ``count`` ranks; return the sum of gradients
        idx, s, coded = ctx.support, ctx.scale, ctx.coded
        out = torch.zeros(numel, dtype=torch.float32, device=payload[0].device)
        if not coded:
            out[idx] = payload[0].float()
            return out
        with torch.no_grad():
            zbar = payload[0].float().view(1, self.ae.latent_channels, -1) / count
            out[idx] = (count * s) * self.ae.decode(zbar, idx.numel())[0]
        return out

    def aggregate(self, payloads: Sequence[list[Tensor]], ctx: Any, numel: int) -> Tensor:
        if isinstance(ctx, TernaryLayer):  # stage 1 through TernGrad: the sum of every rank's codes
            assert self._ternary is not None
            return self._ternary.aggregate(payloads, None, numel)
        idx, s, z_lead, step, key, coded = ctx[:6]
        if self._keeps_refit_sample(key, step):  # every rank's message of the layer was finite
            self._commit_refit(key, step)
        out = torch.zeros(numel, dtype=torch.float32, device=payloads[0][0].device)
        k = idx.numel()
        if not coded:  # stage 2, a layer too short for the code, or one the guard sent exactly
            values = torch.stack([p[0].float() for p in payloads])
            out[idx] = values.sum(0)
            if ctx.named is None:
                self._keep_sample(key, step, step % len(payloads), numel, k, values, idx, ctx.per)
            else:  # a union support: who named what, and its configured size
                self._keep_sample(key, step, ctx.named, numel, ctx.size, values, idx, ctx.per)
            return out
        if ctx.named is not None:
            return self._aggregate_union(payloads, ctx, numel)
        if not self.uses_autoencoder:  # every rank's levels message, decoded and summed
            table, leader = self._levels_for(key, k, numel), step % len(payloads)
            decoded = [
                levels.decode_by_channel(p, table[levels.role(r, leader)], idx // ctx.per)
                if ctx.per
                else levels.decode(p, table[levels.role(r, leader)], k)
                for r, p in enumerate(payloads)
            ]
            out[idx] = torch.stack(decoded).sum(0)
            return out
        u = torch.zeros(len(payloads), k, dtype=torch.float32, device=out.device)
        for r, p in enumerate(payloads):
            u[r, p[1].long()] = p[0].float() / s
        with torch.no_grad():
            vhat = self.ae.decode(z_lead.expand(len(payloads), -1, -1), k, u)
        out[idx] = s * vhat.sum(0)
        return out

    def _keep_sample(
        self,
        key: str,
        step: int,
        lead: int | Tensor,
        numel: int,
        k: int,
        values: Tensor,
        support: Tensor,
        per: int = 0,
    ) -> None:
        """Stage 2: keep every rank's exact values of a layer (``(N, K)``), with the leader's rank
        (or, on a union support, who named which position), as the learned code's training data;
        where its messages will scale by channel (``per`` entries a channel, ``light_scale="channel"``
        at a denser support), how many of the (sorted) ``support`` positions fall in each channel."""
        first_kept = max(self.ae_start_step - self.options.ae_samples, self.density_warmup_end)
        if self.stage(step) == 2 and k >= MIN_AE_LEN and step >= first_kept:
            with self._samples_lock:
                # kept on the values' device: a copy to the host here would wait for the GPU
                # once per layer; they move to the CPU only when checkpointed
                self._samples.append((key, step, lead, numel, values.detach().clone()))
                if per:  # counted only for a sample kept, not on every exact step of stage 3
                    self._sample_channels[(key, step)] = channel_counts(support, numel // per, per)

    # ----------------------------------------------------------------------------------------------
    # training at the switch: rank 0 trains, everyone receives the weights
    def on_step_end(self, step: int) -> None:
        if self._handoff and self.stage(step) >= 2:
            self._handoff.clear()  # layers stage 2 sends uncompressed: PowerSGD's residual there is dropped
        if step + 1 >= self.ae_start_step and not self.ae_trained:
            self.train_autoencoder()
        elif self._refitting(step) and (step + 1 - self.ae_start_step) % self.options.refit_every == 0:
            self.refit_levels()

    def scalars(self, step: int, compressing: bool) -> dict[str, float]:
        """``lgc_stage`` (1, 2 or 3) at ``step``; once the learned code is trained (and its loss
        finite): ``ae_loss``, ``ae_recon_error`` (held-out, at the switch), ``ae_train_s`` (the
        switch's seconds on this rank), ``ae_layers`` (layers the code carried at the last step),
        ``ae_layers_eligible`` (layers that passed the gate at the switch), ``ae_values`` (the share
        of the last step's support values that the code carried) and ``ae_params`` (the
        learned code's parameter count, :meth:`ae_cost`)."""
        out = {"lgc_stage": float(self.stage(step))}
        if self.ae_trained and math.isfinite(self.ae_loss):
            used, eligible = self.ae_layers_used
            out.update(
                ae_loss=self.ae_loss,
                ae_recon_error=self.ae_recon_error,
                ae_train_s=self.ae_train_s,
                ae_layers=float(used),
                ae_layers_eligible=float(eligible),
                ae_values=self._values_used[0] / max(self._values_used[1], 1),
                ae_params=self.ae_cost()["ae_params"],
                ae_refits=float(self._refits),
            )
        return out

    # ----------------------------------------------------------------------------------------------
    # checkpointing: identical on every rank
    def state_dict(self) -> dict[str, Any]:
        return {
            **self._learned_state_dict(),
            **({"warmup": self._warmup_codec.state_dict()} if self._warmup_codec is not None else {}),
            **self.level_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        state = self.load_level_state(state)
        warmup = state.get("warmup")
        if warmup is not None and self._warmup_codec is not None:
            self._warmup_codec.load_state_dict(warmup)
        self._load_learned_state_dict(state)
