"""``tta``: time to accuracy on a slow link, two separate measurements combined.

Neither benchmark measures it alone. The ``accuracy`` runs (the recipes on this machine, several
seeds) give the validation metric at every validation step; the ``link`` runs (one rank per
shaped network host) give the median time of one optimizer step per codec and link rate. For
each codec and rate:

- target: the final metric of ``none`` (plain all-reduce), mean over its seeds, less
  ``--target-drop`` (in the metric's own units: 0.01 is one point of accuracy); or a level given
  with ``--target``, for instance one that every codec reaches within the budget;
- steps to target: the first validation step at which the codec's metric, the mean over its
  seeds at the steps every seed validated, reaches the target ('not reached' within the budget);
- time to accuracy: those steps times the codec's median step time on that link
  (``--hosts`` hosts), and the speed-up against ``none`` and ``powersgd`` (their time / this time);
- beside that target, always: the steps and time to ``none``'s own final metric (the mean over its
  seeds, as for the target) and to 99 % of it, read from the same mean curves ('not reached' when
  the curve never gets there within the budget), whatever ``--target`` says;
- dense steps: a codec that sends its first steps uncompressed (a warm-up) pays for them at
  ``none``'s step time. Their number is what the accuracy run's byte counts say: with ``T`` steps,
  a whole-run ratio ``R`` and a steady ratio ``r``, the run sent ``T / R`` gradients' worth where
  steady compression alone would send ``T / r``, which is ``D = (T/R - T/r) / (1 - 1/r)``
  dense-equivalent steps, charged to the first ``D`` steps. A run whose compression level changed
  (``AdaptiveCompression``) may have ended on a light step, so for it ``r`` is the ratio of the
  steps the link timed: its light steps are charged as dense steps too. Runs whose validation
  history records the bytes sent so far (the recipes do now) are charged exactly what they sent
  up to the step in question, wherever in the run their light steps fell (:func:`dense_steps_to`).

The two measurements need not have run the same model or batch: the link rows here are ResNet-18
with 32 images per rank, while an accuracy run may use ``--model resnet10`` or another
``--batch-size``. Both are recorded in the output, and a warning says when they differ.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_gradcomp.bench import paths
from lightning_gradcomp.bench.accuracy import config_key, parse_seeds, recipe_option
from lightning_gradcomp.bench.results import Column, format_table, read_json, write_csv, write_json

__all__ = [
    "accuracy_curves",
    "add_arguments",
    "caption",
    "columns",
    "compute",
    "dense_equivalent_steps",
    "dense_steps_to",
    "seconds_to_step",
    "link_step_times",
    "main",
    "mean_history",
    "none_levels",
    "parse_step_time_of",
    "reach_text",
    "steps_to_target",
]

#: a mean of the same numbers summed in another order may differ in the last bits
TOLERANCE = 1e-9

#: the fraction of none's final metric reported beside it (``none_99``)
NONE_FRACTION = 0.99


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--accuracy",
        default=str(paths.results_dir("accuracy_r18") / "accuracy.json"),
        help="results of `accuracy` (default: the convergence study's, %(default)s)",
    )
    p.add_argument(
        "--link", default=str(paths.results_dir("link") / "link.json"), help="results of `link` (default: %(default)s)"
    )
    p.add_argument("--rates", default="100mbit,10mbit", help="comma list of link rates found in the link results")
    p.add_argument("--hosts", type=int, default=2, help="host count of the link rows to use")
    p.add_argument("--task", default="cifar10", help="task of the accuracy rows to use")
    p.add_argument(
        "--target-drop",
        type=float,
        default=0.0,
        help="target = none's final metric minus this, in the metric's units (0.01: one point of accuracy)",
    )
    p.add_argument(
        "--target",
        type=float,
        default=None,
        help="an absolute target level of the metric instead of none's final metric (e.g. 0.5)",
    )
    p.add_argument("--compare", default="none,powersgd", help="codecs the speed-up is given against")
    p.add_argument(
        "--seeds",
        default=None,
        help="comma list of the seeds whose runs are read, for every codec (default: every seed in the "
        "accuracy results; give them so that a command reads the same runs once more seeds join the file)",
    )
    p.add_argument(
        "--codecs",
        default=None,
        help="comma list of the codec labels to report (default: every label in the accuracy results; none is kept)",
    )
    p.add_argument(
        "--link-model", default=None, help="model of the link rows (default: the accuracy runs' model if present)"
    )
    p.add_argument(
        "--figure",
        default=None,
        help="also draw test accuracy against wall-clock time at each rate into this directory "
        "(accuracy_vs_time_RATE.png; tta computes, and plot draws once it has written its results)",
    )
    p.add_argument(
        "--step-time-of",
        default=None,
        help="comma list LABEL=OTHER: LABEL has no link row and sends what OTHER's timed steps send "
        "(default: a label NAME@X takes NAME's row)",
    )
    p.add_argument(
        "--figure-codecs",
        default=None,
        help="comma list of the codec labels the figure draws (default: every codec; the tables hold them all)",
    )
    p.add_argument("--out", default=str(paths.results_dir("tta")), help="output directory (default: %(default)s)")


# --------------------------------------------------------------------------------------------------
def mean_history(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The seeds' histories at the steps all of them validated: mean, min and max per step."""
    histories = [{p["step"]: p["metric"] for p in r.get("history") or []} for r in rows]
    if not histories:
        return []
    steps = sorted(set.intersection(*(set(h) for h in histories)))
    return [
        {
            "step": s,
            "mean": sum(h[s] for h in histories) / len(histories),
            "min": min(h[s] for h in histories),
            "max": max(h[s] for h in histories),
        }
        for s in steps
    ]


