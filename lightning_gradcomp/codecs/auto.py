"""``auto``: the strategy measures the link and picks, per bucket, the codec and level that train fastest.

A user rarely knows whether the link between their machines carries 1 Gbit/s or 10 Mbit/s, and
which codec suits it. ``auto`` holds several *arms* (a codec at a level: by default plain
all-reduce, fp16, and ``gradiveq`` at three levels) and hands each DDP bucket to one of them.

What it measures (every rank, then averaged over the ranks so that all see the same numbers):

- **the link**: a blocking all-reduce of one float and one of ``probe_bytes``, timed (median of
  three), at the first decision and every ``remeasure_every`` optimizer steps after it. Latency
  ``a`` is the small one's time, bandwidth ``b`` the large one's ring bytes over its extra time;
- **each arm on each bucket**, in place: for ``probe_steps`` compressed steps every bucket goes
  through one arm, in turn, and the hook times its body (encoding, and any blocking round of the
  codec's own) ``e``, and the time from the body's end to the bucket's result ``r`` (the
  collective, then decoding); decoding is ``r`` less what the link model says the collective took;
- **backward between buckets**: the time from one bucket's hook body's end to the next bucket's
  arrival, ``g``.

The cost model (docs/design.md, "The cost model of auto"), for a plan that gives bucket ``i`` the
arm ``c_i``: backward reaches bucket ``i`` at ``t_i = t_(i-1) + g_i + e_i(c_i)`` (the hook body
runs on backward's thread); its collective starts when the link is free,
``s_i = max(t_i, f_(i-1))``, and frees it at ``f_i = s_i + a + w_i(c_i) / b`` (``w``: the bytes
a rank transmits under the ring algorithms); the bucket is ready at ``f_i + d_i(c_i)``. The step's
communication ends at ``T = max(t_n, max_i(f_i + d_i))``. Every plan of the allowed arms is
scored (buckets times arms is small; coordinate descent beyond 50,000 plans).

The model narrows the search and the clock decides: the model's best ``trials`` plans, and each
arm alone on every bucket where predicted within 25 % of the best, are run for ``probe_steps + 1``
steps each (the first not counted), and of the plans whose mean step time over the ranks is within
``slack`` of the fastest, the one that sends the fewest bytes is kept. (On a CPU the model misses
how communication beside backward slows it; on the 100 Mbit/s link it preferred plain all-reduce
for the first bucket, which the timed steps did not bear out.)

The accuracy budget: ``auto`` is adjustable (:class:`AdjustableLevel`). At level ``L`` only arms of
level ``<= L`` may be chosen (plain and fp16 count as level 0), so under
:class:`~lightning_gradcomp.callbacks.AdaptiveCompression` (on by default for ``auto``) a critical
regime never gets a heavier arm than the controller allows. An arm allowed for the first time is
timed first (``probe_steps`` steps), only then chosen.

A choice that stops paying is revisited: when the measured bandwidth or latency moves by more than
``relink`` (relative) from the one the plan was made with, or the level changes, the plan is made
again from the new numbers. Every plan is the same on every rank (same averaged inputs, same
deterministic search), and a digest check makes sure of it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_gradcomp import comm
from lightning_gradcomp.codecs.base import (
    AdjustableLevel,
    BucketRouter,
    Codec,
    CodecContext,
    CodecOptions,
    HarnessOptions,
    LearnedState,
    MultiRound,
    check_fraction,
    check_positive_float,
    check_positive_int,
)
from lightning_gradcomp.registry import codec_class, register_codec
from lightning_gradcomp.timing import clock_for

__all__ = [
    "AutoCodec",
    "AutoOptions",
    "LinkModel",
    "BucketCosts",
    "plan_bytes",
    "predict_step",
    "rank_plans",
    "choose_plan",
    "parse_arm",
]

log = logging.getLogger(__name__)

PLAIN = "none"
#: arms at level 0 whatever they are given: they never lose information worth a level
LEVEL_ZERO = (PLAIN, "fp16")
#: above this many plans the search is coordinate descent instead of exhaustive
EXHAUSTIVE_PLANS = 50_000
#: plans predicted within this fraction of the fastest are worth timing
TRIAL_MARGIN = 0.25


def parse_arm(spec: str) -> tuple[str, float]:
    """``"gradiveq:0.5"`` -> ``("gradiveq", 0.5)``; a name alone is at level 1 (0 for plain, fp16)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"auto: a candidate is 'codec' or 'codec:level', got {spec!r}")
    name, _, level = spec.partition(":")
    if name in LEVEL_ZERO:
        if level:
            raise ValueError(f"auto: candidate {spec!r}: {name!r} takes no level")
        return name, 0.0
    if not level:
        return name, 1.0
    try:
        value = float(level)
    except ValueError:
        raise ValueError(f"auto: candidate {spec!r}: the level must be a number in [0, 1]") from None
    return name, check_fraction(f"level of candidate {spec!r}", value, low_open=False)


