"""The benchmark tool: a real 2-rank multi-node run on loopback, its tables and files, the plots,
the accuracy driver on a stand-in recipe, and (as root with iproute2) the network namespaces."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_gradcomp import available_codecs
from lightning_gradcomp.bench import accuracy, link, netns, plot
from lightning_gradcomp.bench.__main__ import main as bench_main
from lightning_gradcomp.bench.results import Column, format_table, markdown_table, write_csv
from lightning_gradcomp.bench.worker import NoCommCodec, summarize

ROOT = Path(__file__).resolve().parents[1]
needs_netns = pytest.mark.skipif(not netns.available()[0], reason="needs root and iproute2 (ip, tc)")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


# --------------------------------------------------------------------------------------------------
def test_loopback_multinode_run(tmp_path, monkeypatch, capsys):
    """Two ranks started like two nodes (Lightning env vars), each codec fitted in the same run."""
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    monkeypatch.setattr(netns, "available", lambda: (False, "not running as root"))
    out = tmp_path / "link"
    rc = bench_main(
        [
            "link",
            "--model",
            "tiny",
            "--codecs",
            "none,topk",
            "--hosts",
            "2",
            "--steps",
            "2",
            "--warmup",
            "3",
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "loopback mode" in captured.err and "not running as root" in captured.err
    data = json.loads((out / "link.json").read_text())
    rows = {r["codec"]: r for r in data["rows"]}
    assert list(rows) == ["floor", "none", "topk"]
    assert data["meta"]["mode"] == "loopback"
    for r in rows.values():
        assert r["measured_steps"] == 2 and r["rate"] == "loopback" and r["hosts"] == 2
        assert r["step_s"] > 0 and r["warmup_steps"] >= 3
    # the floor sends nothing; plain all-reduce sends every fp32 gradient plus one flag per bucket
    assert rows["floor"]["wire_bytes"] == 0 and rows["floor"]["x_floor"] == 1.0
    none = rows["none"]
    assert none["compressed_fraction"] == 0.0
    buckets = data["runs"][0]["ranks"][0][1]["steps"][0]["buckets"]
    assert none["wire_bytes"] == 4 * (none["params"] + buckets)  # 2 ranks: ring all-reduce sends 1x
    # top-k measured only once it compresses: 1% of the large layers as (value, int32 index) pairs
    topk = rows["topk"]
    assert topk["compressed_fraction"] == 1.0
    assert 20 < topk["compression_ratio"] < 50
    assert 0 < topk["rel_error"] < 1
    # both ranks ran the same steps and sent the same bytes
    r0, r1 = data["runs"][0]["ranks"]
    assert [c["codec"] for c in r1] == ["floor", "none", "topk"]
    assert [c["wire_bytes"] for c in r0] == [c["wire_bytes"] for c in r1]
    with (out / "link.csv").open() as f:
        lines = list(csv.DictReader(f))
    assert [line["codec"] for line in lines] == ["floor", "none", "topk"]
    assert "step s" in captured.out and "topk" in captured.out


def test_floor_codec_stays_out_of_the_registry():
    codec = NoCommCodec()
    assert codec.name == "floor" and codec.collective == "custom"
    assert "floor" not in available_codecs()


def test_summarize_medians_and_fallback():
    steps = [
        {
            "step_s": 3.0,
            "compressed": True,
            "wire_bytes": 10.0,
            "raw_wire_bytes": 100.0,
            "extra": {"fallback_buckets": 0.0},
        },
        {
            "step_s": 1.0,
            "compressed": True,
            "wire_bytes": 10.0,
            "raw_wire_bytes": 100.0,
            "extra": {"fallback_buckets": 2.0},
        },
        {"step_s": 2.0, "compressed": False, "wire_bytes": 40.0, "raw_wire_bytes": 100.0, "extra": {}},
    ]
    s = summarize(steps)
    assert s["step_s"] == 2.0 and s["measured_steps"] == 3
    assert s["compression_ratio"] == pytest.approx(100 / 20)
    assert s["compressed_fraction"] == pytest.approx(2 / 3)
    assert s["fallback_buckets"] == 2.0
    assert "fallback_buckets" not in summarize(steps[2:])


def test_rows_of_relates_codecs_to_the_floor():
    ranks = [
        [
            {"codec": "floor", "step_s": 0.5, "wire_bytes": 0.0},
            {"codec": "none", "step_s": 2.0, "wire_bytes": 4e6, "encode_ms": 0.0, "decode_ms": 0.0},
            {
                "codec": "topk",
                "step_s": 0.6,
                "wire_bytes": 1e5,
                "compression_ratio": 40.0,
                "encode_ms": 3.0,
                "decode_ms": 1.0,
            },
        ]
    ] * 2
    rows = link.rows_of({"hosts": 2, "rate": "100mbit", "ranks": ranks}, "resnet18")
    assert [r["x_floor"] for r in rows] == [1.0, 4.0, pytest.approx(1.2)]
    assert rows[1]["mb_per_step"] == 4.0 and rows[1]["compression_ratio"] == 1.0
    assert rows[2]["codec_ms"] == 4.0 and rows[0]["rate_bps"] == 1e8
    assert "steps" not in rows[0]


def test_tables_csv_and_markdown(tmp_path):
    rows = [{"a": "x", "b": 1.23456, "nested": {"k": 1}}, {"a": "yy", "b": None}]
    cols = [Column("a", "name"), Column("b", "value", "{:.2f}")]
    text = format_table(rows, cols)
    assert text.splitlines()[2].split() == ["x", "1.23"] and text.splitlines()[3].split() == ["yy", "-"]
    md = markdown_table(rows, cols)
    assert md.splitlines()[0] == "| name | value |" and "| yy | - |" in md
    path = write_csv(tmp_path / "t.csv", rows)
    assert path.read_text().splitlines() == ["a,b", "x,1.23456", "yy,"]


def test_bad_rate_and_codec_are_refused(tmp_path):
    with pytest.raises(ValueError, match="rate must look like"):
        netns.parse_rate("fast")
    assert netns.parse_rate("1gbit") == 1e9
    with pytest.raises(SystemExit, match="unknown codec"):
        bench_main(["link", "--codecs", "nosuch", "--loopback", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--rates"):
        bench_main(["link", "--codecs", "none", "--rates", "10mb", "--out", str(tmp_path)])


# --------------------------------------------------------------------------------------------------
def _results(tmp_path: Path) -> Path:
    res = tmp_path / "results"
    meta = {
        "machine": {"cpu_model": "Test CPU", "cpus_usable": 2, "torch": "9.9"},
        "argv": ["link", "--hosts", "2"],
        "model": "resnet18",
        "mode": "netns",
        "burst": "256kb",
        "latency": "50ms",
    }
    rows = []
    for rate, bps in (("10mbit", 1e7), ("100mbit", 1e8), ("1gbit", 1e9)):
        for codec, t in (("floor", 0.7), ("none", 0.7 + 3.5e8 / bps), ("topk", 0.8)):
            rows.append(
                {
                    "hosts": 2,
                    "rate": rate,
                    "rate_bps": bps,
                    "model": "resnet18",
                    "codec": codec,
                    "step_s": t,
                    "x_floor": t / 0.7,
                    "fallback": 1.0 if codec == "topk" and rate == "1gbit" else None,
                }
            )
    (res / "link").mkdir(parents=True)
    (res / "link" / "link.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    acc = [
        {"task": "cifar10", "codec": c, "metric_name": "val_acc", "metric": m, "bytes_sent": b}
        for c, m, b in (("none", 0.6, 4e10), ("topk", 0.58, 1e9))
    ]
    (res / "accuracy").mkdir()
    (res / "accuracy" / "accuracy.json").write_text(
        json.dumps({"meta": {**meta, "max_steps": 100, "devices": 2}, "rows": acc})
    )
    return res


def test_plot_writes_figures_and_markdown(tmp_path):
    res = _results(tmp_path)
    md = tmp_path / "docs" / "benchmarks.md"
    rc = bench_main(
        ["plot", "--results", str(res), "--figures", str(tmp_path / "docs" / "figures"), "--markdown", str(md)]
    )
    assert rc == 0
    pngs = sorted(p.name for p in (tmp_path / "docs" / "figures").glob("*.png"))
    assert pngs == ["accuracy_cifar10.png", "link_resnet18_2hosts.png"]
    for p in (tmp_path / "docs" / "figures").glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    text = md.read_text()
    assert "2 cores (Test CPU), one core per rank" in text and "torch 9.9" in text
    assert "| codec | 10 Mbit/s | 100 Mbit/s | 1 Gbit/s |" in text
    assert "| none | 35.70 s (51.00x) | 4.20 s (6.00x) | 1.05 s (1.50x) |" in text
    assert "0.80 s (1.14x) fb" in text  # the fallback is visible
    assert "](figures/link_resnet18_2hosts.png)" in text and "](figures/accuracy_cifar10.png)" in text
    assert "`python -m lightning_gradcomp.bench link --hosts 2`" in text
    # hand-written notes around the generated block survive a re-run, the block is replaced
    md.write_text("# Title\n\nintro\n" + text[text.index(plot.BEGIN) :] + "\nclosing note\n")
    bench_main(["plot", "--results", str(res), "--figures", str(tmp_path / "docs" / "figures"), "--markdown", str(md)])
    again = md.read_text()
    assert again.startswith("# Title\n\nintro\n" + plot.BEGIN) and again.endswith("\nclosing note\n")
    assert again.count(plot.BEGIN) == 1 and again.count("| codec | 10 Mbit/s") == 1


# --------------------------------------------------------------------------------------------------
FAKE_RECIPE = """
import argparse, json
p = argparse.ArgumentParser()
for a in ("--codec", "--devices", "--accelerator", "--max-steps", "--metrics-json", "--data-dir"):
    p.add_argument(a)
