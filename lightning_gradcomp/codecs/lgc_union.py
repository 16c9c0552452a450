"""``lgc``'s union support (``support="union"``): every rank names positions, the support is their union.

No rank leads. In stages 2 and 3 each rank names the ``ceil(k / N)`` largest positions of its own
layer; the names are all-gathered (how they travel is ``lgc_names.py``'s), and every rank sends its
values on their union, at most ``k`` positions, knowing who named what. In stage 3 a rank's values
at the positions it named travel on the leader's levels (:data:`~lightning_gradcomp.codecs.levels.LEADER`),
its values at the others' positions on the others' levels (two messages a layer), and the code
carries a layer only where every rank's run-time guard passes.

:class:`UnionSupport` is a base of :class:`~lightning_gradcomp.codecs.lgc.LGCCodec`, as
:class:`~lightning_gradcomp.codecs.lgc_learning.LearnedCode` is: it reads the codec's ``options``,
``rank``, ``world_size``, ``context`` (its ``all_gather``), ``last_timing``, ``k_for``,
``_select``, ``_channel_size``, ``_within_gate``, ``_count_layer`` and ``_exact``, and the learned
code's ``_code_may_carry``, ``_levels_for`` and refit samples. The leader's support
is ``lgc_leader.py``'s; the stages and the codec's collectives stay in ``lgc.py``.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.codecs import levels
from lightning_gradcomp.codecs.base import EncodeResult, Prepared
from lightning_gradcomp.codecs.lgc_layers import LayerContext, LayerPrepared
from lightning_gradcomp.codecs.lgc_names import (
    first_names,
    gap_layout,
    gather_channel_names,
    gather_gap_names,
    names_in,
)
from lightning_gradcomp.codecs.positions import (
    choose_encoding,
    encoded_nbytes,
    output_channels,
    union_of,
    union_slots,
)
from lightning_gradcomp.codecs.sampling import keep_count, named_count

__all__ = ["UnionSupport"]


class UnionSupport:
    """The union support's bucket round, its messages and their sum (see the module docstring)."""

    def _prepare_union(self, layers: list[tuple[str, Tensor, Tensor]], step: int, stage: int, t0: float) -> Prepared:
        """``support="union"``: every rank names the ``ceil(k / N)`` largest positions of its own
        layer and the names are all-gathered with each rank's guard flags; the support is their
        union (at most ``k`` positions), and every rank knows who named what.

        With ``position_code="channel"`` the first all-gather carries the flags and each weight's
        output-channel counts, which fix every rank's code sizes; the second carries the names,
        per layer in the smaller of the channel code and the layer code, every rank's message
        padded to the longest (an all-gather moves equal sizes).

        In stage 3 each rank passes its own named values through the leader's levels (the run-time
        guard of the leader's support, on every rank): the code carries a layer this step only
        where every rank's flag passes. One host read of the gathered flags a bucket (and one of
        the code sizes)."""
        world, device = self.world_size, layers[0][1].device
        numels = [x.numel() for _, x, _ in layers]
        sizes = [self.k_for(n, step) for n in numels]
        named_sizes = [named_count(k, world) for k in sizes]
        encodings = [choose_encoding("auto", m, n) for m, n in zip(named_sizes, numels)]
        code_bytes = [encoded_nbytes(e, m, n) for e, m, n in zip(encodings, named_sizes, numels)]
        use_code = [self._code_may_carry(stage, key, k, n) for (key, _, _), k, n in zip(layers, sizes, numels)]
        # (channels, entries a channel) of the weights whose names travel per channel; None: one
        # code over the layer (a vector, a one-channel weight, a full layer, position_code="layer")
        gapped = self.options.position_code in ("rice", "kernel")
        by_channel = gapped or self.options.position_code == "channel"
        channels = [
            (c, n // c) if by_channel and (c := output_channels(p)) > 1 and b > 0 else None
            for (_, _, p), n, b in zip(layers, numels, code_bytes)
        ]
        kernels = self.options.position_code == "kernel"
        layouts = [
            gap_layout(p, n, m, kernels) if gapped else None for (_, _, p), n, m in zip(layers, numels, named_sizes)
        ]
        # entries a channel of the layers whose messages take a scale a channel (0: one a message)
        pers = [self._channel_size(p, k, n) for (_, _, p), k, n in zip(layers, sizes, numels)]
        n_flags = sum(use_code)
        mine: list[Tensor] = []
        own_codes: list[Any] = [None] * len(layers)
        flags = []
        for i, ((key, x, _), k, m, a, n, per) in enumerate(zip(layers, sizes, named_sizes, use_code, numels, pers)):
            idx = self._select(x, m, step)
            mine.append(idx)
            if a:
                v, table = x[idx], self._levels_for(key, k, n, levels.LEADER)
                own_codes[i] = levels.encode_at(v, table, idx, n, per)
                flags.append(self._within_gate(v, own_codes[i][1]))
        # the first message a rank: its guard flags (fp32), then its names' part
        parts = [torch.stack(flags).to(torch.float32).view(torch.uint8)] if flags else []
        name_parts, counts, own_code = first_names(mine, channels, layouts, encodings, numels, by_channel, gapped)
        parts += name_parts
        msg = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
        first = msg.numel()
        rows = self.context.all_gather(msg)
        # reshape, not contiguous(): one rank's (1, n) slice counts as contiguous with its row
        # stride, and a dtype view needs the bytes to follow one another
        flag_rows = rows[:, : 4 * n_flags].reshape(-1).view(torch.float32).view(world, n_flags)
        passed = flag_rows.amin(0).tolist() if n_flags else []
        if gapped:  # a second round: the names, their lengths read from the first
            names, second = gather_gap_names(
                self.context.all_gather, rows, 4 * n_flags, self.rank, mine, layouts, own_code
            )
        elif by_channel:  # a second round: the names, their sizes fixed by the counts
            names, second = gather_channel_names(
                self.context.all_gather,
                rows,
                4 * n_flags,
                self.rank,
                mine,
                channels,
                counts,
                encodings,
                code_bytes,
                numels,
            )
        else:
            names, second = names_in(rows, 4 * n_flags, self.rank, mine, encodings, code_bytes, numels), 0
        shared: dict[str, LayerPrepared] = {}
        off_f = 0
        for i, ((key, _, _), k, m, a, n) in enumerate(zip(layers, sizes, named_sizes, use_code, numels)):
            support, named = union_of(names[i], n)  # sorted, and who named what
            coded = False
            if a:
                coded = passed[off_f] > 0.5
                off_f += 1
            u, sent = support.numel(), 0
            if coded:
                bits, per = levels.table_bits(self._levels_for(key, k, n)), pers[i]
                sent = levels.message_nbytes(m, bits) + (levels.message_nbytes(u - m, bits) if u > m else 0)
                sent += (1 + (u > m)) * 2 * (n // per) if per else 0  # the channels' scales, bfloat16
            self._count_layer(step, stage, k, n, u, a, coded, sent)
            # where each rank's names sit in the support: read by the code and by the refit samples
            slots = union_slots(names[i], n, support, named) if a or self._keeps_refit_sample(key, step) else None
            shared[key] = LayerPrepared(support, 1.0, None, coded, own_codes[i], named, k, slots, pers[i])
        self.last_timing["prepare_s"] = time.perf_counter() - t0
        return Prepared(first + second, shared, collective="allgather")

    def _encode_union(self, x: Tensor, key: str, step: int, prepared: LayerPrepared) -> EncodeResult:
        """A union support: this rank's values at the positions it named travel on the leader's
        levels, its values at the others' positions on the others' levels (two messages); exact
        values where the code does not carry the layer."""
        idx, coded, own_code = prepared.support, prepared.coded, prepared.own_code
        named, k, per = prepared.named, prepared.size, prepared.per
        v = x[idx]
        local = torch.zeros_like(x)
        ctx = LayerContext(idx, 1.0, None, step, key, coded, named, k, prepared.slots, per)
        if self._keeps_refit_sample(key, step):
            denser = k > keep_count(self.options.ratio, x.numel())
            own, rest = (slots[self.rank] for slots in prepared.slots)
            for part, role in ((own, levels.LEADER), (rest, levels.OTHERS)):
                if part.numel():  # the values as their message scales them
                    sample = v.index_select(0, part)
                    if per:
                        channels = idx.index_select(0, part) // per
                        sample = levels.normalize_by_channel(sample, channels, x.numel() // per)[0]
                    self._stage_for_refit(key, step, sample, denser, role)
        if not coded:
            sent = self._exact(v, step)
            local[idx] = sent.to(local.dtype)
            return EncodeResult([sent], local=local, ctx=ctx)
        message, rec = own_code
        own, rest = (slots[self.rank] for slots in prepared.slots)
        decoded = torch.empty_like(v).index_copy_(0, own, rec)
        if rest.numel():  # else every rank named the same positions: nothing else to send
            values, table = v.index_select(0, rest), self._levels_for(key, k, x.numel(), levels.OTHERS)
            other_message, other_rec = levels.encode_at(values, table, idx.index_select(0, rest), x.numel(), per)
            decoded.index_copy_(0, rest, other_rec)
            message = message + other_message
        local[idx] = decoded
        return EncodeResult(message, local=local, ctx=ctx)

    def _aggregate_union(self, payloads: Sequence[list[Tensor]], ctx: LayerContext, numel: int) -> Tensor:
        """The sum of every rank's decoded values on a union support where the code carries the
        layer (:meth:`_encode_union`)."""
        idx, (owns, rests), per = ctx.support, ctx.slots, ctx.per
        out = torch.zeros(numel, dtype=torch.float32, device=payloads[0][0].device)
        table = self._levels_for(ctx.key, ctx.size, numel)
        total = torch.zeros(idx.numel(), dtype=torch.float32, device=out.device)
        width = 3 if per else 2  # tensors a message: [channels' scales,] r, codes

        def decoded_part(message: list[Tensor], row: Tensor, part: Tensor) -> Tensor:
            if per:
                return levels.decode_by_channel(message, row, idx.index_select(0, part) // per)
            return levels.decode(message, row, part.numel())

        for p, own, rest in zip(payloads, owns, rests):
            decoded = torch.empty_like(total)
            decoded.index_copy_(0, own, decoded_part(p[0:width], table[levels.LEADER], own))
            if rest.numel():
                decoded.index_copy_(0, rest, decoded_part(p[width : 2 * width], table[levels.OTHERS], rest))
            total += decoded
        out[idx] = total
        return out
