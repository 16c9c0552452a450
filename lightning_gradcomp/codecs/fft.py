"""``fft``: FFT-based gradient sparsification with range-based float quantization.

Wang et al., "FFT-based Gradient Sparsification for the Distributed Training of Deep Neural
Networks", HPDC'20 (preprint arXiv:1811.08596). Per layer:

1. ``x`` (gradient plus residual, flat fp32, ``n`` values) is cut into blocks of ``block_size`` ``B``
   (the last one zero-padded) and each block goes to the frequency domain, ``X = rfft(x_blk)``:
   ``C = B/2 + 1`` complex coefficients per block.
2. Sparsify: in every block the ``k = C - floor(theta * C)`` coefficients of largest ``|X_j|`` are kept,
   the fraction ``theta`` with the smallest magnitude dropped (``selection="layer"``: the
   ``N - floor(theta N)`` largest of the whole layer's ``N = nb C`` coefficients instead).
3. The real and imaginary parts of the kept coefficients are quantized with the range-based float
   (:mod:`lightning_gradcomp.codecs.rangefloat`, one range per layer) or sent as fp32 (``bits=None``).
4. Positions travel as a bitmap (``C`` bits a block) or as indices (block-local, ``ceil(log2 C)``
   bits each; layer-wide with ``selection="layer"``), whichever is smaller for the given ``n``, ``B``
   and ``theta`` (``positions="auto"``); with ``theta = 0`` nothing.
5. The receiver scatters the values into a zero spectrum and inverts it, ``irfft(X, n=B)``.

Our choices (the paper leaves them open or its text was not available); the measurements behind
them are in docs/codecs/fft.md, "Details we settled":

* **Fixed-size blocks, not one FFT per layer or bucket.** A layer's length often has a large prime
  factor (ResNet-18's flattened parameters: 2·3·1,863,607), and the FFT of such a length costs
  far more than blocks. ``B = 4096`` by default: blocks of 256 to 4,096 reconstruct almost equally
  well, and 4,096 compresses best at high theta (fewer blocks round ``k`` up) with the cheapest
  transforms.
* **A fixed count per block** (``torch.topk`` along the block dimension) by default. It
  reconstructs as well as a layer-wide top-K, costs no more (a single exact top-K over a layer's
  spectrum costs more than the whole step budget; the layer-wide option uses a sampled threshold
  first), and its block-local positions need 12 bits instead of up to 21, so it compresses more at
  the same theta. Either way every message has the same size on every rank.
* **Magnitude selection of complex coefficients**: a coefficient keeps both its real and imaginary
  part. The DC and Nyquist bins are real; their (zero) imaginary part is sent as a zero code, which
  wastes at most two slots a block.
* **Collective: all-gather** of the fixed-size payloads. Kept positions differ between ranks and
  the range-based codes are not summable, so a plain all-reduce is impossible. Each rank receives
  ``(N - 1)`` payloads of ``P`` bytes, ``(N - 1) P`` in all, against ``2 (N - 1)/N · 4n`` for a ring
  all-reduce of the dense gradient: the all-gather sends less while the compression ratio
  ``4n / P`` exceeds ``N / 2`` (about 24x at ``theta = 0.9`` with 8 bits, so up to ~48 ranks), and
  decoding costs grow with ``N`` too (one scatter per rank; the spectra are summed before a single
  inverse FFT, the FFT being linear).
* **Error feedback** (on by default): the residual keeps what the sparsification and the
  quantization dropped.

``theta`` is a live knob: ``codec.set_level(theta)`` (as :class:`~lightning_gradcomp.callbacks.ThetaDecay`
does) at the same optimizer step on every rank; every message size derives from ``n``, ``B`` and
``theta`` alone. ``compression_limit`` caps it (see
:class:`~lightning_gradcomp.codecs.base.AdjustableCompression`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.codecs.base import (
    Codec,
    CodecOptions,
    EncodeResult,
    LearnedState,
    check_choice,
    check_fraction,
    check_positive_int,
    check_seed,
)
from lightning_gradcomp.codecs.bits import (
    bits_to_hold,
    codes_nbytes,
    pack_codes,
    pack_mask,
    packed_nbytes,
    unpack_codes,
    unpack_mask,
)
from lightning_gradcomp.codecs.positions import positions_of_ones
from lightning_gradcomp.codecs.rangefloat import ROUNDINGS, RangeFloat, range_float
from lightning_gradcomp.codecs.sampling import seeded_generator, select_top
from lightning_gradcomp.registry import register_codec

__all__ = ["FFTCodec"]

POSITIONS = ("auto", "bitmap", "indices")
SELECTIONS = ("layer", "block")


@dataclass(frozen=True)
class FFTOptions(CodecOptions):
    theta: float = 0.9
    block_size: int = 4096
    bits: int | None = 8
    exponent_bits: int | None = None
    rounding: str = "nearest"
    positions: str = "auto"
    selection: str = "block"
    seed: int = 0

    def check(self) -> None:
        self._set("theta", check_fraction("theta", self.theta, low_open=False, high_open=True))
        check_positive_int("block_size", self.block_size)
        if self.block_size % 2 or not 16 <= self.block_size <= 65536:
            raise ValueError(f"block_size must be an even integer in [16, 65536], got {self.block_size}")
        check_choice("rounding", self.rounding, ROUNDINGS)
        if self.bits is not None:
            range_float(self.bits, self.exponent_bits, None, self.rounding)  # validates the format
        check_choice("positions", self.positions, POSITIONS)
        check_choice("selection", self.selection, SELECTIONS)
        self._set("seed", check_seed("seed", self.seed))


@register_codec("fft")
class FFTCodec(LearnedState, Codec):
    """FFT sparsification + range-based float (see the module docstring).

    Args:
        theta: fraction of each block's frequency coefficients dropped, in ``[0, 1)`` (default 0.9).
            ``0`` sends every coefficient: lossless up to the quantizer (and up to fp32 rounding of
            the transforms with ``bits=None``).
        block_size: FFT length ``B``, an even integer in ``[16, 65536]`` (default 4096).
        bits: bits of the range-based float per real value (4..16, default 8), or ``None`` for fp32.
        exponent_bits: fixed exponent width of the range-based float, or ``None`` to fit it per layer.
        rounding: ``"nearest"`` (default) or ``"stochastic"``.
        positions: ``"auto"`` (default: the smaller of bitmap and indices), ``"bitmap"`` or ``"indices"``.
        selection: ``"block"`` (default): the ``C - floor(theta C)`` largest coefficients of every
            block; ``"layer"``: the ``K = N - floor(theta N)`` largest of the layer's ``N`` coefficients
            (threshold from a 1% sample, then an exact top-K among the candidates).
        seed: seed of stochastic rounding and of the threshold sample.
        **kwargs: the common codec options; error feedback is on by default.
    """

    collective = "allgather"
    Options = FFTOptions
    harness_defaults = {"error_feedback": True}

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._theta = self.options.theta  # the level in use: a schedule lowers it while training runs
        self._limit = 1.0

    @property
    def _fmt(self) -> RangeFloat | None:
        o = self.options
        return None if o.bits is None else range_float(o.bits, o.exponent_bits, None, o.rounding)

    # ----------------------------------------------------------------------------------------------
    # the compression knob (AdjustableCompression) and the state that keeps it over a resume
    @property
    def theta(self) -> float:
        """The theta a schedule set last (the option ``theta`` until then)."""
        return self._theta

    @property
    def effective_theta(self) -> float:
        return min(self._theta, self._limit)

    @property
    def compression_level(self) -> float:
        """The theta in use: ``min(theta, compression_limit)``."""
        return self.effective_theta

    def set_level(self, level: float) -> None:
        """Set theta (at the same optimizer step on every rank: message sizes derive from it)."""
        self._theta = check_fraction("theta", level, low_open=False, high_open=True)

    @property
    def compression_limit(self) -> float:
        """Upper bound on theta, whatever a schedule sets; lowered by accuracy-drop rollbacks."""
        return self._limit

    @compression_limit.setter
    def compression_limit(self, value: float) -> None:
        self._limit = check_fraction("compression_limit", value, low_open=False)

    def state_dict(self) -> dict[str, Any]:
        return {"theta": self._theta, "compression_limit": self._limit}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"theta", "compression_limit"}
        if unknown:
            raise ValueError(f"codec 'fft' does not know the state entries {sorted(unknown)}")
        if "theta" in state:
            self.set_level(state["theta"])
        if "compression_limit" in state:
            self.compression_limit = state["compression_limit"]

    # ----------------------------------------------------------------------------------------------
    # sizes: functions of (n, block_size, theta, selection) only, hence equal on every rank
    def layout(self, numel: int) -> tuple[int, int, int, str]:
        """``(blocks nb, coefficients per block C, kept coefficients K, positions mode)`` of a layer.

        ``K = N - floor(theta N)`` of the ``N = nb C`` coefficients; with ``selection="block"``,
        ``k = C - floor(theta C)`` in every block and ``K = nb k``.
        """
        B = self.options.block_size
        nb = -(-numel // B)
        C = B // 2 + 1
        theta = self.effective_theta
        K = (
            nb * max(1, C - math.floor(theta * C))
            if self.options.selection == "block"
            else max(1, nb * C - math.floor(theta * nb * C))
        )
        if K == nb * C:
            mode = "none"
        elif self.options.positions != "auto":
            mode = self.options.positions
        else:
            bitmap = packed_nbytes(nb * C, 1)
            indices = codes_nbytes(K, self._index_bits(nb, C))
            mode = "indices" if indices < bitmap else "bitmap"
        return nb, C, K, mode

    def _index_bits(self, nb: int, C: int) -> int:
        # block selection sends block-local positions; layer selection positions in the whole layer
        span = C if self.options.selection == "block" else nb * C
        return bits_to_hold(span - 1)

    def payload_nbytes(self, numel: int) -> int:
        """Bytes of one layer's message (without the 8-byte range header)."""
        nb, C, K, mode = self.layout(numel)
        vals = 2 * K * 4 if self._fmt is None else self._fmt.nbytes(2 * K)
        pos = {"none": 0, "bitmap": packed_nbytes(nb * C, 1), "indices": codes_nbytes(K, self._index_bits(nb, C))}
        return vals + pos[mode]

    # ----------------------------------------------------------------------------------------------
    def _spectrum(self, x: Tensor, nb: int) -> Tensor:
        B = self.options.block_size
        pad = nb * B - x.numel()
        xb = torch.nn.functional.pad(x, (0, pad)) if pad else x
        return torch.fft.rfft(xb.view(nb, B), dim=1)

    def _select(self, power: Tensor, K: int, gen: torch.Generator | None) -> Tensor:
        """Sorted flat positions of the ``K`` largest entries of ``power`` (``nb x C``)."""
        nb, C = power.shape
        if self.options.selection == "block":
            k = K // nb
            local = torch.topk(power, k, dim=1, sorted=False).indices.sort(dim=1).values
            return (local + torch.arange(nb, device=power.device).unsqueeze(1) * C).reshape(-1)
        # exact top-K over the layer, through a threshold estimated from a 1% sample (DGC-style)
        return select_top(power.reshape(-1), K, 0.01, gen)

    def encode(self, x: Tensor, key: str, param: Tensor, step: int) -> EncodeResult:
        n = x.numel()
        nb, C, K, mode = self.layout(n)
        X = self._spectrum(x, nb).view(-1)
        gen = None
        if self.options.rounding == "stochastic" or (mode != "none" and self.options.selection == "layer"):
            gen = seeded_generator(self.options.seed, self.rank, step, key, x.device)
        if mode == "none":
            idx = None
            kept = X
        else:
            power = (X.real.square() + X.imag.square()).view(nb, C)  # ranks like |X|, without the sqrt
            idx = self._select(power, K, gen)
            kept = X[idx]
        vals = torch.view_as_real(kept).reshape(-1)
        if self._fmt is None:
            payload = [vals.contiguous()]
            q = vals
        else:
            header, codes = self._fmt.quantize(vals, gen if self.options.rounding == "stochastic" else None)
            q = self._fmt.dequantize(header, codes)
            payload = [header, pack_codes(codes, self._fmt.bits)]
        if mode == "bitmap":
            mask = torch.zeros(nb * C, dtype=torch.bool, device=x.device)
            mask[idx] = True
            payload.append(pack_mask(mask))
        elif mode == "indices":
            pos = idx if self.options.selection == "layer" else idx.view(nb, -1) % C
            payload.append(pack_codes(pos.reshape(-1).to(torch.int32), self._index_bits(nb, C)))
        spec = torch.zeros(nb * C, dtype=X.dtype, device=x.device)
        self._add(spec, idx, q)
        local = torch.fft.irfft(spec.view(nb, C), n=self.options.block_size, dim=1).reshape(-1)[:n]
        return EncodeResult(payload, local=local, ctx=(nb, C, K, mode))

    @staticmethod
    def _add(spec: Tensor, idx: Tensor | None, vals: Tensor) -> None:
        """``spec[idx] += vals`` (``vals`` as interleaved real/imaginary parts, ``spec`` flat)."""
        z = torch.view_as_complex(vals.to(torch.float32).reshape(-1, 2).contiguous())
        if idx is None:
            spec += z
        else:
            spec.index_add_(0, idx, z)

    def _unpack(self, payload: Sequence[Tensor], ctx: tuple[int, int, int, str]) -> tuple[Tensor | None, Tensor]:
        nb, C, K, mode = ctx
        if self._fmt is None:
            vals, rest = payload[0], payload[1:]
        else:
            vals = self._fmt.decode(payload[:2], 2 * K)
            rest = payload[2:]
        if mode == "none":
            return None, vals
        if mode == "bitmap":
            idx = positions_of_ones(unpack_mask(rest[0], nb * C), K)  # ascending, as the values were sent
        else:
            idx = unpack_codes(rest[0], self._index_bits(nb, C), K).long()
            if self.options.selection == "block":
                idx = (idx.view(nb, -1) + torch.arange(nb, device=idx.device).unsqueeze(1) * C).view(-1)
        return idx, vals

    def decode(self, payload: list[Tensor], ctx: Any, numel: int, count: int) -> Tensor:
        return self.aggregate([payload], ctx, numel)

    def aggregate(self, payloads: Sequence[list[Tensor]], ctx: Any, numel: int) -> Tensor:
        nb, C, _, _ = ctx
        spec = torch.zeros(nb * C, dtype=torch.complex64, device=payloads[0][0].device)
        for p in payloads:  # the FFT is linear: sum the spectra, invert once
            idx, vals = self._unpack(p, ctx)
            self._add(spec, idx, vals)
        return torch.fft.irfft(spec.view(nb, C), n=self.options.block_size, dim=1).reshape(-1)[:numel]
