"""``accuracy``: task metric against bytes sent, for a fixed training budget per codec and seed.

Runs the project's recipes as they are (``recipes/resnet_cifar10.py`` on CIFAR-10,
``recipes/pspnet_camvid.py`` on CamVid) as subprocesses, one per (task, codec, seed), each on
its YAML config with ``--trainer.strategy.codec NAME --trainer.devices 2 --seed_everything S
--trainer.max_steps N`` (or ``--trainer.max_epochs N``) ``--report.metrics_json PATH
--trainer.strategy.fallback false`` (and ``--data.data_dir DIR`` when given), and collects what each writes: the task
metric (top-1 accuracy, mean IoU), the total bytes the gradients sent, the compression ratio over
the whole run and at its last step, and the validation history (metric at the step of every
validation, the input of ``tta``). Nothing of the recipes is re-implemented here.

Every finished run is saved at once to ``OUT/accuracy.json`` and ``OUT/accuracy.csv``; its
metrics and log are ``OUT/runs/<task>-<codec>-seed<S>.{json,log}``. With ``--resume`` a run that
was stopped goes on where it stopped: each configuration (task, codec label, seed, budget,
``--recipe-args``, codec options, devices) already in ``OUT/accuracy.json`` with status ``ok`` is
skipped and its row kept; failed ones run again; rows of other configurations stay in the file.
Without ``--resume`` the file is written anew.

On a GPU machine, ``--accelerator gpu --devices 1 --jobs 4`` runs four recipes at once on the one
GPU (each a single NCCL rank: the codec compresses that rank's gradient, as every rank's would be;
what only several ranks do, a shared support or basis drawn from the leader, is then the rank's
own). Rows record the accelerator; keep such results in their own ``--out``.

The summary gives per (task, codec, configuration) the mean of the metric over the seeds and its
spread (max - min), the steps, and the mean compression ratios.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from lightning_gradcomp.bench import paths
from lightning_gradcomp.bench.results import (
    Column,
    appended_argv,
    format_table,
    machine_info,
    machine_key,
    write_csv,
    write_json,
)

__all__ = [
    "COLUMNS",
    "DEFAULT_MAX_STEPS",
    "SUMMARY_COLUMNS",
    "TASKS",
    "add_arguments",
    "budget_label",
    "config_key",
    "extract_history",
    "extract_metrics",
    "fill_older_rows",
    "main",
    "normalize_recipe_args",
    "recipe_option",
    "run_dir",
    "run_name",
    "run_recipe",
    "summarize",
]

#: task -> (recipe script relative to the recipes directory, metric keys tried in order)
TASKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "cifar10": ("resnet_cifar10.py", ("task_metric", "metric", "val_acc", "val/acc", "test_acc", "accuracy", "acc")),
    "camvid": ("pspnet_camvid.py", ("task_metric", "metric", "val_miou", "val/miou", "miou", "mIoU", "val_iou", "iou")),
}
BYTES_KEYS = ("bytes_sent", "total_bytes_sent", "bytes_sent_total", "gradcomp/bytes_sent_total", "wire_bytes")
RATIO_KEYS = ("compression_ratio", "gradcomp/compression_ratio", "ratio")

#: the step budget when neither --max-steps nor --max-epochs is given
DEFAULT_MAX_STEPS = 300

COLUMNS = [
    Column("task", "task"),
    Column("codec", "codec"),
    Column("seed", "seed"),
    Column("metric_name", "metric"),
    Column("metric", "value", "{:.4f}"),
    Column("gb_sent", "GB sent", "{:.3f}"),
    Column("compression_ratio_last", "ratio last", "{:.1f}"),
    Column("compression_ratio", "ratio run", "{:.1f}"),
    Column("steps", "steps"),
    Column("wall_s", "wall s", "{:.0f}"),
    Column("status", "status"),
]

#: one line per (task, codec, configuration): the seeds' mean and spread
SUMMARY_COLUMNS = [
    Column("task", "task"),
    Column("codec", "codec"),
    Column("budget", "budget"),
    Column("seeds", "seeds"),
    Column("metric_name", "metric"),
    Column("metric_mean", "mean", "{:.4f}"),
    Column("metric_spread", "max-min", "{:.4f}"),
    Column("vs_none_mean", "vs none", "{:+.4f}"),
    Column("vs_none_spread", "vs none max-min", "{:.4f}"),
    Column("steps", "steps", "{:.0f}"),
    Column("compression_ratio_last", "ratio last", "{:.1f}"),
    Column("compression_ratio", "ratio run", "{:.1f}"),
    Column("gb_sent", "GB sent", "{:.3f}"),
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
    p.add_argument("--seeds", default="0", help="comma list of seeds, one run per seed (passed as --seed)")
    p.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help=f"optimizer steps per run, the fixed budget (default {DEFAULT_MAX_STEPS} without --max-epochs)",
    )
    p.add_argument("--max-epochs", type=int, default=None, help="epochs per run, instead of (or with) --max-steps")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument(
        "--accelerator", choices=("cpu", "gpu"), default="cpu", help="passed to the recipes (default %(default)s)"
    )
    p.add_argument("--jobs", type=int, default=1, help="recipe runs at once (default 1; more on a GPU machine)")
    p.add_argument("--recipes-dir", default=None, help="the recipes (default: the checkout's recipes/)")
    p.add_argument(
        "--cifar-data-dir", default=None, help="CIFAR-10 for resnet_cifar10.py (default: the recipe's own default)"
    )
    p.add_argument("--camvid-data-dir", default=None, help="CamVid for pspnet_camvid.py (default: the recipe's own)")
    p.add_argument("--recipe-args", default="", help="extra arguments passed to every recipe")
    p.add_argument("--metric-key", default=None, help="key of the task metric in the recipe's JSON (default: guessed)")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per recipe run")
    p.add_argument("--python", default=sys.executable)
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep OUT/accuracy.json: skip the configurations it holds with status ok, run the failed and missing ones",
    )
    p.add_argument("--out", default=str(paths.results_dir("accuracy")), help="output directory (default: %(default)s)")


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
    _, ratio_last = _pick(data, ("compression_ratio_last",))
    _, steps = _pick(data, ("global_step", "steps", "step", "max_steps"))
    return {
        "metric_name": name,
        "metric": value,
        "bytes_sent": sent,
        "gb_sent": None if sent is None else sent / 1e9,
        "compression_ratio": ratio,
        "compression_ratio_last": ratio_last,
        "steps": steps,
    }


def extract_history(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The recipe's validation history, ``[{"step": int, "metric": float}, ...]`` by step, with
    ``wall_s`` (seconds since training started) and ``bytes_sent`` / ``raw_bytes`` (this rank's
    bytes so far, and what fp32 all-reduce would have sent) where the recipe recorded them; of two
    points at one step the later one counts. Empty when the recipe records none."""
    points: dict[int, dict[str, Any]] = {}
    for p in data.get("history") or []:
        if isinstance(p, dict) and all(isinstance(p.get(k), (int, float)) for k in ("step", "metric")):
            point: dict[str, Any] = {"step": int(p["step"]), "metric": float(p["metric"])}
            for key in ("wall_s", "bytes_sent", "raw_bytes"):
                if isinstance(p.get(key), (int, float)):
                    point[key] = float(p[key])
            points[point["step"]] = point
    return [points[k] for k in sorted(points)]


