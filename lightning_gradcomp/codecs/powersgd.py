"""``powersgd``: PyTorch's own PowerSGD hook and state (Vogels et al., 2019), run by our harness.

This is not a re-implementation: every bucket goes through
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook`` with a
``PowerSGDState``. What the wrapper adds is what every codec of the package gets: the non-finite
check, statistics, checkpointing of the state, and safety on gloo.

Collective: custom. PowerSGD runs three dependent all-reduces per bucket (the uncompressed small
tensors, then P, then Q); torch's hook starts the later ones *inside* ``.then`` callbacks and waits
on them there. With gloo those callbacks run on the process group's worker threads, and two
buckets doing so at once can block every thread (seen as a deadlock with a two-bucket MLP). And a
worker thread can round a matrix product differently from the thread that called the hook
(``lightning_gradcomp.comm``, "Decoding in a callback"): whether the decompression ran there or
inline depended on timing, and two ranks ended one rounding step apart in about a third of loaded
two-rank runs. On gloo the wrapper therefore hands torch's hook all-reduces that finish before
they return (:class:`_BlockingCollectives`), so the whole chain, orthogonalization and
decompression included, runs in the hook body on the calling thread, identically on every rank;
this gives up overlap of PowerSGD's communication with the rest of backward. With NCCL the chain
is returned as is (its arithmetic runs on the GPU, whichever thread launches it).

The non-finite flag needs its own tiny all-reduce here (one extra round trip per bucket), because
torch's hook would otherwise fold a NaN into its error-feedback memory before anyone could know.
A step skipped for another bucket's NaN (``nonfinite="skip"``) leaves torch's state as it was
before the step: the buckets that went through torch's hook first keep what it replaced (the old
error tensor, copies of P and Q, the iteration and the generator of fresh Qs) until the step ends,
and :meth:`PowerSGDCodec.end_step` puts them back.

The rank is adjustable (:class:`~lightning_gradcomp.codecs.base.AdjustableLevel`): at level ``L``
it is ``round((4 r)^(1-L) * r^L)`` for the configured rank ``r``, so level 1 is ``r`` and level 0
``4 r`` (Accordion switched PowerSGD between ranks 1 and 2 or 1 and 4). torch sizes P and Q by the
rank and reuses them between steps (warm start), so a new rank drops them on every rank alike; the
next step draws fresh Q from the state's seeded generator, which all ranks advance together, as
torch does on its first compressed step. The error-feedback memory does not depend on the rank and
is kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from lightning_gradcomp.codecs.base import (
    AdjustableLevel,
    Codec,
    CodecContext,
    CodecOptions,
    HarnessOptions,
    MultiRound,
    RoundContext,
    check_bool,
    check_positive_float,
    check_positive_int,
    check_seed,
    geometric_level,
)
from lightning_gradcomp.comm import completed_future
from lightning_gradcomp.memory import StepUndo
from lightning_gradcomp.registry import register_codec
from lightning_gradcomp.timing import Span, clock_for

#: the rank at compression level 0, as a multiple of the configured one
LIGHT_RANK_FACTOR = 4


class _FinishedWork:
    """A collective that has already completed: what :class:`_BlockingCollectives` returns."""

    def __init__(self, tensor: Tensor) -> None:
        self._future = completed_future([tensor])

    def get_future(self) -> torch.futures.Future:
        return self._future

    def wait(self, timeout: Any = None) -> bool:
        return True


class _BlockingCollectives:
    """``torch.distributed`` as torch's PowerSGD hook sees it on gloo: ``all_reduce`` runs to
    completion before it returns, so every ``.then`` callback the hook chains runs inline, on the
    thread that called the hook, and no callback ever waits on a collective. Everything else is
    ``torch.distributed`` itself."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def all_reduce(tensor: Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        dist.all_reduce(tensor, op=op, group=group)
        return _FinishedWork(tensor)


