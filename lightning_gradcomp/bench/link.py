"""``link``: step time of DDP training over a real, shaped network, every codec in the same run.

For each host count and link rate, builds the hosts (:mod:`.netns`), starts one rank per host
the way a multi-node user does (``ip netns exec HOST env MASTER_ADDR=... NODE_RANK=... python -m
lightning_gradcomp.bench.worker``, pinned to one core with ``taskset``), and collects per codec:
median step time, its ratio to the no-communication floor measured in the same run, the hook's
communication, encode and decode time, bytes on the wire per step, compression ratio, relative
error, and whether the strategy fell back to plain all-reduce (``fallback_buckets``).
``--repeats N`` runs each host count and rate N times, the codec order reversed every other time,
and keeps each codec's median run: step times on a shared CPU drift between invocations by more
than the gap between two codecs.

Without root or iproute2 the ranks run on loopback without shaping (codec overhead only).
Every namespace made is removed on exit, on error, on Ctrl-C and on SIGTERM; ``--cleanup``
removes those left by a run that was killed with SIGKILL.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning_gradcomp.bench import netns, paths
from lightning_gradcomp.bench.results import Column, appended_argv, format_table, machine_info, write_csv, write_json

__all__ = [
    "COLUMNS",
    "DEFAULT_CODECS",
    "OPTIMIZERS",
    "SEED_CODECS",
    "add_arguments",
    "combine_repeats",
    "default_codecs",
    "main",
    "run_config",
]

DEFAULT_CODECS = ("none", "fp16", "topk", "powersgd")
SEED_CODECS = ("gradiveq", "fft", "lgc", "iwp")
FLOOR = "floor"
#: the benchmark model's optimizer: SGD with momentum 0.9, or AdamW (the segmentation recipe's)
OPTIMIZERS = ("sgd", "adamw")

COLUMNS = [
    Column("hosts", "hosts"),
    Column("rate", "link"),
    Column("codec", "codec"),
    Column("step_s", "step s", "{:.3f}"),
    Column("step_s_spread", "spread", "{:.0%}"),
    Column("x_floor", "x floor", "{:.2f}"),
    Column("comm_ms", "comm ms", "{:.0f}"),
    Column("codec_ms", "enc+dec ms", "{:.0f}"),
    Column("mb_per_step", "MB/step", "{:.2f}"),
    Column("compression_ratio", "ratio", "{:.1f}"),
    Column("rel_error", "rel err", "{:.3f}"),
    Column("compressed_fraction", "compressed", "{:.0%}"),
    Column("fallback", "fallback", "{}"),
    Column("measured_steps", "steps", "{}"),
    Column("error", "error"),
]

_ACTIVE_PROCS: list[subprocess.Popen] = []
_ACTIVE_TOPOLOGIES: list[netns.Topology] = []


def default_codecs() -> list[str]:
    """The baselines, then each seed codec that is installed."""
    from lightning_gradcomp.registry import available_codecs

    have = set(available_codecs())
    return [c for c in DEFAULT_CODECS + SEED_CODECS if c in have]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--codecs",
        default=None,
        help="comma list (default: none,fp16,topk,powersgd + installed seed codecs); NAME@LABEL runs a second "
        "configuration of NAME, with options given under NAME@LABEL in --codec-options",
    )
    p.add_argument(
        "--codec-options", default="{}", help='JSON {"codec": {option: value}}, e.g. {"powersgd": {"rank": 4}}'
    )
    p.add_argument("--no-floor", action="store_true", help="skip the no-communication floor")
    p.add_argument("--rates", default="10mbit,100mbit,1gbit", help="comma list of tc rates")
    p.add_argument("--hosts", default="2", help="comma list of host counts, e.g. 2,4")
    p.add_argument("--model", default="resnet18", choices=["resnet18", "pspnet", "pspnet18", "tiny"])
    p.add_argument(
        "--batch-size", type=int, default=None, help="per rank (default 32 for resnet18, 8 for pspnet, 4 for pspnet18)"
    )
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument(
        "--optimizer",
        default="sgd",
        choices=OPTIMIZERS,
        help="sgd (momentum 0.9) or adamw; beside adamw a codec takes its defaults for Adam-like "
        "optimizers, as the recipes' runs do (default: %(default)s)",
    )
    p.add_argument(
        "--level",
        type=float,
        default=None,
        help="the compression level in [0, 1] of codecs that adjust theirs (0: the light setting, 1: the "
        "configured one, the default; the level controller is off in these runs)",
    )
    p.add_argument("--warmup", type=int, default=3, help="at least this many unmeasured steps per codec")
    p.add_argument(
        "--max-warmup", type=int, default=30, help="measure anyway after this many steps without compression"
    )
    p.add_argument("--steps", type=int, default=8, help="measured steps per codec")
    p.add_argument("--min-steps", type=int, default=2, help="measured steps per codec when the budget runs out")
    p.add_argument(
        "--budget-s", type=float, default=45.0, help="stop measuring a codec after this many seconds of steps"
    )
    p.add_argument(
        "--no-fast-warmup",
        action="store_true",
        help="run warm-up steps at the target rate too (by default they run at 1gbit; "
        "only measured steps use the rate)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run each host count and rate this many times, the codec order reversed on every other run; "
        "a codec's row is that of its median run, with every run's step time (step_s_repeats) and their spread",
    )
    p.add_argument("--loopback", action="store_true", help="no namespaces: all ranks on 127.0.0.1, no shaping")
    p.add_argument("--cleanup", action="store_true", help="remove namespaces left by killed runs, then exit")
    p.add_argument("--force", action="store_true", help="with --cleanup: also namespaces of runs still alive")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per host-count x rate run")
    p.add_argument(
        "--append",
        action="store_true",
        help="keep the results already in OUT/link.json "
        "(a codec measured again at the same hosts and rate replaces its row)",
    )
    p.add_argument("--out", default=str(paths.results_dir("link")), help="output directory (default: %(default)s)")


# --------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the rank and anything it started (own session)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if p in _ACTIVE_PROCS:
            _ACTIVE_PROCS.remove(p)


def _teardown_all() -> None:
    _kill(list(_ACTIVE_PROCS))
    while _ACTIVE_TOPOLOGIES:
        _ACTIVE_TOPOLOGIES.pop().down()


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def worker_args(args: argparse.Namespace, codecs: list[str], out: Path) -> list[str]:
    cmd = [
        "--codecs",
        ",".join(codecs),
        "--codec-options",
        args.codec_options,
        "--model",
        args.model,
        "--optimizer",
        args.optimizer,
        "--warmup",
        str(args.warmup),
        "--max-warmup",
        str(args.max_warmup),
        "--steps",
        str(args.steps),
        "--min-steps",
        str(args.min_steps),
        "--budget-s",
        str(args.budget_s),
        "--out",
        str(out),
    ]
    if args.batch_size:
        cmd += ["--batch-size", str(args.batch_size)]
    if args.image_size:
        cmd += ["--image-size", str(args.image_size)]
    if args.level is not None:
        cmd += ["--level", str(args.level)]
    return cmd


def run_config(args: argparse.Namespace, codecs: list[str], hosts: int, rate: str | None, out: Path) -> dict[str, Any]:
    """One host count at one rate (``None``: loopback): start the ranks, wait, collect their files."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    fast = rate is not None and not args.no_fast_warmup
    topo = None
    procs: list[subprocess.Popen] = []
    error = None
    t0 = time.perf_counter()
    try:
        if rate is not None:
            topo = netns.Topology(hosts, "1gbit" if fast else rate, tag=f"{hosts}x{rate}")
            _ACTIVE_TOPOLOGIES.append(topo)
            topo.up()
            master, port = topo.addrs[0], 29600
        else:
            master, port = "127.0.0.1", _free_port()
        for r in range(hosts):
            cmd = netns.rank_prefix(r, hosts, master, port, topo)
            cmd += [sys.executable, "-m", "lightning_gradcomp.bench.worker"] + worker_args(args, codecs, out)
            if topo:
                cmd += ["--iface", topo.ifaces[r], "--rate", rate]
                if fast:
                    cmd += ["--warmup-rate", "1gbit"]
            with open(out / f"rank{r}.log", "w") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            _ACTIVE_PROCS.append(procs[-1])
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                error = f"rank(s) {failed} exited with {[procs[r].returncode for r in failed]}; see {out}/rank*.log"
                break
            if time.monotonic() > deadline:
                error = f"timed out after {args.timeout:.0f} s; see {out}/rank*.log"
                break
            time.sleep(0.2)
        if error is None and any(p.returncode != 0 for p in procs):
            error = f"rank exit codes {[p.returncode for p in procs]}; see {out}/rank*.log"
    finally:
        _kill(procs)
        if topo is not None:
            topo.down()
            _ACTIVE_TOPOLOGIES.remove(topo)
    ranks = []
    for r in range(hosts):
        f = out / f"rank{r}.json"
        ranks.append(json.loads(f.read_text()) if f.exists() else [])
    return {
        "hosts": hosts,
        "rate": rate or "loopback",
        "ranks": ranks,
        "error": error,
        "wall_s": time.perf_counter() - t0,
    }