def recipe_option(argv: list[str], name: str) -> str | None:
    """The value of ``name`` in an argument list (``--model x`` or ``--model=x``), the last one wins."""
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def _int_or_text(value: str | None) -> int | str | None:
    return int(value) if value is not None and value.isdigit() else value


def _budget(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """(max_steps, max_epochs) of each run: as given, or the default step budget when neither is."""
    if args.max_steps is None and args.max_epochs is None:
        return DEFAULT_MAX_STEPS, None
    return args.max_steps, args.max_epochs


def _codec_options(args: argparse.Namespace, codec: str) -> dict[str, Any]:
    all_options = json.loads(args.codec_options)
    return all_options.get(codec, all_options.get(codec.split("@", 1)[0])) or {}


#: recipe flags of the argparse recipes that came before the LightningCLI ones, and what they
#: became; rows recorded with them keep matching the same configuration run today
LEGACY_RECIPE_FLAGS = {
    "--model": ["--model.model"],
    "--batch-size": ["--data.batch_size"],
    "--lr": ["--model.lr"],
    "--weight-decay": ["--model.weight_decay"],
    "--train-subset": ["--data.train_subset"],
    "--val-subset": ["--data.val_subset"],
    "--crop-size": ["--data.crop_size"],
    "--encoder": ["--model.encoder"],
    "--val-every-n-steps": ["--trainer.check_val_every_n_epoch", "null", "--trainer.val_check_interval"],
}


def normalize_recipe_args(recipe_args: str | None) -> str | None:
    """``recipe_args`` in today's LightningCLI spelling (legacy argparse flags translated)."""
    if not recipe_args:
        return recipe_args
    out: list[str] = []
    for a in shlex.split(recipe_args):
        flag, eq, value = a.partition("=")
        new = LEGACY_RECIPE_FLAGS.get(flag)
        if new is None:
            out.append(a)
        else:
            out += new if not eq else [*new, value]
    return shlex.join(out)


def config_key(row: dict[str, Any]) -> tuple:
    """What makes two runs the same configuration: task, codec label, seed, budget, recipe
    arguments (legacy flags read as today's), codec options, devices and the machine
    (:func:`~lightning_gradcomp.bench.results.machine_key`). A row made by an older version
    without these fields matches none of today's runs: rows written before the machine was
    recorded pair only with each other, since which machine ran them is not known."""
    return (
        row.get("task"),
        row.get("codec"),
        row.get("seed"),
        row.get("max_steps"),
        row.get("max_epochs"),
        normalize_recipe_args(row.get("recipe_args")),
        json.dumps(row.get("codec_options"), sort_keys=True),
        row.get("devices"),
        row.get("machine"),
    )


def run_name(task: str, codec: str, seed: int) -> str:
    """What a run's files under ``OUT/runs`` are named after: ``<task>-<codec>-seed<S>``."""
    return f"{task}-{codec}-seed{seed}"


def run_dir(out: Path, task: str, codec: str, seed: int) -> Path:
    """The working directory of a run made with ``--jobs`` above 1: its logs, the configuration
    LightningCLI saved and its checkpoints (``score`` reads them there)."""
    return Path(out) / "runs" / f"{run_name(task, codec, seed)}.cwd"


def run_recipe(task: str, codec: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One recipe run as a subprocess; its row, with the configuration that :func:`config_key` reads."""
    script = (Path(args.recipes_dir or paths.recipes_dir()) / TASKS[task][0]).resolve()
    data_dir = args.cifar_data_dir if task == "cifar10" else args.camvid_data_dir
    if data_dir and Path(data_dir).exists():
        data_dir = str(Path(data_dir).resolve())
    name = run_name(task, codec, seed)
    metrics = (out / "runs" / f"{name}.json").resolve()
    metrics.parent.mkdir(parents=True, exist_ok=True)
    if metrics.exists():
        metrics.unlink()
    max_steps, max_epochs = _budget(args)
    options = _codec_options(args, codec)
    recipe_args = shlex.split(args.recipe_args)
    cmd = [
        args.python,
        str(script),
        "--trainer.strategy.codec",
        codec.split("@", 1)[0],
        "--trainer.devices",
        str(args.devices),
        "--trainer.accelerator",
        args.accelerator,
        "--seed_everything",
        str(seed),
    ]
    if max_steps is not None:
        # a step budget alone: as many epochs as it takes
        cmd += ["--trainer.max_steps", str(max_steps), "--trainer.max_epochs", str(max_epochs or -1)]
    elif max_epochs is not None:
        cmd += ["--trainer.max_epochs", str(max_epochs)]
    cmd += [
        "--report.metrics_json",
        str(metrics),
        # the accuracy of the codec itself: on this benchmark's fast local link the timing probe
        # would otherwise send plain all-reduce and every codec would train uncompressed
        "--trainer.strategy.fallback",
        "false",
        "--trainer.enable_progress_bar",
        "false",
    ]
    if data_dir:
        cmd += ["--data.data_dir", data_dir]
    if options:
        cmd += ["--trainer.strategy.codec_options", json.dumps(options)]
    cmd += recipe_args
    row: dict[str, Any] = {
        "task": task,
        "codec": codec,
        "seed": seed,
        "max_steps": max_steps,
        "max_epochs": max_epochs,
        "recipe_args": shlex.join(recipe_args),
        "codec_options": options,
        "devices": args.devices,
        "machine": machine_key(args.accelerator),
        "accelerator": args.accelerator,
        "model": recipe_option(recipe_args, "--model.model"),
        "batch_size": _int_or_text(recipe_option(recipe_args, "--data.batch_size")),
        "command": shlex.join(cmd),
    }
    if not script.exists():
        row["status"] = f"missing recipe {script}"
        return row
    # runs at once each get a working directory of their own: their logs, versions and
    # checkpoints (relative to it in the recipes' configs) must not meet
    cwd = None
    if args.jobs > 1:
        cwd = run_dir(out, task, codec, seed)
        cwd.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log = out / "runs" / f"{name}.log"
    with log.open("w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout, check=False, cwd=cwd)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    row["wall_s"] = time.perf_counter() - t0
    if rc != 0 or not metrics.exists():
        row["status"] = f"failed (exit {rc}), see {log}"
        return row
    data = json.loads(metrics.read_text())
    row.update(extract_metrics(data, task, args.metric_key))
    row["history"] = extract_history(data)
    # what the recipe itself reports wins over what its arguments say (its defaults are not in them)
    row["model"] = data.get("model", row["model"])
    row["batch_size"] = data.get("batch_size", row["batch_size"])
    row["raw"] = {k: v for k, v in data.items() if k != "history"}
    row["status"] = "ok" if row["metric"] is not None else "no task metric in JSON"
    return row


def fill_older_rows(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows written before each row recorded its seed and budget, completed: seed 0 (the recipes'
    default, which those runs used) and the budget of the results' ``meta``. Other rows unchanged."""
    budget = {"max_steps": meta.get("max_steps"), "max_epochs": meta.get("max_epochs")}
    return [r if "seed" in r else {"seed": 0, **budget, **r} for r in rows]


def budget_label(row: dict[str, Any]) -> str:
    """``"1 epoch"``, ``"300 steps"`` or ``"2 epochs or 500 steps"`` (whichever ends first), from a
    row or the results' meta."""
    parts = []
    if row.get("max_epochs") is not None:
        parts.append(f"{row['max_epochs']} epoch" + ("s" if row["max_epochs"] != 1 else ""))
    if row.get("max_steps") is not None:
        parts.append(f"{row['max_steps']} steps")
    return " or ".join(parts) or "-"


def _mean(values: list[Any]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return sum(values) / len(values) if values else None


CONTROLLER_FLAG = "--trainer.strategy.adaptive_level"


def _without_controller_flag(recipe_args: str | None) -> str | None:
    """``recipe_args`` without the level controller's flag and its value."""
    if not recipe_args:
        return recipe_args
    out: list[str] = []
    words = iter(shlex.split(recipe_args))
    for a in words:
        if a == CONTROLLER_FLAG:
            next(words, None)
        elif not a.startswith(CONTROLLER_FLAG + "="):
            out.append(a)
    return shlex.join(out)


def _pairing_key(row: dict[str, Any]) -> tuple:
    """What a run shares with the ``none`` run it is compared with: all of :func:`config_key` but
    the codec label, its options and the level controller's flag (``none`` has no level to set,
    and the strategy refuses the controller for it, so its run goes without the flag); the
    machine included."""
    key = config_key(row)
    return key[:1] + key[2:5] + (_without_controller_flag(key[5]),) + key[7:]


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (task, codec, configuration but the seed), in the order rows first show it, over
    its runs with status ok: the metric's mean, min, max and spread (max - min) across seeds; the
    difference to ``none`` on the same seed (and configuration), its mean over the seeds that have
    a ``none`` run and its spread; and the mean steps, bytes and compression ratios (whole run and
    last step)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        key = config_key(r)
        groups.setdefault(key[:2] + key[3:], []).append(r)
    # plain all-reduce on the same task, seed, budget, recipe arguments and machine: the paired
    # reference (on another machine the same seed rounds differently, and the run parts from it)
    # (seeds differ in initialisation, data order and, where a subset is drawn, the test images,
    # which moves every codec together; the difference per seed is what the codec did)
    none_metric = {
        _pairing_key(r): r["metric"]
        for r in rows
        if r.get("codec") == "none" and r.get("status", "ok") == "ok" and r.get("metric") is not None
    }
    out = []
    for rs in groups.values():
        ok = [r for r in rs if r.get("status", "ok") == "ok" and r.get("metric") is not None]
        values = [r["metric"] for r in ok]
        deltas = [r["metric"] - none_metric[_pairing_key(r)] for r in ok if _pairing_key(r) in none_metric]
        out.append(
            {
                "task": rs[0].get("task"),
                "codec": rs[0].get("codec"),
                "budget": budget_label(rs[0]),
                "recipe_args": rs[0].get("recipe_args"),
                "codec_options": rs[0].get("codec_options"),
                "seeds": ",".join(str(r.get("seed", "-")) for r in ok) or "-",
                "runs": len(ok),
                "failed": len(rs) - len(ok),
                "metric_name": next((r.get("metric_name") for r in ok), None),
                "metric_mean": _mean(values),
                "metric_min": min(values) if values else None,
                "metric_max": max(values) if values else None,
                "metric_spread": max(values) - min(values) if values else None,
                "vs_none_mean": _mean(deltas),
                "vs_none_spread": max(deltas) - min(deltas) if deltas else None,
                "vs_none_seeds": len(deltas),
                "steps": _mean([r.get("steps") for r in ok]),
                "compression_ratio_last": _mean([r.get("compression_ratio_last") for r in ok]),
                "compression_ratio": _mean([r.get("compression_ratio") for r in ok]),
                "gb_sent": _mean([r.get("gb_sent") for r in ok]),
            }
        )
    return out


def _merge_saved(done: dict[tuple, dict[str, Any]], path: Path) -> None:
    """Add to ``done`` the rows of ``path`` whose configuration it lacks: those another run of
    the benchmark with ``--resume``, into the same folder, saved after this one started."""
    if not path.exists():
        return
    saved = json.loads(path.read_text())
    for r in fill_older_rows(saved.get("rows", []), saved.get("meta", {})):
        done.setdefault(config_key(r), r)


def parse_seeds(text: str | None) -> list[int] | None:
    """A ``--seeds`` argument: ``"0,1,2"`` -> ``[0, 1, 2]``; ``None`` or empty: ``None``."""
    if not text:
        return None
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds must be a comma list of integers, got {text!r}") from None


def main(args: argparse.Namespace) -> int:
    from lightning_gradcomp.bench.link import default_codecs

    codecs = [c for c in (args.codecs.split(",") if args.codecs else default_codecs()) if c]
    tasks = [t for t in args.tasks.split(",") if t]
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise SystemExit(f"--tasks must be among {list(TASKS)}, got {bad}")
    seeds = parse_seeds(args.seeds)
    if not seeds:
        raise SystemExit("--seeds is empty")
    out = Path(args.out)
    max_steps, max_epochs = _budget(args)
    argv = getattr(args, "argv", sys.argv[1:])
    # every configuration, by config_key, in file order; a rerun replaces its row in place
    done: dict[tuple, dict[str, Any]] = {}
    previous = out / "accuracy.json"
    if args.resume and previous.exists():
        old = json.loads(previous.read_text())
        done = {config_key(r): r for r in fill_older_rows(old.get("rows", []), old.get("meta", {}))}
        argv = appended_argv(old, argv)
    meta = {
        "benchmark": "accuracy",
        "max_steps": max_steps,
        "max_epochs": max_epochs,
        "seeds": seeds,
        "devices": args.devices,
        "accelerator": args.accelerator,
        "recipe_args": args.recipe_args,
        "machine": machine_info(),
        "argv": argv,
    }
    machine = machine_key(args.accelerator)
    this_run: list[tuple] = []
    todo: list[tuple[tuple, str, str, int]] = []
    for task in tasks:
        for codec in codecs:
            for seed in seeds:
                key = config_key(
                    {
                        "task": task,
                        "codec": codec,
                        "seed": seed,
                        "max_steps": max_steps,
                        "max_epochs": max_epochs,
                        "recipe_args": shlex.join(shlex.split(args.recipe_args)),
                        "codec_options": _codec_options(args, codec),
                        "devices": args.devices,
                        "machine": machine,
                    }
                )
                this_run.append(key)
                if done.get(key, {}).get("status") == "ok":
                    print(f"accuracy: {task} {codec} seed {seed}: done before, kept", file=sys.stderr, flush=True)
                    continue
                todo.append((key, task, codec, seed))

    def save(key: tuple, row: dict[str, Any]) -> None:
        if args.resume:  # keep the rows that another --resume run into this folder saved meanwhile
            _merge_saved(done, previous)
        done[key] = row
        rows = list(done.values())
        write_json(out / "accuracy.json", {"meta": meta, "rows": rows, "summary": summarize(rows)})
        write_csv(out / "accuracy.csv", rows)

    jobs = max(1, args.jobs)
    if jobs == 1:  # one at a time: each row is saved before the next run starts
        for key, task, codec, seed in todo:
            print(f"accuracy: {task} {codec} seed {seed} ...", file=sys.stderr, flush=True)
            save(key, run_recipe(task, codec, seed, args, out))
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            running = {}
            for key, task, codec, seed in todo:
                print(f"accuracy: {task} {codec} seed {seed} ...", file=sys.stderr, flush=True)
                running[pool.submit(run_recipe, task, codec, seed, args, out)] = key
            # the rows are written here, by this thread alone, as the runs end
            for future in as_completed(running):
                save(running[future], future.result())
    if args.resume:  # and those saved since this run's last save
        _merge_saved(done, previous)
    rows = list(done.values())
    summary = summarize(rows)
    write_json(out / "accuracy.json", {"meta": meta, "rows": rows, "summary": summary})
    write_csv(out / "accuracy.csv", rows)
    write_csv(out / "accuracy_summary.csv", summary)
    print(format_table(rows, COLUMNS))
    print("\nper configuration: mean over the seeds' runs with status ok; max-min: their spread\n")
    print(format_table(summary, SUMMARY_COLUMNS))
    print(f"\nwrote {out / 'accuracy.json'}, {out / 'accuracy.csv'} and {out / 'accuracy_summary.csv'}")
    return 0 if all(done[k].get("status") == "ok" for k in this_run) else 1
