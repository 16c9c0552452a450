"""``accuracy``: task metric against bytes sent, for a fixed short training budget per codec.

Runs the project's recipes as they are (``recipes/resnet_cifar10.py`` on CIFAR-10,
``recipes/pspnet_camvid.py`` on CamVid) as subprocesses, one per codec, each with
``--codec NAME --devices 2 --accelerator cpu --max-steps N --metrics-json PATH --data-dir DIR
--no-fallback``,
and collects the final metrics each writes: the task metric (top-1 accuracy, mean IoU), the total
bytes the gradients sent, and the compression ratio. Nothing of the recipes is re-implemented here.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning_gradcomp.bench.results import Column, format_table, machine_info, write_csv, write_json

__all__ = ["COLUMNS", "TASKS", "add_arguments", "extract_metrics", "main"]

#: task -> (recipe script relative to the recipes directory, metric keys tried in order)
TASKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "cifar10": ("resnet_cifar10.py", ("task_metric", "metric", "val_acc", "val/acc", "test_acc", "accuracy", "acc")),
    "camvid": ("pspnet_camvid.py", ("task_metric", "metric", "val_miou", "val/miou", "miou", "mIoU", "val_iou", "iou")),
}
BYTES_KEYS = ("bytes_sent", "total_bytes_sent", "bytes_sent_total", "gradcomp/bytes_sent_total", "wire_bytes")
RATIO_KEYS = ("compression_ratio", "gradcomp/compression_ratio", "ratio")

COLUMNS = [
    Column("task", "task"),
    Column("codec", "codec"),
    Column("metric_name", "metric"),
    Column("metric", "value", "{:.4f}"),
    Column("gb_sent", "GB sent", "{:.3f}"),
    Column("compression_ratio", "ratio", "{:.1f}"),
    Column("steps", "steps"),
    Column("wall_s", "wall s", "{:.0f}"),
    Column("status", "status"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--codecs",
        default=None,
        help="comma list (default: the link benchmark's default list); NAME@LABEL for a second configuration",
    )
    p.add_argument(
        "--codec-options", default="{}", help='JSON {"codec": {option: value}} passed to the recipe per codec'
    )
    p.add_argument("--tasks", default="cifar10,camvid", help=f"comma list of {', '.join(TASKS)}")
    p.add_argument("--max-steps", type=int, default=300, help="optimizer steps per run (the fixed budget)")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--recipes-dir", default="recipes")
    p.add_argument("--cifar-data-dir", default="../shared/data/cifar10-jpeg.tar.gz")
    p.add_argument("--camvid-data-dir", default="../shared/data/CamVid")
    p.add_argument("--recipe-args", default="", help="extra arguments passed to every recipe")
    p.add_argument("--metric-key", default=None, help="key of the task metric in the recipe's JSON (default: guessed)")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per recipe run")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--out", default="bench_results/accuracy")


def _pick(d: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    flat = dict(d)
    for v in d.values():  # one level of nesting ({"metrics": {...}})
        if isinstance(v, dict):
            flat.update({k: x for k, x in v.items() if k not in flat})
    for k in keys:
        if isinstance(flat.get(k), (int, float)):
            return k, flat[k]
    return None, None


def extract_metrics(data: dict[str, Any], task: str, metric_key: str | None = None) -> dict[str, Any]:
    """The task metric, bytes sent and compression ratio from a recipe's metrics JSON."""
    keys = (metric_key,) if metric_key else TASKS[task][1]
    name, value = _pick(data, keys)
    if isinstance(data.get("metric_name"), str) and name in ("task_metric", "metric"):
        name = data["metric_name"]
    _, sent = _pick(data, BYTES_KEYS)
    _, ratio = _pick(data, RATIO_KEYS)
    _, steps = _pick(data, ("global_step", "steps", "step", "max_steps"))
    return {
        "metric_name": name,
        "metric": value,
        "bytes_sent": sent,
        "gb_sent": None if sent is None else sent / 1e9,
        "compression_ratio": ratio,
        "steps": steps,
    }


def run_recipe(task: str, codec: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    script = Path(args.recipes_dir) / TASKS[task][0]
    data_dir = args.cifar_data_dir if task == "cifar10" else args.camvid_data_dir
    metrics = out / "runs" / f"{task}-{codec}.json"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    if metrics.exists():
        metrics.unlink()
    cmd = [
        args.python,
        str(script),
        "--codec",
        codec.split("@", 1)[0],
        "--devices",
        str(args.devices),
        "--accelerator",
        "cpu",
        "--max-steps",
        str(args.max_steps),
        "--metrics-json",
        str(metrics),
        "--data-dir",
        data_dir,
        # the accuracy of the codec itself: on this benchmark's fast local link the timing probe
        # would otherwise send plain all-reduce and every codec would train uncompressed
        "--no-fallback",
    ]
    all_options = json.loads(args.codec_options)
    options = all_options.get(codec, all_options.get(codec.split("@", 1)[0]))
    if options:
        cmd += ["--codec-options", json.dumps(options)]
    cmd += shlex.split(args.recipe_args)
    row: dict[str, Any] = {"task": task, "codec": codec, "command": shlex.join(cmd)}
    if not script.exists():
        row["status"] = f"missing recipe {script}"
        return row
    t0 = time.perf_counter()
    log = out / "runs" / f"{task}-{codec}.log"
    with log.open("w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout, check=False)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    row["wall_s"] = time.perf_counter() - t0
    if rc != 0 or not metrics.exists():
        row["status"] = f"failed (exit {rc}), see {log}"
        return row
    data = json.loads(metrics.read_text())
    row.update(extract_metrics(data, task, args.metric_key))
    row["raw"] = data
    row["status"] = "ok" if row["metric"] is not None else "no task metric in JSON"
    return row


def main(args: argparse.Namespace) -> int:
    from lightning_gradcomp.bench.link import default_codecs

    codecs = [c for c in (args.codecs.split(",") if args.codecs else default_codecs()) if c]
    tasks = [t for t in args.tasks.split(",") if t]
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise SystemExit(f"--tasks must be among {list(TASKS)}, got {bad}")
    out = Path(args.out)
    rows = []
    meta = {
        "benchmark": "accuracy",
        "max_steps": args.max_steps,
        "devices": args.devices,
        "machine": machine_info(),
        "argv": getattr(args, "argv", sys.argv[1:]),
    }
    for task in tasks:
        for codec in codecs:
            print(f"accuracy: {task} {codec} ...", file=sys.stderr, flush=True)
            rows.append(run_recipe(task, codec, args, out))
            write_json(out / "accuracy.json", {"meta": meta, "rows": rows})
            write_csv(out / "accuracy.csv", rows)
    print(format_table(rows, COLUMNS))
    print(f"\nwrote {out / 'accuracy.json'} and {out / 'accuracy.csv'}")
    return 0 if all(r.get("status") == "ok" for r in rows) else 1
