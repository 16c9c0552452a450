"""``codecs``: what each codec costs per step on real gradients, in one process.

A one-rank gloo process group runs the model under ``DistributedDataParallel`` with the codec's
hook, so every codec (including ``custom`` ones such as PowerSGD) goes through exactly the code of
a real run: the real buckets of the real model's gradients, error feedback, packing, decode. With
one rank the collectives return at once, so the time spent inside the hook per optimizer step is
the codec's own cost (encode + decode + the hook's bookkeeping). ``none`` gives the cost of the
hook without any codec (a copy and a division); ``over none`` is what the codec adds to it.

Throughput is the gradient's size (fp32 bytes of all parameters DDP reduces) divided by that time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from lightning_gradcomp.bench.results import Column, format_table, machine_info, write_csv, write_json

__all__ = ["COLUMNS", "add_arguments", "main", "measure_codec"]

_NEVER = 10**12

COLUMNS = [
    Column("model", "model"),
    Column("codec", "codec"),
    Column("grad_mb", "grad MB", "{:.1f}"),
    Column("hook_ms", "hook ms/step", "{:.1f}"),
    Column("over_none_ms", "over none ms", "{:.1f}"),
    Column("encode_ms", "encode ms", "{:.1f}"),
    Column("decode_ms", "decode ms", "{:.1f}"),
    Column("throughput_mb_s", "MB/s", "{:.0f}"),
    Column("compression_ratio", "ratio", "{:.1f}"),
    Column("rel_error", "rel err", "{:.3f}"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--codecs", default=None, help="comma list (default: the link benchmark's default list)")
    p.add_argument("--codec-options", default="{}", help='JSON {"codec": {option: value}}')
    p.add_argument("--models", default="resnet18,pspnet", help="comma list of resnet18, pspnet, tiny")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-warmup", type=int, default=30)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="bench_results/codecs")


def _init_single_process_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def measure_codec(name: str, options: dict[str, Any], model_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Steps of the model with the codec's hook on one rank; the hook's time per step."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from lightning_gradcomp.api import make_comm_hook
    from lightning_gradcomp.bench.models import DEFAULT_BATCH, build_model, loss_fn, synthetic_batch

    _init_single_process_group()
    torch.manual_seed(0)
    model = build_model(model_name)
    ddp = DistributedDataParallel(model, init_sync=False)
    # fallback off: in a one-rank group a plain all-reduce is free and would always win
    state, hook = make_comm_hook(name, ddp, stats_every=_NEVER, fallback=False, **options)
    spent = [0.0]

    def timed_hook(st, bucket):  # no annotations: DDP checks them
        t0 = time.perf_counter()
        fut = hook(st, bucket)
        fut.wait()  # completed already with one rank; waiting makes sure decode is inside the time
        spent[0] += time.perf_counter() - t0
        return fut

    ddp.register_comm_hook(state, timed_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    x, y = synthetic_batch(model_name, args.batch_size or DEFAULT_BATCH[model_name], args.image_size)
    # by name: a learned codec's is_compressing() is False until its basis or autoencoder exists
    will_compress = state.codec.name != "none"
    measured: list[dict[str, float]] = []
    rel_error = None
    phase, warm = "warmup", 0
    for _ in range(args.max_warmup + args.steps + 1):
        state.stats_every = 1 if phase == "probe" else _NEVER
        spent[0] = 0.0
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        opt.step()
        st = state.stats.pop()
        # "compressed" and actually smaller: a codec's own warm-up (GradiVeQ's, LGC's) runs on
        # the compressed path while still sending dense gradients
        compressed = bool(st is not None and st.compressed and st.wire_bytes < st.raw_wire_bytes)
        if phase == "probe":
            rel_error = None if st is None else st.rel_error
            break
        if phase == "warmup":
            warm += 1
            if warm >= args.warmup and (compressed or not will_compress) or warm >= args.max_warmup:
                phase = "measure"
            continue
        measured.append(
            {
                "hook_s": spent[0],
                "encode_s": st.encode_s if st else 0.0,
                "decode_s": st.decode_s if st else 0.0,
                "raw_bytes": st.raw_bytes if st else 0,
                "wire": st.wire_bytes if st else 0.0,
                "raw_wire": st.raw_wire_bytes if st else 0.0,
                "compressed": compressed,
            }
        )
        if len(measured) >= args.steps:
            phase = "probe"
    n = max(len(measured), 1)

    def median(key: str) -> float:
        return statistics.median(m[key] for m in measured) if measured else float("nan")

    hook_s = median("hook_s")
    raw = sum(m["raw_bytes"] for m in measured) / n
    wire = sum(m["wire"] for m in measured) / n
    return {
        "model": model_name,
        "codec": name,
        "options": state.codec.options(),
        "measured_steps": len(measured),
        "warmup_steps": warm,
        "compressed_fraction": sum(m["compressed"] for m in measured) / n,
        "grad_mb": raw / 1e6,
        "hook_ms": 1e3 * hook_s,
        "encode_ms": 1e3 * median("encode_s"),
        "decode_ms": 1e3 * median("decode_s"),
        "throughput_mb_s": raw / 1e6 / hook_s if hook_s > 0 else None,
        "compression_ratio": (sum(m["raw_wire"] for m in measured) / n) / wire if wire > 0 else None,
        "rel_error": rel_error,
    }


def main(args: argparse.Namespace) -> int:
    import torch

    from lightning_gradcomp.bench.link import default_codecs

    torch.set_num_threads(1)
    codecs = [c for c in (args.codecs.split(",") if args.codecs else default_codecs()) if c]
    options = json.loads(args.codec_options)
    rows = []
    for model_name in [m for m in args.models.split(",") if m]:
        base = None
        for name in codecs:
            print(f"codecs: {model_name} {name} ...", file=sys.stderr, flush=True)
            row = measure_codec(name, dict(options.get(name, {})), model_name, args)
            if name == "none":
                base = row["hook_ms"]
            rows.append(row)
        for row in rows:
            if row["model"] == model_name and base is not None:
                row["over_none_ms"] = row["hook_ms"] - base
    out = Path(args.out)
    meta = {"benchmark": "codecs", "threads": 1, "machine": machine_info(), "argv": getattr(args, "argv", sys.argv[1:])}
    write_json(out / "codecs.json", {"meta": meta, "rows": rows})
    write_csv(out / "codecs.csv", rows)
    print(format_table(rows, COLUMNS))
    print(f"\nwrote {out / 'codecs.json'} and {out / 'codecs.csv'}")
    return 0