def rows_of(config: dict[str, Any], model: str) -> list[dict[str, Any]]:
    """Table rows of one run: rank 0's numbers, the slowest rank's median, the ratio to the floor."""
    rows = []
    by_codec: list[dict[str, Any]] = config["ranks"][0] if config["ranks"] else []
    floor = next((r.get("step_s") for r in by_codec if r["codec"] == FLOOR), None)
    rate = config["rate"]
    for i, res in enumerate(by_codec):
        row = {k: v for k, v in res.items() if k != "steps"}
        row.update(hosts=config["hosts"], rate=rate, model=model)
        row["rate_bps"] = netns.parse_rate(rate) if rate != "loopback" else None
        others = [rk[i].get("step_s") for rk in config["ranks"] if len(rk) > i and rk[i].get("step_s") is not None]
        row["step_s_slowest_rank"] = max(others) if others else None
        if floor and res.get("step_s"):
            row["x_floor"] = res["step_s"] / floor
        if "wire_bytes" in res:
            row["mb_per_step"] = res["wire_bytes"] / 1e6
        if res.get("encode_ms") is not None and res.get("collective") != "custom":  # custom: not split out
            row["codec_ms"] = res.get("encode_ms", 0.0) + res.get("decode_ms", 0.0)
        if res["codec"] in (FLOOR, "none"):
            row["compression_ratio"] = None if res["codec"] == FLOOR else 1.0
        if res["codec"] == FLOOR:
            row["compressed_fraction"] = None
        row["fallback"] = res.get("fallback_buckets")
        rows.append(row)
    return rows