def steps_to_target(curve: list[dict[str, Any]], target: float) -> int | None:
    """The first step of ``curve`` whose mean reaches ``target``; ``None`` when none does."""
    return next((p["step"] for p in curve if p["mean"] >= target - TOLERANCE), None)


def seconds_to_step(step: float, step_s: float, dense_steps: float, dense_step_s: float | None) -> float:
    """Wall time of a codec's first ``step`` steps: ``step_s`` each, except that the first
    ``dense_steps`` (its uncompressed warm-up) take ``dense_step_s`` (none's), when it is known."""
    extra = max(0.0, dense_step_s - step_s) if dense_step_s is not None else 0.0
    return step * step_s + min(float(step), dense_steps) * extra


def level_changed(row: dict[str, Any]) -> bool:
    """Whether the run's compression level changed (``AdaptiveCompression``): it ran steps at more
    than one level, so its last step's ratio need not be its configured one."""
    return len((row.get("raw") or {}).get("level_steps") or row.get("level_steps") or {}) > 1


def _steady_ratio(row: dict[str, Any], steady_ratio: float | None) -> float | None:
    """A run's steady ratio: its last step's, or ``steady_ratio`` (the timed steps') for a run
    whose level changed, when given. ``None`` when unknown or no compression."""
    steady = steady_ratio if steady_ratio and level_changed(row) else row.get("compression_ratio_last")
    return steady if steady and steady > 1.0 + 1e-6 else None


def _beyond_steady(sent: float, steps: float, steady: float) -> float:
    """Dense-equivalent steps in ``sent`` gradients' worth over ``steps`` steps beyond what steady
    compression at ratio ``steady`` sends: ``D = (sent - steps/r) / (1 - 1/r)``."""
    return max(0.0, (sent - steps / steady) / (1.0 - 1.0 / steady))


def dense_equivalent_steps(rows: list[dict[str, Any]], steady_ratio: float | None = None) -> float:
    """Steps' worth of uncompressed gradient a codec sent beyond its steady compression (its
    warm-ups, its light steps), from the runs' whole-run and steady ratios (mean over the runs; 0
    when unknown). The steady ratio is the run's last step's, except for a run whose level changed
    (its last step may have been a light one): there it is ``steady_ratio``, the ratio of the steps
    the link timed, when given."""
    found = []
    for r in rows:
        steps, whole, steady = r.get("steps"), r.get("compression_ratio"), _steady_ratio(r, steady_ratio)
        if steps and whole and steady:
            found.append(_beyond_steady(steps / whole, steps, steady))
    return sum(found) / len(found) if found else 0.0


