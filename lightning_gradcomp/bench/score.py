"""``score``: the final checkpoints of ``accuracy`` runs, scored again on other evaluation data.

An ``accuracy`` run started with ``--jobs`` above 1 keeps its working directory,
``OUT/runs/<task>-<codec>-seed<S>.cwd``: its TensorBoard logs, the configuration LightningCLI
saved beside them, and its checkpoints. ``score`` runs the recipe's own ``validate`` subcommand
on each run's final checkpoint with that configuration, in one process, and ``--recipe-args`` on
top: ``--data.val_subset null`` scores the CIFAR-10 runs of the convergence study, which
validate on 5,000 of the 10,000 test images, on all of them. The weights are the run's; only the
evaluation changes, so nothing is trained again.

Each checkpoint is first scored with the saved configuration alone, which must give the final
metric the run recorded, to the last digit (``reproduced``; ``--no-check`` skips this): a
checkpoint or a configuration that no longer gives the run's own number is reported, and its new
score is not used in the summary. One process sees every image once; a run validated on several
ranks saw each image once too only when their number divides the images (Lightning's distributed
sampler pads the last batch of the others with repeated images), so a run on an uneven split is
reported as not reproduced, and its score on one process is the exact one.

Written: ``OUT/score.json`` and ``OUT/score.csv``, a row a run, and a summary per (task, codec,
machine): the new metric's mean over the seeds, and its difference to ``none`` on the same seed
and machine (mean and standard error) beside the same difference in the recorded metric, on the
same seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning_gradcomp.bench import paths
from lightning_gradcomp.bench.accuracy import TASKS, parse_seeds, run_dir
from lightning_gradcomp.bench.results import Column, appended_argv, format_table, read_json, write_csv, write_json

__all__ = ["COLUMNS", "SUMMARY_COLUMNS", "add_arguments", "find_checkpoint", "main", "summarize", "validate_checkpoint"]

COLUMNS = [
    Column("task", "task"),
    Column("codec", "codec"),
    Column("seed", "seed"),
    Column("step", "step"),
    Column("metric", "recorded", "{:.4f}"),
    Column("metric_check", "again", "{:.4f}"),
    Column("metric_scored", "scored", "{:.4f}"),
    Column("status", "status"),
]

SUMMARY_COLUMNS = [
    Column("task", "task"),
    Column("codec", "codec"),
    Column("seeds", "seeds"),
    Column("metric_scored_mean", "scored", "{:.4f}"),
    Column("vs_none_scored", "vs none", "{:+.4f}"),
    Column("vs_none_scored_se", "standard error", "{:.4f}"),
    Column("metric_mean", "recorded", "{:.4f}"),
    Column("vs_none_recorded", "vs none", "{:+.4f}"),
    Column("vs_none_recorded_se", "standard error", "{:.4f}"),
]

# The child process: the recipe's LightningCLI runs `validate`, and the metrics it logged are
# written as JSON. The recipe is loaded as a module (its `__main__` block does not run) so that
# the CLI object, and with it the trainer, comes back to this code.
_CHILD = """
import json, runpy, sys
script, out, *args = sys.argv[1:]
sys.path.insert(0, str(__import__("pathlib").Path(script).parent))
cli = runpy.run_path(script)["main"](args)
json.dump({k: float(v) for k, v in cli.trainer.callback_metrics.items()}, open(out, "w"))
"""

_STEP = re.compile(r"step=(\d+)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accuracy", nargs="+", required=True, help="accuracy.json files of runs made with --jobs > 1")
    p.add_argument("--recipe-args", default="", help="arguments on top of each run's saved configuration")
    p.add_argument("--tasks", default=None, help=f"comma list of {', '.join(TASKS)} (default: all in the files)")
    p.add_argument("--codecs", default=None, help="comma list of codec labels (default: all in the files)")
    p.add_argument("--seeds", default=None, help="comma list of seeds (default: all in the files)")
    p.add_argument("--no-check", action="store_true", help="skip scoring each checkpoint on its own configuration")
    p.add_argument("--recipes-dir", default=None, help="the recipes (default: the checkout's recipes/)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per validation")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--resume", action="store_true", help="keep the rows OUT/score.json holds for the same runs")
    p.add_argument("--out", default=str(paths.results_dir("score")), help="output directory (default: %(default)s)")


def find_checkpoint(workdir: Path, steps: int | None = None) -> tuple[Path, Path] | None:
    """``(checkpoint, config.yaml)`` of a run's final checkpoint under its working directory: the
    checkpoint named after the run's last step (``...step=N.ckpt``), else the one of the highest
    step; ``last.ckpt`` is a copy and is not read. ``None`` when there is none with a saved
    configuration beside its ``checkpoints`` folder."""
    found = []
    for ckpt in workdir.glob("**/checkpoints/*.ckpt"):
        match = _STEP.search(ckpt.name)
        config = ckpt.parent.parent / "config.yaml"
        if match and config.is_file():
            found.append((int(match.group(1)), ckpt, config))
    if not found:
        return None
    exact = [f for f in found if f[0] == steps]
    _, ckpt, config = max(exact or found, key=lambda f: (f[0], str(f[1])))
    return ckpt, config


def validate_checkpoint(
    script: Path,
    config: Path,
    checkpoint: Path,
    extra: list[str],
    *,
    python: str = sys.executable,
    cwd: Path | None = None,
    timeout: float = 3600.0,
) -> dict[str, float]:
    """The metrics the recipe's ``validate`` logs for ``checkpoint`` under ``config`` and
    ``extra``, in one process without a logger. Raises ``RuntimeError`` with the output's tail when
    the recipe fails."""
    config, checkpoint = Path(config).resolve(), Path(checkpoint).resolve()  # the child runs in `cwd`
    args = ["validate", "--config", str(config), "--ckpt_path", str(checkpoint), "--trainer.devices", "1"]
    args += ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--report.metrics_json", "null"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "metrics.json"
        # without a logger LightningCLI saves the configuration in the root dir: here, not in `cwd`,
        # where relative paths of the configuration resolve as in the run and a second
        # validation would find the first one's file
        args += ["--trainer.default_root_dir", tmp]
        cmd = [python, "-c", _CHILD, str(script), str(out), *args, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd or tmp, check=False)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr)[-2000:]
            raise RuntimeError(f"validate failed (exit {proc.returncode}): {shlex.join(cmd[3:])}\n{tail}")
        return json.loads(out.read_text())


def _metric(metrics: dict[str, float], row: dict[str, Any]) -> float | None:
    for key in (row.get("metric_name"), *TASKS[row["task"]][1]):
        if key in metrics:
            return metrics[key]
    return None


def _key(row: dict[str, Any]) -> tuple:
    return row.get("task"), row.get("codec"), row.get("seed"), row.get("machine")


def _runs(args: argparse.Namespace) -> list[tuple[dict[str, Any], Path]]:
    """The accuracy rows asked for, each with its file's folder (the ``--out`` of its runs); of two
    rows of one (task, codec, seed, machine) the later file's counts."""
    tasks = set(args.tasks.split(",")) if args.tasks else None
    codecs = set(args.codecs.split(",")) if args.codecs else None
    seeds = set(parse_seeds(args.seeds) or []) or None
    rows: dict[tuple, tuple[dict[str, Any], Path]] = {}
    for path in map(Path, args.accuracy):
        for row in read_json(path).get("rows", []):
            if row.get("status") != "ok" or row.get("task") not in TASKS:
                continue
            if (tasks and row["task"] not in tasks) or (codecs and row["codec"] not in codecs):
                continue
            if seeds and row.get("seed") not in seeds:
                continue
            rows[_key(row)] = (row, path.resolve().parent)
    return list(rows.values())