def main(args: argparse.Namespace) -> int:
    if args.cleanup:
        if not netns.available()[0]:
            print("no namespaces can exist here (no root or no iproute2): nothing to clean up")
            return 0
        removed = netns.cleanup(force=args.force)
        print(f"removed {len(removed)} namespace(s): {' '.join(removed) or '-'}")
        return 0
    codecs = [c for c in (args.codecs.split(",") if args.codecs else default_codecs()) if c]
    from lightning_gradcomp.registry import available_codecs

    unknown = [c for c in codecs if c.split("@", 1)[0] not in available_codecs() and c != FLOOR]
    if unknown:
        raise SystemExit(f"unknown codec(s) {unknown}; available: {', '.join(available_codecs())}")
    try:
        options = json.loads(args.codec_options)
        assert isinstance(options, dict)
    except (ValueError, AssertionError):
        raise SystemExit(f"--codec-options must be a JSON object of objects, got {args.codec_options!r}") from None
    if not args.no_floor and FLOOR not in codecs:
        codecs = [FLOOR] + codecs
    from lightning_gradcomp.bench.models import DEFAULT_BATCH

    args.batch_size = args.batch_size or DEFAULT_BATCH[args.model]
    hosts = [int(h) for h in args.hosts.split(",") if h]
    if any(h < 2 for h in hosts):
        raise SystemExit(f"--hosts must be >= 2, got {args.hosts}")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    if args.level is not None and not 0.0 <= args.level <= 1.0:
        raise SystemExit(f"--level must be in [0, 1], got {args.level}")
    rates: list[str | None] = [r for r in args.rates.split(",") if r]
    for r in rates:
        try:
            netns.parse_rate(r)
        except ValueError as err:
            raise SystemExit(f"--rates: {err}") from None
    if not args.loopback:
        ok, why = netns.available()
        if not ok:
            print(
                f"link: cannot build network namespaces ({why}); running in loopback mode instead: no "
                "shaping, all ranks on 127.0.0.1, so the numbers show codec overhead only. Run as root with "
                "iproute2 (`ip`, `tc`) for a real slow link.",
                file=sys.stderr,
            )
            args.loopback = True
    if args.loopback:
        rates = [None]
    out = Path(args.out)
    atexit.register(_teardown_all)
    old = {s: signal.signal(s, _raise_exit) for s in (signal.SIGTERM, signal.SIGHUP)}
    configs: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    errors: list[str | None] = []  # this invocation's runs only
    previous = out / "link.json"
    if args.append and previous.exists():
        old_data = json.loads(previous.read_text())
        configs, rows = old_data.get("runs", []), old_data.get("rows", [])
        args.argv = appended_argv(old_data, getattr(args, "argv", []))
    try:
        for h in hosts:
            for rate in rates:
                repeated: list[list[dict[str, Any]]] = []
                for i in range(args.repeats):
                    name = f"{h}hosts-{rate or 'loopback'}" + (f"-{i + 1}" if args.repeats > 1 else "")
                    # every other run in reverse: a drift of the machine over the run (another
                    # load, the clock) then falls on each codec's early and late turns alike
                    order = codecs if i % 2 == 0 else codecs[::-1]
                    print(f"link: {name}: {', '.join(order)} ...", file=sys.stderr, flush=True)
                    cfg = run_config(args, order, h, rate, out / "runs" / name)
                    if cfg["error"]:
                        print(f"link: {name}: {cfg['error']}", file=sys.stderr)
                    configs.append({**cfg, "model": args.model, "repeat": i + 1})
                    repeated.append(rows_of(cfg, args.model))
                    errors.append(cfg["error"])
                    rows = merge_rows(rows, combine_repeats(repeated), args.model)
                    write_results(out, rows, configs, args)
    finally:
        _teardown_all()
        for s, h in old.items():
            signal.signal(s, h)
    print(format_table(rows, COLUMNS))
    print(f"\nwrote {out / 'link.json'} and {out / 'link.csv'}")
    return 1 if any(errors) else 0