def dense_steps_to(rows: list[dict[str, Any]], step: int, steady_ratio: float | None = None) -> float | None:
    """Dense-equivalent steps a codec sent in its first ``step`` steps, from the bytes its runs
    recorded at that validation step (mean over the runs): ``D = (step B/A - step/r) / (1 - 1/r)``
    with ``B`` the bytes sent so far, ``A`` what fp32 all-reduce would have sent, and ``r`` the
    steady ratio as in :func:`dense_equivalent_steps`. Exact where a run's light steps came late
    (the whole-run estimate charges them all to the first steps). ``None`` when a run lacks the
    bytes at that step (runs made before the recipes recorded them)."""
    found = []
    for r in rows:
        point = next((p for p in r.get("history") or [] if p.get("step") == step), None)
        if point is None or not point.get("raw_bytes") or point.get("bytes_sent") is None:
            return None
        steady = _steady_ratio(r, steady_ratio)
        sent = step * point["bytes_sent"] / point["raw_bytes"]  # gradients' worth sent so far
        found.append(_beyond_steady(sent, step, steady) if steady else 0.0)
    return sum(found) / len(found) if found else None


def _dense_steps_at(codec: dict[str, Any], step: int, steady_ratio: float | None) -> float:
    """A codec's dense-equivalent steps in its first ``step`` steps: from the bytes its runs
    recorded there (:func:`dense_steps_to`), else the whole run's estimate (``codec["dense_steps"]``)."""
    exact = dense_steps_to(codec["runs"], step, steady_ratio)
    return codec["dense_steps"] if exact is None else exact


