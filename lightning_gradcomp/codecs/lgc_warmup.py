"""``lgc``'s stage 1 through another codec (``warmup_codec``): PowerSGD or TernGrad instead of the
dense all-reduce.

With ``warmup_codec="powersgd"`` each bucket of stage 1 goes through torch's PowerSGD hook (our
:class:`~lightning_gradcomp.codecs.powersgd.PowerSGDCodec`, rank ``warmup_rank``, following the
compression level); at the last step of stage 1 each rank's PowerSGD error memory is cut into its
layers (the *hand-off*) and added to the first step of stage 2, so nothing PowerSGD held back is
lost. With ``warmup_codec="terngrad"`` each layer of stage 1 travels as TernGrad's scale and ternary
codes (:class:`~lightning_gradcomp.codecs.terngrad.TernGradCodec`), unbiased, without a residual.

:class:`StageOneCodecs` is a base of :class:`~lightning_gradcomp.codecs.lgc.LGCCodec`: it reads the
codec's ``options``, ``context``, ``compression_level`` and ``stage(step)``. The stages' schedule
stays in ``lgc.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.codecs.base import CodecContext, EncodeResult, RoundContext
from lightning_gradcomp.codecs.lgc_layers import TERNARY
from lightning_gradcomp.codecs.powersgd import PowerSGDCodec
from lightning_gradcomp.codecs.terngrad import TernGradCodec

__all__ = ["StageOneCodecs"]


class StageOneCodecs:
    """The codec that runs ``lgc``'s stage 1, and what PowerSGD hands to stage 2 (see the module
    docstring)."""

    def _init_stage_one(self) -> None:
        """The warm-up codec the options ask for, not yet set up (from the codec's ``__init__``)."""
        self._warmup_codec = self._make_warmup_codec()
        self._ternary = self._make_ternary()
        self._handoff: dict[str, Tensor] = {}  # its error memory at the end of stage 1, per layer
        self._handoff_spans: dict[int, list] = {}  # the buckets handed off this step (end_step)

    def _stage_one_options(self) -> tuple[str, int, int]:
        """The options the warm-up codec is built from: a change of any of them rebuilds it."""
        return self.options.warmup_codec, self.options.warmup_rank, self.options.seed

    def _rebuild_stage_one(self) -> None:
        """The warm-up options changed: a new warm-up codec. Options replaced after setup (the
        defaults beside Adam are adopted once the optimizers exist) set it up as the old one was,
        at the codec's level."""
        self._warmup_codec = self._make_warmup_codec()
        self._ternary = self._make_ternary()
        if self.context is not None:
            self._setup_stage_one(self.context)
            if self._warmup_codec is not None:
                self._warmup_codec.set_level(self.compression_level)

    def _setup_stage_one(self, context: CodecContext) -> None:
        if self._warmup_codec is not None:
            self._warmup_codec.setup(context)
        if self._ternary is not None:
            self._ternary.setup(context)

    def _take_handoff(self, layers: list[tuple[str, Tensor, Tensor]]) -> None:
        """The first step after a PowerSGD stage 1: what it held back travels now, added to each
        layer's ``x`` before the support is chosen."""
        if self._handoff:
            for key, x, _ in layers:
                held = self._handoff.pop(key, None)
                if held is not None:
                    x.add_(held.to(x.device))

    def _make_warmup_codec(self) -> PowerSGDCodec | None:
        """``warmup_codec="powersgd"``: torch's PowerSGD through our wrapper, which runs stage 1."""
        o = self.options
        return PowerSGDCodec(rank=o.warmup_rank) if o.warmup_codec == "powersgd" else None

    def _make_ternary(self) -> TernGradCodec | None:
        """``warmup_codec="terngrad"``: TernGrad as its baseline runs (clipped at 2.5 standard
        deviations), its rounding seeded by ``seed``."""
        return TernGradCodec(seed=self.options.seed) if self.options.warmup_codec == "terngrad" else None

    def wire_formats(self) -> dict[str, int]:
        """``lgc``'s own layout and its stage-1 codec's (TernGrad's or PowerSGD's), whose messages
        it sends in stage 1."""
        formats = super().wire_formats()  # type: ignore[misc]
        for codec in (self._warmup_codec, self._ternary):
            if codec is not None:
                formats.update(codec.wire_formats())
        return formats

    @property
    def bucket_keyed_state(self) -> bool:  # type: ignore[override]
        # PowerSGD keys its factors and error by DDP bucket index (see MultiRound)
        return self._warmup_codec is not None

    def on_level_change(self) -> None:
        if self._warmup_codec is not None:  # PowerSGD's rank follows the level in stage 1
            self._warmup_codec.set_level(self.compression_level)

    def communicate_bucket(self, bucket: Any, layers: list, flag: Tensor, rc: RoundContext) -> Any:
        """Stage 1 with ``warmup_codec="powersgd"``: the bucket goes through PowerSGD. At the last
        step of stage 1 PowerSGD's error-feedback memory is handed to stage 2, layer by layer."""
        assert self._warmup_codec is not None
        fut = self._warmup_codec.communicate_bucket(bucket, layers, flag, rc)
        if self.stage(rc.step + 1) == 1:
            return fut
        buf = bucket.buffer()
        base = buf.data_ptr()
        spans = [(k, (g.data_ptr() - base) // buf.element_size(), g.numel()) for k, g, _ in layers]
        index = bucket.index()
        self._handoff_spans[index] = spans

        def hand_off(f: torch.futures.Future) -> Tensor:
            out = f.value()
            self._hand_off(index, spans)
            return out

        return fut.then(hand_off)

    def _hand_off(self, index: int, spans: list) -> None:
        err = self._warmup_codec.pop_error(index)
        for k, start, n in spans:
            if err is None:
                self._handoff.pop(k, None)
            else:
                self._handoff[k] = err[start : start + n].clone()

    def end_step(self, discarded: bool) -> None:
        """With a PowerSGD stage 1: a discarded step puts PowerSGD's state back, and if it was the
        last step of stage 1, what stage 2 takes over is PowerSGD's error from before the step."""
        if self._warmup_codec is None:
            return
        restored = self._warmup_codec.end_step(discarded)
        spans, self._handoff_spans = self._handoff_spans, {}
        for index in restored:  # a non-finite bucket went through no PowerSGD: it handed off its old error
            if index in spans:
                self._hand_off(index, spans[index])

    def _encode_ternary(self, x: Tensor, key: str, param: Tensor, step: int) -> EncodeResult:
        """Stage 1 with ``warmup_codec="terngrad"``: the layer as TernGrad's scale and ternary codes.
        Its rounding is unbiased, so the residual keeps nothing (as the ``terngrad`` baseline,
        which runs without error feedback): feeding back a zero-mean error of the gradient's own
        size would add its variance to later steps. ``sent`` is what the codes decode to, so
        ``rel_error`` counts the rounding."""
        assert self._ternary is not None
        enc = self._ternary.encode(x, key, param, step)
        enc.sent, enc.local, enc.ctx = enc.local, x, TERNARY
        return enc

    # per rank: PowerSGD's error memory and P during stage 1, and what it hands to stage 2
    def rank_state_dict(self) -> dict[str, Tensor]:
        if self._warmup_codec is None:
            return {}
        out = {f"warmup.{k}": v for k, v in self._warmup_codec.rank_state_dict().items()}
        out.update({f"handoff.{k}": v.detach().cpu().clone() for k, v in self._handoff.items()})
        return out

    def load_rank_state_dict(self, state: dict[str, Tensor]) -> None:
        if self._warmup_codec is None:
            if state:
                raise ValueError(
                    "this checkpoint holds the per-rank state of lgc's PowerSGD warm-up: "
                    "resume with codec_options={'warmup_codec': 'powersgd'}"
                )
            return
        prefix = "warmup."
        self._warmup_codec.load_rank_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
        self._handoff = {k[len("handoff.") :]: v for k, v in state.items() if k.startswith("handoff.")}
