"""One rank of the ``link`` benchmark: a real Lightning multi-node DDP run, one codec after another.

Started the way a multi-node user starts a rank, with Lightning's environment variables::

    MASTER_ADDR=10.77.0.1 MASTER_PORT=29600 WORLD_SIZE=2 NODE_RANK=1 LOCAL_RANK=0 \
    GLOO_SOCKET_IFNAME=gc1v python -m lightning_gradcomp.bench.worker --codecs floor,none,topk --out DIR

and ``Trainer(num_nodes=WORLD_SIZE, devices=1, strategy=CompressedDDPStrategy(codec=...))``. For
each codec it fits a fresh model (same seed on every rank, so DDP's initial broadcast is skipped
with ``init_sync=False``) and measures, per optimizer step, the wall time from the start of the
batch to the end of the optimizer step, with the hook's statistics of that step.

Phases of each codec's run:

1. warm-up: at least ``--warmup`` steps, and until the codec compresses (the hook's ``phase``)
   and the per-bucket fallback has taken its decision, at most ``--max-warmup`` steps;
2. measurement: ``--steps`` steps, or fewer (but at least ``--min-steps``) once the measured steps
   have taken ``--budget-s`` seconds; the stop is agreed by all ranks;
3. one probe step with the relative error sampled (computing it costs time, so it is not timed).

With ``--iface``/``--rate``/``--warmup-rate`` (namespaces only) warm-up and probe run at the fast
``--warmup-rate`` and only the measured steps at ``--rate``: our choice, since warm-up steps are
uncompressed by construction (DDP rebuilds its buckets) and at 10 Mbit/s each costs ~35 s of
plain all-reduce that is not measured anyway. All ranks switch together behind a barrier.
With the fallback on (the strategy's default) warm-up runs at ``--rate`` too: the fallback decides
from the timings of the last plain and the first compressed steps, and a decision taken on the
fast warm-up link would be applied to the slow one. Turn it off for the slowest links with
``LIGHTNING_GRADCOMP_FALLBACK=0`` (compression always pays there) to keep warm-up fast.

``floor`` is a bench-only codec (not in the public registry) that communicates nothing: the
bucket's local gradient is returned at once. Its step time is the no-communication floor of the
same strategy, hook and model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.bench.link import OPTIMIZERS
from lightning_gradcomp.callbacks.monitor import CompressionMonitor
from lightning_gradcomp.codecs.base import BucketRouter, Codec, MultiRound, RoundContext
from lightning_gradcomp.codecs.extensions import AdjustableCompression
from lightning_gradcomp.comm import completed_future

__all__ = ["NoCommCodec", "main", "summarize"]

FLOOR = "floor"
_NEVER = 10**12


class NoCommCodec(MultiRound, Codec):
    """Bench-only: sends nothing; each rank keeps its own gradient. Not registered, so it never
    appears in :func:`lightning_gradcomp.available_codecs`."""

    name = FLOOR
    collective = "custom"
    harness_defaults = {"min_numel": 0, "start_step": 0}

    def communicate_bucket(self, bucket: Any, layers: list, flag: Tensor, rc: RoundContext) -> Any:
        buf = bucket.buffer()
        rc.record_bucket(buf, "allreduce", 0)  # nothing travels
        return completed_future(buf)


def make_bench_codec(name: str, options: dict[str, Any]) -> Codec:
    """``name`` is a codec name, or ``NAME@LABEL`` for a second configuration of the same codec."""
    from lightning_gradcomp.registry import make_codec

    base = name.split("@", 1)[0]
    return NoCommCodec(**options) if base == FLOOR else make_codec(base, **options)


def options_for(entry: str, all_options: dict[str, Any]) -> dict[str, Any]:
    """Options of ``NAME@LABEL`` are looked up under the full entry, then under ``NAME``."""
    return dict(all_options.get(entry, all_options.get(entry.split("@", 1)[0], {})))


# --------------------------------------------------------------------------------------------------
class _Link:
    """Switches this host's ``tc`` rate (namespaces only) and lines all ranks up behind it."""

    def __init__(self, iface: str | None, rate: str | None, warmup_rate: str | None) -> None:
        self.iface, self.rate, self.warmup_rate = iface, rate, warmup_rate
        # the link is built at the warm-up rate when there is one (`bench link` does so): starting
        # from `rate` would make the first switch to `rate` a no-op and measure at the fast rate
        self.current = warmup_rate or rate

    def set(self, rate: str | None) -> None:
        if not (self.iface and rate and self.warmup_rate) or rate == self.current:
            return
        from lightning_gradcomp.bench.netns import shape_command

        subprocess.run(shape_command("change", self.iface, rate), check=True, capture_output=True)
        self.current = rate
        torch.distributed.barrier()


