"""The DDP communication hook that runs any :class:`~lightning_gradcomp.codecs.base.Codec`.

One state object (:class:`CodecHookState`) and one hook function (:func:`codec_hook`), in the
manner of torch's ``powerSGD_hook``. For each bucket DDP hands over, the hook

1. counts optimizer steps (on the bucket with ``is_last()``; hooks do not run inside ``no_sync``,
   so micro-batches of gradient accumulation are not counted);
2. before compression starts (the codec's warm-up, and always the first two steps, during which
   DDP rebuilds its buckets; three with ``static_graph=True``) sends the bucket uncompressed and
   shows each aggregated layer gradient to the codec (:meth:`Codec.observe_dense`);
3. otherwise walks the bucket layer by layer: layers the codec does not compress (small ones) are
   averaged in fp32; each other layer is compensated with its residual, encoded, and its new
   residual staged; the payloads of all layers travel in **one** collective per bucket
   (all-reduce or all-gather, as the codec declares);
4. decodes once the collective has finished (in a ``.then`` callback that never waits on another
   collective), divides by the world size, and writes the result into the bucket.

With momentum correction (the codec's ``momentum`` option, DGC), every layer's gradient first
becomes this rank's velocity, ``u <- momentum * u + g`` (plus weight decay, Nesterov as
``torch.optim.SGD``), on every step and every path; the momentum buffers follow the residuals'
stage/commit rule, and sparsifying codecs zero them where they sent (momentum factor masking).

Every message carries a one-element flag that says whether any rank's bucket held a NaN or an
Inf, so all ranks detect a non-finite gradient together without an extra round trip. Such a
bucket is zeroed on every rank, its residuals are not updated, learned codec state does not see
it, and the state asks the strategy to skip the optimizer step (``nonfinite="skip"``, default),
to step with the zeroed gradient (``"zero"``) or to stop (``"raise"``).
"""

import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.codecs.base import Codec, CodecContext, EncodeResult
from lightning_gradcomp.comm import allgather_async, allreduce_async, pack, unpack, wire_bytes
from lightning_gradcomp.fallback import FallbackPolicy
from lightning_gradcomp.memory import ResidualMemory
from lightning_gradcomp.stats import StatsAccumulator
from lightning_gradcomp.timing import Span, clock_for