def accuracy_curves(rows: list[dict[str, Any]], task: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Per codec label, from the runs of ``task`` with status ok: its mean history curve, the mean
    final metric, the seeds, model, batch size and ranks. A codec with runs of several
    configurations (another budget, other recipe arguments) keeps those of the last one."""
    warnings: list[str] = []
    by_codec: dict[str, dict[tuple, list[dict[str, Any]]]] = {}
    for r in rows:
        if r.get("task") == task and r.get("status", "ok") == "ok" and r.get("metric") is not None:
            key = config_key(r)
            by_codec.setdefault(r["codec"], {}).setdefault(key[:2] + key[3:], []).append(r)
    out = {}
    for codec, configs in by_codec.items():
        runs = list(configs.values())[-1]
        if len(configs) > 1:
            warnings.append(f"{codec}: runs of {len(configs)} configurations; the last one's ({len(runs)} run(s)) used")
        first = runs[0]
        out[codec] = {
            "curve": mean_history(runs),
            "final_metric": sum(r["metric"] for r in runs) / len(runs),
            "seeds": [r.get("seed") for r in runs],
            "steps": max(r.get("steps") or 0 for r in runs),
            "metric_name": first.get("metric_name"),
            # rows of older versions name the model only in their command line
            "model": first.get("model") or recipe_option(shlex.split(first.get("command", "")), "--model"),
            "batch_size": first.get("batch_size"),
            "world_size": (first.get("raw") or {}).get("world_size", first.get("devices")),
            "dense_steps": dense_equivalent_steps(runs),
            "runs": runs,
        }
    missing = [codec for codec, c in out.items() if not c["curve"]]
    if missing:
        warnings.append(
            f"no validation history for {', '.join(missing)}: accuracy runs made before the recipes recorded one; "
            "run them again"
        )
    return out, warnings


def none_levels(none_final: float) -> dict[str, float]:
    """The levels every codec's time is also given to, whatever the target: ``none``'s final metric
    (the mean over its seeds) and :data:`NONE_FRACTION` of it, keyed as in the rows' keys."""
    return {"none_final": none_final, "none_99": NONE_FRACTION * none_final}


def reach_text(steps: int | None, seconds: float | None, has_curve: bool) -> str:
    """A table cell for the time to a level: seconds and steps, 'not reached' within the budget,
    or why there is no time ('-' without a validation history)."""
    if not has_curve:
        return "-"
    if steps is None:
        return "not reached"
    if seconds is None:
        return f"step {steps}, no step time"
    return f"{seconds:.0f} ({steps} steps)"


def _link_rows(rows: list[dict[str, Any]], hosts: int, rate: str, model: str | None) -> dict[str, dict[str, Any]]:
    """The timed link row per codec label at ``hosts`` hosts and ``rate`` (the last of a repeat wins)."""
    return {
        r["codec"]: r
        for r in rows
        if r.get("hosts") == hosts
        and r.get("rate") == rate
        and r.get("step_s") is not None
        and (model is None or r.get("model", model) == model)
    }


def link_step_times(rows: list[dict[str, Any]], hosts: int, rate: str, model: str | None) -> dict[str, float]:
    """Median step time per codec label at ``hosts`` hosts and ``rate`` (the last row of a repeat wins)."""
    return {codec: r["step_s"] for codec, r in _link_rows(rows, hosts, rate, model).items()}


def _pick_link_model(
    rows: list[dict[str, Any]], meta: dict[str, Any], wanted: str | None, acc_model: Any
) -> str | None:
    """``--link-model``, else the accuracy runs' model, else the link run's own, among the models
    the link rows hold."""
    models = [r.get("model") for r in rows if r.get("model")]
    if wanted:
        return wanted
    for m in (acc_model, meta.get("model")):
        if m in models:
            return m
    return models[-1] if models else meta.get("model")


def compute(
    acc: dict[str, Any],
    link: dict[str, Any],
    rates: list[str],
    *,
    hosts: int = 2,
    task: str = "cifar10",
    target_drop: float = 0.0,
    target: float | None = None,
    compare: tuple[str, ...] = ("none", "powersgd"),
    link_model: str | None = None,
    step_time_of: dict[str, str] | None = None,
    only: tuple[str, ...] | None = None,
    seeds: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Time to accuracy per codec and rate from the JSON of ``accuracy`` and of ``link``:
    ``{"meta": ..., "rows": [...], "curves": {codec: [{step, mean, min, max}]}}``.
    ``step_time_of``: codec labels without a link row of their own, mapped to the label whose
    timed steps send the same bytes (by default a label ``name@x`` borrows ``name``'s row).
    ``only``: the codec labels to report (``none`` is always kept: it sets the target).
    ``seeds``: read only the runs of these seeds, for every codec (``none`` included)."""
    step_time_of = step_time_of or {}
    acc_rows = acc.get("rows", [])
    if seeds is not None:
        acc_rows = [r for r in acc_rows if r.get("seed") in seeds]
    codecs, warnings = accuracy_curves(acc_rows, task)
    if "none" not in codecs:
        among = f" among seeds {', '.join(map(str, seeds))}" if seeds is not None else ""
        raise ValueError(f"the accuracy results hold no run of 'none' on {task} with status ok{among}: no target")
    if only:
        unknown = [c for c in only if c not in codecs]
        if unknown:
            raise ValueError(f"no runs of {', '.join(unknown)} on {task}; the results hold {', '.join(sorted(codecs))}")
        codecs = {c: info for c, info in codecs.items() if c == "none" or c in only}
    given = target is not None
    if target is None:
        target = codecs["none"]["final_metric"] - target_drop
    info = codecs["none"]
    levels = none_levels(info["final_metric"])
    acc_model, acc_batch = info["model"], info["batch_size"]
    link_meta = link.get("meta", {})
    model = _pick_link_model(link.get("rows", []), link_meta, link_model, acc_model)
    link_batch = link_meta.get("batch_size")
    if link_batch is None and model:
        from lightning_gradcomp.bench.models import DEFAULT_BATCH

        link_batch = DEFAULT_BATCH.get(model)
    if model != acc_model:
        warnings.append(
            f"model differs: accuracy runs {acc_model or 'unknown'}, link rows {model}; "
            f"the step times belong to {model}"
        )
    if link_batch != acc_batch:
        warnings.append(
            f"batch per rank differs: accuracy runs {acc_batch or 'unknown'}, link rows {link_batch}; "
            "steps to target depend on it"
        )
    rows = []
    for rate in rates:
        timed = _link_rows(link.get("rows", []), hosts, rate, model)
        step_s = {codec: r["step_s"] for codec, r in timed.items()}
        if not step_s:
            warnings.append(f"no link rows at {rate} with {hosts} hosts (model {model})")
        times: dict[str, float | None] = {}
        rate_rows = []
        dense_s = step_s.get("none")
        for codec, c in codecs.items():
            steps = steps_to_target(c["curve"], target)
            s = step_s.get(codec)
            base = step_time_of.get(codec, codec.split("@", 1)[0])
            borrowed = s is None and base != codec and step_s.get(base) is not None
            if borrowed:  # another configuration of a codec that sends the same bytes (an option
                s = step_s[base]  # such as momentum correction): its step time, said in the note
            row = timed.get(base if borrowed else codec) or {}
            timed_ratio = None
            if any(level_changed(r) for r in c["runs"]) and row.get("compression_ratio"):
                # the level changed over the run: the bytes beyond those of the timed steps are
                # charged as dense steps, whatever level the run's last step had
                timed_ratio = row["compression_ratio"]
                c = {**c, "dense_steps": dense_equivalent_steps(c["runs"], timed_ratio)}
            tta = None
            note = ""
            dense_steps = c["dense_steps"] if steps is None else _dense_steps_at(c, steps, timed_ratio)
            if steps is not None and s is not None:
                tta = seconds_to_step(steps, s, dense_steps, dense_s)
                if dense_steps > 0 and dense_s is None:
                    dense = min(float(steps), dense_steps)
                    note = f"{dense:.0f} dense steps not charged (no link row for none at {rate})"
            times[codec] = tta
            if not c["curve"]:
                note = "no validation history"
            elif s is None:
                note = f"no link row for {codec} at {rate}"
            elif borrowed:
                note = f"step time of {base}"
            reach: dict[str, Any] = {}
            for key, level in levels.items():  # none's final metric and 99 % of it, beside the target
                n = steps_to_target(c["curve"], level)
                t = (
                    seconds_to_step(n, s, _dense_steps_at(c, n, timed_ratio), dense_s)
                    if n is not None and s is not None
                    else None
                )
                reach |= {f"steps_to_{key}": n, f"tta_{key}_s": t, f"{key}_text": reach_text(n, t, bool(c["curve"]))}
            rate_rows.append(
                {
                    "codec": codec,
                    "rate": rate,
                    "hosts": hosts,
                    "target": target,
                    "final_metric": c["final_metric"],
                    "seeds": ",".join("?" if x is None else str(x) for x in c["seeds"]),
                    "steps_to_target": steps,
                    "reached": steps is not None,
                    "steps_text": str(steps) if steps is not None else ("not reached" if c["curve"] else "-"),
                    "budget_steps": c["steps"],
                    "dense_steps": dense_steps,
                    "step_s": s,
                    "tta_s": tta,
                    **reach,
                    "note": note,
                }
            )
        for r in rate_rows:
            for base in compare:
                b = times.get(base)
                r[f"speedup_vs_{base}"] = b / r["tta_s"] if b is not None and r["tta_s"] else None
        rows += rate_rows
    meta = {
        "benchmark": "tta",
        "task": task,
        "metric_name": info["metric_name"],
        "target": target,
        "target_drop": 0.0 if given else target_drop,
        "target_given": given,
        "none_final_metric": info["final_metric"],
        "none_seeds": info["seeds"],
        "seeds_read": list(seeds) if seeds is not None else None,
        "none_levels": levels,
        "none_fraction": NONE_FRACTION,
        "rates": rates,
        "hosts": hosts,
        "compare": list(compare),
        "accuracy_model": acc_model,
        "accuracy_batch_size": acc_batch,
        "accuracy_world_size": info["world_size"],
        "link_model": model,
        "link_batch_size": link_batch,
        "warnings": warnings,
    }
    meta["caption"] = caption(meta)
    return {"meta": meta, "rows": rows, "curves": {codec: c["curve"] for codec, c in codecs.items()}}


def caption(meta: dict[str, Any]) -> str:
    """What the table combines, in words: two separate measurements, their models and batches."""
    drop = f" less {meta['target_drop']:g}" if meta.get("target_drop") else ""
    if meta.get("target_given"):
        goal = f"Target: {meta.get('metric_name') or 'metric'} = {meta['target']:.4f} (given)."
    else:
        seeds = ", ".join("?" if s is None else str(s) for s in meta.get("none_seeds", []))
        goal = (
            f"Target: the final {meta.get('metric_name') or 'metric'} of none (mean over seeds {seeds}){drop} "
            f"= {meta['target']:.4f}."
        )
    levels = meta.get("none_levels")
    if levels:
        seeds = ", ".join("?" if s is None else str(s) for s in meta.get("none_seeds", []))
        fraction = meta.get("none_fraction", NONE_FRACTION)
        goal += (
            f" Beside it, the time to none's own final {meta.get('metric_name') or 'metric'} (mean over seeds "
            f"{seeds}) = {levels['none_final']:.4f} and to {fraction:.0%} of it = {levels['none_99']:.4f}, "
            "read from the same mean curves; 'not reached' means not within the budget."
        )
    acc_batch = meta.get("accuracy_batch_size")
    return (
        "Time to accuracy combines two separate measurements: the steps to the target come from the accuracy "
        f"runs on the local machine ({meta.get('accuracy_model') or 'the recipe default model'}, "
        f"{f'batch {acc_batch}' if acc_batch else 'the recipe default batch'} per rank, "
        f"{meta.get('accuracy_world_size')} ranks; validation metric at each validation step, mean over seeds), "
        f"the time of one step from the shaped-link runs ({meta.get('link_model')}, batch "
        f"{meta.get('link_batch_size')} per rank, {meta.get('hosts')} hosts; median step time). Steps a codec "
        "sent uncompressed (its warm-up, counted from the run's bytes) are charged at none's step time. "
        f"{goal}"
    )


def columns(compare: list[str] | tuple[str, ...]) -> list[Column]:
    return [
        Column("codec", "codec"),
        Column("rate", "link"),
        Column("final_metric", "final", "{:.4f}"),
        Column("steps_text", "steps to target"),
        Column("dense_steps", "dense steps", "{:.0f}"),
        Column("step_s", "step s", "{:.3f}"),
        Column("tta_s", "time to acc. s", "{:.0f}"),
        *(Column(f"speedup_vs_{b}", f"x vs {b}", "{:.2f}") for b in compare),
        Column("none_final_text", "to none's final: s (steps)"),
        Column("none_99_text", "to 99 % of it: s (steps)"),
        Column("note", "note"),
    ]


def parse_step_time_of(text: str | None) -> dict[str, str]:
    """``"a=b,c=d"`` as ``{"a": "b", "c": "d"}`` (``--step-time-of``)."""
    out = {}
    for item in (text or "").split(","):
        if not item:
            continue
        label, sep, other = item.partition("=")
        if not (sep and label and other):
            raise SystemExit(f"tta: --step-time-of takes LABEL=OTHER items, got {item!r}")
        out[label] = other
    return out


def main(args: argparse.Namespace) -> int:
    for path in (args.accuracy, args.link):
        if not Path(path).exists():
            raise SystemExit(f"tta: {path} not found (run `python -m lightning_gradcomp.bench accuracy` and `link`)")
    rates = [r for r in args.rates.split(",") if r]
    compare = tuple(c for c in args.compare.split(",") if c)
    try:
        result = compute(
            read_json(args.accuracy),
            read_json(args.link),
            rates,
            hosts=args.hosts,
            task=args.task,
            target_drop=args.target_drop,
            target=args.target,
            compare=compare,
            link_model=args.link_model,
            step_time_of=parse_step_time_of(args.step_time_of),
            only=tuple(c for c in (args.codecs or "").split(",") if c) or None,
            seeds=parse_seeds(args.seeds),
        )
    except ValueError as err:
        raise SystemExit(f"tta: {err}") from None
    meta = result["meta"]
    meta.update(accuracy=str(args.accuracy), link=str(args.link), argv=getattr(args, "argv", sys.argv[1:]))
    for w in meta["warnings"]:
        print(f"tta: warning: {w}", file=sys.stderr)
    out = Path(args.out)
    write_json(out / "tta.json", result)
    write_csv(out / "tta.csv", result["rows"])
    print(meta["caption"] + "\n")
    print(format_table(result["rows"], columns(compare)))
    print(f"\nwrote {out / 'tta.json'} and {out / 'tta.csv'}")
    return 0