def _generator_state(rng: Any) -> dict[str, Any]:
    """torch's generator of fresh Qs (a NumPy ``RandomState``) as tensors and numbers, which a
    checkpoint loaded with ``weights_only=True`` takes: the next fresh Q after a resume (a new
    rank, or every step without warm start) is the one the uninterrupted run draws."""
    kind, keys, pos, has_gauss, gauss = rng.get_state()
    return {
        "kind": kind,
        "keys": torch.from_numpy(keys.astype("int64")),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }


def _set_generator_state(rng: Any, state: dict[str, Any]) -> None:
    keys = state["keys"].numpy().astype("uint32")
    rng.set_state((state["kind"], keys, state["pos"], state["has_gauss"], state["gauss"]))


@contextlib.contextmanager
def _blocking_collectives() -> Iterator[None]:
    """Run torch's PowerSGD hook with :class:`_BlockingCollectives` (the hook reads the module's
    ``dist`` at call time; DDP calls the comm hook of one model from one thread at a time)."""
    module_dist = torch_powersgd.dist
    torch_powersgd.dist = _BlockingCollectives()
    try:
        yield
    finally:
        torch_powersgd.dist = module_dist


@dataclass(frozen=True)
class PowerSGDOptions(CodecOptions):
    rank: int = 4
    min_compression_rate: float = 2.0
    warm_start: bool = True
    use_error_feedback: bool = True
    seed: int = 0

    def check(self) -> None:
        check_positive_int("rank", self.rank)
        rate = check_positive_float("min_compression_rate", self.min_compression_rate, allow_inf=True)
        self._set("min_compression_rate", rate)
        self._set("warm_start", check_bool("warm_start", self.warm_start))
        self._set("use_error_feedback", check_bool("use_error_feedback", self.use_error_feedback))
        self._set("seed", check_seed("seed", self.seed))