@dataclass(frozen=True)
class AutoOptions(CodecOptions):
    candidates: tuple[str, ...] = ("none", "fp16", "gradiveq:0", "gradiveq:0.5", "gradiveq:1")
    probe_steps: int = 2
    trials: int = 3
    remeasure_every: int = 100
    relink: float = 0.25
    probe_bytes: int = 1 << 20
    slack: float = 0.02

    def check(self) -> None:
        candidates = self.candidates
        if isinstance(candidates, str):
            candidates = tuple(c.strip() for c in candidates.split(","))
        candidates = tuple(candidates)
        if PLAIN not in candidates:
            raise ValueError(f"auto: the candidates must include {PLAIN!r} (plain all-reduce), got {list(candidates)}")
        if len(set(candidates)) != len(candidates):
            raise ValueError(f"auto: candidates repeat: {list(candidates)}")
        for spec in candidates:
            name, _ = parse_arm(spec)
            cls = codec_class(name)  # an unknown name raises, listing the valid ones
            if name == "auto" or cls.collective not in ("allreduce", "allgather"):
                raise ValueError(
                    f"auto: candidate {spec!r} runs its own exchange (collective {cls.collective!r}); auto "
                    "hands buckets only to codecs whose payloads travel in one all-reduce or all-gather "
                    "(none, fp16, gradiveq, randk, iwp, topk, qsgd, terngrad, fft, lgc, ...)"
                )
        self._set("candidates", candidates)
        check_positive_int("probe_steps", self.probe_steps)
        check_positive_int("trials", self.trials)
        check_positive_int("remeasure_every", self.remeasure_every)
        self._set("relink", check_positive_float("relink", self.relink))
        check_positive_int("probe_bytes", self.probe_bytes)
        if self.probe_bytes < 4096:
            raise ValueError(f"probe_bytes must be at least 4096, got {self.probe_bytes}")
        slack = float(self.slack)
        if not 0 <= slack < 1:
            raise ValueError(f"slack must be in [0, 1), got {self.slack!r}")
        self._set("slack", slack)