__all__ = ["CodecHookState", "codec_hook", "check_codec_consistency", "NONFINITE_POLICIES"]

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
        nonfinite: what to do when any rank's gradient holds a NaN or Inf, see the module docstring.
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
        "stats",
        "nonfinite_steps",
        "skip_requested",
        "_step_end_pending",
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
        self.fallback = FallbackPolicy(enabled=fallback)
        self.step = 0
        self.memory = ResidualMemory()
        self.momentum_buffers = ResidualMemory()  # per-rank momentum of momentum correction
        self.residual_lr: dict[str, float] = {}  # lr_scaled_feedback: the rate each residual is scaled to
        self.stats = StatsAccumulator()
        self.nonfinite_steps = 0
        self.skip_requested = False
        self._step_end_pending = False
        self._lock = threading.Lock()
        self._anon_keys: dict[int, str] = {}

    # the process group cannot be pickled (spawn, checkpoints): drop it, fall back to WORLD
    def __getstate__(self) -> dict[str, Any]:
        state = {s: getattr(self, s) for s in self.__slots__ if s not in ("process_group", "_lock")}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self.process_group = None
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def key_of(self, param: Tensor) -> str:
        name = self.param_names.get(id(param))
        if name is not None:
            return name
        return self._anon_keys.setdefault(id(param), f"param{len(self._anon_keys)}")

    def rescale_residuals(self, lr_by_key: dict[str, float]) -> None:
        """Learning-rate-scaled error feedback (the codec's ``lr_scaled_feedback``): before a step
        whose learning rate for parameter ``k`` is ``lr_by_key[k]``, multiply its residual by
        ``lr_then / lr_now``, where ``lr_then`` is the rate it was last scaled to, so that
        ``lr_now * residual`` stays the update the held-back gradients would have made at their own
        steps. A rate of 0 leaves the residual and its rate as they are (what that step sends is
        applied with rate 0, so it is lost: schedules reach 0 at most at their last step).
        Identical on every rank, as the rates are; a no-op when the codec does not ask for it.
        Call it before each backward (repeating it at an unchanged rate changes nothing)."""
        if not (self.codec.error_feedback and getattr(self.codec, "lr_scaled_feedback", False)):
            return
        for key, lr_now in lr_by_key.items():
            if not lr_now > 0:
                continue
            lr_then = self.residual_lr.get(key)
            if lr_then is not None and lr_then != lr_now:
                self.memory.scale(key, lr_then / lr_now)
            self.residual_lr[key] = float(lr_now)

    def compressing(self, step: int | None = None) -> bool:
        step = self.step if step is None else step
        return step >= self.first_compress_step and self.codec.is_compressing(step)

    def state_dict(self) -> dict[str, Any]:
        """State identical on every rank (the codec's and the step counter)."""
        return {
            "step": self.step,
            "nonfinite_steps": self.nonfinite_steps,
            "codec": self.codec.state_dict(),
            "fallback": self.fallback.state_dict(),
            # a checkpoint is written between steps, before the codec's step-end work of the last
            # step ran (it runs at the start of the next step): a resumed run must still run it
            "step_end_pending": self._step_end_pending,
            "residual_lr": dict(self.residual_lr),
            # schedules given as a fraction of the run keep the step boundaries of the run that
            # started them: a resume with a longer budget must not move lgc back into its warm-up
            "run_total_steps": self.codec.run_total_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
        self.codec.load_state_dict(state["codec"])
        self.fallback.load_state_dict(state.get("fallback", {}))
        self._step_end_pending = bool(state.get("step_end_pending", False))
        self.residual_lr = {str(k): float(v) for k, v in state.get("residual_lr", {}).items()}
        if state.get("run_total_steps") is not None:
            self.codec.fit_to_run(int(state["run_total_steps"]))

    def consume_skip(self) -> bool:
        """True once after a step whose gradient was non-finite on some rank."""
        with self._lock:
            skip, self.skip_requested = self.skip_requested, False
        return skip

    def _note_nonfinite(self, step: int) -> None:
        with self._lock:
            if not self.skip_requested:
                self.nonfinite_steps += 1
            self.skip_requested = True
        self.stats.add(nonfinite=True)

    # ----------------------------------------------------------------------------------------------
    def process_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buf = bucket.buffer()
        fallback = self.fallback
        fallback.use_device(buf.device)
        if self._step_end_pending:
            # the previous step's futures have all completed (DDP waited for them), so step-end
            # work (refitting a basis, training an autoencoder) may run collectives here safely
            self._step_end_pending = False
            timing = fallback.wants_timing()
            step_end_start = fallback.clock.mark() if timing else 0.0
            self.codec.on_step_end(self.step - 1)
            # a refit or an autoencoder's training is not what the fallback compares
            fallback.start_step(exclude_s=(step_end_start, fallback.clock.mark()) if timing else 0.0)
            fell_back = fallback.maybe_decide(self.process_group, _group_device(self.process_group))
            if fell_back is not None:
                self.stats.set_extra(fallback_buckets=len(fell_back))
        body_start = fallback.clock.mark() if fallback.wants_timing() else 0.0
        step = self.step
        world = self.world_size
        # one cheap pass: the sum is finite iff every element is (barring fp32 overflow of the sum);
        # it stays on the device and travels in the message, so no rank waits for it here
        flag = torch.isfinite(buf.sum(dtype=torch.float32)).logical_not().to(torch.float32).reshape(1)
        keys = [self.key_of(p) for p in bucket.parameters()]
        layers = list(zip(keys, bucket.gradients(), bucket.parameters()))
        bucket_key = f"{keys[0]}..{keys[-1]}[{len(keys)}]" if keys else "empty"
        compress = self.compressing(step) and not self.fallback.falls_back(bucket_key)
        if not compress:
            fut = self._dense(buf, layers, flag, world, step)
        elif self.codec.collective == "custom":
            fut = self.codec.communicate_bucket(self, bucket, layers, flag, step)
        else:
            fut = self._compressed(buf, layers, flag, world, step)
        if self.fallback.wants_timing():
            fut = self.fallback.track(fut, bucket_key, compress, body_start)
        if bucket.is_last():
            self.step += 1
            self._step_end_pending = True
        return fut

    # ----------------------------------------------------------------------------------------------
    def _velocity(self, key: str, g: Tensor, param: Tensor) -> Tensor:
        """Momentum correction: stage ``u <- m u + (g + wd w)`` and return what travels in place of
        the gradient, ``u`` (or ``g + wd w + m u`` with Nesterov), exactly as ``torch.optim.SGD``
        forms its update direction. ``g`` is flat fp32."""
        codec = self.codec
        d = g if not codec.weight_decay else g + codec.weight_decay * param.detach().reshape(-1).to(g.dtype)
        previous = self.momentum_buffers.residuals.get(key)
        u = d.clone() if previous is None else previous.mul(codec.momentum).add_(d)
        self.momentum_buffers.stage(key, u)
        return d.add(u, alpha=codec.momentum) if codec.nesterov else u.clone()

    def _dense(self, buf: Tensor, layers: list, flag: Tensor, world: int, step: int) -> torch.futures.Future:
        """Plain averaging all-reduce of the bucket, residuals flushed into it, codec observing."""
        codec, memory = self.codec, self.memory
        if codec.momentum:
            for k, g, p in layers:
                g.copy_(self._velocity(k, g.reshape(-1).to(torch.float32), p).view_as(g))
        all_keys = [k for k, _, _ in layers]
        flushed = [k for k, _, _ in layers if k in memory.residuals]
        if flushed:  # a residual left from earlier compressed steps travels now, nothing is lost
            for k, g, _ in layers:
                if k in memory.residuals:
                    g.copy_(memory.compensate(k, g.reshape(-1).float()).view_as(g))
        n = buf.numel()
        msg = torch.empty(n + 1, dtype=buf.dtype, device=buf.device)
        torch.div(buf.reshape(-1), world, out=msg[:n])
        msg[n:] = flag
        nbytes = msg.numel() * msg.element_size()
        self.stats.add(
            buckets=1,
            raw_bytes=buf.numel() * buf.element_size(),
            payload_bytes=nbytes,
            wire_bytes=wire_bytes("allreduce", nbytes, world),
            raw_wire_bytes=wire_bytes("allreduce", buf.numel() * buf.element_size(), world),
        )
        clock = clock_for(buf.device)
        launched = clock.mark()
        observe = [(k, g) for k, g, p in layers if codec.should_compress(k, p)]

        def finish(fut: torch.futures.Future) -> Tensor:
            t = self._received(fut, step)
            self.stats.add(comm_s=Span(clock, launched, clock.mark()))
            # the one host sync of the bucket: whether to keep it is decided on the host
            if float(t[n]) > 0:
                buf.zero_()
                memory.discard(flushed)
                self.momentum_buffers.discard(all_keys)
                self._note_nonfinite(step)
                return buf
            buf.copy_(t[:n].view_as(buf))
            self.momentum_buffers.commit(all_keys)
            if flushed:
                memory.drop(flushed)
            for k, g in observe:
                codec.observe_dense(k, g.reshape(-1), step)
            return buf

        return allreduce_async(msg, self.process_group).then(finish)

    # ----------------------------------------------------------------------------------------------
    def _compressed(self, buf: Tensor, layers: list, flag: Tensor, world: int, step: int) -> torch.futures.Future:
        codec, memory, stats = self.codec, self.memory, self.stats
        sample = step % self.stats_every == 0
        clock = clock_for(buf.device)
        t0 = clock.mark()
        dense_grads: list[Tensor] = []
        inputs: list[tuple[str, Tensor, Tensor, Tensor]] = []  # key, grad view, flat fp32 input, param
        for k, g, p in layers:
            x = g.reshape(-1).to(torch.float32)
            if codec.momentum:
                x = self._velocity(k, x, p)
            if codec.should_compress(k, p):
                if codec.error_feedback:
                    x = memory.compensate(k, x)
                inputs.append((k, g, x, p))
            else:
                if codec.momentum:
                    g.copy_(x.view_as(g))
                dense_grads.append(g)
        masking = codec.momentum and codec.momentum_masking and codec.sparse_local
        extra_bytes = codec.prepare_bucket([(k, x, p) for k, _, x, p in inputs], step) if inputs else 0
        encoded: list[EncodeResult] = []
        # error sums stay on the device (0-d tensors) until the statistics are read
        err_sq: Tensor | float = 0.0
        ref_sq: Tensor | float = 0.0
        for k, g, x, p in inputs:
            enc = codec.encode(x, k, p, step)
            encoded.append(enc)
            if codec.error_feedback or sample or masking:
                local = enc.local if enc.local is not None else codec.decode_local(enc, x.numel())
                if masking:  # the sent coordinates start their momentum afresh
                    self.momentum_buffers.mask_pending(k, local == 0)
                diff = x - local
                if codec.error_feedback:
                    memory.stage(k, diff)
                if sample:
                    sent_diff = diff if enc.sent is None else x - enc.sent
                    err_sq = err_sq + sent_diff.double().pow(2).sum()
                    ref_sq = ref_sq + x.double().pow(2).sum()
        if dense_grads:
            dense = torch.cat([g.reshape(-1) for g in dense_grads]).to(torch.float32).div_(world)
        else:
            dense = torch.zeros(0, dtype=torch.float32, device=buf.device)
        keys = [k for k, _, _, _ in inputs]
        all_keys = [k for k, _, _ in layers]
        if codec.collective == "allreduce":
            wire_dtype = getattr(codec, "wire_dtype", torch.float32)
            pieces = [t.reshape(-1).to(wire_dtype) for enc in encoded for t in enc.payload]
            msg = torch.cat(pieces + [dense.to(wire_dtype), flag.to(wire_dtype)])
            nbytes = msg.numel() * msg.element_size()
            fut = allreduce_async(msg, self.process_group)
        elif codec.collective == "allgather":
            msg, layout = pack([t for enc in encoded for t in enc.payload] + [dense, flag], buf.device)
            nbytes = layout.payload_bytes
            fut = allgather_async(msg, self.process_group)
        else:
            raise ValueError(f"codec {codec.name!r} declares unknown collective {codec.collective!r}")
        t1 = clock.mark()
        stats.add(
            buckets=1,
            compressed=True,
            raw_bytes=buf.numel() * buf.element_size(),
            payload_bytes=nbytes + extra_bytes,
            wire_bytes=wire_bytes(codec.collective, nbytes, world) + wire_bytes("broadcast", extra_bytes, world),
            raw_wire_bytes=wire_bytes("allreduce", buf.numel() * buf.element_size(), world),
            encode_s=Span(clock, t0, t1),
            err_sq=err_sq,
            ref_sq=ref_sq,
        )

        def write_dense(total: Tensor) -> None:
            off = 0
            for g in dense_grads:
                g.copy_(total[off : off + g.numel()].view_as(g))
                off += g.numel()

        def finish(fut: torch.futures.Future) -> Tensor:
            t2 = clock.mark()
            stats.add(comm_s=Span(clock, t1, t2))
            received = self._received(fut, step)
            if codec.collective == "allreduce":
                t = received
                # every rank received the same sum, so checking it decides identically everywhere:
                # this also catches an overflow of a narrow wire format (fp16 beyond 65504). The
                # bucket's one host sync: keeping or discarding it is decided on the host.
                if bool((t[-1] > 0).logical_or(torch.isfinite(t).all().logical_not())):
                    return self._discard(buf, keys, step, all_keys)
                off = 0
                for (k, g, x, p), enc in zip(inputs, encoded):
                    summed = []
                    for part in enc.payload:
                        summed.append(t[off : off + part.numel()].view(part.shape).to(part.dtype))
                        off += part.numel()
                    g.copy_(codec.decode(summed, enc.ctx, x.numel(), world).div_(world).view_as(g))
                write_dense(t[off : off + dense.numel()].float())
            else:
                rows = [unpack(r, layout) for r in received]
                # host sync 1 of 2: every rank's flag, before any decode sees a non-finite payload
                if bool(torch.stack([r[-1][0] for r in rows]).sum() > 0):
                    return self._discard(buf, keys, step, all_keys)
                off = 0
                for (k, g, x, p), enc in zip(inputs, encoded):
                    m = len(enc.payload)
                    total = codec.aggregate([r[off : off + m] for r in rows], enc.ctx, x.numel())
                    g.copy_(total.div_(world).view_as(g))
                    off += m
                if dense_grads:
                    write_dense(torch.stack([r[-2] for r in rows]).sum(0))
                # host sync 2 of 2: an overflow in decoding; decoded from identical rows, so the
                # verdict is the same everywhere
                if not bool(torch.isfinite(buf).all()):
                    return self._discard(buf, keys, step, all_keys)
            memory.commit(keys)
            self.momentum_buffers.commit(all_keys)
            stats.add(decode_s=Span(clock, t2, clock.mark()))
            return buf

        return fut.then(finish)

    def _received(self, fut: torch.futures.Future, step: int) -> Any:
        """The collective's result, or a clear error when it failed (a rank died or stalled)."""
        try:
            return fut.value()
        except Exception as err:
            raise RuntimeError(
                f"gradient communication failed at optimizer step {step} (codec {self.codec.name!r}): {err}. "
                "Another rank probably died or stalled; the wait is bounded by the process group's timeout "
                "(CompressedDDPStrategy(timeout=...), init_process_group(timeout=...))."
            ) from err

    def _discard(self, buf: Tensor, keys: list[str], step: int, momentum_keys: list[str] = ()) -> Tensor:
        buf.zero_()
        self.memory.discard(keys)
        self.momentum_buffers.discard(list(momentum_keys))
        self._note_nonfinite(step)
        return buf


def codec_hook(state: CodecHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that compresses ``bucket`` with ``state.codec``.

    Register it with ``ddp_model.register_comm_hook(state, codec_hook)``, or get both from
    :func:`lightning_gradcomp.make_comm_hook`. The returned future resolves to the bucket's averaged
    gradient (the sum over ranks divided by the world size), as DDP expects.
    """
    return state.process_bucket(bucket)


def check_codec_consistency(codec: Codec, process_group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if the ranks were started with different codec settings.

    A digest of the codec's name and options is all-gathered (8 bytes a rank) and compared.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(process_group) == 1:
        return
    device = _group_device(process_group)
    mine = torch.tensor([codec.config_hash()], dtype=torch.int64, device=device)
    allh = [torch.zeros_like(mine) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(allh, mine, group=process_group)
    digests = [int(h.item()) for h in allh]
    if len(set(digests)) > 1:
        groups: dict[int, list[int]] = {}
        for r, h in enumerate(digests):
            groups.setdefault(h, []).append(r)
        raise RuntimeError(
            "ranks were started with different gradient-compression settings: "
            + "; ".join(f"ranks {rs} share one setting" for rs in groups.values())
            + f". This rank ({dist.get_rank(process_group)}) has {codec!r}. Start every rank with the same codec"
            " name and options."
        )


def _group_device(process_group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(process_group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_context(process_group: dist.ProcessGroup | None, device: torch.device) -> CodecContext:
    if dist.is_available() and dist.is_initialized():
        return CodecContext(dist.get_rank(process_group), dist.get_world_size(process_group), device)
    return CodecContext(0, 1, device)