class StepRecorder(CompressionMonitor):
    """Times each step and pops the hook's statistics itself (it replaces the monitor that the
    strategy would attach, so nothing is logged inside the timed window)."""

    def __init__(self, codec: Codec, args: argparse.Namespace, link: _Link) -> None:
        super().__init__(prog_bar=False)
        self.codec, self.args, self.link = codec, args, link
        # a codec with a learned warm-up says False until it has learned: ask for its name instead
        self.will_compress = codec.name != "none" and not isinstance(codec, NoCommCodec)
        self.phase = "warmup"
        self.steps: list[dict[str, Any]] = []
        self.warmup_steps = 0
        self.warmup_exhausted = False
        self.rel_error: float | None = None
        self.extras: dict[str, float] = {}
        self._elapsed = 0.0
        self._t0 = 0.0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # The fallback compares a bucket's last plain steps with its first compressed ones: both
        # must run at the rate being measured, so with the fallback on there is no fast warm-up.
        # auto measures the link and its arms in its first steps, and plans for what it measured
        state = trainer.strategy.hook_state
        fallback_on = state.fallback.enabled or isinstance(state.codec, BucketRouter)
        self.link.set(self.link.rate if fallback_on else self.link.warmup_rate)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        state = trainer.strategy.hook_state
        state.stats_every = 1 if self.phase == "probe" else _NEVER
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        dt = time.perf_counter() - self._t0
        state = trainer.strategy.hook_state
        st = state.stats.pop()
        compressed = bool(st is not None and st.compressed)
        if self.phase == "probe":
            self.rel_error = None if st is None else st.rel_error
            trainer.should_stop = True
            return
        if self.phase == "warmup":
            self.warmup_steps += 1
            fallback = state.fallback
            decided = fallback.decided or not fallback.enabled  # measure what runs after the decision
            ready = self.warmup_steps >= self.args.warmup and ((compressed and decided) or not self.will_compress)
            if fallback.decided and fallback.fallback and not compressed:
                ready = self.warmup_steps >= self.args.warmup  # every bucket fell back: plain from now on
            if isinstance(state.codec, BucketRouter):  # measure the plan, whatever it chose
                ready = self.warmup_steps >= self.args.warmup and state.codec.planned
            if not ready and self.warmup_steps >= self.args.max_warmup:
                ready = self.warmup_exhausted = True
            if ready:
                self.link.set(self.link.rate)
                self.phase = "measure"
            return
        rec = {"step_s": dt, "compressed": compressed}
        if st is not None:
            rec.update(
                comm_ms=1e3 * st.comm_s,
                encode_ms=1e3 * st.encode_s,
                decode_ms=1e3 * st.decode_s,
                wire_bytes=st.wire_bytes,
                raw_wire_bytes=st.raw_wire_bytes,
                buckets=st.buckets,
                extra={k: float(v) for k, v in st.extra.items()},
            )
        self.steps.append(rec)
        self._elapsed += dt
        done = len(self.steps) >= self.args.steps or (
            self._elapsed >= self.args.budget_s and len(self.steps) >= self.args.min_steps
        )
        if trainer.strategy.reduce_boolean_decision(done, all=False):  # any rank: all stop together
            self.link.set(self.link.warmup_rate)
            self.phase = "probe"


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Median step time and per-step means of the hook's statistics over the measured steps."""
    out: dict[str, Any] = {"measured_steps": len(steps)}
    if not steps:
        return out
    times = [s["step_s"] for s in steps]
    out["step_s"] = statistics.median(times)
    out["step_s_min"] = min(times)
    out["step_s_max"] = max(times)
    out["compressed_fraction"] = sum(bool(s["compressed"]) for s in steps) / len(steps)
    for key in ("comm_ms", "encode_ms", "decode_ms", "wire_bytes", "raw_wire_bytes"):
        vals = [s[key] for s in steps if key in s]
        if vals:
            out[key] = sum(vals) / len(vals)
    if out.get("wire_bytes"):
        out["compression_ratio"] = out["raw_wire_bytes"] / out["wire_bytes"]
    extras: dict[str, list[float]] = {}
    for s in steps:
        for k, v in s.get("extra", {}).items():
            extras.setdefault(k, []).append(v)
    if extras:
        out["extra"] = {k: sum(v) / len(v) for k, v in extras.items()}
    if "fallback_buckets" in extras:
        out["fallback_buckets"] = max(extras["fallback_buckets"])
    return out