class LinkModel(NamedTuple):
    """The link as the collectives see it: ``latency_s + wire_bytes / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, wire_bytes: float) -> float:
        return self.latency_s + wire_bytes / self.bytes_per_s

    def changed(self, other: LinkModel, relink: float) -> bool:
        """Whether ``other`` differs from this one by more than ``relink`` in bandwidth, or in
        latency (latencies under a millisecond are noise, not a change)."""
        bw = abs(math.log(other.bytes_per_s / self.bytes_per_s)) > math.log1p(relink)
        lat = abs(other.latency_s - self.latency_s) > max(1e-3, relink * self.latency_s)
        return bw or lat

    def describe(self) -> str:
        return f"{8 * self.bytes_per_s / 1e6:.1f} Mbit/s, {1e3 * self.latency_s:.1f} ms"


@dataclass
class BucketCosts:
    """What the plan of one bucket is made from (seconds, bytes): ``gap`` is backward's time
    before the bucket arrives, and per arm: ``encode`` (hook body), ``decode`` and ``wire``
    (bytes one rank transmits)."""

    key: str
    raw_bytes: int
    gap: float
    encode: list[float]
    decode: list[float]
    wire: list[float]


def plan_bytes(plan: tuple[int, ...], buckets: list[BucketCosts]) -> float:
    """The bytes one rank transmits a step under ``plan``."""
    return sum(b.wire[a] for a, b in zip(plan, buckets))


def predict_step(plan: tuple[int, ...], buckets: list[BucketCosts], link: LinkModel) -> float:
    """The time from the first bucket's arrival until every bucket's result is ready (the module
    docstring's cost model)."""
    t = free = ready = 0.0
    for arm, b in zip(plan, buckets):
        t += b.gap + b.encode[arm]
        free = max(t, free) + link.seconds(b.wire[arm])
        ready = max(ready, free + b.decode[arm])
    return max(t, ready)


def rank_plans(
    buckets: list[BucketCosts], allowed: list[int], link: LinkModel, limit: int = 3, margin: float = TRIAL_MARGIN
) -> list[tuple[float, tuple[int, ...]]]:
    """Up to ``limit`` plans (one arm index per bucket, from ``allowed``) with their predicted
    times, fastest first, those predicted within ``margin`` (relative) of the fastest; equal
    predictions put the plan that transmits more bytes first. Deterministic for the same inputs."""
    n = len(buckets)
    if n == 0:
        return [(0.0, ())]
    allowed = sorted(allowed)
    if len(allowed) ** n <= EXHAUSTIVE_PLANS:
        plans = set(itertools.product(allowed, repeat=n))
    else:  # coordinate descent from each all-one-arm plan
        plans = set()
        for start in allowed:
            plan = [start] * n
            for _ in range(3):
                for i in range(n):
                    options = [(predict_step(tuple(plan[:i] + [a] + plan[i + 1 :]), buckets, link), a) for a in allowed]
                    plan[i] = min(options)[1]
            plans.add(tuple(plan))
    scored = sorted(((predict_step(p, buckets, link), -plan_bytes(p, buckets), p) for p in plans))
    best = scored[0][0]
    return [(t, p) for t, _, p in scored if t <= best * (1 + margin)][:limit]


def choose_plan(buckets: list[BucketCosts], allowed: list[int], link: LinkModel) -> tuple[tuple[int, ...], float]:
    """The plan the cost model predicts fastest, and its predicted time."""
    t, plan = rank_plans(buckets, allowed, link, limit=1)[0]
    return plan, t


def time_link(context: CodecContext, probe_bytes: int, repeats: int = 3) -> LinkModel:
    """Time blocking all-reduces of one float and of ``probe_bytes`` in the codec's group; every
    rank gets the slowest rank's times. A collective: call it at the same point on every rank,
    outside ``.then`` callbacks."""
    small = torch.zeros(1, device=context.device)
    large = torch.zeros(probe_bytes // 4, device=context.device)
    clock = clock_for(context.device)
    times = []
    for t in (small, large):
        context.all_reduce(t)  # a first round connects and allocates
        samples = []
        for _ in range(repeats):
            clock.synchronize()
            start = time.perf_counter()
            context.all_reduce(t)
            clock.synchronize()
            samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
    both = torch.tensor(times, dtype=torch.float64, device=context.device)
    context.all_reduce(both, op="max")
    t_small, t_large = both.tolist()
    wire = comm.wire_bytes("allreduce", large.numel() * 4, context.world_size)
    # a link so fast that the large probe is no slower than the small one: call it 100 Gbit/s
    return LinkModel(t_small, wire / max(t_large - t_small, wire / 12.5e9))


class _Tap:
    """The hook state's statistics, seen by one arm: what it records also counts the bucket's bytes."""

    __slots__ = ("stats", "wire")

    def __init__(self, stats: Any) -> None:
        self.stats, self.wire = stats, 0.0

    def add(self, **values: Any) -> None:
        self.wire += float(values.get("wire_bytes", 0.0))
        self.stats.add(**values)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stats, name)


class _ArmView:
    """The hook state as the paths see it for one bucket: the arm is the codec, and the bytes it
    records are counted; everything else (residuals, statistics, settling) is the state's own."""

    def __init__(self, state: Any, arm: Codec) -> None:
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "codec", arm)
        object.__setattr__(self, "stats", _Tap(state.stats))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    def round_context(self, step: int, keys: list[str] = (), momentum_keys: list[str] = ()) -> Any:
        rc = self._state.round_context(step, keys, momentum_keys)
        rc.record = self.stats.add
        return rc


