"""Stepping aside when compression does not pay: per-bucket fallback to plain all-reduce.

On a fast link, encoding and decoding can cost more than the bytes they save. The hook times each
bucket on its last uncompressed step and on its first ``probe_steps`` compressed steps:

- the *dense cost* of a bucket is the time the link spent on its plain all-reduce;
- the *compressed cost* is the time the hook body took for it (encoding, and any blocking rounds)
  plus the time the link spent on its compressed collective plus decoding.

"Time the link spent" is the completion time of the bucket's collective minus the later of its
launch and the previous bucket's completion: collectives of one process group run in order, so
this removes the time a bucket waited behind earlier ones.

Per-bucket costs miss one thing: on a CPU, encoding takes the core away from backward, while a
plain all-reduce runs beside it. So the policy also times whole steps (from one step's first
bucket to the next step's first bucket, less the codec's step-end work such as a refit):

- when the compressed steps are clearly faster than the last plain step before them (by the factor
  ``clear_win``, as on any slow link), every bucket keeps its codec, decided at once;
- otherwise the policy sends ``probe_steps`` more steps plainly (their residuals go with them, so
  nothing is lost) and compares the medians of the two kinds of step taken at the same point of
  training; every bucket falls back when the compressed step is not faster (ties go to plain
  all-reduce, which is exact) by more than ``min_gain_ms``.

After each probe phase every rank contributes its costs to one all-reduce (so all ranks see the
same averages and take the same decision), once an all-gather of a digest of the timed buckets'
names has shown that every rank timed the same buckets (else every rank raises), and a bucket
falls back to plain all-reduce for the rest of the run when its compressed cost exceeds its dense
cost by more than ``margin`` (relative) and ``min_gain_ms`` (absolute). A bucket that falls back
sends its residual with its next gradient, so nothing compression had deferred is lost. The
decision is logged and counted in ``gradcomp/fallback_buckets``.

Clocks (:mod:`lightning_gradcomp.timing`): on a CPU every time is a ``perf_counter`` reading. On
CUDA the per-bucket times are CUDA events recorded on the current stream (hook body start and end,
the collective's completion in its callback), read only at the next step's start; the step clock
reads the host clock after one ``torch.cuda.synchronize`` at the start of each step, and only
while the policy is still timing (a few steps at the start of compression), so the step times are
those of the work itself, not of its launch.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from lightning_gradcomp import comm
from lightning_gradcomp.memory import LocksNotPickled
from lightning_gradcomp.timing import Clock, Mark, clock_for

__all__ = ["FallbackPolicy", "default_enabled"]

#: set to "0" to make ``fallback=None`` mean off (test suites that check codecs on tiny models)
ENV_VAR = "LIGHTNING_GRADCOMP_FALLBACK"


def default_enabled() -> bool:
    """What ``fallback=None`` means: on, unless the environment variable says ``0``/``off``."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "off", "false", "no")


log = logging.getLogger(__name__)


