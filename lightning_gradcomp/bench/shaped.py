"""``shaped``: one recipe run across shaped hosts, one rank per host, the link's rate changed mid-run if asked.

Builds the hosts (:mod:`.netns`, as ``link`` does), and starts the recipe on each the way a
multi-node user does: ``ip netns exec HOST env MASTER_ADDR=10.77.0.1 NODE_RANK=r WORLD_SIZE=N
LOCAL_RANK=0 GLOO_SOCKET_IFNAME=IF python RECIPE --trainer.num_nodes N --trainer.devices 1 ...``,
pinned to one core each with ``taskset`` (core ``r`` modulo the machine's cores). With
``--change-rate R --change-after-s T`` every host's link is reshaped to ``R`` (``tc qdisc change``)
``T`` seconds after the ranks started: what ``codec="auto"`` sees as a link that stopped paying.

It writes the recipe's report (``--report.metrics_json``: final metrics, bytes, the validation
history with each point's wall-clock second, and what ``auto`` chose) and each rank's log to
``--out``, and prints rank 0's report. Needs root and iproute2; the namespaces are removed at the
end, also when a rank fails. Everything after ``--`` goes to the recipe::

    python -m lightning_gradcomp.bench shaped --hosts 2 --rate 100mbit --out docs/results/shaped_auto \\
        -- recipes/cifar10.py --trainer.strategy.codec auto --seed_everything 0
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lightning_gradcomp.bench import netns

__all__ = ["add_arguments", "main", "rank_command"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", type=int, default=2, help="hosts (one rank each)")
    p.add_argument("--rate", default="100mbit", help="the link's rate at the start (tc units: 10mbit, 1gbit)")
    p.add_argument("--change-rate", default=None, help="reshape every host's link to this rate mid-run")
    p.add_argument("--change-after-s", type=float, default=None, help="... this many seconds after the start")
    p.add_argument("--port", type=int, default=29640)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds before the ranks are stopped")
    p.add_argument("--out", required=True, help="directory of the report and the ranks' logs")
    p.add_argument("recipe", nargs=argparse.REMAINDER, help="-- RECIPE.py [recipe arguments]")


def rank_command(args: argparse.Namespace, topo: netns.Topology, rank: int, recipe: list[str]) -> list[str]:
    """The command that starts rank ``rank`` of the recipe on its host."""
    report = str(Path(args.out) / "report.json")
    return [
        *netns.rank_prefix(rank, args.hosts, topo.addrs[0], args.port, topo),
        args.python,
        *recipe[:1],
        "--trainer.num_nodes",
        str(args.hosts),
        "--trainer.devices",
        "1",
        "--trainer.accelerator",
        "cpu",
        "--trainer.enable_progress_bar",
        "false",
        "--report.metrics_json",
        report,
        *recipe[1:],
    ]


def main(args: argparse.Namespace) -> int:
    recipe = list(args.recipe)
    if recipe and recipe[0] == "--":
        recipe = recipe[1:]
    if not recipe:
        print(
            "shaped: give the recipe after --, e.g. -- recipes/cifar10.py --trainer.strategy.codec auto",
            file=sys.stderr,
        )
        return 2
    if (args.change_rate is None) != (args.change_after_s is None):
        print("shaped: --change-rate and --change-after-s go together", file=sys.stderr)
        return 2
    netns.parse_rate(args.rate)
    if args.change_rate:
        netns.parse_rate(args.change_rate)
    ok, why = netns.available()
    if not ok:
        print(f"shaped: cannot build shaped hosts here: {why}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    events: list[dict[str, Any]] = []
    with netns.Topology(args.hosts, args.rate, tag="shaped") as topo:
        commands = [rank_command(args, topo, r, recipe) for r in range(args.hosts)]
        logs = [(out / f"rank{r}.log").open("w") for r in range(args.hosts)]
        t0 = time.perf_counter()
        procs = [subprocess.Popen(c, stdout=f, stderr=subprocess.STDOUT) for c, f in zip(commands, logs)]
        events.append({"s": 0.0, "rate": args.rate})
        changed = threading.Event()

        def reshape() -> None:
            if not changed.wait(args.change_after_s):
                topo.set_rate(args.change_rate)
                events.append({"s": time.perf_counter() - t0, "rate": args.change_rate})
                print(f"shaped: link reshaped to {args.change_rate} at {time.perf_counter() - t0:.0f} s", flush=True)

        timer = threading.Thread(target=reshape, daemon=True) if args.change_rate else None
        if timer is not None:
            timer.start()
        try:
            codes = [p.wait(timeout=max(args.timeout - (time.perf_counter() - t0), 1.0)) for p in procs]
        except subprocess.TimeoutExpired:
            codes = [None] * len(procs)
        finally:
            changed.set()
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for f in logs:
                f.close()
        wall = time.perf_counter() - t0
    run = {
        "benchmark": "shaped",
        "argv": getattr(args, "argv", None),
        "hosts": args.hosts,
        "rate_events": events,
        "commands": [shlex.join(c) for c in commands],
        "exit_codes": codes,
        "wall_s": wall,
    }
    (out / "run.json").write_text(json.dumps(run, indent=2))
    report = out / "report.json"
    if any(c != 0 for c in codes) or not report.exists():
        print(f"shaped: a rank failed (exit codes {codes}); see {out}/rank*.log", file=sys.stderr)
        return 1
    print(report.read_text())
    print(f"wrote {out}/report.json and {out}/run.json ({wall:.0f} s)")
    return 0
