"""``codecs``: what each codec costs per step on real gradients, in one process.

A one-rank gloo process group runs the model under ``DistributedDataParallel`` with the codec's
hook, so every codec (including ``custom`` ones such as PowerSGD) goes through exactly the code of
a real run: the real buckets of the real model's gradients, error feedback, packing, decode. With
one rank the collectives return at once, so the time spent inside the hook per optimizer step is
the codec's own cost (encode + decode + the hook's bookkeeping). ``none`` gives the cost of the
hook without any codec (a copy and a division); ``over none`` is what the codec adds to it.

Throughput is the gradient's size (fp32 bytes of all parameters DDP reduces) divided by that time,
and ``of mem BW`` is that throughput as a fraction of the device's memory bandwidth
(``--mem-bandwidth-gbs``): a codec that reads and writes the gradient a few times cannot go faster
than a few times the gradient's size over that bandwidth.

``NAME@LABEL`` measures a second configuration of codec ``NAME``, with its options under
``NAME@LABEL`` in ``--codec-options``: a grid of settings is a list of labels.

``--fit-steps N`` trains for at least N steps with the codec's hook before the measured ones, each
step on a new batch (CIFAR-10 images with ``--data cifar10=PATH``, random ones otherwise), so a
codec that learns from the gradients fits on varied ones and is measured on gradients its fit
never saw; the codec's own schedule (``warmup_steps``, ``ae_train_steps``, ...) is set in
``--codec-options``. What such a codec learned is reported beside its cost where it has it: the
autoencoder's training time, size and held-out error (``lgc``), the mean number of PCA components
and the variance they explain (``gradiveq``).

``--device cuda`` runs the model on the GPU with a one-rank NCCL group and times the hook with CUDA
events on the current stream (:mod:`lightning_gradcomp.timing`), so asynchronous kernels are timed
when they run, not when they are launched. ``torch-powersgd`` is torch's own ``powerSGD_hook``
(rank 1, compressing from step 2) registered directly on the same model and gradients, beside the
package's codecs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from lightning_gradcomp.bench import paths
from lightning_gradcomp.bench.results import Column, format_table, machine_info, write_csv, write_json

__all__ = [
    "COLUMNS",
    "LEARNED_COLUMNS",
    "LEARNED_SCALARS",
    "add_arguments",
    "columns_for",
    "learned_summary",
    "main",
    "measure_codec",
]

_NEVER = 10**12
#: torch's own PowerSGD hook, registered directly (not a codec of this package)
TORCH_POWERSGD = "torch-powersgd"
#: HBM3 bandwidth of an H100 SXM, the default for ``--device cuda``
H100_SXM_GBS = 3350.0

COLUMNS = [
    Column("model", "model"),
    Column("device", "device"),
    Column("codec", "codec"),
    Column("grad_mb", "grad MB", "{:.1f}"),
    Column("hook_ms", "hook ms/step", "{:.1f}"),
    Column("over_none_ms", "over none ms", "{:.1f}"),
    Column("encode_ms", "encode ms", "{:.1f}"),
    Column("decode_ms", "decode ms", "{:.1f}"),
    Column("throughput_mb_s", "MB/s", "{:.0f}"),
    Column("mem_bw_fraction", "of mem BW", "{:.4f}"),
    Column("compression_ratio", "ratio", "{:.1f}"),
    Column("rel_error", "rel err", "{:.3f}"),
]
#: what a codec learned from the gradients, for the codecs that have it (:func:`learned_summary`)
LEARNED_COLUMNS = [
    Column("ae_train_s", "AE train s", "{:.1f}"),
    Column("ae_params", "AE params", "{:.0f}"),
    Column("ae_recon_error", "AE err", "{:.3f}"),
    Column("basis_k", "PCA k", "{:.1f}"),
    Column("explained_variance", "PCA EV", "{:.3f}"),
]


def columns_for(rows: list[dict[str, Any]]) -> list[Column]:
    """:data:`COLUMNS`, and those of :data:`LEARNED_COLUMNS` that some row has."""
    return COLUMNS + [c for c in LEARNED_COLUMNS if any(r.get(c.key) is not None for r in rows)]


#: column of :data:`LEARNED_COLUMNS` -> the scalar a codec reports it as (``LearnedState.scalars``)
LEARNED_SCALARS = {
    "ae_train_s": "ae_train_s",
    "ae_params": "ae_params",
    "ae_recon_error": "ae_recon_error",
    "basis_k": "pca_k",
    "explained_variance": "explained_variance",
}


def learned_summary(scalars: dict[str, float]) -> dict[str, float]:
    """The :data:`LEARNED_COLUMNS` among what a learning codec reports of its last step
    (:meth:`~lightning_gradcomp.codecs.base.LearnedState.scalars`, as
    ``CodecHookState.codec_scalars`` returns them): an autoencoder's training time, held-out
    relative error and parameter count (``lgc``, once trained); PCA bases' mean number of
    components and the variance they explain (``gradiveq``). A value that is not finite or is 0 is
    left out: a codec reports 0 for what it has not fitted (``gradiveq`` before its first fit, or
    the variance of bases a leader fits on its own gradient, which no fit measured)."""
    out = {}
    for column, name in LEARNED_SCALARS.items():
        v = scalars.get(name)
        if v is not None and math.isfinite(v) and v != 0:
            out[column] = float(v)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--codecs",
        default=None,
        help="comma list (default: the link benchmark's default list); NAME@LABEL measures a second configuration "
        "of NAME, with options given under NAME@LABEL in --codec-options",
    )
    p.add_argument("--codec-options", default="{}", help='JSON {"codec": {option: value}}')
    p.add_argument(
        "--models",
        "--model",
        dest="models",
        default="resnet18,pspnet",
        help="comma list of resnet18 (CIFAR shape), resnet50 (ImageNet shape, 224x224, batch 32), pspnet, tiny, mlp",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model and the codecs run")
    p.add_argument(
        "--mem-bandwidth-gbs",
        type=float,
        default=None,
        help=f"the device's memory bandwidth in GB/s, to report each codec's throughput as a fraction of it "
        f"(default for cuda: {H100_SXM_GBS:g}, an H100 SXM's HBM3; none for cpu)",
    )
    p.add_argument("--no-torch-powersgd", action="store_true", help=f"leave out the {TORCH_POWERSGD!r} row")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-warmup", type=int, default=30)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--fit-steps",
        type=int,
        default=0,
        help="train at least this many steps with the codec before measuring, each on a new batch (real with "
        "--data, random otherwise), and measure on new batches too: for codecs that learn from the gradients",
    )
    p.add_argument(
        "--data",
        default=None,
        metavar="cifar10=PATH",
        help="real batches for the models they fit (cifar10: resnet18, tiny): cifar10-jpeg.tar.gz, "
        "a directory holding it, or an unpacked train/<class>/*.jpg tree",
    )
    p.add_argument("--out", default=str(paths.results_dir("codecs")), help="output directory (default: %(default)s)")


def _init_single_process_group(device: str = "cpu") -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        if device == "cuda":
            import torch

            torch.cuda.set_device(0)
            dist.init_process_group(
                "nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0)
            )
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def measure_codec(name: str, options: dict[str, Any], model_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Steps of the model with the codec's hook on one rank; the hook's time per step."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from lightning_gradcomp.api import make_comm_hook
    from lightning_gradcomp.bench.data import batches
    from lightning_gradcomp.bench.models import DEFAULT_BATCH, build_model, loss_fn
    from lightning_gradcomp.timing import clock_for

    device_name = getattr(args, "device", "cpu")
    _init_single_process_group(device_name)
    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    clock = clock_for(device)
    torch.manual_seed(0)
    model = build_model(model_name).to(device)
    ddp = DistributedDataParallel(model, device_ids=[0] if device.type == "cuda" else None, init_sync=False)
    if name == TORCH_POWERSGD:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

        state = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        hook = torch_powersgd.powerSGD_hook
        stats = None
    else:
        # fallback off: in a one-rank group a plain all-reduce is free and would always win
        state, hook = make_comm_hook(name.split("@", 1)[0], ddp, stats_every=_NEVER, fallback=False, **options)
        stats = state
    marks: list = []

    def timed_hook(st, bucket):  # no annotations: DDP checks them
        start = clock.mark()
        fut = hook(st, bucket)
        fut.wait()  # completed already with one rank; waiting makes sure decode is inside the time
        marks.append((start, clock.mark()))
        return fut

    ddp.register_comm_hook(state, timed_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    fit_steps = getattr(args, "fit_steps", 0)
    source, data_name = batches(
        model_name,
        args.batch_size or DEFAULT_BATCH[model_name],
        args.image_size,
        data=getattr(args, "data_paths", None),
        fresh=fit_steps > 0,
    )
    raw_grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    # by name: a learned codec's is_compressing() is False until its basis or autoencoder exists
    will_compress = name.split("@", 1)[0] != "none"
    min_warmup, max_warmup = max(args.warmup, fit_steps), max(args.max_warmup, fit_steps)
    measured: list[dict[str, float]] = []
    rel_error = None
    phase, warm = "warmup", 0
    for step in range(max_warmup + args.steps + 1):
        if stats is not None:
            stats.stats_every = 1 if phase == "probe" else _NEVER
        x, y = (t.to(device) for t in next(source))
        marks.clear()
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        opt.step()
        # the events of this step are read here, outside the hook (a wait once per step)
        spent = [sum(clock.elapsed(a, b) for a, b in marks)]
        st = stats.stats.pop() if stats is not None else None
        # "compressed" and actually smaller: a codec's own warm-up (GradiVeQ's, LGC's) runs on
        # the compressed path while still sending dense gradients
        if stats is None:
            compressed = step >= state.start_powerSGD_iter
        else:
            compressed = bool(st is not None and st.compressed and st.wire_bytes < st.raw_wire_bytes)
        if phase == "probe":
            rel_error = None if st is None else st.rel_error
            break
        if phase == "warmup":
            warm += 1
            if warm >= min_warmup and (compressed or not will_compress) or warm >= max_warmup:
                phase = "measure"
            continue
        measured.append(
            {
                "hook_s": spent[0],
                "encode_s": st.encode_s if st else 0.0,
                "decode_s": st.decode_s if st else 0.0,
                "raw_bytes": st.raw_bytes if st else raw_grad_bytes,
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
    throughput = raw / 1e6 / hook_s if hook_s > 0 else None
    torch_options = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
    bandwidth = getattr(args, "mem_bandwidth_gbs", None)
    if bandwidth is None and device.type == "cuda":
        bandwidth = H100_SXM_GBS
    return {
        "model": model_name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "codec": name,
        "options": state.codec.config() if stats is not None else torch_options,
        "batches": data_name,
        "measured_steps": len(measured),
        "warmup_steps": warm,
        "compressed_fraction": sum(m["compressed"] for m in measured) / n,
        "grad_mb": raw / 1e6,
        "hook_ms": 1e3 * hook_s,
        "encode_ms": 1e3 * median("encode_s") if stats is not None else None,
        "decode_ms": 1e3 * median("decode_s") if stats is not None else None,
        "throughput_mb_s": throughput,
        "mem_bandwidth_gbs": bandwidth,
        "mem_bw_fraction": throughput / 1e3 / bandwidth if throughput is not None and bandwidth else None,
        "compression_ratio": (sum(m["raw_wire"] for m in measured) / n) / wire if wire > 0 else None,
        "rel_error": rel_error,
        **(learned_summary(state.codec_scalars()) if stats is not None else {}),
    }


def main(args: argparse.Namespace) -> int:
    import torch

    from lightning_gradcomp.bench.data import parse_data
    from lightning_gradcomp.bench.link import default_codecs
    from lightning_gradcomp.bench.worker import options_for

    torch.set_num_threads(1)
    codecs = [c for c in (args.codecs.split(",") if args.codecs else default_codecs()) if c]
    if not getattr(args, "no_torch_powersgd", False) and TORCH_POWERSGD not in codecs:
        codecs.append(TORCH_POWERSGD)
    if getattr(args, "device", "cpu") == "cuda" and not torch.cuda.is_available():
        print("codecs: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    options = json.loads(args.codec_options)
    try:
        args.data_paths = parse_data(getattr(args, "data", None))
    except ValueError as err:
        print(f"codecs: {err}", file=sys.stderr)
        return 2
    rows = []
    for model_name in [m for m in args.models.split(",") if m]:
        base = None
        for name in codecs:
            print(f"codecs: {model_name} {name} ...", file=sys.stderr, flush=True)
            row = measure_codec(name, options_for(name, options), model_name, args)
            if name == "none":
                base = row["hook_ms"]
            rows.append(row)
        for row in rows:
            if row["model"] == model_name and base is not None:
                row["over_none_ms"] = row["hook_ms"] - base
    out = Path(args.out)
    meta = {
        "benchmark": "codecs",
        "threads": 1,
        "device": getattr(args, "device", "cpu"),
        "machine": machine_info(),
        "argv": getattr(args, "argv", sys.argv[1:]),
    }
    write_json(out / "codecs.json", {"meta": meta, "rows": rows})
    write_csv(out / "codecs.csv", rows)
    print(format_table(rows, columns_for(rows)))
    print(f"\nwrote {out / 'codecs.json'} and {out / 'codecs.csv'}")
    return 0
