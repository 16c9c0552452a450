"""``plot``: the figures and tables of ``docs/benchmarks.md`` from the JSON results.

Reads ``link/link.json``, ``codecs/codecs.json`` and ``accuracy/accuracy.json`` under
``--results`` (whichever exist), draws PNGs with matplotlib's Agg backend (no display needed):

- ``link_<model>_<hosts>hosts.png``: median step time against link rate (log x), one line per codec,
  the no-communication floor dashed;
- ``accuracy_<task>.png``: task metric against bytes sent (log x), one point per codec;

and, with ``--markdown``, writes the tables, the figures and the machine they ran on.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from lightning_gradcomp.bench import accuracy as accuracy_mod
from lightning_gradcomp.bench import codecs as codecs_mod
from lightning_gradcomp.bench import link as link_mod
from lightning_gradcomp.bench.results import Column, markdown_table, read_json

__all__ = ["add_arguments", "main", "plot_link", "plot_accuracy", "link_pivot", "write_markdown"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", default="bench_results", help="directory holding link/, codecs/, accuracy/")
    p.add_argument("--figures", default="docs/figures", help="where the PNGs go")
    p.add_argument("--markdown", default=None, help="write the tables and figures to this file (e.g. docs/benchmarks.md)")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_link(rows: list[dict[str, Any]], figdir: Path) -> list[Path]:
    """One figure per (model, host count): step time against rate, per codec."""
    plt = _pyplot()
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("rate_bps") and r.get("step_s"):
            groups[(r.get("model", "model"), r["hosts"])].append(r)
    paths = []
    figdir.mkdir(parents=True, exist_ok=True)
    for (model, hosts), rs in sorted(groups.items()):
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        by_codec: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in rs:
            by_codec[r["codec"]].append((r["rate_bps"] / 1e6, r["step_s"]))
        for codec, pts in by_codec.items():
            pts.sort()
            style = dict(color="black", linestyle="--") if codec == link_mod.FLOOR else dict(marker="o")
            label = "no communication (floor)" if codec == link_mod.FLOOR else codec
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate (Mbit/s)")
        ax.set_ylabel("median step time (s)")
        ax.set_title(f"{model}, {hosts} hosts, one core per rank")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = figdir / f"link_{model}_{hosts}hosts.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_accuracy(rows: list[dict[str, Any]], figdir: Path) -> list[Path]:
    """One figure per task: metric against bytes sent, a labelled point per codec."""
    plt = _pyplot()
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("metric") is not None and r.get("bytes_sent"):
            groups[r["task"]].append(r)
    paths = []
    figdir.mkdir(parents=True, exist_ok=True)
    for task, rs in sorted(groups.items()):
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for r in rs:
            ax.scatter(r["bytes_sent"] / 1e9, r["metric"])
            ax.annotate(r["codec"], (r["bytes_sent"] / 1e9, r["metric"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("gradient bytes sent per rank (GB)")
        ax.set_ylabel(rs[0].get("metric_name") or "task metric")
        ax.set_title(f"{task}: same step budget for every codec")
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        path = figdir / f"accuracy_{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def link_pivot(rows: list[dict[str, Any]]) -> dict[tuple[str, int], tuple[list[dict[str, Any]], list[Column]]]:
    """Per (model, hosts): one row per codec, one column per rate, cells ``step s (x floor)``."""
    out = {}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r.get("model", "model"), r["hosts"])].append(r)
    for key, rs in sorted(groups.items()):
        rates = sorted({r["rate"] for r in rs}, key=lambda s: next((r.get("rate_bps") or 0 for r in rs if r["rate"] == s)))
        table: dict[str, dict[str, Any]] = {}
        for r in rs:
            cell = "-" if r.get("step_s") is None else f"{r['step_s']:.2f} s"
            if r.get("x_floor") and r["codec"] != link_mod.FLOOR:
                cell += f" ({r['x_floor']:.2f}x)"
            if r.get("fallback"):
                cell += " fb"
            name = "no communication (floor)" if r["codec"] == link_mod.FLOOR else r["codec"]
            table.setdefault(r["codec"], {"codec": name})[r["rate"]] = cell
        cols = [Column("codec", "codec")] + [Column(rt, _rate_label(rt)) for rt in rates]
        out[key] = (list(table.values()), cols)
    return out


def _rate_label(rate: str) -> str:
    return {"mbit": " Mbit/s", "gbit": " Gbit/s", "kbit": " kbit/s"}.get(rate[-4:], "") and (
        rate[:-4] + {"mbit": " Mbit/s", "gbit": " Gbit/s", "kbit": " kbit/s"}[rate[-4:]]
    ) or rate


def _machine_text(meta: dict[str, Any]) -> str:
    m = meta.get("machine", {})
    cores = m.get("cpus_usable", m.get("cpu_count"))
    return (
        f"{cores} cores ({m.get('cpu_model', 'unknown CPU')}), one core per rank (`taskset`, "
        f"`torch.set_num_threads(1)`), {m.get('mem_gib', '?')} GiB; torch {m.get('torch', '?')}, "
        f"Lightning {m.get('lightning', '?')}, Python {m.get('python', '?')}; gloo over TCP."
    )


def write_markdown(path: Path, results: Path, figures: list[Path]) -> Path:
    link = _load(results / "link" / "link.json")
    codecs = _load(results / "codecs" / "codecs.json")
    acc = _load(results / "accuracy" / "accuracy.json")
    meta = next((d["meta"] for d in (link, codecs, acc) if d), {})
    lines = ["# Benchmarks", "", "Machine: " + _machine_text(meta), ""]
    rel = lambda p: Path(p).resolve().relative_to(path.parent.resolve()) if _under(p, path.parent) else p  # noqa: E731
    if link:
        lm = link["meta"]
        lines += [
            "## Step time on a real slow link (`link`)", "",
            f"Model {lm.get('model')}, batch {lm.get('batch_size') or 'default'} per rank; each rank on its own "
            f"network host (a Linux network namespace), links shaped with `tc tbf` (burst {lm.get('burst')}, "
            f"latency {lm.get('latency')}); mode: {lm.get('mode')}. Median step time after warm-up (in brackets: "
            "times the no-communication floor of the same run; `fb`: the strategy fell back to plain all-reduce).", "",
            f"Command: `python -m lightning_gradcomp.bench link {' '.join(lm.get('argv', [])[1:])}`", "",
        ]
        for (model, hosts), (rows, cols) in link_pivot(link["rows"]).items():
            lines += [f"### {model}, {hosts} hosts", "", markdown_table(rows, cols), ""]
        lines += ["Details (communication, codec time, bytes per step per rank, compression, relative error):", "",
                  markdown_table(link["rows"], link_mod.COLUMNS), ""]
        lines += [f"![step time]({rel(p)})" for p in figures if p.name.startswith("link_")] + [""]
    if codecs:
        lines += ["## Codec cost on real gradients (`codecs`)", "",
                  "One process, one core; time inside the DDP hook per optimizer step with a one-rank group "
                  "(collectives return at once), median of the measured steps.", "",
                  f"Command: `python -m lightning_gradcomp.bench codecs {' '.join(codecs['meta'].get('argv', [])[1:])}`", "",
                  markdown_table(codecs["rows"], codecs_mod.COLUMNS), ""]
    if acc:
        lines += ["## Accuracy against bytes sent (`accuracy`)", "",
                  f"The recipes, {acc['meta'].get('max_steps')} optimizer steps each, "
                  f"{acc['meta'].get('devices')} ranks on CPU.", "",
                  f"Command: `python -m lightning_gradcomp.bench accuracy {' '.join(acc['meta'].get('argv', [])[1:])}`", "",
                  markdown_table(acc["rows"], accuracy_mod.COLUMNS), ""]
        lines += [f"![accuracy]({rel(p)})" for p in figures if p.name.startswith("accuracy_")] + [""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def _under(p: Path, d: Path) -> bool:
    try:
        Path(p).resolve().relative_to(d.resolve())
        return True
    except ValueError:
        return False


def _load(path: Path) -> dict[str, Any] | None:
    return read_json(path) if path.exists() else None


def main(args: argparse.Namespace) -> int:
    results, figdir = Path(args.results), Path(args.figures)
    figures: list[Path] = []
    link = _load(results / "link" / "link.json")
    acc = _load(results / "accuracy" / "accuracy.json")
    if link:
        figures += plot_link(link["rows"], figdir)
    if acc:
        figures += plot_accuracy(acc["rows"], figdir)
    for f in figures:
        print(f"wrote {f}")
    if args.markdown:
        print(f"wrote {write_markdown(Path(args.markdown), results, figures)}")
    if not (link or acc or (results / "codecs" / "codecs.json").exists()):
        print(f"plot: no results under {results}", file=sys.stderr)
        return 1
    return 0
