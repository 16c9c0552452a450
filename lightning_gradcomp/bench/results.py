"""Tables, JSON and CSV of benchmark results, and a description of the machine they ran on."""

from __future__ import annotations

import csv
import json
import math
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "Column",
    "appended_argv",
    "format_table",
    "machine_key",
    "machine_info",
    "markdown_table",
    "read_json",
    "write_csv",
    "write_json",
]


class Column:
    """A table column: a row key, a header and a number format (``None``/NaN print as ``-``)."""

    def __init__(self, key: str, header: str, fmt: str = "{}") -> None:
        self.key, self.header, self.fmt = key, header, fmt

    def cell(self, row: dict[str, Any]) -> str:
        v = row.get(self.key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        try:
            return self.fmt.format(v)
        except (ValueError, TypeError):
            return str(v)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """A plain-text table with aligned columns, for the terminal."""
    cells = [[c.header for c in columns]] + [[c.cell(r) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(s.rjust(w) if j else s.ljust(w) for j, (s, w) in enumerate(zip(line, widths))) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    head = "| " + " | ".join(c.header for c in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(c.cell(r) for c in columns) + " |" for r in rows]
    return "\n".join([head, sep] + body)


def write_json(path: Path, payload: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def appended_argv(previous: dict[str, Any], argv: Sequence[str]) -> list[str]:
    """The commands that wrote a results file, for its ``meta.argv``: those recorded in
    ``previous`` (the file's JSON, written before this command resumed or appended to it), ``+``,
    then ``argv`` (``plot`` splits them at the ``+``)."""
    return list(previous.get("meta", {}).get("argv", [])) + ["+"] + list(argv)


def write_csv(path: Path, rows: Sequence[dict[str, Any]], keys: Sequence[str] | None = None) -> Path:
    """One line per row; nested values (dicts, lists) are left out, the JSON keeps them."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if keys is None:
        keys = []
        for r in rows:
            keys += [k for k, v in r.items() if k not in keys and not isinstance(v, (dict, list))]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(keys), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in keys})
    return path


def machine_key(accelerator: str = "cpu") -> str:
    """What decides a run's floating-point results beyond its code and seed: the CPU model and the
    instruction set torch's kernels use (``AVX2``, ``AVX512``, ...), or the GPU, and torch's version.
    The same recipe and seed on two such machines round differently, and the runs part: on
    PSPNet/CamVid, plain all-reduce on two CPUs ended 0.9 mIoU apart on the same seed."""
    import torch

    if accelerator in ("gpu", "cuda") and torch.cuda.is_available():
        where = torch.cuda.get_device_name(0)
    else:
        where = f"{_cpu_model() or platform.processor() or 'cpu'}, {torch.backends.cpu.get_cpu_capability()}"
    return f"{where}, torch {torch.__version__}"


def _cpu_model() -> str | None:
    """The first ``model name`` of ``/proc/cpuinfo`` (``None`` where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), None)


def machine_info() -> dict[str, Any]:
    """CPU model and cores, memory, the GPU if any, Python, torch and Lightning versions."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version()}
    if (cpu := _cpu_model()) is not None:
        info["cpu_model"] = cpu
    info["cpu_count"] = os.cpu_count()
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        mem = [line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")]
        info["mem_gib"] = round(int(mem[0].split()[1]) / 2**20, 1)
    except (OSError, IndexError):
        pass
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # no torch or no driver: a CPU machine
        pass
    for mod in ("torch", "lightning", "torchvision", "segmentation_models_pytorch"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # a missing optional package is just not reported
            pass
    return info
