"""``memory``: does a long compressed run hold memory flat? RSS and peak RSS per rank, early and late.

``--ranks`` gloo processes on this machine train a model (by default the 32-256-256-10 ``mlp``)
with plain ``DistributedDataParallel`` and the codec's hook (``make_comm_hook``, its timing
fallback off so that the codec runs on every step) for ``--steps`` optimizer steps, a new random
batch each step, and report per rank VmRSS and VmHWM (peak RSS)
from ``/proc/self/status`` after step ``--start`` and at the end. A leak in the hook (residuals,
staged state, statistics, futures) shows as an end value well above the start value; the first
few thousand steps take some 20 MiB while the allocator and gloo's buffers warm up, so compare
a long run's second half with its first (``--steps 6000 --start 3000``).
"""

from __future__ import annotations

import argparse
import json
import queue as queue_mod
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from lightning_gradcomp.bench import paths
from lightning_gradcomp.bench.models import MODELS
from lightning_gradcomp.bench.results import Column, format_table, machine_info, write_csv, write_json

__all__ = ["COLUMNS", "add_arguments", "main", "memory_mib"]

COLUMNS = [
    Column("rank", "rank"),
    Column("codec", "codec"),
    Column("steps", "steps"),
    Column("compressed_steps", "compressed"),
    Column("rss_start_mib", "RSS start MiB", "{:.1f}"),
    Column("rss_end_mib", "RSS end MiB", "{:.1f}"),
    Column("rss_growth_mib", "RSS growth", "{:+.1f}"),
    Column("peak_start_mib", "peak start MiB", "{:.1f}"),
    Column("peak_end_mib", "peak end MiB", "{:.1f}"),
    Column("step_ms", "ms/step", "{:.1f}"),
    Column("residual_norm", "residual norm", "{:.3g}"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--codec", default="topk", help="the codec of the run")
    p.add_argument("--codec-options", default="{}", help='JSON {"codec": {option: value}}')
    p.add_argument("--ranks", type=int, default=2, help="gloo processes on this machine")
    p.add_argument("--steps", type=int, default=3000, help="optimizer steps")
    p.add_argument("--start", type=int, default=100, help="the start values are taken after this step")
    p.add_argument("--model", default="mlp", choices=MODELS)
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default: the model's benchmark batch)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument(
        "--nonfinite",
        default="zero",
        choices=["zero", "skip"],
        help="the hook's policy (make_comm_hook's default, zero; skip, the strategy's, holds a step's "
        "replaced residuals until it has settled)",
    )
    p.add_argument("--out", default=str(paths.results_dir("memory")), help="output directory (default: %(default)s)")


def memory_mib() -> dict[str, float]:
    """VmRSS and VmHWM of this process in MiB (``resource`` gives only the peak)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value, _unit = line.split()
                    out[key[:-1]] = int(value) / 1024
    except OSError:
        import resource

        out["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _rank(rank: int, world: int, init_file: str, args: argparse.Namespace, options: dict, queue: Any) -> None:
    """One rank's run; its report, or its traceback, goes to ``queue``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        from lightning_gradcomp import make_comm_hook
        from lightning_gradcomp.bench.data import batches
        from lightning_gradcomp.bench.models import DEFAULT_BATCH, build_model, loss_fn

        torch.manual_seed(0)  # the same model on every rank
        ddp = DistributedDataParallel(build_model(args.model))
        # fallback off: on this machine's loopback it would send plainly and leave the codec idle
        state, hook = make_comm_hook(args.codec, ddp, fallback=False, nonfinite=args.nonfinite, **options)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        source, _ = batches(args.model, args.batch_size or DEFAULT_BATCH[args.model], fresh=True, seed=rank << 32)
        start = min(args.start, args.steps)
        report: dict[str, Any] = {"compressed_steps": 0}
        t0 = time.perf_counter()
        for step in range(args.steps):
            x, y = next(source)
            opt.zero_grad(set_to_none=True)
            loss_fn(ddp(x), y).backward()
            if not state.consume_skip():
                opt.step()
            st = state.stats.pop()  # as the Lightning monitor does every step
            report["compressed_steps"] += int(st is not None and st.compressed)
            if step + 1 == start:
                report["start"] = memory_mib()
        report["end"] = memory_mib()
        report["seconds"] = time.perf_counter() - t0
        report["residual_norm"] = float(state.memory.norm())
        queue.put((rank, "ok", report))
    except BaseException:  # the parent reports it instead of waiting for a rank that is gone
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(args: argparse.Namespace, options: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Start the ranks, wait for their reports (by rank); ``RuntimeError`` if one fails or times out."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # only what a rank reads: the parsed arguments also hold the verb's module, which does not pickle
    keys = ("codec", "model", "batch_size", "steps", "start", "nonfinite")
    rank_args = argparse.Namespace(**{k: getattr(args, k) for k in keys})
    with tempfile.TemporaryDirectory(prefix="gradcomp-memory-") as tmp:
        init_file = str(Path(tmp) / "store")
        procs = [
            ctx.Process(target=_rank, args=(rank, args.ranks, init_file, rank_args, options, queue))
            for rank in range(args.ranks)
        ]
        for p in procs:
            p.start()
        reports: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + args.timeout
        try:
            while len(reports) < args.ranks:
                try:
                    rank, status, value = queue.get(timeout=1.0)
                except queue_mod.Empty:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"memory: no report after {args.timeout:.0f} s") from None
                    if any(p.exitcode not in (None, 0) for p in procs):
                        raise RuntimeError("memory: a rank exited without a report") from None
                    continue
                if status != "ok":
                    raise RuntimeError(f"memory: rank {rank} failed:\n{value}")
                reports[rank] = value
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
                    p.join()
    return reports


def main(args: argparse.Namespace) -> int:
    from lightning_gradcomp.bench.worker import options_for
    from lightning_gradcomp.registry import available_codecs

    if args.ranks < 1 or args.steps < 1 or args.start < 1:
        print("memory: --ranks, --steps and --start must be >= 1", file=sys.stderr)
        return 2
    if args.codec not in available_codecs():
        print(f"memory: unknown codec {args.codec!r}; available: {', '.join(available_codecs())}", file=sys.stderr)
        return 2
    try:
        options = options_for(args.codec, json.loads(args.codec_options))
        reports = run(args, options)
    except (ValueError, RuntimeError) as err:
        print(err, file=sys.stderr)
        return 1
    rows = []
    for rank in sorted(reports):
        r = reports[rank]
        s, e = r["start"], r["end"]
        rows.append(
            {
                "rank": rank,
                "codec": args.codec,
                "model": args.model,
                "steps": args.steps,
                "start_step": min(args.start, args.steps),
                "compressed_steps": r["compressed_steps"],
                "rss_start_mib": s.get("VmRSS"),
                "rss_end_mib": e.get("VmRSS"),
                "rss_growth_mib": e["VmRSS"] - s["VmRSS"] if "VmRSS" in s and "VmRSS" in e else None,
                "peak_start_mib": s.get("VmHWM"),
                "peak_end_mib": e.get("VmHWM"),
                "seconds": r["seconds"],
                "step_ms": 1e3 * r["seconds"] / args.steps,
                "residual_norm": r["residual_norm"],
            }
        )
    out = Path(args.out)
    meta = {
        "benchmark": "memory",
        "codec_options": options,
        "ranks": args.ranks,
        "machine": machine_info(),
        "argv": getattr(args, "argv", sys.argv[1:]),
    }
    write_json(out / "memory.json", {"meta": meta, "rows": rows})
    write_csv(out / "memory.csv", rows)
    print(f"codec {args.codec}, model {args.model}, {args.steps} steps; start: after step {rows[0]['start_step']}")
    print(format_table(rows, COLUMNS))
    print(f"\nwrote {out / 'memory.json'} and {out / 'memory.csv'}")
    return 0