def combine_repeats(repeated: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per codec from the rows of repeated runs of one host count and rate.

    A codec's row is that of its run with the median step time (the lower middle one for an even
    count), so that every number in it comes from one run; ``step_s_repeats`` holds each run's
    median step time and ``step_s_spread`` their range over that median. ``x_floor`` compares
    the medians. With one run its rows come back as they are.
    """
    if len(repeated) == 1:
        return repeated[0]
    codecs = list(dict.fromkeys(r["codec"] for rows in repeated for r in rows))
    combined = []
    for codec in codecs:
        runs = [r for rows in repeated for r in rows if r["codec"] == codec]
        timed = sorted((r for r in runs if r.get("step_s") is not None), key=lambda r: r["step_s"])
        if not timed:
            combined.append(runs[-1])
            continue
        row = dict(timed[(len(timed) - 1) // 2])
        times = [r["step_s"] for r in runs if r.get("step_s") is not None]
        row["step_s_repeats"] = times
        row["step_s_spread"] = (max(times) - min(times)) / row["step_s"]
        row.pop("x_floor", None)
        combined.append(row)
    floor = next((r["step_s"] for r in combined if r["codec"] == FLOOR and r.get("step_s")), None)
    for row in combined:
        if floor and row["codec"] != FLOOR and row.get("step_s"):
            row["x_floor"] = row["step_s"] / floor
    return combined


def _key(d: dict[str, Any], model: str) -> tuple[int, str, str]:
    return d["hosts"], d["rate"], d.get("model", model)


def merge_rows(old: list[dict[str, Any]], new: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    """``old`` with ``new`` in place of the rows of the same hosts, rate, model and codec.

    A codec measured again replaces its own row only, so ``--append`` can add one codec to a rate
    measured before. A new row without a floor of its own (``--no-floor``) takes its ``x_floor``
    from the floor already there for the same hosts, rate and model.
    """
    replaced = {(*_key(r, model), r["codec"]) for r in new}
    rows = [r for r in old if (*_key(r, model), r["codec"]) not in replaced] + new
    floors = {_key(r, model): r.get("step_s") for r in rows if r["codec"] == FLOOR and r.get("step_s")}
    for r in new:
        floor = floors.get(_key(r, model))
        if r["codec"] != FLOOR and floor and r.get("step_s") and "x_floor" not in r:
            r["x_floor"] = r["step_s"] / floor
    return rows


def write_results(
    out: Path, rows: list[dict[str, Any]], configs: list[dict[str, Any]], args: argparse.Namespace
) -> None:
    meta = {
        "benchmark": "link",
        "model": args.model,
        "batch_size": args.batch_size,
        "optimizer": args.optimizer,
        "level": args.level,
        "mode": "loopback" if args.loopback else "netns",
        "fast_warmup": not args.no_fast_warmup,
        "burst": netns.BURST,
        "latency": netns.LATENCY,
        "cores_per_rank": 1,
        "machine": machine_info(),
        "argv": getattr(args, "argv", sys.argv[1:]),
        "steps": args.steps,
        "min_steps": args.min_steps,
        "budget_s": args.budget_s,
        "warmup": args.warmup,
    }
    write_json(out / "link.json", {"meta": meta, "rows": rows, "runs": configs})
    write_csv(out / "link.csv", rows)