def _mean_se(values: list[float]) -> tuple[float | None, float | None]:
    """The mean and its standard error (the sample standard deviation over the square root of n)."""
    if not values:
        return None, None
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return statistics.fmean(values), se


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (task, codec, machine), over the rows scored and reproduced: the new metric's mean, and
    the difference to ``none`` of the same task, seed and machine, new and recorded, on the seeds
    where both are there (mean and standard error of the paired differences)."""
    good = [r for r in rows if r.get("status") == "ok" and r.get("metric_scored") is not None]
    none = {(r["task"], r["seed"], r.get("machine")): r for r in good if r["codec"] == "none"}
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in good:
        groups.setdefault((r["task"], r["codec"], r.get("machine")), []).append(r)
    out = []
    for (task, codec, machine), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        paired = [(r, none[(task, r["seed"], machine)]) for r in rs if (task, r["seed"], machine) in none]
        scored, scored_se = _mean_se([r["metric_scored"] - n["metric_scored"] for r, n in paired])
        recorded, recorded_se = _mean_se([r["metric"] - n["metric"] for r, n in paired])
        out.append(
            {
                "task": task,
                "codec": codec,
                "machine": machine,
                "seeds": ",".join(str(r["seed"]) for r in rs),
                "paired_seeds": ",".join(str(r["seed"]) for r, _ in paired),
                "metric_scored_mean": _mean_se([r["metric_scored"] for r in rs])[0],
                "metric_mean": _mean_se([r["metric"] for r in rs])[0],
                "vs_none_scored": scored if codec != "none" else None,
                "vs_none_scored_se": scored_se if codec != "none" else None,
                "vs_none_recorded": recorded if codec != "none" else None,
                "vs_none_recorded_se": recorded_se if codec != "none" else None,
            }
        )
    return out


def _score(row: dict[str, Any], accuracy_dir: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "task": row["task"],
        "codec": row["codec"],
        "seed": row["seed"],
        "machine": row.get("machine"),
        "metric_name": row.get("metric_name"),
        "metric": row.get("metric"),
        "recipe_args": shlex.join(extra),
    }
    workdir = run_dir(accuracy_dir, row["task"], row["codec"], row["seed"])
    found = find_checkpoint(workdir, row.get("steps")) if workdir.is_dir() else None
    if found is None:
        out["status"] = f"no checkpoint with a saved configuration under {workdir}"
        return out
    ckpt, config = found
    out["checkpoint"], out["step"] = str(ckpt), int(_STEP.search(ckpt.name).group(1))
    script = (Path(args.recipes_dir or paths.recipes_dir()) / TASKS[row["task"]][0]).resolve()
    t0 = time.perf_counter()
    try:
        kwargs = {"python": args.python, "cwd": workdir, "timeout": args.timeout}
        if not args.no_check:
            out["metric_check"] = _metric(validate_checkpoint(script, config, ckpt, [], **kwargs), row)
            out["reproduced"] = out["metric_check"] == row.get("metric")
        out["metric_scored"] = _metric(validate_checkpoint(script, config, ckpt, extra, **kwargs), row)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        out["status"] = f"failed: {str(e).splitlines()[0]}"
        print(e, file=sys.stderr)
        return out
    out["wall_s"] = time.perf_counter() - t0
    if out["metric_scored"] is None:
        out["status"] = "no task metric logged"
    elif out.get("reproduced") is False:
        out["status"] = f"not reproduced: {out['metric_check']!r} against the recorded {row.get('metric')!r}"
    else:
        out["status"] = "ok"
    return out


def main(args: argparse.Namespace) -> int:
    extra = shlex.split(args.recipe_args)
    out_dir = Path(args.out)
    previous = out_dir / "score.json"
    done: dict[tuple, dict[str, Any]] = {}
    argv = list(args.argv)
    if args.resume and previous.exists():
        old = read_json(previous)
        done = {_key(r) + (r.get("recipe_args"),): r for r in old.get("rows", [])}
        argv = appended_argv(old, argv)
    runs = _runs(args)
    if not runs:
        raise SystemExit("score: no run with status ok matches --tasks/--codecs/--seeds in " + ", ".join(args.accuracy))
    meta = {"benchmark": "score", "accuracy": args.accuracy, "recipe_args": args.recipe_args, "argv": argv}
    asked = []
    for row, accuracy_dir in runs:
        key = _key(row) + (shlex.join(extra),)
        asked.append(key)
        kept = done.get(key)
        if kept and kept.get("status") == "ok" and kept.get("metric") == row.get("metric"):
            print(f"score: {row['task']} {row['codec']} seed {row['seed']}: scored before, kept", file=sys.stderr)
            continue
        print(f"score: {row['task']} {row['codec']} seed {row['seed']} ...", file=sys.stderr, flush=True)
        done[key] = _score(row, accuracy_dir, args, extra)
        rows = list(done.values())
        write_json(previous, {"meta": meta, "rows": rows, "summary": summarize(rows)})
    rows = list(done.values())
    summary = summarize(rows)
    write_json(previous, {"meta": meta, "rows": rows, "summary": summary})
    write_csv(out_dir / "score.csv", rows)
    print(format_table(rows, COLUMNS))
    print("\nrecorded: the run's final metric; again: its checkpoint on the saved configuration; scored:")
    print(f"on the configuration and {args.recipe_args or 'nothing else'}")
    print("vs none: paired by seed, the mean and its standard error\n")
    print(format_table(summary, SUMMARY_COLUMNS))
    print(f"\nwrote {previous} and {out_dir / 'score.csv'}")
    return 0 if all(done[k].get("status") == "ok" for k in asked) else 1
