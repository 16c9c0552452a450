"""The learned stage of ``lgc``: its training data, the code fitted at the switch, and its refits.

:class:`LearnedCode` is the half of :class:`~lightning_gradcomp.codecs.lgc.LGCCodec` that learns. It
keeps stage 2's samples (every rank's values on the shared support, which every rank sees), fits
the learned code on rank 0 at the switch (the magnitude levels of
:mod:`~lightning_gradcomp.codecs.levels`, or the autoencoder of
:mod:`~lightning_gradcomp.codecs.lgc_autoencoder`), broadcasts it and checks it is identical on
every rank, fits the levels again in stage 3 on rank 0's own messages, applies the gate, and
checkpoints all of it. The support, the messages, the collectives and the stages' schedule are the
codec's, in ``lgc.py``.

The class is a base of the codec, not a codec of its own: it reads the codec's ``options``
(:class:`~lightning_gradcomp.codecs.lgc.LGCOptions`), ``rank``, ``world_size``, ``context`` (its
``broadcast`` and ``agree``), ``_device()``, ``innovation_k(numel)`` and ``ae_start_step``.
:meth:`LearnedCode.train_autoencoder` and :meth:`LearnedCode.refit_levels` broadcast, so they run on
every rank at the same step (the codec calls them from ``on_step_end``).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gradcomp import comm
from lightning_gradcomp.codecs import levels
from lightning_gradcomp.codecs import lgc_autoencoder as autoencoder
from lightning_gradcomp.codecs.lgc_autoencoder import MIN_AE_LEN, GradientAutoencoder
from lightning_gradcomp.codecs.positions import union_of
from lightning_gradcomp.codecs.sampling import keep_count, named_count
from lightning_gradcomp.memory import LocksNotPickled

__all__ = ["LearnedCode", "REFIT_VALUES"]

#: relative magnitudes kept a layer and step for a refit of the levels (a seeded subsample)
REFIT_VALUES = 4096


class LearnedCode(LocksNotPickled):
    """The learned code of ``lgc`` and its training (see the module docstring)."""

    _unpickled_locks = ("_samples_lock",)

    def _init_learned_code(self) -> None:
        """The untrained code and empty training data (from the codec's ``__init__``)."""
        # the AE is built once, from the options at construction (variant, ae_width,
        # latent_channels, seed); replace_options does not rebuild it
        o = self.options
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(o.seed)
            self.ae = GradientAutoencoder(o.ae_width, o.latent_channels, innovation=o.variant == "ps")
        self.ae.requires_grad_(False)
        # identical on every rank: the AE, whether it is trained, its training summary, the samples
        self._ae_state = {"trained": False, "loss": float("nan"), "recon_error": float("nan"), "train_s": float("nan")}
        self._ae_layers: dict[str, float] = {}  # layers the learned code carries in stage 3 -> held-out error
        self._levels: dict[str, Tensor] = {}  # "levels": each layer's magnitude levels
        self._levels_denser: dict[str, Tensor] = {}  # the same, for a support denser than ``ratio``
        # key, step, leader (a union support: who named what, (N, K)), numel, (N, K) values
        self._samples: list[tuple[str, int, int | Tensor, int, Tensor]] = []
        # (key, step) -> how the sample's sorted positions fall in the layer's channels (counts a
        # channel): a denser sample with light_scale="channel" (either support), whose levels fit
        # its values in units of their channel's RMS
        self._sample_channels: dict[tuple[str, int], Tensor] = {}
        self._samples_lock = threading.Lock()
        # "levels" in stage 3, rank 0 only: its own messages since the last fit, as
        # (key, step, role, denser, relative magnitudes, at most REFIT_VALUES of them)
        self._refit_samples: list[tuple[str, int, int, bool, Tensor]] = []
        # rank 0: a layer's messages of the step in flight, as (step, values, denser, role); kept
        # for the fit only once every rank's message of the step was finite (``aggregate`` runs),
        # so that a skipped step leaves the samples as they were
        self._refit_staged: dict[str, list[tuple[int, Tensor, bool, int | None]]] = {}
        self._refits = 0  # fits of the levels after the switch
        self._ae_layers_used = (0, 0)  # of the last step: layers the AE carried, layers it may carry
        self._values_used = (0, 0, 0)  # of the last step: values the code carried, support values, their code's bytes
        self._ae_count_step = -1
        # over the run's stage-3 steps, at the configured support and at a denser one: support
        # values the code carried, and all support values of the compressed layers
        self._values_run = {"configured": [0, 0], "denser": [0, 0]}

    # ----------------------------------------------------------------------------------------------
    # training summary (run-time state, not options: it changes during the run)
    @property
    def ae_trained(self) -> bool:
        return bool(self._ae_state["trained"])

    @property
    def ae_loss(self) -> float:
        """Mean AE training loss over its last epoch (NaN before training)."""
        return float(self._ae_state["loss"])

    @property
    def ae_recon_error(self) -> float:
        """Relative error of the decoded aggregate on held-out stage-2 samples (NaN before training)."""
        return float(self._ae_state["recon_error"])

    @property
    def ae_layers_used(self) -> tuple[int, int]:
        """Of the last step: how many layers the AE carried, and how many it may carry (those that
        passed the gate at the switch); the run-time guard sent the others' values exactly."""
        return self._ae_layers_used

    @property
    def values_used(self) -> tuple[int, int, int]:
        """Of the last step, on this rank: how many support values the learned code carried, how
        many values the supports of the compressed layers held, and the bytes this rank sent for
        the carried values (4 a value would have been sent exactly)."""
        return self._values_used

    @property
    def values_run(self) -> dict[str, tuple[int, int]]:
        """Over the run's stage-3 steps so far, on this rank, at the configured support
        (``"configured"``) and at a denser one (``"denser"``, the level controller's light steps):
        how many support values the learned code carried, and how many the supports held."""
        return {name: (c, n) for name, (c, n) in self._values_run.items()}

    @property
    def denser_code_bits(self) -> int | None:
        """Bits a value on the denser support's levels (``light_code_bits`` at the switch, or what
        a checkpoint holds); None where the denser support has no levels of its own."""
        table = next(iter(self._levels_denser.values()), None)
        return None if table is None else levels.table_bits(table)

    @property
    def refits(self) -> int:
        """How many times the levels were fitted again after the switch (``refit_every``)."""
        return self._refits

    @property
    def ae_train_s(self) -> float:
        """Seconds the switch took (training, broadcast and check) on this rank."""
        return float(self._ae_state["train_s"])

    @property
    def uses_autoencoder(self) -> bool:
        return self.options.code == "autoencoder"

    # ----------------------------------------------------------------------------------------------
    # training at the switch and refits in stage 3: rank 0 fits, every rank receives the code
    def _refitting(self, step: int) -> bool:
        """Whether the levels are fitted again in stage 3 (and rank 0 keeps its messages for it)."""
        return (
            not self.uses_autoencoder
            and self.options.refit_every > 0
            and self.ae_trained
            and step >= self.ae_start_step
        )

    def _keeps_refit_sample(self, key: str, step: int) -> bool:
        """Whether this rank keeps ``key``'s message of ``step`` for the next fit (rank 0, every
        layer with levels, carried or not)."""
        return self.rank == 0 and self._refitting(step) and key in self._levels

    def _stage_for_refit(self, key: str, step: int, v: Tensor, denser: bool, role: int | None = None) -> None:
        """Rank 0, from ``encode``: hold ``key``'s message of ``step`` (one a role on a union
        support) until :meth:`_commit_refit`; a message still held from an earlier step was of a
        skipped one, and goes."""
        with self._samples_lock:
            held = self._refit_staged.get(key, [])
            if held and held[0][0] != step:
                held = []
            self._refit_staged[key] = [*held, (step, v, denser, role)]

    def _commit_refit(self, key: str, step: int) -> None:
        """Rank 0, from ``aggregate`` (every rank's message of the layer was finite): keep what
        :meth:`_stage_for_refit` held for ``key`` at ``step``."""
        with self._samples_lock:
            held = self._refit_staged.pop(key, [])
        for held_step, v, denser, role in held:
            if held_step == step:
                self._keep_for_refit(key, step, v, denser, role)

    def _keep_for_refit(self, key: str, step: int, v: Tensor, denser: bool, role: int | None = None) -> None:
        """Rank 0: keep a seeded subsample of ``|v| / RMS(v)`` of its own message (the RMS of the
        whole message, as it travels), with its role (``None``: its role at ``step`` on the
        leader's support), for the next fit."""
        m = levels.relative_magnitudes(v.detach().float())
        if m.numel() > REFIT_VALUES:
            g = torch.Generator(device="cpu").manual_seed(self.options.seed * 1_000_003 + step)
            m = m[torch.randperm(m.numel(), generator=g)[:REFIT_VALUES].to(m.device)]
        with self._samples_lock:
            self._refit_samples.append((key, step, self._role(step) if role is None else role, denser, m.clone()))
            first = step - self.options.refit_every  # only what came since the last fit
            if self._refit_samples[0][1] <= first:
                self._refit_samples = [smp for smp in self._refit_samples if smp[1] > first]

    def refit_levels(self) -> None:
        """Fit the levels again on rank 0's messages since the last fit, broadcast them, check them.

        Must run on every rank at the same point (it broadcasts). In stage 3 no rank sees the
        others' exact values, but rank 0 sends as the leader on some steps and as another rank on
        the others, so its own messages hold both roles' values. For each layer and support size
        (the configured one, and the denser one where its levels exist), a role's row is fitted
        again when rank 0 sent that role on at least two steps; the most recent eighth of the steps
        is held out, and a layer keeps the code where the held-out error of rank 0's messages at
        the configured support is at most ``max_recon_error`` (the gate, now per rank rather than
        of the aggregate). Nothing is fitted and no layer changes where there are no samples."""
        keys = sorted(self._levels)
        if not keys:
            return
        device = self._device()
        # (layer x role x level, the layers' names) at the configured support and, where it has
        # levels of its own (all of keys, or none), at the denser one; each table keeps the number
        # of levels it was fitted with at the switch (the denser one's may have more)
        supports = [(self._levels, keys)]
        if self._levels_denser:
            supports.append((self._levels_denser, sorted(self._levels_denser)))
        fitted = [torch.stack([t[k] for k in names]).to(device=device, dtype=torch.float32) for t, names in supports]
        errors = torch.full((len(keys),), float("nan"), dtype=torch.float32, device=device)
        if self.rank == 0:
            with self._samples_lock:
                samples, self._refit_samples = self._refit_samples, []
            for which, (table, (_, names)) in enumerate(zip(fitted, supports)):
                for i, key in enumerate(names):
                    mine = [smp for smp in samples if smp[0] == key and smp[3] == bool(which)]
                    error = levels.refit_rows(mine, table[i], table.shape[-1], self.options.seed + i)
                    if which == 0 and error is not None:
                        errors[i] = error
        if self.world_size > 1:
            for table in fitted:
                self.context.broadcast(table, 0)
            self.context.broadcast(errors, 0)
        self._levels = {k: fitted[0][i].clone() for i, k in enumerate(keys)}
        if len(fitted) > 1:
            self._levels_denser = {k: fitted[1][i].clone() for i, k in enumerate(supports[1][1])}
        if self.world_size > 1:
            self.context.agree(self.ae_digest(), "lgc: the refitted levels differ between ranks after the broadcast")
        for key, error in zip(keys, errors.tolist()):  # once a refit, not per step
            if math.isnan(error):
                continue
            if error <= self.options.max_recon_error:
                self._ae_layers[key] = error
            else:
                self._ae_layers.pop(key, None)
        self._refits += 1

    def train_autoencoder(self) -> None:
        """Fit the AE on the collected samples (rank 0), broadcast it, check it is identical.

        Must run on every rank at the same point (it broadcasts). Sets :attr:`ae_loss` (last-epoch
        mean training loss), :attr:`ae_recon_error` (relative error ``||v_hat - v|| / ||v||`` of the
        aggregate on held-out samples: the most recent 1/8 of the steps) and :attr:`ae_train_s`.
        """
        t0 = time.perf_counter()
        with self._samples_lock:  # identical on every rank: every rank saw every rank's values
            keys = sorted({smp[0] for smp in self._samples})
        # everything handed to a collective lives on the codec's device (NCCL takes no CPU tensor)
        device = self._device()
        stats = torch.zeros(2 + len(keys), dtype=torch.float64, device=device)
        count = 2 ** (self.options.code_bits - 1)
        light_bits = self.options.light_code_bits or self.options.code_bits
        # the levels (each layer's leader's and others') of the configured support; those of a
        # denser one, with ``light_code_bits``, and in their last row whether they exist
        fitted = torch.ones(len(keys), 2, count, dtype=torch.float32, device=device)
        fitted_denser = torch.ones(len(keys) + 1, 2, 2 ** (light_bits - 1), dtype=torch.float32, device=device)
        fitted_denser[-1] = 0.0
        if self.rank == 0:
            if self.uses_autoencoder:
                loss, per_layer = self._fit()
            else:
                loss, per_layer = self._fit_levels(keys, fitted, fitted_denser)
            errors = [per_layer.get(k, (0.0, 0.0)) for k in keys]
            err, ref = sum(e for e, _ in errors), sum(r for _, r in errors)
            stats[0], stats[1] = loss, (math.sqrt(err / ref) if ref > 0 else float("nan"))
            per_layer_error = [math.sqrt(e / r) if r > 0 else math.inf for e, r in errors]
            stats[2:] = torch.tensor(per_layer_error, dtype=torch.float64).to(device)
        if self.world_size > 1:
            if self.uses_autoencoder:
                flat = nn.utils.parameters_to_vector(self.ae.parameters()).detach()
                self.context.broadcast(flat, 0)
                nn.utils.vector_to_parameters(flat, self.ae.parameters())
            else:
                self.context.broadcast(fitted, 0)
                self.context.broadcast(fitted_denser, 0)
            self.context.broadcast(stats, 0)
        if not self.uses_autoencoder:
            self._levels = {k: fitted[i].clone() for i, k in enumerate(keys)}
            has_denser = bool(fitted_denser[-1, 0, 0] > 0.5)  # once, at the switch
            self._levels_denser = {k: fitted_denser[i].clone() for i, k in enumerate(keys)} if has_denser else {}
        if self.world_size > 1:
            self.context.agree(self.ae_digest(), "lgc: the learned code differs between ranks after the broadcast")
        self.ae.requires_grad_(False)
        values = stats.tolist()  # once, at the switch (step-end work, not per layer)
        self._ae_layers = {k: float(e) for k, e in zip(keys, values[2:]) if e <= self.options.max_recon_error}
        with self._samples_lock:
            self._samples.clear()  # stage 3 never needs them again
            self._sample_channels.clear()
        self._ae_state = {
            "trained": True,
            "loss": float(values[0]),
            "recon_error": float(values[1]),
            "train_s": time.perf_counter() - t0,
        }

    def _split_samples(self, samples: list | None = None) -> tuple[list, list]:
        """Training and held-out samples (all of them, or ``samples``): the most recent eighth of
        the steps is held out."""
        if samples is None:
            with self._samples_lock:
                samples = list(self._samples)
        return levels.split_held_out(samples)

    def _samples_by_support(self) -> tuple[list, list]:
        """The samples as the configured support (``ratio``) would have given them, and the samples
        taken on a denser one.

        Under the level controller stage 2 runs partly or wholly on a ten times denser support,
        whose values, in units of their RMS, are distributed otherwise: levels fitted to them
        carried 3-5 of 19 layers at the configured support on ResNet-18. The leader's top ``k`` of
        its whole layer are the top ``k`` of its denser support, so a denser sample is cut to the
        leader's ``k`` largest values (every rank's values at those positions), which is the
        configured support of that step's gradient; a union support's, to each rank's
        ``ceil(k / N)`` largest values among those it named."""
        with self._samples_lock:
            samples = _in_step_order(self._samples)
        configured, denser = [], []
        for key, step, lead, numel, values in samples:
            k = keep_count(self.options.ratio, numel)
            if isinstance(lead, Tensor):  # a union support: each rank named ceil(k / N) of them
                named = named_count(k, values.shape[0])
                if int(lead[0].sum()) > named:
                    denser.append((key, step, lead, numel, values))
                    values, lead = _cut_union(values, lead, named)
            elif values.shape[-1] > k:
                denser.append((key, step, lead, numel, values))
                keep = values[lead].abs().topk(k, sorted=False).indices.sort().values
                values = values[:, keep]
            configured.append((key, step, lead, numel, values))
        return configured, denser

    def _levels_for(self, key: str, k: int, numel: int, role: int | None = None) -> Tensor:
        """The levels of ``key`` for a support of ``k`` values: those fitted to the denser support
        when ``k`` is above the configured size and they exist, else the configured support's; a
        ``(2, count)`` table (the leader's row and the others'), or the row of ``role``."""
        if k > keep_count(self.options.ratio, numel) and key in self._levels_denser:
            table = self._levels_denser[key]
        else:
            table = self._levels[key]
        return table if role is None else table[role]

    def _codes_support(self, k: int, numel: int) -> bool:
        """Whether the learned code may carry a support of ``k`` of ``numel`` values: always at the
        configured size; a denser one (the level controller's light steps) only with
        ``code_denser``, else it travels exactly."""
        return self.options.code_denser or k <= keep_count(self.options.ratio, numel)

    def _code_may_carry(self, stage: int, key: str, k: int, numel: int) -> bool:
        """Whether the learned code may carry layer ``key`` (``k`` of ``numel`` values on its
        support) this step, before the run-time guard: in stage 3, long enough for the code, passed
        by the gate at the switch, and a support the code carries (:meth:`_codes_support`). Both
        supports ask this (``lgc_leader.py``, ``lgc_union.py``)."""
        return stage == 3 and k >= MIN_AE_LEN and key in self._ae_layers and self._codes_support(k, numel)

    def _role(self, step: int) -> int:
        """This rank's row of the levels at ``step``: the leader's, or the others'."""
        return levels.role(self.rank, step % self.world_size)

    def _fit_levels(
        self, keys: list[str], fitted: Tensor, fitted_denser: Tensor
    ) -> tuple[float, dict[str, tuple[float, float]]]:
        """Fit ``fitted`` to the configured support's samples (their held-out error is the gate)
        and, when stage 2 ran a denser support on at least two steps, ``fitted_denser`` to those;
        its last row is set to 1 when it was fitted."""
        configured, denser = self._samples_by_support()
        if not configured:
            return float("nan"), {}
        train, val = self._split_samples(configured)
        loss, per_layer = levels.fit_layers(train, val, keys, fitted, self.options.seed)
        if self.options.light_scale == "channel":  # as their messages will scale them
            denser = [self._by_channel(smp) for smp in denser]
            denser = [smp for smp in denser if smp is not None]
        if len({s[1] for s in denser}) >= 2:
            d_train, d_val = self._split_samples(denser)
            levels.fit_layers(d_train, d_val, keys, fitted_denser[:-1], self.options.seed)
            fitted_denser[-1] = 1.0
        return loss, per_layer

    def _by_channel(self, sample: tuple) -> tuple | None:
        """A denser sample with its values in units of their channel's RMS within each
        message (:func:`levels.normalize_sample`); None where its channels are unknown (a sample
        from a checkpoint written without them), which the fit then leaves out."""
        key, step, lead, numel, values = sample
        with self._samples_lock:
            counts = self._sample_channels.get((key, step))
        if counts is None:
            return None
        counts = counts.to(values.device)
        channels = torch.repeat_interleave(torch.arange(counts.numel(), device=values.device), counts)
        named = lead if isinstance(lead, Tensor) else None
        return key, step, lead, numel, levels.normalize_sample(values, named, channels, counts.numel())

    def _fit(self) -> tuple[float, dict[str, tuple[float, float]]]:
        # a sample of a denser support (the level controller's light steps) cut to the configured
        # one can be shorter than the AE takes: that layer's configured support bypasses the AE
        configured = [smp for smp in self._samples_by_support()[0] if smp[4].shape[-1] >= MIN_AE_LEN]
        if not configured:
            return float("nan"), {}
        train, val = self._split_samples(configured)
        return autoencoder.fit(self.ae, self.options, train, val, self.innovation_k)

    def _innovation(self, v: Tensor, numel: int) -> tuple[Tensor, Tensor]:
        return autoencoder.innovation(v, self.innovation_k(numel))

    def ae_digest(self) -> int:
        """A 62-bit digest of the learned code: the AE's weights and the levels (compare it across
        ranks)."""
        tables = [self._levels[k] for k in sorted(self._levels)]
        tables += [self._levels_denser[k] for k in sorted(self._levels_denser)]
        return comm.digest(*self.ae.state_dict().values(), *tables)

    @property
    def ae_layers(self) -> dict[str, float]:
        """Layers that use the AE in stage 3, with their held-out relative error."""
        return dict(self._ae_layers)

    def ae_cost(self) -> dict[str, float]:
        """Parameter count and bytes of the learned code (the AE's weights, or the levels)."""
        if not self.uses_autoencoder:
            n = sum(v.numel() for v in [*self._levels.values(), *self._levels_denser.values()])
            return {"ae_params": float(n), "ae_param_bytes": float(4 * n)}
        n = sum(p.numel() for p in self.ae.parameters())
        return {"ae_params": float(n), "ae_param_bytes": float(4 * n)}

    # ----------------------------------------------------------------------------------------------
    # checkpointing: identical on every rank, but for the messages rank 0 keeps for the next refit
    def _learned_state_dict(self) -> dict[str, Any]:
        """The learned code, its summary, stage 2's samples and the run's tallies, on the CPU; and,
        on rank 0, which writes the checkpoint, its messages kept for the next refit of the levels
        (every other rank holds none)."""
        with self._samples_lock:
            refit_samples = [
                {"key": k, "step": s, "role": role, "denser": denser, "values": m.detach().cpu().clone()}
                for k, s, role, denser, m in _in_step_order(self._refit_samples)
            ]
            samples = [
                {"key": k, "step": s, "leader": _to_cpu(lead), "numel": n, "values": v.detach().cpu().clone()}
                for k, s, lead, n, v in _in_step_order(self._samples)
            ]
            for d in samples:
                counts = self._sample_channels.get((d["key"], d["step"]))
                if counts is not None:
                    d["channel_counts"] = counts.detach().cpu().clone()
        return {
            "ae": {k: v.detach().cpu().clone() for k, v in self.ae.state_dict().items()},
            "ae_trained": self.ae_trained,
            "ae_loss": self.ae_loss,
            "ae_recon_error": self.ae_recon_error,
            "ae_train_s": self.ae_train_s,
            "ae_layers": dict(self._ae_layers),
            "code": self.options.code,
            "levels": {k: v.detach().cpu().clone() for k, v in self._levels.items()},
            "levels_denser": {k: v.detach().cpu().clone() for k, v in self._levels_denser.items()},
            "samples": samples,
            "values_run": {name: list(t) for name, t in self._values_run.items()},
            "refits": self._refits,
            "refit_samples": refit_samples,
        }

    def _load_learned_state_dict(self, state: dict[str, Any]) -> None:
        """The inverse of :meth:`_learned_state_dict`; also reads what earlier versions wrote."""
        device = next(self.ae.parameters()).device
        self.ae.load_state_dict({k: v.to(device) for k, v in state["ae"].items()})
        self.ae.requires_grad_(False)
        self._ae_state = {
            "trained": bool(state["ae_trained"]),
            "loss": float(state["ae_loss"]),
            "recon_error": float(state["ae_recon_error"]),
            "train_s": float(state["ae_train_s"]),
        }
        self._ae_layers = {str(k): float(v) for k, v in state["ae_layers"].items()}
        saved_code = state.get("code", "autoencoder")  # checkpoints before the levels hold an AE only
        # a code that carries no layer sends what any other would: exact values on the support
        if self.ae_trained and saved_code != self.options.code and self._ae_layers:
            raise ValueError(
                f"this checkpoint's lgc learned code {saved_code!r} at its switch, and this run asks for "
                f"code={self.options.code!r}: resume with codec_options={{'code': {saved_code!r}}}, "
                "or restart before the switch"
            )
        self._levels = {str(k): _by_role(v).to(device) for k, v in state.get("levels", {}).items()}
        # before the denser support had levels of its own it used the configured support's
        self._levels_denser = {str(k): _by_role(v).to(device) for k, v in state.get("levels_denser", {}).items()}
        self._refits = int(state.get("refits", 0))
        for name, tally in state.get("values_run", {}).items():  # absent before it was counted
            self._values_run[str(name)] = [int(v) for v in tally]
        with self._samples_lock:
            self._samples = [
                (d["key"], int(d["step"]), _leader(d["leader"]), int(d["numel"]), d["values"]) for d in state["samples"]
            ]
            # absent before light_scale, and for samples that scale by message
            self._sample_channels = {
                (d["key"], int(d["step"])): d["channel_counts"] for d in state["samples"] if "channel_counts" in d
            }
            # rank 0's messages since the last refit, which only rank 0 fits on (absent before they
            # were saved: the next refit then fits on the steps since the resume)
            saved = state.get("refit_samples", []) if self.rank == 0 else []
            self._refit_samples = [
                (d["key"], int(d["step"]), int(d["role"]), bool(d["denser"]), d["values"].to(device)) for d in saved
            ]
            self._refit_staged = {}


def _in_step_order(samples: list) -> list:
    """``samples`` (tuples of a layer, a step and more) by step, then layer: within a step the
    layers come in DDP's bucket order, which differs on the first step after a resume, and the
    autoencoder's training takes its batches in the order of the samples."""
    return sorted(samples, key=lambda smp: (smp[1], smp[0]))


def _by_role(table: Tensor) -> Tensor:
    """A layer's levels as a ``(2, count)`` table, the leader's row and the others': a checkpoint
    written before the levels had a row per role holds one row, which served both."""
    return table.expand(2, -1).clone() if table.dim() == 1 else table


def _cut_union(values: Tensor, named: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """A union support's sample cut to what ``count`` names a rank would have given: each rank's
    ``count`` largest values among the positions it named, and their union."""
    picks = []
    for r in range(values.shape[0]):
        columns = named[r].to(values.device).nonzero().reshape(-1)
        picks.append(columns[values[r, columns].abs().topk(min(count, columns.numel()), sorted=False).indices])
    keep, named_kept = union_of(picks, values.shape[1])
    return values[:, keep], named_kept


def _to_cpu(lead: int | Tensor) -> int | Tensor:
    """A sample's leader for a checkpoint: a rank, or a union support's mask on the CPU."""
    return lead.detach().cpu().clone() if isinstance(lead, Tensor) else lead


def _leader(saved: Any) -> int | Tensor:
    """A checkpointed sample's leader: a rank, or a union support's mask of who named what."""
    return saved.bool() if isinstance(saved, Tensor) else int(saved)