@register_codec("auto")
class AutoCodec(BucketRouter, AdjustableLevel, Codec):
    """Per-bucket choice of a codec and level from the measured link (see the module docstring).

    Args:
        candidates: the arms, ``"codec"`` or ``"codec:level"`` (default plain, fp16 and
            ``gradiveq`` at levels 0, 0.5 and 1); ``"none"`` must be among them. Only codecs whose
            payloads travel in one all-reduce or all-gather can be arms (not ``powersgd``). A
            comma-separated string is accepted (YAML, the command line).
        probe_steps: steps each arm is timed on before it can be chosen, and steps each plan on
            trial is timed on, after one step that is not counted (default 2).
        trials: how many of the model's best plans are timed (default 3), besides each arm alone
            on every bucket; only plans predicted within 25 % of the fastest are.
        remeasure_every: optimizer steps between link measurements after a plan (default 100).
        relink: relative change of the link's bandwidth or latency that makes a new plan (0.25).
        probe_bytes: the size of the timed all-reduce that measures the bandwidth (1 MiB).
        slack: timed plans within this fraction of the fastest count as equally fast; the one that
            sends the fewest bytes of them is kept, as the least exposed to the link (default 0.02).
    """

    collective = "allreduce"  # the plain path's; each bucket goes the way of its arm
    Options = AutoOptions
    # its accuracy budget: no heavy arm in a critical regime
    adaptive_by_default = True

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.arms: list[Codec] = []
        self.arm_levels: list[float] = []
        for spec in self.options.candidates:
            name, level = parse_arm(spec)
            self.arms.append(_build_arm(name, level))
            self.arm_levels.append(level)
        self.plain = self.options.candidates.index(PLAIN)
        self.link: LinkModel | None = None  # of the plan in use
        self.plan: dict[str, int] = {}
        self.kept: dict[str, int] = {}  # the last plan kept after its trial
        self.predicted_s: float | None = None
        self.measured_s: float | None = None  # the kept plan's step time, as timed in its trial
        self.costs: list[BucketCosts] = []  # averaged over the ranks, when the arms were timed
        self.replans = 0
        self.explored = [0] * len(self.arms)
        self.explored[self.plain] = self.options.probe_steps  # plain costs come from the link model
        self._last_measure = -1
        self._first_compressed: int | None = None
        self._replan: str | None = None  # why the next step end makes a new plan ("level")
        # the plans being timed: (predicted s, plan), this rank's step times of each, the current one
        self._trials: list[tuple[float, tuple[int, ...]]] = []
        self.trial_log: list[dict[str, Any]] = []  # the last plans timed: predicted and timed step
        self._trial_times: list[list[float]] = []
        self._trial_reason = ""
        # this rank's timings: (arm, bucket) -> deque of (encode_s, result_s, wire bytes); gaps
        self._samples: dict[tuple[int, str], deque] = {}
        self._gaps: dict[str, deque] = {}
        self._order: list[str] = []  # bucket keys in arrival order, of the last step
        self._raw: dict[str, int] = {}
        self._marks: list[list[Any]] = []
        self._step_arm: int | None = None  # the arm every bucket of an exploration step goes through

    def wire_formats(self) -> dict[str, int]:
        # each arm's own wire_formats(), as lgc takes its stage-1 codec's: an arm that sends another
        # codec's messages brings that layout too
        formats = super().wire_formats()
        for arm in self.arms:
            formats.update(arm.wire_formats())
        return formats

    def check_harness(self, harness: HarnessOptions) -> None:
        if harness.momentum:
            raise ValueError(
                "auto chooses a codec per bucket and cannot carry momentum correction (momentum must be 0)"
            )
        if harness.precondition:
            raise ValueError("auto chooses a codec per bucket and cannot precondition (precondition must be False)")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_marks"] = []  # CUDA events do not pickle
        return state

    # ----------------------------------------------------------------------------------------------
    # the codec's life, passed on to every arm
    def setup(self, context: CodecContext) -> None:
        super().setup(context)
        for arm in self.arms:
            arm.setup(context)

    def plan_layers(self, named_parameters: Any) -> frozenset[str]:
        named = list(named_parameters)
        for arm in self.arms:
            arm.plan_layers(named)
        return super().plan_layers(named)

    def fit_to_run(self, total_steps: int | None) -> None:
        super().fit_to_run(total_steps)
        for arm in self.arms:
            arm.fit_to_run(total_steps)

    def encode(self, x: Tensor, key: str, param: Tensor, step: int) -> Any:
        raise TypeError("auto hands whole buckets to its arms (send_bucket); it encodes no layer itself")

    @property
    def planned(self) -> bool:
        """Whether a plan is kept and in use (no arm or plan is being timed)."""
        return bool(self.plan) and self._step_arm is None and not self._trials

    def allowed(self) -> list[int]:
        """Arms the level allows: those of level <= the level in use."""
        level = self.compression_level
        return [i for i, lv in enumerate(self.arm_levels) if lv <= level + 1e-9]

    def exploring_arm(self) -> int | None:
        """The allowed arm still to be timed, if any (the same on every rank: counts of steps)."""
        for i in self.allowed():
            if self.explored[i] < self.options.probe_steps:
                return i
        return None

    def on_level_change(self) -> None:
        # between steps: the next step's end (the same point on every rank) re-plans, before any
        # bucket of that step is sent, so a lower level never meets a heavier arm
        self._replan = "level"

    # ----------------------------------------------------------------------------------------------
    # the hook's side
    def send_bucket(self, state: Any, bucket: Any, layers: list, flag: Tensor, step: int, key: str, compress: bool):
        """Send one bucket through the arm the plan (or the exploration) gives it; returns the
        future of the averaged bucket. Called by the hook for every bucket of every step."""
        from lightning_gradcomp.hook import allgather, allreduce, dense
        from lightning_gradcomp.hook.encode import encode_layers

        buf = bucket.buffer()
        clock = clock_for(buf.device)
        # a kept plan needs no timing: no mark, no wait for the device at step end
        timing = not self.planned or self._replan is not None
        arrive = clock.mark() if timing else 0.0
        if compress and self._first_compressed is None:
            self._first_compressed = step
        if not compress:
            arm_i = self.plain
        elif self._step_arm is not None:
            arm_i = self._step_arm
        else:
            arm_i = self.plan.get(key, self.plain)
        if arm_i not in self.allowed() and arm_i != self.plain:  # never heavier than the level
            arm_i = self.plain
        self._raw[key] = buf.numel() * buf.element_size()
        arm = self.arms[arm_i]
        tap = None
        if arm_i == self.plain:  # its bytes and costs come from the link model
            fut = dense.send(state, buf, layers, flag, step)
        else:
            view = _ArmView(state, arm)
            tap = view.stats
            path = allreduce if arm.collective == "allreduce" else allgather
            fut = path.send(view, buf, encode_layers(view, buf, layers, step), flag, step)
        if not timing:
            return fut
        entry = [key, arm_i, arrive, clock.mark(), None, tap]
        self._marks.append(entry)

        def done(f: Any) -> Tensor:
            entry[4] = clock.mark()
            return f.value()

        return fut.then(done)

    def end_step(self, discarded: bool) -> None:
        """Passed on to the arms that keep state of their own (``gradiveq``'s leader bases)."""
        for arm in self.arms:
            if isinstance(arm, MultiRound):
                arm.end_step(discarded)

    def on_step_end(self, step: int) -> None:
        """After the step's futures completed (the hook calls it at the next step's first bucket,
        before sending it, on every rank): read this step's timings, pass the step on to learning
        arms, and move on: time the arms, then the best plans, then keep the fastest; re-plan when
        the link or the level changes."""
        step_s = self._read_marks(step)
        for arm in self.arms:
            if isinstance(arm, LearnedState):
                arm.on_step_end(step)
        if self._first_compressed is None or step < self._first_compressed:
            return
        explored = self._step_arm is not None
        if explored:
            self.explored[self._step_arm] += 1
        self._step_arm = self.exploring_arm()
        if self._step_arm is not None:
            # exploration steps send every bucket through the arm being timed; plans on trial are
            # timed again once it is done, with that arm among them
            self.plan, self._trials, self._trial_times = {}, [], []
            return
        if self._trials:
            self._trial_step(step_s)
            return
        reason, self._replan = self._replan, None
        if explored or not self.costs:
            reason = "arms timed"
        elif step - self._last_measure >= self.options.remeasure_every:
            reason = reason or "remeasure"
        if reason is None:
            return
        link = time_link(self.context, self.options.probe_bytes)
        self._last_measure = step
        if reason == "arms timed":
            # decoding is what remains of the timed results once the link, measured now, is
            # taken out; a later change of the link keeps these costs
            self.costs = self._averaged_costs(link)
        elif reason == "remeasure":
            if self.link is not None and not self.link.changed(link, self.options.relink):
                return
            reason = "link changed"
        self._start_trials(link, reason)

    # ----------------------------------------------------------------------------------------------
    def _start_trials(self, link: LinkModel, reason: str) -> None:
        self.link = link
        allowed = self.allowed()
        ranked = rank_plans(self.costs, allowed, link, limit=self.options.trials)
        # the model's best plans, and each arm alone on every bucket where the model puts it near
        # them: what the model misjudges (communication that takes the core from backward on a
        # CPU) shows in the timed steps
        uniform = [(predict_step(p, self.costs, link), p) for p in (tuple([a] * len(self.costs)) for a in allowed)]
        best = ranked[0][0]
        extra = [
            tp for tp in sorted(uniform) if tp[0] <= best * (1 + TRIAL_MARGIN) and tp[1] not in {p for _, p in ranked}
        ]
        self._trials = ranked + extra
        self._trial_times = [[] for _ in self._trials]
        self._trial_reason = reason
        self._use(self._trials[0][1])
        if len(self._trials) == 1:  # nothing to compare: keep it
            self._keep(0, None)

    def _use(self, plan: tuple[int, ...]) -> None:
        self.plan = {b.key: a for b, a in zip(self.costs, plan)}

    def _trial_step(self, step_s: float | None) -> None:
        """One timed step of the plan on trial; once every plan has ``probe_steps`` steps, keep the
        fastest (the ranks' mean step times: the same choice everywhere)."""
        steps = self.options.probe_steps + 1  # the first step of a plan is not counted
        current = next(i for i, t in enumerate(self._trial_times) if len(t) < steps)
        self._trial_times[current].append(step_s if step_s is not None else math.inf)
        nxt = next((i for i, t in enumerate(self._trial_times) if len(t) < steps), None)
        if nxt is not None:
            self._use(self._trials[nxt][1])
            return
        # the first step of a plan may pay for the switch: the median of the rest
        medians = [statistics.median(t[1:]) for t in self._trial_times]
        times = torch.tensor(medians, dtype=torch.float64, device=self.context.device)
        self.context.all_reduce(times)
        means = (times / self.world_size).tolist()
        best = min(means)
        near = [i for i, m in enumerate(means) if m <= best * (1 + self.options.slack)]
        self.trial_log = [
            {"plan": [self.options.candidates[a] for a in p], "predicted_s": t, "timed_s": m}
            for (t, p), m in zip(self._trials, means)
        ]
        self._keep(min(near, key=lambda i: (plan_bytes(self._trials[i][1], self.costs), means[i])), means)

    def _keep(self, index: int, measured: list[float] | None) -> None:
        predicted, plan = self._trials[index]
        self._use(plan)
        self.context.agree(comm.digest(repr(sorted(self.plan.items()))), "auto's plan")
        self.predicted_s = predicted
        self.measured_s = None if measured is None else measured[index]
        self.replans += 1 if self.kept else 0
        self.kept = dict(self.plan)
        tried = "" if measured is None else " (timed: " + ", ".join(f"{1e3 * m:.0f} ms" for m in measured) + ")"
        log.info(
            "gradcomp auto (%s): link %s -> %s%s", self._trial_reason, self.link.describe(), self.describe_plan(), tried
        )
        self._trials, self._trial_times = [], []

    def _read_marks(self, step: int) -> float | None:
        """This step's per-bucket timings into the samples; returns the step's time from its first
        bucket's arrival until now (the next step's first bucket), or None when it was not timed."""
        marks, self._marks = self._marks, []
        if not marks:
            return None
        clock = clock_for(self.context.device if self.context else None)
        clock.synchronize()
        now = clock.mark()
        order, prev_end, prev_done = [], None, 0.0
        for key, arm_i, arrive, body_end, done, tap in marks:
            if done is None:  # a bucket whose result never arrived (a failed step): nothing to learn
                return None
            a, e, d = clock.seconds(arrive), clock.seconds(body_end), clock.seconds(done)
            order.append(key)
            self._gaps.setdefault(key, deque(maxlen=16)).append(0.0 if prev_end is None else max(a - prev_end, 0.0))
            prev_end = e
            result = d - max(e, prev_done)
            prev_done = max(prev_done, d)
            if tap is not None:  # an arm other than plain
                sample = (e - a, result, tap.wire)
                self._samples.setdefault((arm_i, key), deque(maxlen=8)).append(sample)
        self._order = order
        return clock.elapsed(marks[0][2], now)

    def _averaged_costs(self, link: LinkModel) -> list[BucketCosts]:
        """This rank's medians, averaged over the ranks (one all-reduce, the same on every rank,
        after an 8-byte all-gather that checks every rank timed the same buckets in the same order)."""
        keys, n_arms = list(self._order), len(self.arms)
        values = []
        for key in keys:
            values.append(statistics.median(self._gaps.get(key) or [0.0]))
            for i in range(n_arms):
                s = self._samples.get((i, key))
                if i == self.plain or not s:
                    values += [0.0, 0.0, 0.0]
                    continue
                enc = statistics.median(x[0] for x in s)
                wire = statistics.median(x[2] for x in s)
                dec = max(statistics.median(x[1] for x in s) - link.seconds(wire), 0.0)
                values += [enc, dec, wire]
        ctx, what = self.context, "auto: ranks timed different bucket layouts; cannot agree on a plan"
        values = comm.mean_over_ranks(values, keys, what, ctx.group, ctx.device, self.world_size)
        costs, per = [], 1 + 3 * n_arms
        for j, key in enumerate(keys):
            row = values[j * per : (j + 1) * per]
            enc, dec, wire = row[1::3], row[2::3], row[3::3]
            raw = self._raw.get(key, 0)
            wire[self.plain] = comm.wire_bytes("allreduce", raw + 4, self.world_size)
            costs.append(BucketCosts(key, raw, row[0], list(enc), list(dec), list(wire)))
        return costs

    def describe_plan(self, plan: dict[str, int] | None = None) -> str:
        plan = self.plan if plan is None else plan
        raw = {b.key: b.raw_bytes for b in self.costs}
        names = self.options.candidates
        return "; ".join(
            f"bucket {j} ({raw.get(k, 0) / 1e6:.1f} MB): {names[a]}" for j, (k, a) in enumerate(plan.items())
        )

    def report_lines(self) -> list[str]:
        """What the end-of-fit report says of the choice."""
        if not self.kept or self.link is None:
            return ["auto: no plan was kept (the run ended while its arms or plans were being timed)"]
        timed = "" if self.measured_s is None else f", {1e3 * self.measured_s:.0f} ms a step as timed"
        ending = "" if self.planned else "; the run ended while a new plan was being timed"
        return [
            f"auto: link {self.link.describe()}; {self.describe_plan(self.kept)} (predicted "
            f"{1e3 * (self.predicted_s or 0):.0f} ms of communication after the first bucket{timed}); "
            f"{self.replans} re-plan(s) after the first{ending}"
        ]

    # ----------------------------------------------------------------------------------------------
    def scalars(self, step: int, compressing: bool) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.link is not None:
            out["auto_link_mbit"] = 8 * self.link.bytes_per_s / 1e6
            out["auto_latency_ms"] = 1e3 * self.link.latency_s
            out["auto_predicted_ms"] = 1e3 * (self.predicted_s or 0.0)
            out["auto_replans"] = float(self.replans)
            for j, arm_i in enumerate(self.plan.values()):
                out[f"auto_bucket{j}_arm"] = float(arm_i)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.level_state(),
            "plan": list(self.plan.items()),
            "kept": list(self.kept.items()),
            "link": list(self.link) if self.link is not None else None,
            "predicted_s": self.predicted_s,
            "measured_s": self.measured_s,
            "costs": [dataclasses.asdict(b) for b in self.costs],
            "explored": list(self.explored),
            "replans": self.replans,
            "last_measure": self._last_measure,
            "first_compressed": self._first_compressed,
            "arms": [arm.state_dict() if isinstance(arm, LearnedState) else {} for arm in self.arms],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rest = self.load_level_state(state)
        self._replan = None  # the level the checkpoint recorded is the one its plan was made for
        arms = rest.pop("arms", [{}] * len(self.arms))
        if len(arms) != len(self.arms):
            raise ValueError(f"auto: the checkpoint has {len(arms)} arms, this codec {len(self.arms)}")
        for arm, s in zip(self.arms, arms):
            if isinstance(arm, LearnedState):
                arm.load_state_dict(s)
        self.plan = {str(k): int(a) for k, a in rest.get("plan", [])}
        self.kept = {str(k): int(a) for k, a in rest.get("kept", rest.get("plan", []))}
        link = rest.get("link")
        self.link = LinkModel(*link) if link else None
        self.predicted_s = rest.get("predicted_s")
        self.measured_s = rest.get("measured_s")
        self.costs = [BucketCosts(**b) for b in rest.get("costs", [])]
        self.explored = [int(x) for x in rest.get("explored", self.explored)]
        self.replans = int(rest.get("replans", 0))
        self._last_measure = int(rest.get("last_measure", -1))
        self._first_compressed = rest.get("first_compressed")
        if not self.plan:  # saved while timing: time again from the start
            self.explored = [0] * len(self.arms)
            self.explored[self.plain] = self.options.probe_steps

    def rank_state_dict(self) -> dict[str, Tensor]:
        out = {}
        for i, arm in enumerate(self.arms):
            if isinstance(arm, LearnedState):
                out.update({f"{i}.{k}": v for k, v in arm.rank_state_dict().items()})
        return out

    def load_rank_state_dict(self, state: dict[str, Tensor]) -> None:
        for i, arm in enumerate(self.arms):
            if isinstance(arm, LearnedState):
                prefix = f"{i}."
                arm.load_rank_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})


def _build_arm(name: str, level: float) -> Codec:
    """One arm: the codec with error feedback (what a bucket leaves behind travels with its next
    arm, whichever that is), at its level. Its own schedule does not apply: auto decides which
    steps compress."""
    cls = codec_class(name)
    options: dict[str, Any] = {"start_step": 0}
    if name != PLAIN:
        options["error_feedback"] = True
    arm = cls(**options)
    if isinstance(arm, AdjustableLevel):
        arm.set_level(level)
    elif name not in LEVEL_ZERO and level != 1.0:
        raise ValueError(f"auto: candidate {name!r}:{level:g}: {name!r} has no adjustable level")
    return arm