class FallbackPolicy(LocksNotPickled):
    """Per-bucket timing and the one-off decision to stop compressing a bucket.

    Args:
        enabled: ``False`` never falls back; ``None`` follows ``LIGHTNING_GRADCOMP_FALLBACK`` (on by default).
        probe_steps: compressed steps timed before deciding.
        margin: fall back when compressed cost > (1 + margin) * dense cost ...
        min_gain_ms: ... and the difference exceeds this many milliseconds (tiny buckets whose
            costs differ by noise keep their codec).
        clear_win: compressed steps shorter than ``clear_win`` times the last plain step are a
            clear win, decided without plain probe steps.
    """

    def __init__(
        self,
        enabled: bool | None = None,
        probe_steps: int = 3,
        margin: float = 0.1,
        min_gain_ms: float = 2.0,
        clear_win: float = 0.8,
    ):
        if probe_steps < 1:
            raise ValueError(f"probe_steps must be >= 1, got {probe_steps}")
        if margin < 0 or min_gain_ms < 0:
            raise ValueError("margin and min_gain_ms must be >= 0")
        if not 0 < clear_win <= 1:
            raise ValueError(f"clear_win must be in (0, 1], got {clear_win}")
        self.clear_win = float(clear_win)
        self.enabled = default_enabled() if enabled is None else bool(enabled)
        self.probe_steps = int(probe_steps)
        self.margin = float(margin)
        self.min_gain_ms = float(min_gain_ms)
        self.dense_cost: dict[str, float] = {}
        self.comp_costs: dict[str, list[float]] = {}
        self.fallback: set[str] = set()
        self.decided = False
        self.decisions: dict[str, tuple[float, float]] = {}
        self.step_decision: tuple[float, float] | None = None
        self._lock = threading.Lock()
        self._prev_done = 0.0
        self.step_times: dict[str, list[float]] = {"dense": [], "compressed": [], "plain_probe": []}
        self._step_start: float | None = None
        self._step_kind: str | None = None
        # set once the compressed probe is not a clear win: (averaged compressed bucket costs, step)
        self._plain_probe: tuple[list[str], list[float], float] | None = None
        self._probe_dense: dict[str, list[float]] = {}
        self._device = torch.device("cpu")
        # this step's buckets: (key, compressed, plain probe, body start, body end, done) marks,
        # read at the next step's start (on CUDA they are events, not yet readable in the hook)
        self._marks: list[tuple[str, bool, bool, Mark, Mark, Mark]] = []

    def __getstate__(self) -> dict[str, Any]:
        # CUDA events do not pickle; a pickled policy starts a fresh step
        return {**super().__getstate__(), "_marks": []}

    def use_device(self, device: torch.device) -> None:
        """Time the work of ``device`` (CUDA events on a GPU, the host clock on a CPU)."""
        self._device = torch.device(device)

    @property
    def clock(self) -> Clock:
        return clock_for(getattr(self, "_device", torch.device("cpu")))

    def falls_back(self, bucket_key: str) -> bool:
        return self._plain_probe is not None or bucket_key in self.fallback

    def wants_timing(self) -> bool:
        return self.enabled and not self.decided

    def start_step(self, exclude_s: float | tuple[Mark, Mark] = 0.0) -> None:
        """A new step begins (its first bucket is ready); ``exclude_s``: time since the previous
        step's end that was not the step's own (the codec's step-end work), in seconds or as the
        two marks of this clock around it."""
        clock = self.clock
        timing = self.wants_timing()
        if timing:
            # CUDA: the one wait of the step, and only while timing, so that the host clock below
            # measures the previous step's work and every mark of it can be read
            clock.synchronize()
        if isinstance(exclude_s, tuple):
            exclude_s = clock.elapsed(*exclude_s) if timing else 0.0
        now = time.perf_counter()
        with self._lock:
            marks, self._marks = self._marks, []
            if timing:
                for entry in marks:
                    self._record(clock, *entry)
            self._prev_done = 0.0
            if self.wants_timing() and self._step_start is not None and self._step_kind is not None:
                self.step_times[self._step_kind].append(now - self._step_start - exclude_s)
            self._step_start, self._step_kind = now, None

    def track(
        self, fut: torch.futures.Future, bucket_key: str, compressed: bool, body_start: Mark
    ) -> torch.futures.Future:
        """Chain a timing callback onto a bucket's future; the future's value is unchanged.
        ``body_start`` is a mark of :attr:`clock` taken when the hook body began."""
        clock = self.clock
        body_end = clock.mark()
        with self._lock:
            if compressed or self._step_kind is None:
                self._step_kind = "compressed" if compressed else "plain_probe" if self._plain_probe else "dense"
            plain_probe = self._plain_probe is not None

        def record(f: torch.futures.Future) -> torch.Tensor:
            done = clock.mark()  # in the callback the current stream follows the collective
            with self._lock:
                self._marks.append((bucket_key, compressed, plain_probe, body_start, body_end, done))
            return f.value()

        return fut.then(record)

    def _record(
        self,
        clock: Clock,
        bucket_key: str,
        compressed: bool,
        plain_probe: bool,
        body_start: Mark,
        body_end: Mark,
        done: Mark,
    ) -> None:
        """One bucket's costs from its marks (called in completion order, under the lock)."""
        start_s, end_s, done_s = clock.seconds(body_start), clock.seconds(body_end), clock.seconds(done)
        link = done_s - max(end_s, self._prev_done)
        self._prev_done = max(self._prev_done, done_s)
        if compressed:
            self.comp_costs.setdefault(bucket_key, []).append((end_s - start_s) + link)
        elif plain_probe:
            self._probe_dense.setdefault(bucket_key, []).append(link)
        else:
            self.dense_cost[bucket_key] = link

    def maybe_decide(self, process_group: dist.ProcessGroup | None, device: torch.device) -> list[str] | None:
        """Decide once every timed bucket has ``probe_steps`` compressed samples, or after the plain
        probe steps when that was not a clear win. A collective: the hook calls it at the same point
        on every rank. Returns the keys that fall back, if decided."""
        if not self.wants_timing():
            return None
        if self._plain_probe is not None:
            return self._decide_after_plain_probe(process_group, device)
        keys = sorted(k for k in self.comp_costs if k in self.dense_cost)
        if not keys or any(len(self.comp_costs[k]) < self.probe_steps for k in keys):
            return None
        # the first compressed step pays one-off allocations: use the median of the rest
        comp = [statistics.median(self.comp_costs[k][1:] or self.comp_costs[k]) for k in keys]
        dense = [self.dense_cost[k] for k in keys]
        steps_c, steps_d = self.step_times["compressed"], self.step_times["dense"]
        # the compressed steps after the first, and the last plain step before compression started
        step_pair = [statistics.median(steps_c[1:] or steps_c or [0.0]), steps_d[-1] if steps_d else 0.0]
        costs = self._average(comp + dense + step_pair, keys, process_group, device)
        n = len(keys)
        comp, dense = costs[:n], costs[n : 2 * n]
        step_c, step_d = costs[2 * n], costs[2 * n + 1]
        if step_c > 0 and step_d > 0 and step_c >= self.clear_win * step_d:
            # not a clear win: time plain steps now, at the same point of training
            self._plain_probe = (keys, comp, step_c)
            log.info(
                "gradcomp fallback: compressed step %.1f ms vs plain %.1f ms: probing plain steps",
                1e3 * step_c,
                1e3 * step_d,
            )
            return None
        # a clear win for the whole step: per-bucket costs, noisy where ranks share cores, must
        # not send a large bucket plainly over the slow link that made compression win
        return self._finish(keys, comp, dense, (step_c, step_d), whole_step_loses=False, per_bucket=False)

    def _decide_after_plain_probe(
        self, process_group: dist.ProcessGroup | None, device: torch.device
    ) -> list[str] | None:
        keys, comp, step_c = self._plain_probe
        steps_p = self.step_times["plain_probe"]
        if len(steps_p) < self.probe_steps or any(len(self._probe_dense.get(k, [])) < self.probe_steps for k in keys):
            return None
        dense = [statistics.median(self._probe_dense[k]) for k in keys]
        costs = self._average(dense + [statistics.median(steps_p)], keys, process_group, device)
        step_p = costs[len(keys)]
        self._plain_probe = None
        # compression must win by more than min_gain_ms; ties go to plain all-reduce, which is exact
        loses = (step_p - step_c) * 1e3 <= self.min_gain_ms
        return self._finish(keys, comp, costs[: len(keys)], (step_c, step_p), whole_step_loses=loses)

    def _average(
        self, values: list[float], keys: list[str], process_group: dist.ProcessGroup | None, device: torch.device
    ) -> list[float]:
        """``values`` averaged over the ranks once they agree they timed the same buckets ``keys``
        (:func:`~lightning_gradcomp.comm.mean_over_ranks`; once per decision, not per bucket)."""
        world = dist.get_world_size(process_group) if dist.is_initialized() else 1
        what = "ranks timed different bucket layouts; cannot agree on a fallback decision"
        return comm.mean_over_ranks(values, keys, what, process_group, device, world)

    def _finish(
        self,
        keys: list[str],
        comp: list[float],
        dense: list[float],
        steps: tuple[float, float],
        whole_step_loses: bool,
        per_bucket: bool = True,
    ) -> list[str]:
        self.step_decision = steps
        for k, c, d in zip(keys, comp, dense):
            self.decisions[k] = (c, d)
            if whole_step_loses or (per_bucket and self._loses(c, d)):
                self.fallback.add(k)
        self.decided = True
        log.info("gradcomp fallback: compressed step %.1f ms vs plain step %.1f ms", 1e3 * steps[0], 1e3 * steps[1])
        for k in keys:
            c, d = self.decisions[k]
            verdict = "plain all-reduce" if k in self.fallback else "compressed"
            log.info(
                "gradcomp fallback: bucket %s compressed %.1f ms vs plain %.1f ms -> %s", k, 1e3 * c, 1e3 * d, verdict
            )
        return sorted(self.fallback)

    def _loses(self, compressed: float, plain: float) -> bool:
        return compressed > (1 + self.margin) * plain and (compressed - plain) * 1e3 > self.min_gain_ms

    def state_dict(self) -> dict[str, Any]:
        return {"decided": self.decided, "fallback": sorted(self.fallback)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decided = bool(state.get("decided", False))
        self.fallback = set(state.get("fallback", []))