@register_codec("powersgd")
class PowerSGDCodec(AdjustableLevel, MultiRound, Codec):
    """PowerSGD through ``torch``'s hook.

    Args:
        rank: ``matrix_approximation_rank`` (default 4, as in our benchmarks' reference run) at
            compression level 1; ``4 * rank`` at level 0.
        min_compression_rate: torch's per-tensor threshold (default 2, torch's).
        warm_start: reuse P and Q from the previous step (torch's default, True).
        use_error_feedback: torch's error feedback (default True).
        seed: ``random_seed`` of the shared Q initialization.
        start_step: steps of plain all-reduce first (default 2, the earliest DDP allows).
    """

    collective = "custom"
    Options = PowerSGDOptions
    # torch's hook picks the matrices it compresses by its own rule (min_compression_rate)
    harness_defaults = {"min_numel": 0, "dense_layers": "none"}
    # torch keys P, Q and the error by bucket index, and a new DDP wrapper (a resumed run) hands
    # over its first buckets in declaration order before rebuilding them in gradient-ready order:
    # the strategy then sends plain all-reduce until the rebuilt layout, which the state fits, is back
    bucket_keyed_state = True

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._torch_state: torch_powersgd.PowerSGDState | None = None
        self._pending_state: dict[str, Any] | None = None
        self._pending_rank_state: dict[str, Tensor] | None = None
        # nonfinite="skip": what torch's hook replaced during this step, per bucket, for end_step
        self._before_step = StepUndo()

    def check_harness(self, harness: HarnessOptions) -> None:
        if harness.error_feedback:
            raise ValueError("powersgd keeps torch's own error feedback: use use_error_feedback, not error_feedback")
        if harness.dense_layers != ("none",):
            raise ValueError("this codec chooses its compressed layers itself: dense_layers must be 'none'")
        if harness.momentum:
            raise ValueError(
                "this codec keeps its own state per bucket and cannot take momentum correction (momentum must be 0)"
            )
        if harness.precondition:
            raise ValueError("powersgd runs torch's own exchange and cannot precondition (precondition must be False)")

    def setup(self, context: CodecContext) -> None:
        super().setup(context)
        o = self.options
        self._torch_state = torch_powersgd.PowerSGDState(
            process_group=context.group,
            matrix_approximation_rank=self.rank_in_use,
            start_powerSGD_iter=2,
            min_compression_rate=o.min_compression_rate,
            use_error_feedback=o.use_error_feedback,
            warm_start=o.warm_start,
            random_seed=o.seed,
            compression_stats_logging_frequency=2**62,
        )
        # our harness already ran the plain all-reduce steps: let torch's hook compress at once
        self._torch_state.iter = self._torch_state.start_powerSGD_iter
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)
        if self._pending_rank_state is not None:
            self.load_rank_state_dict(self._pending_rank_state)

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_torch_state"] = None  # rebuilt in setup(); holds a process group
        return d

    @property
    def rank_in_use(self) -> int:
        """``matrix_approximation_rank`` at the compression level in use: ``round((4r)^(1-L) r^L)``."""
        r = self.options.rank
        return round(geometric_level(LIGHT_RANK_FACTOR * r, r, self.compression_level))

    def on_level_change(self) -> None:
        s = self._torch_state
        if s is None or s.matrix_approximation_rank == self.rank_in_use:
            return
        s.matrix_approximation_rank = self.rank_in_use
        # P and Q were sized for the old rank: torch reallocates them, and draws Q afresh from its
        # seeded generator, for a bucket it holds none of (identically on every rank)
        s.p_memory_dict.clear()
        s.q_memory_dict.clear()

    def compresses_parameter(self, key: str, param: Tensor) -> bool:
        """Whether torch's hook compresses ``param`` at the configured rank (the heavy level; a
        lighter one has a larger rank and compresses no more): a matrix, seen as ``(shape[0], -1)``,
        whose rank-r factors are ``min_compression_rate`` times smaller than it."""
        if param.dim() <= 1 or key in self.dense_keys:
            return False
        rows = param.shape[0]
        cols = param.numel() // max(rows, 1)
        rank = min(rows, cols, self.options.rank)
        return torch_powersgd._should_compress(rows, cols, rank, self.options.min_compression_rate)[0]

    def nothing_compressed_hint(self, largest: int) -> str:
        return (
            f"torch's PowerSGD compresses a weight only when its rank-{self.options.rank} factors are "
            f"min_compression_rate={self.options.min_compression_rate} times smaller than it, and none is, so every "
            "gradient is averaged whole. A smaller rank or min_compression_rate (e.g. codec_options="
            "{'min_compression_rate': 1}) compresses more of them"
        )

    def payload_elements(self, bucket: Any) -> int:
        """Elements PowerSGD sends for ``bucket``, by torch's own per-tensor rule."""
        total = 0
        for t in bucket.gradients():
            rows = t.shape[0] if t.dim() > 1 else 1
            cols = t.numel() // max(rows, 1)
            r = min(rows, cols, self.rank_in_use)
            if t.dim() > 1:
                ok, _, compressed = torch_powersgd._should_compress(rows, cols, r, self.options.min_compression_rate)
            else:
                ok, compressed = False, 0
            total += compressed if ok else t.numel()
        return total

    def communicate_bucket(self, bucket: Any, layers: list, flag: Tensor, rc: RoundContext) -> Any:
        assert self._torch_state is not None, "PowerSGDCodec.setup() was not called"
        buf = bucket.buffer()
        clock = clock_for(buf.device)
        t0 = clock.mark()
        flag_t = rc.comm.all_reduce(flag.to(device=buf.device, dtype=torch.float32).reshape(1).clone())
        # the bucket's one host sync: torch's hook must not even start on a non-finite bucket
        if float(flag_t) > 0:
            return completed_future(rc.discard(buf))
        feedback = self.options.use_error_feedback
        ref_sq = 0.0
        if rc.sample:  # torch's hook sends buf + its old error: that is the input to compare against
            old = self._torch_state.error_dict.get(bucket.index()) if feedback else None
            ref = buf.double() if old is None or old.shape != buf.shape else buf.double() + old.double()
            ref_sq = ref.pow(2).sum()  # read with the statistics, not here
        if rc.revertible:
            self._keep_for_revert(bucket.index())
        if dist.get_backend(rc.comm.group) == "gloo":  # see the module docstring
            with _blocking_collectives():
                fut = torch_powersgd.powerSGD_hook(self._torch_state, bucket)
        else:
            fut = torch_powersgd.powerSGD_hook(self._torch_state, bucket)
        nbytes = self.payload_elements(bucket) * 4
        rc.record_bucket(buf, "allreduce", nbytes + 4, comm_s=Span(clock, t0, clock.mark()))

        def finish(f: torch.futures.Future) -> Tensor:
            out = f.value()
            if rc.sample and feedback:
                err = self._torch_state.error_dict.get(bucket.index())
                if err is not None:
                    rc.record(err_sq=err.double().pow(2).sum(), ref_sq=ref_sq)
            return out

        return fut.then(finish)

    def _keep_for_revert(self, index: int) -> None:
        """Keep what torch's hook is about to change for bucket ``index``: it assigns a new error
        tensor (the old one is kept as it is) and writes P and Q in place (they are copied)."""
        s, undo = self._torch_state, self._before_step
        undo.keep_start(lambda: (s.iter, s.rng.get_state()))

        def read() -> tuple[Tensor | None, ...]:
            p, q = s.p_memory_dict.get(index), s.q_memory_dict.get(index)
            return s.error_dict.get(index), None if p is None else p.clone(), None if q is None else q.clone()

        undo.keep(index, read)

    def end_step(self, discarded: bool) -> list[int]:
        """A discarded step puts back the error, P and Q of every bucket torch's hook compressed in
        it, and the iteration and generator: the next step runs as if this one had not been.
        Returns the indices of the buckets put back."""
        s, undo = self._torch_state, self._before_step
        restored: list[int] = []
        if discarded and undo:
            s.iter, rng_state = undo.started_from
            s.rng.set_state(rng_state)
            restored = undo.restore(s.error_dict, s.p_memory_dict, s.q_memory_dict)
        undo.clear()
        return restored

    def pop_error(self, bucket_index: int) -> Tensor | None:
        """Take this rank's error-feedback memory of a bucket out of torch's state (flat, in the
        bucket's layout: what the last step did not send), or ``None`` if it holds none."""
        return None if self._torch_state is None else self._torch_state.error_dict.pop(bucket_index, None)

    # torch keeps P, Q (identical on all ranks after their all-reduce) and the error per rank,
    # all keyed by bucket index, which is stable once DDP has rebuilt its buckets
    def state_dict(self) -> dict[str, Any]:
        s = self._torch_state
        if s is None:
            return self.level_state()
        return {
            **self.level_state(),
            "iter": int(s.iter),
            "q": {int(k): v.detach().cpu().clone() for k, v in s.q_memory_dict.items()},
            "rng": _generator_state(s.rng),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # the level first: a new rank clears P and Q, which the saved Q (of that rank) then refills
        state = self.load_level_state(state)
        if not state:
            return
        if self._torch_state is None:
            self._pending_state = state
            return
        self._torch_state.iter = int(state["iter"])
        device = torch.device("cpu") if self.context is None else self.context.device
        self._torch_state.q_memory_dict = {int(k): v.to(device) for k, v in state["q"].items()}
        if "rng" in state:  # a checkpoint of an earlier version starts the generator from its seed
            _set_generator_state(self._torch_state.rng, state["rng"])

    def rank_state_dict(self) -> dict[str, Tensor]:
        s = self._torch_state
        if s is None:
            return {}
        out = {f"error.{k}": v.detach().cpu().clone() for k, v in s.error_dict.items()}
        out.update({f"p.{k}": v.detach().cpu().clone() for k, v in s.p_memory_dict.items()})
        return out

    def load_rank_state_dict(self, state: dict[str, Tensor]) -> None:
        if self._torch_state is None:
            self._pending_rank_state = state
            return
        device = torch.device("cpu") if self.context is None else self.context.device
        for name, v in state.items():
            kind, idx = name.split(".")
            target = self._torch_state.error_dict if kind == "error" else self._torch_state.p_memory_dict
            target[int(idx)] = v.to(device)
