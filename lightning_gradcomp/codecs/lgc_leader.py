"""``lgc``'s leader support (``support="leader"``, the default beside SGD): one rank names it.

In stages 2 and 3 the leader of a step (rank ``step % N``) picks each layer's top ``k`` positions
and broadcasts them in one byte message for the bucket. In stage 3 the message also carries, for
each layer the learned code may carry, the run-time guard's flag (1: the code carries the layer
this step, 0: its values go exactly), which the leader sets by passing its own values through the
code; with the autoencoder, the leader's scale too, and with its ``"ps"`` variant the leader's
latents. Every size follows from ``k`` and the layer's length, so no header travels.

:class:`LeaderSupport` is a base of :class:`~lightning_gradcomp.codecs.lgc.LGCCodec`, as
:class:`~lightning_gradcomp.codecs.lgc_union.UnionSupport` is: it reads the codec's ``options``,
``rank``, ``world_size``, ``context`` (its ``broadcast``), ``ae``, ``last_timing``, ``k_for``,
``uses_autoencoder``, ``_select``, ``_channel_size``, ``_within_gate``, ``_rar_code``,
``_innovation``, ``_code_nbytes`` and ``_count_layer``, and the learned code's
``_code_may_carry`` and ``_levels_for``. The stages, the guard and the codec's collectives stay in
``lgc.py``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.codecs import levels
from lightning_gradcomp.codecs.base import Prepared
from lightning_gradcomp.codecs.lgc_autoencoder import GradientAutoencoder
from lightning_gradcomp.codecs.lgc_layers import LayerPrepared
from lightning_gradcomp.codecs.positions import choose_encoding, decode_positions, encode_positions, encoded_nbytes

__all__ = ["LeaderSupport"]


class LeaderSupport:
    """The leader's bucket round: its support and, in stage 3, its guard flags (see the module docstring)."""

    def _prepare_leader(self, layers: list[tuple[str, Tensor, Tensor]], step: int, stage: int, t0: float) -> Prepared:
        """``support="leader"``: the leader's support (and, in stage 3, its scales, flags and
        latents), broadcast once for the bucket; each layer's :class:`LayerPrepared` is what
        ``encode`` gets as ``prepared``."""
        leader = step % self.world_size  # a rank of the codec's group
        is_leader = self.rank == leader
        device = layers[0][1].device
        numels = [x.numel() for _, x, _ in layers]
        sizes = [self.k_for(n, step) for n in numels]
        encodings = [choose_encoding("auto", k, n) for k, n in zip(sizes, numels)]
        code_bytes = [encoded_nbytes(e, k, n) for e, k, n in zip(encodings, sizes, numels)]
        use_ae = [self._code_may_carry(stage, key, k, n) for (key, _, _), k, n in zip(layers, sizes, numels)]
        ae, ps = self.uses_autoencoder, self.uses_autoencoder and self.options.variant == "ps"
        lat = [
            self.ae.latent_channels * GradientAutoencoder.latent_len(k) if a and ps else 0
            for k, a in zip(sizes, use_ae)
        ]
        pers = [self._channel_size(p, k, n) for (_, _, p), k, n in zip(layers, sizes, numels)]
        n_flags = sum(use_ae)
        n_scales = n_flags if ae else 0
        n_lat = sum(lat)
        # one byte message: for each layer that may use the learned code its scale (the AE's
        # only) and its flag (1: the code carries it this step, 0: exact values), the leader's
        # latents (all fp32, first, so that their views stay aligned), then every layer's support
        # as a position code; all sizes follow from k and n, so no header travels
        nbytes = sum(code_bytes) + 4 * (n_scales + n_flags + n_lat)
        msg = torch.empty(nbytes, dtype=torch.uint8, device=device)
        supports: list[Tensor | None] = [None] * len(layers)
        own_codes: list[tuple[Any, Tensor] | None] = [None] * len(layers)  # the leader's codes, reused by encode
        if is_leader:
            parts, scales, flags, zs = [], [], [], []
            for i, ((key, x, _), k, a, e, n) in enumerate(zip(layers, sizes, use_ae, encodings, numels)):
                idx = self._select(x, k, step)
                supports[i] = idx
                parts.append(encode_positions(idx, n, e))
                if a and not ae:
                    # the run-time guard: the leader's own values through the code, this step
                    v, table, per = x[idx], self._levels_for(key, k, n, levels.LEADER), pers[i]
                    own_codes[i] = levels.encode_at(v, table, idx, n, per)
                    flags.append(self._within_gate(v, own_codes[i][1]))
                elif a:
                    v = x[idx]
                    s = v.pow(2).mean().sqrt() + 1e-30
                    scales.append(s)
                    # the run-time guard: the leader's own values through the AE, this step
                    with torch.no_grad():
                        if self.options.variant == "rar":
                            own_codes[i] = self._rar_code(v, s)  # encode() reuses it
                            rec = own_codes[i][1]
                        else:
                            z = self.ae.encode((v / s).unsqueeze(0))
                            zs.append(z.reshape(-1))
                            rec = s * self.ae.decode(z, k, self._innovation(v / s, n)[1].unsqueeze(0))[0]
                    flags.append(self._within_gate(v, rec))
            head = [torch.stack(scales).to(torch.float32).view(torch.uint8)] if scales else []
            head += [torch.stack(flags).to(torch.float32).view(torch.uint8)] if flags else []
            head += [z.to(torch.float32).view(torch.uint8) for z in zs]
            parts = head + parts
            if parts:
                torch.cat(parts, out=msg)
        if nbytes:  # a no-op on one rank
            self.context.broadcast(msg, leader)
        scale_values = msg[: 4 * n_scales].view(torch.float32)
        # the one host read of this bucket in stage 3: which layers travel as codes decides the
        # payload's shape (every rank reads the same flags)
        flag_bytes = msg[4 * n_scales : 4 * (n_scales + n_flags)]
        flag_values = flag_bytes.view(torch.float32).tolist() if n_flags else []
        latents = msg[4 * (n_scales + n_flags) : 4 * (n_scales + n_flags + n_lat)].view(torch.float32)
        off_b, off_f, off_z = 4 * (n_scales + n_flags + n_lat), 0, 0
        shared: dict[str, LayerPrepared] = {}
        for i, ((key, _, _), k, a, nl, e, b, n) in enumerate(
            zip(layers, sizes, use_ae, lat, encodings, code_bytes, numels)
        ):
            idx = supports[i]
            if idx is None:
                idx = decode_positions(msg[off_b : off_b + b], k, n, e)
            off_b += b
            s, z, coded = 1.0, None, False
            if a:
                if ae:
                    s = scale_values[off_f : off_f + 1].clone()  # a tensor: no host sync per layer
                coded = flag_values[off_f] > 0.5
                off_f += 1
                if ps:
                    z = latents[off_z : off_z + nl].view(1, self.ae.latent_channels, -1) if coded else None
                    off_z += nl
            code_nbytes = self._code_nbytes(key, k, n, pers[i]) if coded else 0
            self._count_layer(step, stage, k, n, k, a, coded, code_nbytes)
            shared[key] = LayerPrepared(idx, s, z, coded, own_codes[i], per=pers[i])
        self.last_timing["prepare_s"] = time.perf_counter() - t0
        return Prepared(nbytes, shared)