# --------------------------------------------------------------------------------------------------
def run_codec(name: str, options: dict[str, Any], args: argparse.Namespace, link: _Link) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_gradcomp.bench.models import build_model, loss_fn, synthetic_batch
    from lightning_gradcomp.strategy import CompressedDDPStrategy

    class BenchModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_model(args.model)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return loss_fn(self.net(x), y)

        def configure_optimizers(self) -> Any:
            if args.optimizer == "adamw":  # the strategy gives the codec its Adam-like defaults
                return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=1e-4)
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    # beside AdamW a codec goes by name: the strategy then gives it its defaults beside an
    # Adam-like optimizer (a codec object is kept as it is); the floor has no name to go by
    floor = name.split("@", 1)[0] == FLOOR
    by_name = args.optimizer == "adamw" and not floor
    try:
        strategy = CompressedDDPStrategy(
            codec=name.split("@", 1)[0] if by_name else make_bench_codec(name, options),
            codec_options=options if by_name else None,
            process_group_backend="gloo",
            init_sync=False,
            # the floor sends nothing: there is nothing for the fallback to weigh, and its probe
            # steps would send plainly inside the floor's measurement
            fallback=False if floor else None,
            # steady-state step times: no level controller (auto would otherwise start in its light arms)
            adaptive_level=False,
        )
    except (ValueError, TypeError) as err:  # raised alike on every rank: report it and go on
        return {"codec": name, "options": options, "error": str(err), "steps": [], "measured_steps": 0}
    codec = strategy.codec
    if args.level is not None and isinstance(codec, AdjustableCompression):
        codec.set_level(args.level)  # held there: no controller
    pl.seed_everything(0, verbose=False)  # identical models on every rank: no initial broadcast needed
    module = BenchModule()
    recorder = StepRecorder(codec, args, link)
    max_steps = args.max_warmup + args.steps + 2
    batch = synthetic_batch(args.model, args.batch_size, args.image_size)
    loader = DataLoader([batch] * max_steps, batch_size=None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    t0 = time.perf_counter()
    trainer.fit(module, loader)
    result = {
        "codec": name,
        "options": codec.config(),
        "collective": codec.collective_at(strategy.hook_state.step - 1),
        "level": codec.compression_level if isinstance(codec, AdjustableCompression) else None,
        "warmup_steps": recorder.warmup_steps,
        "warmup_exhausted": recorder.warmup_exhausted,
        "rel_error": recorder.rel_error,
        "fallback_decided": strategy.hook_state.fallback.decided,
        "fallback_buckets_total": len(strategy.hook_state.fallback.fallback),
        "wall_s": time.perf_counter() - t0,
        "steps": recorder.steps,
        "params": sum(p.numel() for p in module.parameters() if p.requires_grad),
    }
    result.update(summarize(recorder.steps))
    if isinstance(codec, BucketRouter):  # what auto chose, and the costs it chose from
        result["choice"] = codec.report_lines()
        result["choice_costs"] = [dataclasses.asdict(b) for b in getattr(codec, "costs", [])]
        result["choice_trials"] = list(getattr(codec, "trial_log", []))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightning_gradcomp.bench.worker", description=__doc__.split("\n")[0])
    p.add_argument("--codecs", required=True, help="comma list; 'floor' is the no-communication floor")
    p.add_argument("--codec-options", default="{}", help='JSON {"codec": {option: value}}')
    p.add_argument("--model", default="resnet18")
    p.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS)
    p.add_argument("--level", type=float, default=None, help="the compression level of adjustable codecs")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-warmup", type=int, default=30)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--min-steps", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=60.0)
    p.add_argument("--iface", default=None)
    p.add_argument("--rate", default=None)
    p.add_argument("--warmup-rate", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from lightning_gradcomp.bench.models import DEFAULT_BATCH

    if args.batch_size is None:
        args.batch_size = DEFAULT_BATCH.get(args.model, 32)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    rank = int(os.environ.get("NODE_RANK", "0"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    all_options = json.loads(args.codec_options)
    link = _Link(args.iface, args.rate, args.warmup_rate)
    results: list[dict[str, Any]] = []
    for name in [c for c in args.codecs.split(",") if c]:
        results.append(run_codec(name, options_for(name, all_options), args, link))
        r = results[-1]
        print(
            f"[rank {rank}] {name}: "
            + (
                f"error: {r['error']}"
                if "error" in r
                else f"median step {r.get('step_s', float('nan')):.3f} s over {r['measured_steps']} steps"
            ),
            file=sys.stderr,
            flush=True,
        )
        (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
