"""The hook's state between calls, and the dispatch of one bucket to its path."""

import copy
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.codecs.base import BucketRouter, Codec, LearnedState, MultiRound, RoundContext
from lightning_gradcomp.fallback import FallbackPolicy
from lightning_gradcomp.hook import allgather, allreduce, custom, dense
from lightning_gradcomp.hook.consistency import check_codec_consistency, group_device, make_context
from lightning_gradcomp.hook.encode import encode_layers, holds_nonfinite
from lightning_gradcomp.memory import ResidualMemory
from lightning_gradcomp.stats import StatsAccumulator

__all__ = ["CodecHookState", "codec_hook", "NONFINITE_POLICIES", "in_parameter_order"]

NONFINITE_POLICIES = ("skip", "zero", "raise")


class CodecHookState:
    """Everything the hook remembers between calls.

    Args:
        codec: the codec to run.
        process_group: the group to communicate in (``None``: the default group).
        param_names: ``id(parameter) -> name``; names key the residuals and codec state so that
            they survive DDP's bucket rebuild and a checkpoint. Without it, parameters are keyed by
            their position in the first bucket that holds them (not checkpointable).
        static_graph: DDP's ``static_graph`` flag; it delays the bucket rebuild by one step.
        stats_every: sample the relative error every this many steps (it costs a local decode).
        nonfinite: what to do when any rank's gradient holds a NaN or Inf, see the package docstring.
        fallback: time each bucket plain and compressed for a few steps and send it plain for the
            rest of the run when compressing it costs more (see :mod:`lightning_gradcomp.fallback`).
    """

    __slots__ = (
        # configuration
        "codec",
        "process_group",
        "param_names",
        "first_compress_step",
        "stats_every",
        "nonfinite",
        "fallback",
        # internal state
        "step",
        "memory",
        "momentum_buffers",
        "residual_lr",
        "second_moments",
        "stats",
        "nonfinite_steps",
        "skip_requested",
        "_step_end_pending",
        "_step_discarded",
        "_lock",
        "_anon_keys",
    )

    def __init__(
        self,
        codec: Codec,
        process_group: dist.ProcessGroup | None = None,
        param_names: dict[int, str] | None = None,
        static_graph: bool = False,
        stats_every: int = 10,
        nonfinite: str = "skip",
        fallback: bool | None = None,
    ) -> None:
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {list(NONFINITE_POLICIES)}, got {nonfinite!r}")
        if int(stats_every) < 1:
            raise ValueError(f"stats_every must be >= 1, got {stats_every!r}")
        self.codec = codec
        self.process_group = process_group
        self.param_names = dict(param_names or {})
        # DDP rebuilds buckets after step 0 (after step 1 with static_graph): never compress before.
        self.first_compress_step = 3 if static_graph else 2
        self.stats_every = int(stats_every)
        self.nonfinite = nonfinite
        # a router chooses plain all-reduce itself, per bucket (codec "auto")
        self.fallback = FallbackPolicy(enabled=False if isinstance(codec, BucketRouter) else fallback)
        self.step = 0
        self.memory = ResidualMemory(revertible=self.reverts_skipped_steps)
        self.momentum_buffers = ResidualMemory(revertible=self.reverts_skipped_steps)  # momentum correction's
        self.residual_lr: dict[str, float] = {}  # lr_scaled_feedback: the rate each residual is scaled to
        self.second_moments: dict[str, Tensor] = {}  # precondition: the optimizer's exp_avg_sq by key
        self.stats = StatsAccumulator()
        self.nonfinite_steps = 0
        self.skip_requested = False
        self._step_end_pending = False
        self._step_discarded = False  # a bucket of this step was non-finite and the step is skipped
        self._lock = threading.Lock()
        self._anon_keys: dict[int, str] = {}

    @classmethod
    def for_model(
        cls,
        codec: Codec,
        module: "torch.nn.Module | None",
        *,
        process_group: "dist.ProcessGroup | None" = None,
        device: "torch.device | None" = None,
        total_steps: "int | None" = None,
        **options: Any,
    ) -> "CodecHookState":
        """Set ``codec`` up for ``module`` and return the hook's state: the one set-up path of the
        strategy and of :func:`~lightning_gradcomp.make_comm_hook`. Call it on every rank after
        ``init_process_group``.

        In order: the run's length (:meth:`Codec.fit_to_run`, ``total_steps``), the layer policy
        against the module's parameters (:meth:`Codec.plan_layers`), the ranks' agreement on the
        codec and its options (:func:`check_codec_consistency`), the codec's context in
        ``process_group`` on ``device`` (default: the device of the module's first parameter, else
        the CPU). The module's parameter names key the state. ``options``: the constructor's
        (``static_graph``, ``stats_every``, ``nonfinite``, ``fallback``)."""
        codec.fit_to_run(total_steps)
        names: dict[int, str] = {}
        if module is not None:
            check_dense_gradients(module)
            names = {id(p): n for n, p in module.named_parameters()}
            codec.plan_layers(module.named_parameters())
            first = next(module.parameters(), None)
            if device is None and first is not None:
                device = first.device
        check_codec_consistency(codec, process_group)
        codec.setup(make_context(process_group, device or torch.device("cpu")))
        return cls(codec, process_group=process_group, param_names=names, **options)

    def continue_from(self, previous: "CodecHookState") -> None:
        """A second ``fit()`` in the same process goes on where ``previous`` stopped: its step,
        the codec's step-end work of its last step (which runs as the next step starts), the
        fallback's decision, residuals, momentum, learning rates, non-finite count and whole-run
        statistics (what a checkpoint would carry)."""
        self.step = previous.step
        self._step_end_pending = previous._step_end_pending
        self.fallback.load_state_dict(previous.fallback.state_dict())
        self.memory = previous.memory
        self.momentum_buffers = previous.momentum_buffers
        self.residual_lr = previous.residual_lr
        self.nonfinite_steps = previous.nonfinite_steps
        self.stats.totals = previous.stats.totals

    # the process group cannot be pickled (spawn, checkpoints): drop it, fall back to WORLD
    def __getstate__(self) -> dict[str, Any]:
        # the second moments are the optimizer's tensors, set again before each backward
        return {s: getattr(self, s) for s in self.__slots__ if s not in ("process_group", "_lock", "second_moments")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self.process_group = None
        self.second_moments = {}
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def deflating(self, msg: Tensor) -> bool:
        """Whether ``msg`` travels compressed without loss (the ``deflate`` harness option): on
        the CPU, with another rank to send it to."""
        return self.codec.harness.deflate and msg.device.type == "cpu" and self.world_size > 1

    def key_of(self, param: Tensor) -> str:
        name = self.param_names.get(id(param))
        if name is not None:
            return name
        return self._anon_keys.setdefault(id(param), f"param{len(self._anon_keys)}")

    def rescale_residuals(self, lr_by_key: dict[str, float]) -> None:
        """Learning-rate-scaled error feedback (the ``lr_scaled_feedback`` harness option): before a
        step whose learning rate for parameter ``k`` is ``lr_by_key[k]``, multiply its residual by
        ``lr_then / lr_now``, where ``lr_then`` is the rate it was last scaled to, so that
        ``lr_now * residual`` stays the update the held-back gradients would have made at their own
        steps. A rate of 0 leaves the residual and its rate as they are (what that step sends is
        applied with rate 0, so it is lost: schedules reach 0 at most at their last step).
        Identical on every rank, as the rates are; a no-op when the codec does not ask for it.
        Call it before each backward (repeating it at an unchanged rate changes nothing)."""
        if not self.codec.harness.lr_scaled_feedback:
            return
        for key, lr_now in lr_by_key.items():
            if not lr_now > 0:
                continue
            lr_then = self.residual_lr.get(key)
            if lr_then is not None and lr_then != lr_now:
                self.memory.scale(key, lr_then / lr_now)
            self.residual_lr[key] = float(lr_now)

    def set_second_moments(self, by_key: dict[str, Tensor]) -> None:
        """The ``precondition`` harness option: the optimizer's per-coordinate second moment
        (``exp_avg_sq``) of each named parameter, read before each backward. The tensors are kept
        by reference (the optimizer updates them in place after the hook has run). A no-op when
        the codec does not ask for it."""
        if self.codec.harness.precondition:
            self.second_moments = dict(by_key)

    def preconditioner(self, key: str) -> Tensor | None:
        """``d = max(sqrt(v), 0.01 * mean(sqrt(v)), 1e-8)`` of parameter ``key``, flat fp32, or
        ``None`` without a second moment: the codec compresses ``x / d`` and its aggregate is
        multiplied by ``d``. The floors keep a coordinate whose moment is still zero (never
        stepped) from dividing by zero (1e-8 is Adam's own ``eps``); ``v`` is the same on every
        rank (it comes from the all-reduced gradients), so ``d`` is too. No host sync."""
        v = self.second_moments.get(key)  # empty unless the codec asks (set_second_moments)
        if v is None:
            return None
        d = v.detach().reshape(-1).to(torch.float32).sqrt()
        return torch.maximum(d, (d.mean() * 0.01).clamp_min(1e-8))

    def compressing(self, step: int | None = None) -> bool:
        step = self.step if step is None else step
        return step >= self.first_compress_step and self.codec.is_compressing(step)

    def codec_scalars(self) -> dict[str, float]:
        """What a :class:`LearnedState` codec reports of the last optimizer step
        (:meth:`LearnedState.scalars`), as floats; empty before the first step and for other codecs."""
        if self.step == 0 or not isinstance(self.codec, LearnedState):
            return {}
        step = self.step - 1  # the optimizer step that just communicated
        return {str(k): float(v) for k, v in self.codec.scalars(step, self.compressing(step)).items()}

    # ----------------------------------------------------------------------------------------------
    # checkpoints and snapshots
    def state_dict(self) -> dict[str, Any]:
        """State identical on every rank (the codec's and the step counter)."""
        codec = self.codec
        return {
            "step": self.step,
            "nonfinite_steps": self.nonfinite_steps,
            "codec": codec.state_dict() if isinstance(codec, LearnedState) else {},
            "fallback": self.fallback.state_dict(),
            # a checkpoint is written between steps, before the codec's step-end work of the last
            # step ran (it runs at the start of the next step): a resumed run must still run it
            "step_end_pending": self._step_end_pending,
            "residual_lr": dict(self.residual_lr),
            # schedules given as a fraction of the run keep the step boundaries of the run that
            # started them: a resume with a longer budget must not move lgc back into its warm-up
            "run_total_steps": codec.run_total_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
        _load_codec_state(self.codec, state["codec"])
        self.fallback.load_state_dict(state.get("fallback", {}))
        self._step_end_pending = bool(state.get("step_end_pending", False))
        self.residual_lr = {str(k): float(v) for k, v in state.get("residual_lr", {}).items()}
        if state.get("run_total_steps") is not None:
            self.codec.fit_to_run(int(state["run_total_steps"]))

    def rank_state_dict(self, stats: bool = True) -> dict[str, Tensor]:
        """This rank's own tensors, flat and named, as CPU copies: ``residual.*``, ``momentum.*``,
        ``codec.*`` (a codec's per-rank state) and, with ``stats``, ``stats.totals``."""
        codec = self.codec
        local = {f"residual.{k}": v for k, v in self.memory.state_dict().items()}
        local.update({f"momentum.{k}": v for k, v in self.momentum_buffers.state_dict().items()})
        if isinstance(codec, LearnedState):
            local.update({f"codec.{k}": v for k, v in codec.rank_state_dict().items()})
        if stats:
            local["stats.totals"] = self.stats.totals_tensor()
        return local

    def load_rank_state_dict(self, state: dict[str, Tensor], device: torch.device) -> None:
        def part(prefix: str) -> dict[str, Tensor]:
            return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}

        self.memory.load_state_dict(part("residual."), device=device)
        self.momentum_buffers.load_state_dict(part("momentum."), device=device)
        _load_codec_state(self.codec, part("codec."), rank=True)
        if "stats.totals" in state:  # absent from checkpoints written before the totals were kept
            self.stats.load_totals_tensor(state["stats.totals"])

    def snapshot(self) -> dict[str, Any]:
        """A copy of what training changes here (codec state, residuals, momentum, rates), on the
        CPU, for :meth:`restore`; the step counter and statistics are not part of it."""
        codec = self.codec
        return {
            "codec": copy.deepcopy(codec.state_dict()) if isinstance(codec, LearnedState) else {},
            "rank": self.rank_state_dict(stats=False),
            "residual_lr": dict(self.residual_lr),
        }

    def restore(self, snapshot: dict[str, Any], device: torch.device) -> None:
        _load_codec_state(self.codec, copy.deepcopy(snapshot["codec"]))
        self.load_rank_state_dict({k: v.clone() for k, v in snapshot["rank"].items()}, device)
        self.residual_lr = dict(snapshot["residual_lr"])

    # ----------------------------------------------------------------------------------------------
    # what the paths call back
    def consume_skip(self) -> bool:
        """True once after a step whose gradient was non-finite on some rank."""
        with self._lock:
            skip, self.skip_requested = self.skip_requested, False
        # called after backward, when every bucket has settled: the residuals a kept step replaced
        # are let go now rather than at the next step's first bucket (after its forward)
        self._end_step(self._step_discarded)
        return skip

    @property
    def reverts_skipped_steps(self) -> bool:
        """``nonfinite="skip"``: a step skipped as a whole takes back what its finite buckets
        committed, in the residuals and in the codec's own state."""
        return self.nonfinite == "skip"

    def _end_step(self, discarded: bool) -> None:
        self.memory.end_step()
        self.momentum_buffers.end_step()
        if isinstance(self.codec, (MultiRound, BucketRouter)):  # its own memory (PowerSGD's, bases)
            self.codec.end_step(discarded)

    def note_nonfinite(self) -> None:
        with self._lock:
            if not self.skip_requested:
                self.nonfinite_steps += 1
            self.skip_requested = True
        self.stats.add(nonfinite=True)

    def settle(
        self, buf: Tensor, keep: bool, keys: list[str] = (), momentum_keys: list[str] = (), flushed: bool = False
    ) -> Tensor:
        """The end of a bucket, on every path; returns ``buf``.

        Kept: the residuals staged for ``keys`` and the momentum staged for ``momentum_keys`` are
        committed; with ``flushed`` (the plain path) ``keys`` are residuals that travelled in the
        bucket, and are dropped. Not kept (a non-finite value on some rank): the bucket is zeroed,
        what it staged is dropped (the residuals stay as they were) and the step is to be skipped.
        With ``nonfinite="skip"`` no bucket of that step reaches the optimizer, so what its other
        buckets committed is taken back as well, and those still to come commit nothing: every
        residual is what it was before the step. (With ``"zero"`` the finite buckets are applied
        and keep what they committed.)
        """
        if not keep:
            buf.zero_()
            with self._lock:
                if self.reverts_skipped_steps:
                    self._step_discarded = True
                    self.memory.revert_step()
                    self.momentum_buffers.revert_step()
                else:
                    self.memory.discard(list(keys))
                    self.momentum_buffers.discard(list(momentum_keys))
            self.note_nonfinite()
            return buf
        with self._lock:  # against a non-finite bucket of the same step settling on another thread
            if self._step_discarded:
                self.memory.discard(list(keys))
                self.momentum_buffers.discard(list(momentum_keys))
                return buf
            if flushed:
                self.memory.drop(list(keys))
            else:
                self.memory.commit(list(keys))
            self.momentum_buffers.commit(list(momentum_keys))
        return buf

    def received(self, fut: torch.futures.Future, step: int) -> Any:
        """The collective's result, or a clear error when it failed (a rank died or stalled)."""
        try:
            return fut.value()
        except Exception as err:
            raise RuntimeError(
                f"gradient communication failed at optimizer step {step} (codec {self.codec.name!r}): {err}. "
                "Another rank probably died or stalled; the wait is bounded by the process group's timeout "
                "(CompressedDDPStrategy(timeout=...), init_process_group(timeout=...))."
            ) from err

    def round_context(self, step: int, keys: list[str] = (), momentum_keys: list[str] = ()) -> RoundContext:
        """The narrow view a :class:`MultiRound` codec gets of this state for one bucket."""
        assert self.codec.context is not None, "the codec's setup() was not called"
        return RoundContext(
            step=step,
            comm=self.codec.context,
            sample=step % self.stats_every == 0,
            record=self.stats.add,
            discard=lambda buf: self.settle(buf, False, keys, momentum_keys),
            revertible=self.reverts_skipped_steps,
        )

    # ----------------------------------------------------------------------------------------------
    def process_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buf = bucket.buffer()
        params = bucket.parameters()
        keys = [self.key_of(p) for p in params]
        if buf.is_sparse:  # from a module check_dense_gradients does not know: every rank gets one alike
            raise RuntimeError(
                f"the gradient of {keys} reached the hook as a sparse tensor: the gradient codecs, "
                f"{self.codec.name!r} included, work on dense gradients; make that gradient dense"
            )
        fallback = self.fallback
        fallback.use_device(buf.device)
        if self._step_end_pending:
            self._run_step_end()
        body_start = fallback.clock.mark() if fallback.wants_timing() else 0.0
        step = self.step
        # it stays on the device and travels in the message, so no rank waits for it here
        flag = holds_nonfinite(buf).to(torch.float32).reshape(1)
        layers = list(zip(keys, map(in_parameter_order, bucket.gradients(), params), params))
        bucket_key = f"{keys[0]}..{keys[-1]}[{len(keys)}]" if keys else "empty"
        compress = self.compressing(step) and not fallback.falls_back(bucket_key)
        collective = self.codec.collective_at(step)
        if isinstance(self.codec, BucketRouter):
            fut = self.codec.send_bucket(self, bucket, layers, flag, step, bucket_key, compress)
        elif not compress:
            fut = dense.send(self, buf, layers, flag, step)
        elif collective == "custom":
            fut = custom.send(self, bucket, layers, flag, step)
        elif collective == "allreduce":
            fut = allreduce.send(self, buf, encode_layers(self, buf, layers, step), flag, step)
        elif collective == "allgather":
            fut = allgather.send(self, buf, encode_layers(self, buf, layers, step), flag, step)
        else:
            raise ValueError(f"codec {self.codec.name!r} declares unknown collective {collective!r}")
        if fallback.wants_timing():
            fut = fallback.track(fut, bucket_key, compress, body_start)
        if bucket.is_last():
            self.step += 1
            self._step_end_pending = True
        return fut

    def _run_step_end(self) -> None:
        # the previous step's futures have all completed (DDP waited for them), so step-end
        # work (refitting a basis, training an autoencoder) may run collectives here safely
        self._step_end_pending = False
        # the previous step's buckets have all settled: what they committed stays, unless the
        # step was discarded (consume_skip() has usually settled it already; again is harmless)
        discarded, self._step_discarded = self._step_discarded, False
        self._end_step(discarded)
        fallback = self.fallback
        timing = fallback.wants_timing()
        step_end_start = fallback.clock.mark() if timing else 0.0
        if isinstance(self.codec, LearnedState):
            self.codec.on_step_end(self.step - 1)
        # a refit or an autoencoder's training is not what the fallback compares
        fallback.start_step(exclude_s=(step_end_start, fallback.clock.mark()) if timing else 0.0)
        fell_back = fallback.maybe_decide(self.process_group, group_device(self.process_group))
        if fell_back is not None:
            self.stats.set_extra(fallback_buckets=len(fell_back))


def in_parameter_order(grad: Tensor, param: Tensor) -> Tensor:
    """``grad``, one slice of a DDP bucket, viewed so that entry ``i`` of ``reshape(-1)`` is entry
    ``i`` of ``param``.

    DDP writes a dense parameter's gradient into its bucket in the parameter's memory order (for a
    ``channels_last`` weight: output channel, row, column, input channel), but
    ``GradBucket.gradients()`` views every slice as C-contiguous in the parameter's shape. Read
    through that view, a ``channels_last`` weight's values would be permuted against the weight
    itself and the optimizer's state of it, which ``iwp``'s importance, momentum correction's
    weight decay and ``precondition`` read. Viewed with the parameter's strides, as DDP's own
    bucket views are, they are not. A parameter that is not dense (DDP then lays it out
    C-contiguous too) and a contiguous one keep the view they have.
    """
    return grad.as_strided(param.shape, param.stride()) if read_in_bucket_order(param) else grad


def check_dense_gradients(module: torch.nn.Module) -> None:
    """Refuse a module whose embeddings give sparse gradients (``nn.Embedding`` or
    ``nn.EmbeddingBag`` with ``sparse=True``) before the first step, naming them: DDP hands such a
    gradient to the hook as a sparse tensor of its own bucket, which no codec here reads. Raised
    on every rank alike, before any collective."""
    sparse = [
        name
        for name, m in module.named_modules()
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad
    ]
    if sparse:
        raise ValueError(
            f"the gradient codecs work on dense gradients, and module(s) {', '.join(map(repr, sparse))} of this "
            "model are embeddings with sparse=True, whose gradients are sparse: build them with sparse=False "
            "(their gradients are then compressed like any other layer's)"
        )


def read_in_bucket_order(param: Tensor) -> bool:
    """Whether ``param``'s slice of a bucket is in another order than ``GradBucket.gradients()``
    views it (a dense parameter that is not C-contiguous, such as a ``channels_last`` weight):
    the hook reads it with the parameter's strides (:func:`in_parameter_order`), and read it
    permuted before it did."""
    return not param.is_contiguous() and _dense(param)


def from_bucket_order(flat: Tensor, param: Tensor) -> Tensor:
    """A flat tensor of one entry per entry of ``param`` in the order of ``param``'s memory (as a
    checkpoint written before :func:`in_parameter_order` holds residuals and momentum), put in
    the order of ``param`` itself."""
    laid_out = torch.empty_strided(param.shape, param.stride(), dtype=flat.dtype, device=flat.device)
    laid_out.as_strided((flat.numel(),), (1,)).copy_(flat)
    return laid_out.reshape(-1)


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill its memory exactly once, in some order of its dimensions
    (DDP's ``is_non_overlapping_and_dense``): strides that, sorted, are the running product of
    their sizes."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


# no "from __future__ import annotations" in this module: DDP checks the hook's annotations at run time
def codec_hook(state: CodecHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that compresses ``bucket`` with ``state.codec``.

    Register it with ``ddp_model.register_comm_hook(state, codec_hook)``, or get both from
    :func:`lightning_gradcomp.make_comm_hook`. The returned future resolves to the bucket's averaged
    gradient (the sum over ranks divided by the world size), as DDP expects.
    """
    return state.process_bucket(bucket)


def _load_codec_state(codec: Codec, state: dict[str, Any], rank: bool = False) -> None:
    if isinstance(codec, LearnedState):
        (codec.load_rank_state_dict if rank else codec.load_state_dict)(state)
    elif state:
        kind = "per-rank state" if rank else "state"
        raise ValueError(f"codec {codec.name!r} keeps no {kind} but was given {sorted(state)}")