p.add_argument("--no-fallback", action="store_true")
a = p.parse_args()
assert a.no_fallback  # accuracy measures the codec, never the plain fallback
if a.codec == "broken":
    raise SystemExit(3)
sent = {"none": 4e9, "topk": 8e7}[a.codec]
json.dump({"val_acc": 0.5 if a.codec == "none" else 0.45, "bytes_sent": sent, "compression_ratio": 4e9 / sent,
           "global_step": int(a.max_steps), "argv": vars(a)}, open(a.metrics_json, "w"))
"""


def test_accuracy_runs_recipes_and_collects_metrics(tmp_path, capsys):
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "resnet_cifar10.py").write_text(FAKE_RECIPE)
    out = tmp_path / "acc"
    rc = bench_main(
        [
            "accuracy",
            "--tasks",
            "cifar10,camvid",
            "--codecs",
            "none,topk,broken",
            "--max-steps",
            "7",
            "--recipes-dir",
            str(recipes),
            "--cifar-data-dir",
            "DATA",
            "--out",
            str(out),
        ]
    )
    assert rc == 1  # a failed run and a missing recipe are reported, not hidden
    rows = json.loads((out / "accuracy.json").read_text())["rows"]
    ok = {r["codec"]: r for r in rows if r["task"] == "cifar10" and r["status"] == "ok"}
    assert ok["none"]["metric"] == 0.5 and ok["topk"]["metric"] == 0.45
    assert ok["topk"]["gb_sent"] == pytest.approx(0.08) and ok["topk"]["compression_ratio"] == 50
    assert ok["topk"]["steps"] == 7 and ok["topk"]["metric_name"] == "val_acc"
    assert ok["topk"]["raw"]["argv"] == {
        "codec": "topk",
        "devices": "2",
        "accelerator": "cpu",
        "max_steps": "7",
        "metrics_json": str(out / "runs" / "cifar10-topk.json"),
        "data_dir": "DATA",
        "no_fallback": True,
    }
    broken = next(r for r in rows if r["codec"] == "broken" and r["task"] == "cifar10")
    assert broken["status"].startswith("failed (exit 3)")
    assert all(r["status"].startswith("missing recipe") for r in rows if r["task"] == "camvid")


def test_extract_metrics_reads_nested_and_named_metrics():
    got = accuracy.extract_metrics(
        {"metrics": {"task_metric": 0.7, "total_bytes_sent": 2e9}, "metric_name": "miou"}, "camvid"
    )
    assert got["metric"] == 0.7 and got["metric_name"] == "miou" and got["gb_sent"] == 2.0


# --------------------------------------------------------------------------------------------------
def _in_ns(ns: str, code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, **kw
    )


@needs_netns
@pytest.mark.parametrize("hosts", [2, 4])
def test_namespaces_carry_tcp_and_are_removed(hosts):
    mine = f"{netns.PREFIX}{os.getpid()}-"
    with netns.Topology(hosts, "100mbit", tag="t") as topo:
        assert sorted(netns.list_namespaces(mine)) == sorted(topo.made) and len(topo.made) == hosts + (hosts > 2)
        shaped = subprocess.run(
            topo.exec_prefix(1) + ["tc", "qdisc", "show", "dev", topo.ifaces[1]], capture_output=True, text=True
        )
        assert "tbf" in shaped.stdout and "100Mbit" in shaped.stdout
        server = _in_ns(
            topo.namespaces[0],
            (
                "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
                f"s.bind(('{topo.addrs[0]}', 29650)); s.listen(1); print('ready', flush=True); c, _ = s.accept();"
                "print(c.recv(16).decode(), flush=True)"
            ),
        )
        assert server.stdout.readline().strip() == "ready"
        client = _in_ns(
            topo.namespaces[-1],
            f"import socket; s = socket.create_connection(('{topo.addrs[0]}', 29650), 5); s.sendall(b'hello')",
        )
        assert client.wait(20) == 0
        assert server.stdout.readline().strip() == "hello"
        server.wait(10)
        topo.set_rate("10mbit")
        shaped = subprocess.run(
            topo.exec_prefix(0) + ["tc", "qdisc", "show", "dev", topo.ifaces[0]], capture_output=True, text=True
        )
        assert "10Mbit" in shaped.stdout
    assert netns.list_namespaces(mine) == []


@needs_netns
def test_cleanup_removes_only_dead_runs():
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    dead, alive = f"{netns.PREFIX}{pid_max + 1}-x", f"{netns.PREFIX}{os.getpid()}-x"
    try:
        for n in (dead, alive):
            subprocess.run(["ip", "netns", "add", n], check=True)
        assert netns.cleanup() == [dead]
        assert netns.list_namespaces(alive) == [alive]
    finally:
        for n in (dead, alive):
            subprocess.run(["ip", "netns", "del", n], capture_output=True, check=False)


@needs_netns
def test_link_removes_its_namespaces_on_sigterm(tmp_path):
    """Killed in the middle of a run, the harness stops its ranks and deletes every namespace."""
    out = tmp_path / "sig"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lightning_gradcomp.bench",
            "link",
            "--model",
            "tiny",
            "--codecs",
            "none",
            "--rates",
            "100mbit",
            "--steps",
            "50",
            "--out",
            str(out),
        ],
        env=_env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    prefix = f"{netns.PREFIX}{proc.pid}-"
    try:
        deadline = time.monotonic() + 60
        while not (out / "runs" / "2hosts-100mbit" / "rank1.log").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(netns.list_namespaces(prefix)) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert netns.list_namespaces(prefix) == []
    leftovers = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and str(out).encode() in (p / "cmdline").read_bytes():
                leftovers.append(p.name)
        except OSError:
            pass
    assert leftovers == []


def test_append_merges_runs_and_replaces_a_repeated_one(tmp_path, monkeypatch):
    monkeypatch.setattr(netns, "available", lambda: (True, ""))
    calls = []

    def fake_run(args, codecs, hosts, rate, out):
        calls.append((hosts, rate, codecs))
        ranks = [[{"codec": c, "step_s": 1.0 + len(calls), "wire_bytes": 8.0} for c in codecs]] * hosts
        return {"hosts": hosts, "rate": rate, "ranks": ranks, "error": None, "wall_s": 0.0}

    monkeypatch.setattr(link, "run_config", fake_run)
    out = str(tmp_path / "l")
    assert bench_main(["link", "--codecs", "none", "--hosts", "2", "--rates", "10mbit,1gbit", "--out", out]) == 0
    assert (
        bench_main(["link", "--codecs", "none,topk", "--hosts", "4", "--rates", "100mbit", "--append", "--out", out])
        == 0
    )
    assert bench_main(["link", "--codecs", "none", "--hosts", "2", "--rates", "1gbit", "--append", "--out", out]) == 0
    assert calls[0] == (2, "10mbit", ["floor", "none"]) and calls[2] == (4, "100mbit", ["floor", "none", "topk"])
    data = json.loads((tmp_path / "l" / "link.json").read_text())
    got = sorted((r["hosts"], r["rate"], r["codec"], r["step_s"]) for r in data["rows"])
    assert got == [
        (2, "10mbit", "floor", 2.0),
        (2, "10mbit", "none", 2.0),
        (2, "1gbit", "floor", 5.0),
        (2, "1gbit", "none", 5.0),
        (4, "100mbit", "floor", 4.0),
        (4, "100mbit", "none", 4.0),
        (4, "100mbit", "topk", 4.0),
    ]
    assert data["meta"]["argv"].count("+") == 2 and len(data["runs"]) == 3


@needs_netns
def test_link_over_namespaces_times_steps_at_the_shaped_rate(tmp_path, monkeypatch):
    """Two hosts at 100 Mbit/s: warm-up runs at 1 Gbit/s, the timed steps pay the shaped link (10x
    slower), and nothing is left behind."""
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    out = tmp_path / "ns"
    rc = bench_main(
        [
            "link",
            "--model",
            "tiny",
            "--codecs",
            "none",
            "--hosts",
            "2",
            "--rates",
            "100mbit",
            "--steps",
            "2",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads((out / "link.json").read_text())
    assert data["meta"]["mode"] == "netns"
    none = next(r for r in data["rows"] if r["codec"] == "none")
    # ~2.1 MB of fp32 gradient at 100 Mbit/s: ~0.17 s (less the 256 kB burst); at 1 Gbit/s ~0.02 s
    link_s = none["wire_bytes"] * 8 / 1e8
    assert none["measured_steps"] == 2 and none["comm_ms"] / 1e3 > 0.6 * link_s
    assert none["step_s"] > 0.6 * link_s
    assert netns.list_namespaces(f"{netns.PREFIX}{os.getpid()}-") == []


def test_plot_lists_only_the_run_behind_each_configuration():
    argv = ["link", "--hosts", "2", "--rates", "1gbit", "+", "link", "--hosts", "4", "--rates", "100mbit",
            "+", "link", "--hosts", "2", "--rates", "1gbit", "--codecs", "none"]
    lines = plot._commands(argv)
    assert lines[0] == "Commands:" and len(lines) == 3
    assert "--hosts 4" in lines[1] and "--codecs none" in lines[2]  # the first 1gbit run was replaced
