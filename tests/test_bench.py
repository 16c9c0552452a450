"""The benchmark tool: a real 2-rank multi-node run on loopback, its tables and files, the plots,
the accuracy driver on a stand-in recipe (seeds, resume), time to accuracy on synthetic results,
the recipes' validation history, and (as root with iproute2) the network namespaces."""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_gradcomp import available_codecs
from lightning_gradcomp.bench import accuracy, link, netns, paths, plot, tta
from lightning_gradcomp.bench.__main__ import main as bench_main
from lightning_gradcomp.bench.results import Column, format_table, machine_key, markdown_table, write_csv
from lightning_gradcomp.bench.worker import NoCommCodec, summarize

ROOT = Path(__file__).resolve().parents[1]
needs_netns = pytest.mark.skipif(not netns.available()[0], reason="needs root and iproute2 (ip, tc)")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


# --------------------------------------------------------------------------------------------------
def test_link_on_loopback_runs_two_ranks_started_like_two_nodes(tmp_path, monkeypatch, capsys):
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
    assert data["meta"]["optimizer"] == "sgd" and data["meta"]["level"] is None
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


def test_link_beside_adamw_gives_codecs_their_adam_defaults_at_the_level_asked(tmp_path, monkeypatch):
    """``--optimizer adamw``: each codec takes its defaults beside an Adam-like optimizer, as in the
    recipes, under the options given; ``--level`` holds every adjustable codec's level."""
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    monkeypatch.setattr(netns, "available", lambda: (False, "not running as root"))
    out = tmp_path / "link"
    options = {"lgc": {"warmup_steps": 1, "ae_train_steps": 2}}
    argv = ["link", "--model", "tiny", "--codecs", "lgc,topk", "--no-floor", "--optimizer", "adamw", "--level", "0"]
    argv += ["--codec-options", json.dumps(options), "--steps", "1", "--warmup", "2", "--max-warmup", "6"]
    assert bench_main(argv + ["--out", str(out)]) == 0
    data = json.loads((out / "link.json").read_text())
    assert data["meta"]["optimizer"] == "adamw" and data["meta"]["level"] == 0.0
    for rank in data["runs"][0]["ranks"]:
        runs = {c["codec"]: c for c in rank}
        lgc = runs["lgc"]["options"]
        assert (lgc["support"], lgc["ratio"], lgc["warmup_steps"]) == ("union", 0.14, 1)  # given options kept
        assert runs["lgc"]["level"] == runs["topk"]["level"] == 0.0


def test_bad_rate_and_codec_are_refused(tmp_path):
    with pytest.raises(ValueError, match="rate must look like"):
        netns.parse_rate("fast")
    assert netns.parse_rate("1gbit") == 1e9
    with pytest.raises(SystemExit, match="unknown codec"):
        bench_main(["link", "--codecs", "nosuch", "--loopback", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--rates"):
        bench_main(["link", "--codecs", "none", "--rates", "10mb", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--level must be in"):
        bench_main(["link", "--codecs", "none", "--level", "2", "--loopback", "--out", str(tmp_path)])


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


def test_plot_tabulates_every_accuracy_study_paired_with_none_on_its_own_seeds(tmp_path):
    """Several studies (``accuracy*/accuracy.json``): a section each with its summary, ``vs none``
    paired per seed within the study, and no per-run table or figure (their rows are in the CSV)."""
    res = _results(tmp_path)
    meta = {"max_epochs": 10, "devices": 2, "accelerator": "cpu", "machine": {}}
    runs = [("none", 0, 0.40), ("none", 1, 0.38), ("fft@peak", 0, 0.39), ("fft@peak", 1, 0.36)]
    rows = [
        {
            "task": "camvid",
            "codec": c,
            "seed": s,
            "max_epochs": 10,
            "metric_name": "val/miou",
            "metric": m,
            "bytes_sent": 1e9,
        }
        for c, s, m in runs
    ]
    (res / "accuracy_camvid").mkdir()
    (res / "accuracy_camvid" / "accuracy.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    md, figures = tmp_path / "docs" / "benchmarks.md", tmp_path / "docs" / "figures"
    assert bench_main(["plot", "--results", str(res), "--figures", str(figures), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert text.count("## Accuracy against bytes sent") == 1
    assert "### camvid: `" in text and "### cifar10: `" in text
    assert "accuracy_camvid/accuracy.csv`" in text and "Each run:" not in text
    assert "| camvid | fft@peak | 10 epochs | 0,1 | val/miou | 0.3750 |" in text
    assert "| -0.0150 |" in text  # (0.39 - 0.40 + 0.36 - 0.38) / 2, each seed against its own none
    assert "The recipes, 10 epochs each," in text
    # a longer schedule beside the protocol's: the text names both budgets, whatever the meta says
    rows.append({**rows[2], "codec": "fft@long", "max_epochs": 12})
    meta["max_epochs"] = 12  # what the last invocation ran
    (res / "accuracy_camvid" / "accuracy.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    assert bench_main(["plot", "--results", str(res), "--figures", str(figures), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "The recipes, each for the budget in its row (10 epochs; 12 epochs)," in text
    assert "| camvid | fft@long | 12 epochs | 0 |" in text
    assert not list(figures.glob("accuracy_*.png"))
    with pytest.raises(SystemExit, match="no accuracy results at"):
        bench_main(["plot", "--results", str(res), "--accuracy", str(tmp_path / "absent.json")])


# --------------------------------------------------------------------------------------------------
# codecs: cost on real gradients, learned codecs fitted first
def _cifar_like_tarball(path: Path, per_class: int = 3) -> Path:
    """CIFAR-10's tarball layout (``train/<class>/*.jpg``, a ``test/`` split) with a few 32x32 images."""
    import io
    import tarfile

    from PIL import Image

    with tarfile.open(path, "w:gz") as tar:
        for split in ("train", "test"):
            for c, cls in enumerate(("cat", "airplane", "dog")):
                for i in range(per_class):
                    buf = io.BytesIO()
                    Image.new("RGB", (32, 32), (40 * c, 10 * i, 200)).save(buf, format="JPEG")
                    info = tarfile.TarInfo(f"{split}/{cls}/{i:04d}.jpg")
                    info.size = len(buf.getvalue())
                    tar.addfile(info, io.BytesIO(buf.getvalue()))
    return path


def test_cifar10_loader_reads_the_tarball_and_the_unpacked_tree_alike(tmp_path):
    import tarfile

    from lightning_gradcomp.bench.data import batches, load_cifar10

    tarball = _cifar_like_tarball(tmp_path / "cifar10-jpeg.tar.gz")
    x, y = load_cifar10(tarball, every=1)
    assert x.shape == (9, 3, 32, 32) and sorted(y.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # train split only
    with tarfile.open(tarball) as tar:
        tar.extractall(tmp_path / "tree", filter="data")
    x2, y2 = load_cifar10(tmp_path / "tree", every=1)
    order, order2 = y.argsort(stable=True), y2.argsort(stable=True)
    assert torch.equal(y[order], y2[order2]) and torch.allclose(x[order], x2[order2])
    assert load_cifar10(tmp_path, every=3)[0].shape[0] == 3  # a directory holding the tarball; every 3rd image
    source, name = batches("tiny", 4, data={"cifar10": tarball})
    xb, yb = next(source)
    assert name == "cifar10" and xb.shape == (4, 3, 16, 16) and yb.max() < 3  # resized to the model's input
    assert batches("mlp", 4, data={"cifar10": tarball})[1] == "fixed random"  # images do not fit an MLP


def test_codecs_fit_steps_train_learned_codecs_before_measuring(tmp_path, capsys):
    """--fit-steps: the codecs train on new batches before the timed steps; NAME@LABEL entries get
    their own options; what the learned codecs fitted is reported beside their cost."""
    tarball = _cifar_like_tarball(tmp_path / "cifar10-jpeg.tar.gz")
    options = {
        "gradiveq": {"basis_source": "aggregate", "warmup_steps": 4, "refresh_every": 0},
        "gradiveq@d32": {"basis_source": "aggregate", "warmup_steps": 4, "refresh_every": 0, "slice_dim": 32},
        "lgc": {"warmup_steps": 2, "ae_train_steps": 3, "ae_epochs": 1},
    }
    out = tmp_path / "codecs"
    argv = ["codecs", "--models", "tiny,mlp", "--codecs", "none,gradiveq,gradiveq@d32,lgc", "--no-torch-powersgd"]
    argv += ["--fit-steps", "7", "--steps", "2", "--codec-options", json.dumps(options), "--out", str(out)]
    argv += ["--data", f"cifar10={tarball}"]
    threads = torch.get_num_threads()
    try:
        assert bench_main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # the verb pins one thread for the process
    rows = {(r["model"], r["codec"]): r for r in json.loads((out / "codecs.json").read_text())["rows"]}
    assert len(rows) == 8
    assert {r["batches"] for (m, _), r in rows.items() if m == "tiny"} == {"cifar10"}
    assert {r["batches"] for (m, _), r in rows.items() if m == "mlp"} == {"random"}  # new ones each step
    for r in rows.values():
        assert r["warmup_steps"] >= 7 and r["measured_steps"] == 2
    for model in ("tiny", "mlp"):
        assert rows[(model, "gradiveq@d32")]["options"]["slice_dim"] == 32
        assert rows[(model, "gradiveq")]["options"]["slice_dim"] == 64
        for codec in ("gradiveq", "gradiveq@d32"):  # bases fitted on the warm-up, measured compressing
            r = rows[(model, codec)]
            assert r["basis_k"] == 4 and 0 < r["explained_variance"] <= 1 and r["compression_ratio"] > 4
        lgc = rows[(model, "lgc")]  # stage 3 from step 5: the learned code fitted within the fit steps
        # two magnitude levels for each layer that collected samples
        assert lgc["ae_train_s"] > 0 and lgc["ae_params"] >= 2 and "ae_recon_error" in lgc
        assert "ae_train_s" not in rows[(model, "none")]
    printed = capsys.readouterr().out
    assert "AE train s" in printed and "PCA EV" in printed and "gradiveq@d32" in printed


# --------------------------------------------------------------------------------------------------
# memory: RSS over a run
def test_memory_reports_rss_per_rank_early_and_late(tmp_path, capsys):
    out = tmp_path / "memory"
    argv = ["memory", "--ranks", "2", "--steps", "20", "--start", "5", "--codec", "topk", "--out", str(out)]
    assert bench_main(argv) == 0
    rows = json.loads((out / "memory.json").read_text())["rows"]
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["steps"] == 20 and r["start_step"] == 5 and r["model"] == "mlp"
        assert 0 < r["compressed_steps"] < 20  # the codec ran (from its start step on), not the fallback
        assert r["rss_start_mib"] > 10 and r["peak_end_mib"] >= r["peak_start_mib"] >= r["rss_start_mib"]
        assert r["rss_growth_mib"] == pytest.approx(r["rss_end_mib"] - r["rss_start_mib"])
        assert r["residual_norm"] > 0  # error feedback holds what top-k left out
    assert (out / "memory.csv").read_text().startswith("rank,codec,model,steps,")
    assert "RSS growth" in capsys.readouterr().out


def test_memory_refuses_an_unknown_codec_before_starting_ranks(tmp_path, capsys):
    assert bench_main(["memory", "--codec", "zip", "--out", str(tmp_path)]) == 2
    assert "unknown codec 'zip'" in capsys.readouterr().err and not any(tmp_path.iterdir())


# --------------------------------------------------------------------------------------------------
# default locations (bench/paths.py)
def test_results_default_to_the_checkout_docs_whatever_the_cwd(tmp_path, monkeypatch):
    monkeypatch.delenv(paths.RESULTS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert paths.checkout() == ROOT
    assert paths.results_dir("codecs") == ROOT / "docs" / "results" / "codecs"
    assert paths.figures_dir() == ROOT / "docs" / "figures"
    assert paths.recipes_dir() == ROOT / "recipes" and (paths.recipes_dir() / "resnet_cifar10.py").is_file()
    assert paths.benchmarks_markdown() == ROOT / "docs" / "benchmarks.md"
    # the committed results sit where the defaults point
    assert (paths.results_dir("link") / "link.json").is_file()
    # and the verbs' defaults are those paths, not relative to the current directory
    parser_defaults = {}
    for verb in ("link", "codecs", "tta", "accuracy", "plot"):
        p = argparse.ArgumentParser()
        importlib.import_module(f"lightning_gradcomp.bench.{verb}").add_arguments(p)
        parser_defaults[verb] = p.parse_args([])
    assert parser_defaults["link"].out == str(ROOT / "docs" / "results" / "link")
    # tta's accuracy runs are the convergence study's, committed
    assert parser_defaults["tta"].accuracy == str(ROOT / "docs" / "results" / "accuracy_r18" / "accuracy.json")
    assert Path(parser_defaults["tta"].accuracy).is_file()
    assert parser_defaults["plot"].results == str(ROOT / "docs" / "results")
    assert parser_defaults["plot"].figures == str(ROOT / "docs" / "figures")


def test_results_environment_variable_wins_over_the_checkout(tmp_path, monkeypatch):
    res = _results(tmp_path)
    monkeypatch.setenv(paths.RESULTS_ENV, str(res))
    assert paths.results_dir("tta") == res / "tta" and paths.figures_dir() == res / "figures"
    assert bench_main(["plot"]) == 0  # reads the results under the variable and draws beside them
    drawn = sorted(p.name for p in (res / "figures").glob("*.png"))
    assert drawn == ["accuracy_cifar10.png", "link_resnet18_2hosts.png"]


def test_outside_a_checkout_results_go_to_the_cache_and_recipes_must_be_named(tmp_path, monkeypatch):
    monkeypatch.delenv(paths.RESULTS_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(paths, "_PACKAGE_DIR", tmp_path / "site-packages" / "lightning_gradcomp")
    assert paths.checkout() is None
    cache = tmp_path / "home" / ".cache" / "lightning_gradcomp" / "results"
    assert paths.results_dir("link") == cache / "link" and paths.figures_dir() == cache / "figures"
    with pytest.raises(SystemExit, match="--recipes-dir DIR"):
        paths.recipes_dir()
    with pytest.raises(SystemExit, match="--markdown FILE"):
        bench_main(["plot", "--results", str(_results(tmp_path)), "--figures", str(tmp_path / "f"), "--markdown"])


# --------------------------------------------------------------------------------------------------
FAKE_RECIPE = """
import argparse, json
p = argparse.ArgumentParser()
for a in ("--trainer.strategy.codec", "--trainer.devices", "--trainer.accelerator", "--seed_everything",
          "--trainer.max_steps", "--trainer.max_epochs", "--report.metrics_json", "--data.data_dir",
          "--trainer.strategy.fallback", "--trainer.enable_progress_bar"):
    p.add_argument(a)
a = vars(p.parse_args())
assert a["trainer.strategy.fallback"] == "false"  # accuracy measures the codec, never the plain fallback
codec = a["trainer.strategy.codec"]
if codec == "broken":
    raise SystemExit(3)
sent = {"none": 4e9, "topk": 8e7}[codec]
steps = int(a["trainer.max_steps"] or 10)
acc = (0.5 if codec == "none" else 0.45) + (0.02 if codec == "none" else 0.01) * int(a["seed_everything"])
json.dump({"val_acc": acc, "bytes_sent": sent, "compression_ratio": 4e9 / sent,
           "compression_ratio_last": 4e9 / sent * 1.5, "global_step": steps, "batch_size": 64,
           "history": [{"step": steps // 2, "metric": acc / 2}, {"step": steps, "metric": acc}],
           "argv": {k: v for k, v in a.items() if v is not None}}, open(a["report.metrics_json"], "w"))
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
    assert ok["topk"]["compression_ratio_last"] == 75 and ok["topk"]["batch_size"] == 64
    assert ok["topk"]["steps"] == 7 and ok["topk"]["metric_name"] == "val_acc" and ok["topk"]["seed"] == 0
    assert ok["topk"]["history"] == [{"step": 3, "metric": 0.225}, {"step": 7, "metric": 0.45}]
    assert ok["topk"]["raw"]["argv"] == {
        "trainer.strategy.codec": "topk",
        "trainer.devices": "2",
        "trainer.accelerator": "cpu",
        "seed_everything": "0",
        "trainer.max_steps": "7",
        "trainer.max_epochs": "-1",  # a step budget alone: as many epochs as it takes
        "report.metrics_json": str(out / "runs" / "cifar10-topk-seed0.json"),
        "data.data_dir": "DATA",
        "trainer.strategy.fallback": "false",
        "trainer.enable_progress_bar": "false",
    }
    broken = next(r for r in rows if r["codec"] == "broken" and r["task"] == "cifar10")
    assert broken["status"].startswith("failed (exit 3)") and "cifar10-broken-seed0.log" in broken["status"]
    assert all(r["status"].startswith("missing recipe") for r in rows if r["task"] == "camvid")


def test_accuracy_runs_several_recipes_at_once_on_the_accelerator_given(tmp_path, capsys):
    """--jobs N: N runs at once, every row saved with its seed and the accelerator the recipe got."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "resnet_cifar10.py").write_text(FAKE_RECIPE)
    out = tmp_path / "acc"
    args = ["accuracy", "--tasks", "cifar10", "--codecs", "none,topk", "--seeds", "0,1", "--max-steps", "5"]
    args += ["--accelerator", "gpu", "--devices", "1", "--jobs", "3", "--recipes-dir", str(recipes), "--out", str(out)]
    assert bench_main(args) == 0
    data = json.loads((out / "accuracy.json").read_text())
    assert sorted((r["codec"], r["seed"]) for r in data["rows"]) == [("none", 0), ("none", 1), ("topk", 0), ("topk", 1)]
    for r in data["rows"]:
        assert r["status"] == "ok" and r["accelerator"] == "gpu"
        assert r["raw"]["argv"]["trainer.accelerator"] == "gpu" and r["raw"]["argv"]["trainer.devices"] == "1"
        assert r["raw"]["argv"]["seed_everything"] == str(r["seed"])
    assert data["meta"]["accelerator"] == "gpu"
    assert (out / "runs" / "cifar10-topk-seed1.cwd").is_dir()  # runs at once do not share a working directory
    summary = {s["codec"]: s for s in data["summary"]}
    assert summary["topk"]["vs_none_mean"] == pytest.approx(-0.055) and summary["topk"]["vs_none_seeds"] == 2


def test_accuracy_seeds_and_epochs_reach_the_recipe(tmp_path, capsys):
    """Each seed is its own run with its own files; --max-epochs replaces the step budget."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "resnet_cifar10.py").write_text(FAKE_RECIPE)
    out = tmp_path / "acc"
    rc = bench_main(
        [
            "accuracy",
            "--tasks",
            "cifar10",
            "--codecs",
            "none,topk",
            "--seeds",
            "0,1",
            "--max-epochs",
            "1",
            "--recipes-dir",
            str(recipes),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads((out / "accuracy.json").read_text())
    assert [(r["codec"], r["seed"]) for r in data["rows"]] == [("none", 0), ("none", 1), ("topk", 0), ("topk", 1)]
    assert sorted(p.name for p in (out / "runs").glob("*.json")) == [
        "cifar10-none-seed0.json",
        "cifar10-none-seed1.json",
        "cifar10-topk-seed0.json",
        "cifar10-topk-seed1.json",
    ]
    argv = data["rows"][3]["raw"]["argv"]
    assert argv["seed_everything"] == "1" and argv["trainer.max_epochs"] == "1" and "trainer.max_steps" not in argv
    assert "data.data_dir" not in argv  # no --cifar-data-dir: the recipe looks in its own default places
    assert data["meta"]["max_epochs"] == 1 and data["meta"]["max_steps"] is None and data["meta"]["seeds"] == [0, 1]
    summary = {s["codec"]: s for s in data["summary"]}
    assert summary["none"]["metric_mean"] == pytest.approx(0.51)
    assert summary["none"]["metric_spread"] == pytest.approx(0.02)
    # paired with none on the same seed: -0.05 on seed 0, -0.06 on seed 1
    assert summary["topk"]["vs_none_mean"] == pytest.approx(-0.055) and summary["none"]["vs_none_mean"] == 0
    assert summary["topk"]["vs_none_spread"] == pytest.approx(0.01) and summary["topk"]["vs_none_seeds"] == 2
    assert summary["topk"]["seeds"] == "0,1" and summary["topk"]["budget"] == "1 epoch"
    assert summary["topk"]["compression_ratio"] == 50 and summary["topk"]["compression_ratio_last"] == 75
    printed = capsys.readouterr().out
    assert "max-min" in printed and "ratio last" in printed and "ratio run" in printed
    assert (out / "accuracy_summary.csv").read_text().splitlines()[0].startswith("task,codec,budget,")


def _fake_runner(calls: list, fail: set):
    """A stand-in for :func:`accuracy.run_recipe`: records the call, fails where told."""

    def run(task, codec, seed, args, out):
        calls.append((codec, seed, args.max_steps))
        row = {
            "task": task,
            "codec": codec,
            "seed": seed,
            "max_steps": args.max_steps or 300,
            "max_epochs": None,
            "recipe_args": args.recipe_args,
            "codec_options": {},
            "devices": args.devices,
            "machine": accuracy.machine_key(args.accelerator),  # as run_recipe records it
        }
        if (codec, seed) in fail:
            return {**row, "status": "failed (exit 1)"}
        return {
            **row,
            "status": "ok",
            "metric": 0.5 + seed / 100,
            "steps": 10,
            "compression_ratio": 2.0,
            "compression_ratio_last": 3.0,
            "gb_sent": 1.0,
            "metric_name": "val/acc",
            "call": len(calls),
        }

    return run


def test_accuracy_resume_skips_done_runs_and_reruns_failed(tmp_path, monkeypatch):
    calls: list = []
    fail = {("topk", 1)}
    monkeypatch.setattr(accuracy, "run_recipe", _fake_runner(calls, fail))
    out = str(tmp_path / "acc")
    base = [
        "accuracy",
        "--tasks",
        "cifar10",
        "--codecs",
        "none,topk",
        "--seeds",
        "0,1",
        "--max-steps",
        "10",
        "--recipe-args",
        "--model resnet10",
        "--out",
        out,
    ]
    assert bench_main(base) == 1
    assert calls == [("none", 0, 10), ("none", 1, 10), ("topk", 0, 10), ("topk", 1, 10)]
    fail.clear()
    calls.clear()
    assert bench_main(base + ["--resume"]) == 0
    assert calls == [("topk", 1, 10)]  # only the failed run again
    data = json.loads((tmp_path / "acc" / "accuracy.json").read_text())
    rows = data["rows"]
    assert [(r["codec"], r["seed"], r["status"]) for r in rows] == [
        ("none", 0, "ok"),
        ("none", 1, "ok"),
        ("topk", 0, "ok"),
        ("topk", 1, "ok"),
    ]
    assert [r["call"] for r in rows] == [1, 2, 3, 1]  # the kept rows are those of the first invocation
    assert data["meta"]["argv"].count("+") == 1
    # everything done: nothing runs
    calls.clear()
    assert bench_main(base + ["--resume"]) == 0 and calls == []
    # another budget is another configuration: it runs, the rows of the first stay
    assert (
        bench_main(
            [
                *base[:-4],
                "--max-steps",
                "20",
                "--seeds",
                "0",
                "--recipe-args",
                "--model resnet10",
                "--out",
                out,
                "--resume",
            ]
        )
        == 0
    )
    assert calls == [("none", 0, 20), ("topk", 0, 20)]
    rows = json.loads((tmp_path / "acc" / "accuracy.json").read_text())["rows"]
    assert len(rows) == 6
    summary = {(s["codec"], s["budget"]): s for s in accuracy.summarize(rows)}
    assert summary[("none", "10 steps")]["metric_mean"] == pytest.approx(0.505)
    assert summary[("none", "20 steps")]["seeds"] == "0"
    # without --resume the results are written anew
    calls.clear()
    assert (
        bench_main(
            base[:4] + ["none", "--seeds", "0", "--max-steps", "10", "--recipe-args", "--model resnet10", "--out", out]
        )
        == 0
    )
    assert calls == [("none", 0, 10)]
    assert len(json.loads((tmp_path / "acc" / "accuracy.json").read_text())["rows"]) == 1


def test_accuracy_runs_resumed_into_one_folder_keep_each_others_rows(tmp_path, monkeypatch):
    calls: list = []
    out = tmp_path / "acc"
    argv = ["accuracy", "--tasks", "cifar10", "--seeds", "0", "--max-steps", "10", "--out", str(out), "--resume"]
    runner = _fake_runner(calls, set())
    monkeypatch.setattr(accuracy, "run_recipe", runner)
    assert bench_main([*argv, "--codecs", "none"]) == 0

    def run_while_another_saves(task, codec, seed, args, out_dir):
        if codec == "topk":  # a second invocation, started after this one, ends before it
            monkeypatch.setattr(accuracy, "run_recipe", runner)
            assert bench_main([*argv, "--codecs", "fft"]) == 0
        return runner(task, codec, seed, args, out_dir)

    monkeypatch.setattr(accuracy, "run_recipe", run_while_another_saves)
    assert bench_main([*argv, "--codecs", "topk,iwp"]) == 0
    rows = json.loads((out / "accuracy.json").read_text())["rows"]
    assert sorted(r["codec"] for r in rows) == ["fft", "iwp", "none", "topk"]


def test_accuracy_resume_keys_on_recipe_args_and_codec_options(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(accuracy, "run_recipe", _fake_runner(calls, set()))
    out = str(tmp_path / "acc")
    assert bench_main(["accuracy", "--tasks", "cifar10", "--codecs", "none", "--out", out]) == 0
    assert (
        bench_main(
            [
                "accuracy",
                "--tasks",
                "cifar10",
                "--codecs",
                "none",
                "--out",
                out,
                "--resume",
                "--recipe-args",
                "--lr 0.05",
            ]
        )
        == 0
    )
    assert len(calls) == 2  # other recipe arguments: not the same run
    row = {"task": "cifar10", "codec": "powersgd", "seed": 0, "codec_options": {"rank": 4, "a": 1}}
    assert accuracy.config_key(row) == accuracy.config_key({**row, "codec_options": {"a": 1, "rank": 4}})
    assert accuracy.config_key(row) != accuracy.config_key({**row, "codec_options": {"rank": 2, "a": 1}})


def test_a_run_under_the_level_controller_pairs_with_none_of_the_same_configuration():
    """none cannot take the controller's flag; a controlled run still pairs with the none run that
    differs from it by that flag alone, and with no other."""
    base = {"task": "cifar10", "seed": 0, "max_steps": None, "max_epochs": 1, "codec_options": {}, "devices": 2}
    args = "--model.model resnet18 --data.batch_size 32"
    rows = [
        {**base, "codec": "none", "recipe_args": args, "metric": 0.60, "status": "ok"},
        {**base, "codec": "none", "recipe_args": args + " --model.lr 0.1", "metric": 0.70, "status": "ok"},
        {
            **base,
            "codec": "fft@adaptive",
            "recipe_args": args + " --trainer.strategy.adaptive_level true",
            "metric": 0.59,
            "status": "ok",
        },
        {
            **base,
            "codec": "topk@adaptive",
            "recipe_args": args + " --trainer.strategy.adaptive_level=true",
            "metric": 0.57,
            "status": "ok",
        },
        {
            **base,
            "codec": "fft@lr",
            "recipe_args": args + " --model.lr 0.1 --trainer.strategy.adaptive_level true",
            "metric": 0.69,
            "status": "ok",
        },
    ]
    got = {s["codec"]: s["vs_none_mean"] for s in accuracy.summarize(rows)}
    assert got["fft@adaptive"] == pytest.approx(-0.01) and got["topk@adaptive"] == pytest.approx(-0.03)
    assert got["fft@lr"] == pytest.approx(-0.01)  # its own none: the one at lr 0.1


def test_a_run_pairs_with_none_of_its_own_machine_only():
    """The same seed rounds differently on another CPU and the run parts from it, so a run pairs
    with the none run of its machine; rows that recorded no machine pair only with each other.
    Both machines' none rows of one seed are kept side by side."""
    base = {"task": "camvid", "seed": 0, "max_steps": None, "max_epochs": 10, "codec_options": {}, "devices": 2}
    base["recipe_args"] = "--trainer.check_val_every_n_epoch 2"
    a, b = "CPU A, AVX2, torch 2.14.1", "CPU B, AVX512, torch 2.14.1"
    rows = [
        {**base, "codec": "none", "metric": 0.408, "status": "ok"},  # machine not recorded
        {**base, "codec": "none", "machine": a, "metric": 0.400, "status": "ok"},
        {**base, "codec": "none", "machine": b, "metric": 0.390, "status": "ok"},
        {**base, "codec": "fp16", "metric": 0.404, "status": "ok"},
        {**base, "codec": "topk", "machine": a, "metric": 0.380, "status": "ok"},
        {**base, "codec": "topk", "machine": b, "metric": 0.385, "status": "ok"},
        {**base, "codec": "fft", "machine": "CPU C, AVX2, torch 2.14.1", "metric": 0.380, "status": "ok"},
    ]
    assert len({accuracy.config_key(r) for r in rows}) == len(rows)  # every machine's none row is kept
    got = {(s["codec"], s["seeds"], round(s["metric_mean"], 3)): s for s in accuracy.summarize(rows)}
    assert got["fp16", "0", 0.404]["vs_none_mean"] == pytest.approx(-0.004)
    assert got["topk", "0", 0.380]["vs_none_mean"] == pytest.approx(-0.020)  # machine A's none
    assert got["topk", "0", 0.385]["vs_none_mean"] == pytest.approx(-0.005)  # machine B's none
    fft = got["fft", "0", 0.380]
    assert fft["vs_none_mean"] is None and fft["vs_none_seeds"] == 0  # no none on its machine: unpaired
    assert accuracy.config_key({**base, "codec": "none"})[-1] is None


def test_a_run_records_the_machine_it_ran_on():
    key = machine_key("cpu")
    assert torch.backends.cpu.get_cpu_capability() in key and torch.__version__ in key


def test_extract_history_orders_steps_and_keeps_the_last_point_of_a_step():
    data = {
        "history": [
            {"step": 100, "metric": 0.4},
            {"step": 50, "metric": 0.3},
            {"step": 100, "metric": 0.45, "wall_s": 12.5, "bytes_sent": 3e6, "raw_bytes": 4e8, "other": 1},
            {"step": "x", "metric": 1.0},
            {"metric": 0.2},
        ]
    }
    assert accuracy.extract_history(data) == [
        {"step": 50, "metric": 0.3},
        # the recipe's seconds since training started and the bytes sent so far, kept
        {"step": 100, "metric": 0.45, "wall_s": 12.5, "bytes_sent": 3e6, "raw_bytes": 4e8},
    ]
    assert accuracy.extract_history({"metrics": {"val/acc": 0.5}}) == []


def test_rows_of_older_results_get_seed_zero_and_the_meta_budget():
    old = [{"task": "cifar10", "codec": "none", "metric": 0.46}, {"codec": "topk", "seed": 1, "max_steps": 5}]
    filled = accuracy.fill_older_rows(old, {"max_steps": 200})
    assert filled[0] == {"seed": 0, "max_steps": 200, "max_epochs": None, **old[0]}
    assert filled[1] == old[1]
    assert accuracy.summarize(filled)[0]["budget"] == "200 steps"


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

    def leftovers() -> list[str]:
        found = []
        for p in Path("/proc").iterdir():
            try:
                if p.name.isdigit() and str(out).encode() in (p / "cmdline").read_bytes():
                    found.append(p.name)
            except OSError:
                pass
        return found

    # the ranks' process groups were sent SIGKILL; on a loaded machine a grandchild can take a
    # moment to go, so allow a few seconds
    deadline = time.monotonic() + 10
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers() == []


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
    assert data["meta"]["argv"].count("+") == 2 and len(data["runs"]) == 4

    # one codec added to a rate measured before: the other codecs' rows stay, and the new row is
    # compared with the floor already there
    assert (
        bench_main(
            ["link", "--codecs", "topk", "--no-floor", "--hosts", "2", "--rates", "1gbit", "--append", "--out", out]
        )
        == 0
    )
    assert calls[4] == (2, "1gbit", ["topk"])
    data = json.loads((tmp_path / "l" / "link.json").read_text())
    at_1gbit = {r["codec"]: r for r in data["rows"] if (r["hosts"], r["rate"]) == (2, "1gbit")}
    assert sorted(at_1gbit) == ["floor", "none", "topk"]
    assert at_1gbit["none"]["step_s"] == 5.0 and at_1gbit["topk"]["step_s"] == 6.0
    assert at_1gbit["topk"]["x_floor"] == pytest.approx(6.0 / 5.0)
    assert len([r for r in data["rows"] if r["rate"] == "10mbit"]) == 2


def test_link_worker_switches_to_the_measured_rate_even_when_it_starts_there(monkeypatch):
    """`bench link` builds the link at the warm-up rate: the worker's first switch to the
    measured rate must reach `tc`, also when the first codec keeps that rate from its first step
    (the fallback on), and a switch to the rate already set must not."""
    from lightning_gradcomp.bench import worker

    issued = []
    monkeypatch.setattr(worker.subprocess, "run", lambda cmd, **kw: issued.append(cmd))
    monkeypatch.setattr(worker.torch.distributed, "barrier", lambda: None)
    link_ = worker._Link("veth0", "100mbit", "1gbit")
    link_.set("100mbit")
    assert len(issued) == 1 and "100mbit" in " ".join(issued[0])
    link_.set("100mbit")
    assert len(issued) == 1
    link_.set("1gbit")
    assert len(issued) == 2 and "1gbit" in " ".join(issued[1])


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
    argv = [
        "link",
        "--hosts",
        "2",
        "--rates",
        "1gbit",
        "+",
        "link",
        "--hosts",
        "4",
        "--rates",
        "100mbit",
        "+",
        "link",
        "--hosts",
        "2",
        "--rates",
        "1gbit",
        "--codecs",
        "none",
    ]
    lines = plot._commands(argv)
    assert lines[0] == "Commands:" and len(lines) == 3
    assert "--hosts 4" in lines[1] and "--codecs none" in lines[2]  # the first 1gbit run was replaced


# --------------------------------------------------------------------------------------------------
# time to accuracy
def _acc_row(codec: str, seed: int, history: list[tuple[int, float]], final: float) -> dict:
    return {
        "task": "cifar10",
        "codec": codec,
        "seed": seed,
        "max_steps": None,
        "max_epochs": 1,
        "recipe_args": "--model resnet10",
        "codec_options": {},
        "devices": 2,
        "status": "ok",
        "metric_name": "val/acc",
        "metric": final,
        "steps": history[-1][0],
        "model": "resnet10",
        "batch_size": 64,
        "history": [{"step": s, "metric": m} for s, m in history],
    }


def _tta_inputs() -> tuple[dict, dict]:
    rows = [
        _acc_row("none", 0, [(50, 0.2), (100, 0.4), (150, 0.5)], 0.5),
        _acc_row("none", 1, [(50, 0.3), (100, 0.4), (150, 0.6)], 0.6),
        _acc_row("powersgd", 0, [(50, 0.3), (100, 0.5), (150, 0.55)], 0.55),
        _acc_row("powersgd", 1, [(50, 0.3), (100, 0.6), (150, 0.57)], 0.57),
        _acc_row("topk", 0, [(50, 0.1), (100, 0.2), (150, 0.3)], 0.3),
        _acc_row("topk", 1, [(50, 0.1), (100, 0.2), (150, 0.3)], 0.3),
        # seed 1 did not validate at step 100: only the steps both seeds validated count
        _acc_row("lgc", 0, [(50, 0.5), (100, 0.56), (150, 0.6)], 0.6),
        _acc_row("lgc", 1, [(50, 0.5), (150, 0.6)], 0.6),
        {**_acc_row("iwp", 0, [(50, 0.9)], 0.9), "status": "failed (exit 1)"},  # failed runs are left out
    ]
    link_rows = [
        {"hosts": 2, "rate": "100mbit", "model": "resnet18", "codec": c, "step_s": t}
        for c, t in (("floor", 1.0), ("none", 4.0), ("powersgd", 1.2), ("topk", 1.3), ("lgc", 1.25))
    ]
    link_rows += [
        {"hosts": 2, "rate": "10mbit", "model": "resnet18", "codec": c, "step_s": t}
        for c, t in (("none", 40.0), ("powersgd", 1.5), ("topk", 1.6))
    ]
    link_rows += [
        {"hosts": 4, "rate": "100mbit", "model": "resnet18", "codec": c, "step_s": 9.0}
        for c in ("none", "powersgd", "lgc")
    ]
    return ({"meta": {}, "rows": rows}, {"meta": {"model": "resnet18", "batch_size": 32}, "rows": link_rows})


def test_tta_steps_and_seconds_to_none_final_accuracy():
    acc, link_data = _tta_inputs()
    result = tta.compute(acc, link_data, ["100mbit", "10mbit"], hosts=2)
    meta = result["meta"]
    assert meta["target"] == pytest.approx(0.55) and meta["none_seeds"] == [0, 1]
    got = {(r["codec"], r["rate"]): r for r in result["rows"]}
    assert set(got) == {(c, r) for c in ("none", "powersgd", "topk", "lgc") for r in ("100mbit", "10mbit")}
    # none: means 0.25, 0.4, 0.55 reach its own final mean at 150; powersgd: 0.55 at 100, exactly the target
    assert got["none", "100mbit"]["steps_to_target"] == 150 and got["none", "100mbit"]["tta_s"] == pytest.approx(600)
    assert got["powersgd", "100mbit"]["steps_to_target"] == 100
    assert got["powersgd", "100mbit"]["tta_s"] == pytest.approx(120)
    assert got["powersgd", "100mbit"]["speedup_vs_none"] == pytest.approx(5.0)
    assert got["powersgd", "100mbit"]["speedup_vs_powersgd"] == pytest.approx(1.0)
    # lgc: step 100 is not common to both seeds, so its first point at the target is 150
    assert got["lgc", "100mbit"]["steps_to_target"] == 150 and got["lgc", "100mbit"]["tta_s"] == pytest.approx(187.5)
    assert got["lgc", "100mbit"]["speedup_vs_powersgd"] == pytest.approx(120 / 187.5)
    assert result["curves"]["lgc"] == [
        {"step": 50, "mean": 0.5, "min": 0.5, "max": 0.5},
        {"step": 150, "mean": 0.6, "min": 0.6, "max": 0.6},
    ]
    # topk never gets there; the step time is still reported
    topk = got["topk", "100mbit"]
    assert topk["steps_to_target"] is None and topk["steps_text"] == "not reached" and topk["tta_s"] is None
    assert topk["step_s"] == 1.3 and topk["speedup_vs_none"] is None
    # 10 Mbit/s: no link row for lgc
    assert got["none", "10mbit"]["tta_s"] == pytest.approx(6000)
    assert got["powersgd", "10mbit"]["tta_s"] == pytest.approx(150)
    assert got["powersgd", "10mbit"]["speedup_vs_none"] == pytest.approx(40.0)
    assert got["lgc", "10mbit"]["steps_to_target"] == 150 and got["lgc", "10mbit"]["tta_s"] is None
    assert "no link row" in got["lgc", "10mbit"]["note"]
    # both measurements and their differences are on record
    assert (meta["accuracy_model"], meta["accuracy_batch_size"], meta["link_model"], meta["link_batch_size"]) == (
        "resnet10",
        64,
        "resnet18",
        32,
    )
    assert any("model differs" in w for w in meta["warnings"]) and any("batch" in w for w in meta["warnings"])
    assert "two separate measurements" in meta["caption"] and "0.5500" in meta["caption"]


def test_tta_target_drop_hosts_and_missing_none():
    acc, link_data = _tta_inputs()
    result = tta.compute(acc, link_data, ["100mbit"], hosts=4, target_drop=0.2)
    got = {r["codec"]: r for r in result["rows"]}
    assert result["meta"]["target"] == pytest.approx(0.35)
    assert got["none"]["steps_to_target"] == 100 and got["none"]["tta_s"] == pytest.approx(900)  # 4 hosts: 9 s
    assert got["topk"]["steps_to_target"] is None and got["topk"]["step_s"] is None
    assert got["powersgd"]["steps_to_target"] == 100
    acc["rows"] = [r for r in acc["rows"] if r["codec"] != "none"]
    with pytest.raises(ValueError, match="no run of 'none'"):
        tta.compute(acc, link_data, ["100mbit"])


def test_tta_reports_only_the_codecs_asked_and_names_the_labels_it_has():
    acc, link_data = _tta_inputs()
    result = tta.compute(acc, link_data, ["100mbit"], only=("powersgd",))
    assert [r["codec"] for r in result["rows"]] == ["none", "powersgd"]  # none stays: it sets the target
    with pytest.raises(ValueError, match="no runs of iwp on cifar10; the results hold lgc, none, powersgd, topk"):
        tta.compute(acc, link_data, ["100mbit"], only=("powersgd", "iwp"))


def test_tta_reads_only_the_seeds_asked_for_every_codec():
    acc, link_data = _tta_inputs()
    acc["rows"].append(_acc_row("none", 2, [(50, 0.2), (100, 0.3), (150, 0.3)], 0.3))
    acc["rows"].append(_acc_row("powersgd", 2, [(50, 0.1), (100, 0.1), (150, 0.1)], 0.1))
    every = tta.compute(acc, link_data, ["100mbit"], hosts=2)
    assert every["meta"]["none_seeds"] == [0, 1, 2] and every["meta"]["seeds_read"] is None
    assert every["meta"]["target"] == pytest.approx((0.5 + 0.6 + 0.3) / 3)
    asked = tta.compute(acc, link_data, ["100mbit"], hosts=2, seeds=(0, 1))
    # the same as a file that never held seed 2
    assert asked["meta"]["none_seeds"] == [0, 1] and asked["meta"]["seeds_read"] == [0, 1]
    assert asked["meta"]["target"] == pytest.approx(0.55)
    got = {r["codec"]: r for r in asked["rows"]}
    assert got["powersgd"]["steps_to_target"] == 100 and got["powersgd"]["tta_s"] == pytest.approx(120)
    assert got["lgc"]["seeds"] == "0,1"
    with pytest.raises(ValueError, match="no run of 'none' on cifar10 with status ok among seeds 7"):
        tta.compute(acc, link_data, ["100mbit"], seeds=(7,))
    assert tta.parse_seeds("0, 1,2") == [0, 1, 2] and tta.parse_seeds(None) is None
    with pytest.raises(SystemExit, match="comma list of integers"):
        tta.parse_seeds("0,a")


def test_tta_given_target_level_replaces_none_final_metric():
    acc, link_data = _tta_inputs()
    result = tta.compute(acc, link_data, ["100mbit"], hosts=2, target=0.3, target_drop=0.2)
    got = {r["codec"]: r for r in result["rows"]}
    assert result["meta"]["target"] == pytest.approx(0.3) and result["meta"]["target_given"]
    assert result["meta"]["target_drop"] == 0.0  # a given level is not shifted again
    # topk, which never reaches none's final accuracy, reaches 0.3 at its last validation
    assert got["topk"]["steps_to_target"] == 150 and got["topk"]["tta_s"] == pytest.approx(195)
    assert got["none"]["steps_to_target"] == 100 and got["powersgd"]["steps_to_target"] == 50
    assert "0.3000 (given)" in result["meta"]["caption"]


def test_tta_time_to_none_final_accuracy_and_99_percent_of_it_beside_the_target():
    acc, link_data = _tta_inputs()
    # fp16: 0.546 at the end, above 99 % of none's final mean 0.55 (0.5445) and below 0.55 itself
    acc["rows"] += [_acc_row("fp16", s, [(50, 0.3), (100, 0.5), (150, 0.546)], 0.546) for s in (0, 1)]
    link_data["rows"].append({"hosts": 2, "rate": "100mbit", "model": "resnet18", "codec": "fp16", "step_s": 2.0})
    for r in acc["rows"]:  # lgc: 10 dense warm-up steps, charged at none's step time as for the target
        if r["codec"] == "lgc":
            r.update(compression_ratio=150 / (10 + 140 / 100), compression_ratio_last=100.0)
    # a given target does not move the two levels: they are none's final metric and 99 % of it
    result = tta.compute(acc, link_data, ["100mbit", "10mbit"], hosts=2, target=0.3)
    meta = result["meta"]
    assert meta["target"] == pytest.approx(0.3)
    assert meta["none_levels"]["none_final"] == pytest.approx(0.55) == meta["none_final_metric"]
    assert meta["none_levels"]["none_99"] == pytest.approx(0.5445) and meta["none_fraction"] == 0.99
    got = {(r["codec"], r["rate"]): r for r in result["rows"]}
    # none reaches its own final mean (0.25, 0.4, 0.55) at its last validation; 150 steps at 4 s
    none = got["none", "100mbit"]
    assert none["steps_to_none_final"] == 150 and none["tta_none_final_s"] == pytest.approx(600)
    assert none["steps_to_none_99"] == 150 and none["none_final_text"] == "600 (150 steps)"
    # powersgd (means 0.3, 0.55, 0.56) gets there at 100 steps of 1.2 s
    ps = got["powersgd", "100mbit"]
    assert ps["steps_to_none_final"] == 100 and ps["tta_none_final_s"] == pytest.approx(120)
    assert ps["steps_to_none_99"] == 100 and ps["tta_none_99_s"] == pytest.approx(120)
    # fp16 reaches 99 % of it, not all of it
    fp16 = got["fp16", "100mbit"]
    assert fp16["steps_to_none_99"] == 150 and fp16["tta_none_99_s"] == pytest.approx(300)
    assert fp16["none_99_text"] == "300 (150 steps)"
    assert fp16["steps_to_none_final"] is None and fp16["tta_none_final_s"] is None
    assert fp16["none_final_text"] == "not reached"
    # topk never reaches either level (nor is a number made up), though it reaches the given target
    for rate in ("100mbit", "10mbit"):
        topk = got["topk", rate]
        assert topk["steps_to_target"] == 150 and topk["tta_s"] is not None
        assert topk["steps_to_none_final"] is None and topk["tta_none_final_s"] is None
        assert topk["steps_to_none_99"] is None and topk["tta_none_99_s"] is None
        assert topk["none_final_text"] == "not reached" == topk["none_99_text"]
    # lgc: 150 steps at 1.25 s plus its 10 dense steps at none's 4.0 s; at 10 Mbit/s it has no link row
    assert got["lgc", "100mbit"]["tta_none_final_s"] == pytest.approx(150 * 1.25 + 10 * (4.0 - 1.25))
    assert got["lgc", "10mbit"]["steps_to_none_final"] == 150 and got["lgc", "10mbit"]["tta_none_final_s"] is None
    assert got["lgc", "10mbit"]["none_final_text"] == "step 150, no step time"
    assert got["none", "10mbit"]["tta_none_99_s"] == pytest.approx(6000)
    # the existing columns are unchanged, the new ones are in the table and the caption
    assert ps["steps_to_target"] == 50 and ps["tta_s"] == pytest.approx(60)
    table = format_table(result["rows"], tta.columns(meta["compare"]))
    assert "to none's final: s (steps)" in table and "to 99 % of it: s (steps)" in table
    assert "0.5500" in meta["caption"] and "0.5445" in meta["caption"]


def test_tta_charges_warm_up_steps_at_none_pace_and_borrows_step_times_of_a_configuration():
    acc, link_data = _tta_inputs()
    # lgc's runs: 150 steps, steady ratio 100, whole-run ratio 150 / (10 + 140/100): 10 dense steps
    for r in acc["rows"]:
        if r["codec"] == "lgc":
            r.update(compression_ratio=150 / (10 + 140 / 100), compression_ratio_last=100.0)
    acc["rows"].append({**_acc_row("lgc@mc", 0, [(50, 0.5), (100, 0.56), (150, 0.6)], 0.6)})
    assert tta.dense_equivalent_steps([r for r in acc["rows"] if r["codec"] == "lgc"]) == pytest.approx(10)
    result = tta.compute(acc, link_data, ["100mbit"], hosts=2)
    got = {r["codec"]: r for r in result["rows"]}
    # 150 steps at 1.25 s plus 10 dense steps at none's 4.0 s instead of 1.25 s
    assert got["lgc"]["dense_steps"] == pytest.approx(10)
    assert got["lgc"]["tta_s"] == pytest.approx(150 * 1.25 + 10 * (4.0 - 1.25))
    assert got["none"]["dense_steps"] == 0 and got["none"]["tta_s"] == pytest.approx(600)
    # lgc@mc has no link row of its own: lgc's step time, said in the note
    assert got["lgc@mc"]["step_s"] == 1.25 and got["lgc@mc"]["note"] == "step time of lgc"
    assert got["lgc@mc"]["steps_to_target"] == 100 and got["lgc@mc"]["tta_s"] == pytest.approx(125)
    assert "none's step time" in result["meta"]["caption"]


def test_tta_charges_the_light_steps_of_an_adaptive_run_beyond_the_timed_ratio():
    """A run under AdaptiveCompression whose last step was light has no steady ratio of its own:
    the bytes beyond those of the steps the link timed (ratio 100) are charged as dense steps."""
    acc, link_data = _tta_inputs()
    light = 150 / (20 + 130 / 100)  # 150 steps that sent as much as 20 dense steps and 130 at 100x
    acc["rows"].append(
        {
            **_acc_row("topk@adaptive", 0, [(50, 0.5), (100, 0.56), (150, 0.6)], 0.6),
            "compression_ratio": light,
            "compression_ratio_last": 4.0,  # the last step ran at the light level
            "raw": {"level_steps": {"0": 30, "1": 120}},
        }
    )
    for r in link_data["rows"]:
        if r["codec"] == "topk":
            r["compression_ratio"] = 100.0
    assert tta.dense_equivalent_steps(acc["rows"][-1:]) == 0  # the last step's ratio hides them
    got = {r["codec"]: r for r in tta.compute(acc, link_data, ["100mbit"], hosts=2)["rows"]}
    row = got["topk@adaptive"]
    assert row["note"] == "step time of topk" and row["dense_steps"] == pytest.approx(20)
    assert row["tta_s"] == pytest.approx(100 * 1.3 + 20 * (4.0 - 1.3))
    # told that it sends what another label's timed steps send, it takes that row instead
    link_data["rows"].append({"hosts": 2, "rate": "100mbit", "model": "resnet18", "codec": "lgc@new", "step_s": 1.1})
    link_data["rows"][-1]["compression_ratio"] = 100.0
    got = tta.compute(acc, link_data, ["100mbit"], hosts=2, step_time_of={"topk@adaptive": "lgc@new"})["rows"]
    row = next(r for r in got if r["codec"] == "topk@adaptive")
    assert row["note"] == "step time of lgc@new" and row["tta_s"] == pytest.approx(100 * 1.1 + 20 * (4.0 - 1.1))
    assert tta.parse_step_time_of("a@x=a@y,b=c") == {"a@x": "a@y", "b": "c"}
    with pytest.raises(SystemExit, match="LABEL=OTHER"):
        tta.parse_step_time_of("a@x")
    # without a timed ratio the run's own is all there is
    for r in link_data["rows"]:
        r.pop("compression_ratio", None)
    got = {r["codec"]: r for r in tta.compute(acc, link_data, ["100mbit"], hosts=2)["rows"]}
    assert got["topk@adaptive"]["dense_steps"] == 0


def test_accuracy_figure_draws_the_chosen_codecs_in_their_order(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from lightning_gradcomp.bench import plot

    acc, link_data = _tta_inputs()
    drawn: list[str] = []
    original = Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append(kwargs.get("label"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    paths_ = plot.plot_accuracy_vs_time(acc, link_data, tmp_path, rate="100mbit", codecs=["powersgd", "none", "x"])
    assert [p.name for p in paths_] == ["accuracy_vs_time_100mbit.png"]
    assert drawn == ["powersgd", "none"]  # an unknown label is skipped
    drawn.clear()
    plot.plot_accuracy_vs_time(acc, link_data, tmp_path, rate="100mbit")
    assert drawn == ["none", "powersgd", "topk", "lgc"]


def test_tta_command_writes_json_csv_and_table(tmp_path, capsys):
    acc, link_data = _tta_inputs()
    (tmp_path / "acc.json").write_text(json.dumps(acc))
    (tmp_path / "link.json").write_text(json.dumps(link_data))
    out = tmp_path / "tta"
    rc = bench_main(
        [
            "tta",
            "--accuracy",
            str(tmp_path / "acc.json"),
            "--link",
            str(tmp_path / "link.json"),
            "--rates",
            "100mbit,10mbit",
            "--out",
            str(out),
            "--figure",
            str(tmp_path / "fig"),
        ]
    )
    assert rc == 0
    for rate in ("100mbit", "10mbit"):  # the figure of accuracy against wall-clock time, per rate
        assert (tmp_path / "fig" / f"accuracy_vs_time_{rate}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    captured = capsys.readouterr()
    assert "two separate measurements" in captured.out and "not reached" in captured.out
    assert "x vs powersgd" in captured.out and "model differs" in captured.err
    data = json.loads((out / "tta.json").read_text())
    assert data["meta"]["argv"][0] == "tta" and len(data["rows"]) == 8
    with (out / "tta.csv").open() as f:
        lines = list(csv.DictReader(f))
    assert lines[1]["codec"] == "powersgd" and float(lines[1]["tta_s"]) == pytest.approx(120)


def test_plot_draws_accuracy_against_time_and_tta_tables(tmp_path):
    acc, link_data = _tta_inputs()
    res = tmp_path / "results"
    (res / "accuracy").mkdir(parents=True)
    (res / "link").mkdir()
    for r in acc["rows"]:
        r["bytes_sent"] = 1e9
    (res / "accuracy" / "accuracy.json").write_text(
        json.dumps({"meta": {"max_epochs": 1, "seeds": [0, 1], "devices": 2}, "rows": acc["rows"]})
    )
    (res / "link" / "link.json").write_text(json.dumps(link_data))
    md = tmp_path / "docs" / "benchmarks.md"
    figures = tmp_path / "docs" / "figures"
    assert bench_main(["plot", "--results", str(res), "--figures", str(figures), "--markdown", str(md)]) == 0
    assert (figures / "accuracy_vs_time_100mbit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = md.read_text()
    assert "## Time to accuracy on a slow link" in text and "two separate measurements" in text
    assert "| powersgd | 100mbit | 0.5600 | 100 | 0 | 1.200 | 120 | 5.00 | 1.00 |" in text
    assert "| topk | 100mbit | 0.3000 | not reached | 0 |" in text
    assert "to none's final: s (steps)" in text and "| 5.00 | 1.00 | 120 (100 steps) | 120 (100 steps) |" in text
    assert "](figures/accuracy_vs_time_100mbit.png)" in text
    assert "| task | codec | budget | seeds |" in text
    assert "| cifar10 | none | 1 epoch | 0,1 | val/acc | 0.5500 | 0.1000 |" in text
    assert text.count("![accuracy](") == 1  # the time figure is not listed with the bytes figures


# --------------------------------------------------------------------------------------------------
# what the recipes record
def test_compression_report_records_rank_zero_history_and_writes_the_result(tmp_path, capsys):
    from lightning.pytorch.callbacks import Callback

    from lightning_gradcomp.callbacks import CompressionReport

    report = CompressionReport(monitor="val/acc", metrics_json=str(tmp_path / "out" / "m.json"))
    assert isinstance(report, Callback)
    trainer = SimpleNamespace(
        sanity_checking=False, is_global_zero=True, global_step=50, callback_metrics={"val/acc": 0.25}
    )
    report.on_validation_end(trainer, None)
    trainer.global_step, trainer.callback_metrics = 100, {"val/acc": 0.5}
    report.on_validation_end(trainer, None)
    # validated again at one step (a test metric logged before fit ended is reported too)
    trainer.callback_metrics = {"val/acc": 0.52, "val/loss": 1.5, "train/loss": 1.0, "test/acc": 0.5}
    report.on_validation_end(trainer, None)
    report.on_validation_end(SimpleNamespace(**{**vars(trainer), "is_global_zero": False, "global_step": 150}), None)
    report.on_validation_end(SimpleNamespace(**{**vars(trainer), "sanity_checking": True, "global_step": 0}), None)
    assert report.history == [{"step": 50, "metric": 0.25}, {"step": 100, "metric": 0.52}]
    resumed = CompressionReport(monitor="val/acc")
    resumed.load_state_dict(report.state_dict())
    assert resumed.history == report.history and resumed.state_key == report.state_key
    # the end of fit: printed on rank 0 and written as JSON, with the history
    fake = SimpleNamespace(
        **vars(trainer),
        strategy=SimpleNamespace(),
        world_size=2,
        num_nodes=1,
        loggers=[],
        logger=None,
        datamodule=SimpleNamespace(hparams={"batch_size": 32}),
    )
    report.on_fit_end(fake, SimpleNamespace(hparams={"model": "resnet18"}))
    result = json.loads((tmp_path / "out" / "m.json").read_text())
    assert result["history"] == report.history
    assert result["metrics"] == {"val/acc": 0.52, "val/loss": 1.5, "test/acc": 0.5}
    assert result["batch_size"] == 32 and result["model"] == "resnet18" and result["steps"] == 100
    assert result["num_nodes"] == 1 and result["cluster_environment"] is None  # a strategy without one
    assert "val/acc 0.5200 after 100 steps" in capsys.readouterr().out


def test_compression_report_validates_the_last_step_gives_the_epoch_rule_back_and_says_what_ran(capsys, monkeypatch):
    from lightning_gradcomp.callbacks import AdaptiveCompression, CompressionReport

    report = CompressionReport()
    controller = AdaptiveCompression()
    controller.steps_at_level = {1.0: 2, 0.0: 1}  # heavy steps first in the dict
    totals = SimpleNamespace(wire_bytes=1e6, raw_wire_bytes=3e6, compression_ratio=3.0)
    hook_state = SimpleNamespace(
        stats=SimpleNamespace(totals=totals, last=SimpleNamespace(compression_ratio=40.0)),
        fallback=SimpleNamespace(fallback={4: "plain", 5: "plain"}),
        codec=None,
    )
    trainer = SimpleNamespace(
        estimated_stepping_batches=3,
        global_step=2,
        current_epoch=0,
        check_val_every_n_epoch=2,
        should_stop=False,
        is_global_zero=True,
        callback_metrics={},
        callbacks=[controller],
        strategy=SimpleNamespace(hook_state=hook_state),
        world_size=2,
        num_nodes=1,
        loggers=[],
        logger=None,
        datamodule=None,
    )
    report.on_train_start(trainer, None)
    report.on_train_batch_end(trainer, None, None, None, 1)
    assert not trainer.should_stop and trainer.check_val_every_n_epoch == 2
    trainer.global_step = 3  # the last step, in an epoch that would not validate: it does
    report.on_train_batch_end(trainer, None, None, None, 2)
    assert trainer.should_stop and trainer.check_val_every_n_epoch is None
    report.on_fit_end(trainer, SimpleNamespace(hparams={}))
    assert trainer.check_val_every_n_epoch == 2  # as the user set it, for a later fit or validate
    out = capsys.readouterr().out
    assert "compression ratio 40.0 at steady state (last step), 3.0 over the run; 1.00 MB sent" in out
    assert "fallback: 2 gradient bucket(s) went back to plain all-reduce" in out
    assert "(steps at each level, 1 = the codec's setting): 1 at 0, 2 at 1" in out  # in the order of the levels
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")  # what seed_everything set
    assert report.result(trainer, SimpleNamespace(hparams={}), 0.0)["seed"] == 7


def test_legacy_recipe_flags_match_todays_configuration():
    """Rows recorded with the argparse recipes keep matching the same run spelled for LightningCLI."""
    old = "--model resnet18 --batch-size 32 --lr 0.05 --val-subset 5000 --val-every-n-steps 130"
    new = (
        "--model.model resnet18 --data.batch_size 32 --model.lr 0.05 --data.val_subset 5000 "
        "--trainer.check_val_every_n_epoch null --trainer.val_check_interval 130"
    )
    assert accuracy.normalize_recipe_args(old) == new and accuracy.normalize_recipe_args(new) == new
    assert accuracy.normalize_recipe_args("--model=resnet10") == "--model.model resnet10"
    row = {"task": "cifar10", "codec": "topk", "seed": 0, "max_epochs": 1, "codec_options": {}, "devices": 2}
    assert accuracy.config_key({**row, "recipe_args": old}) == accuracy.config_key({**row, "recipe_args": new})
    assert accuracy.config_key({**row, "recipe_args": old}) != accuracy.config_key(
        {**row, "recipe_args": "--model.lr 0.1"}
    )


def test_codes_scores_exact_lossy_and_leader_codes_on_known_values():
    """bench codes: the fp32 code is exact, a coarser code costs fewer bytes and loses more, and
    the leader's values predict the mean exactly when every rank holds the same values."""
    from lightning_gradcomp.bench import codes

    g = torch.Generator().manual_seed(0)
    steps = [{"w": torch.randn(2, 500, generator=g)} for _ in range(6)]
    leaders = [s % 2 for s in range(6)]
    exact = codes.score(steps, leaders, codes._per_layer(lambda v, lead, k: (v.mean(0), v, 4.0)))
    assert exact["mean_error"] == 0 and exact["bytes_per_value"] == 4.0
    two = codes.score(steps, leaders, codes._per_layer(codes._learned_levels(2, steps)))
    three = codes.score(steps, leaders, codes._per_layer(codes._learned_levels(3, steps)))
    assert two["bytes_per_value"] < three["bytes_per_value"] < 1 and 0 < three["mean_error"] < two["mean_error"] < 1
    same = [{"w": s["w"][:1].expand(2, -1)} for s in steps]
    leader = codes.score(same, leaders, codes._per_layer(codes._leader_scaled(same, leaders)))
    assert leader["mean_error"] < 1e-6 and math.isnan(leader["rank_error"])
    assert codes.inter_rank_cosine(same) == pytest.approx(1.0)


def test_position_bits_see_a_support_crowded_into_one_channel_and_one_that_stays():
    """bench codes' position accounting: Elias-Fano (what lgc sends) is above the uniform bound; a
    support inside one output channel costs far less coded per channel; a support that repeats
    costs almost nothing against the previous step's."""
    from lightning_gradcomp.bench import codes

    shapes = {"w": (64, 32, 3, 3)}  # 18,432 values, 288 per output channel
    n, k = 18_432, 184
    g = torch.Generator().manual_seed(0)
    spread = [{"w": torch.randperm(n, generator=g)[:k].sort().values} for _ in range(4)]
    crowded = [{"w": (5 * 288 + torch.randperm(288, generator=g)[:k]).sort().values} for _ in range(4)]
    same = [{"w": spread[0]["w"]} for _ in range(4)]
    a, b, c = (codes.position_bits(x, shapes) for x in (spread, crowded, same))
    assert a["elias_fano"] > a["uniform"] > 0
    assert a["uniform"] == pytest.approx(codes._log2_binomial(n, k) / k)
    assert a["per_channel"] > a["uniform"]  # nothing to gain from counts when the support is spread
    assert b["per_channel"] < 0.6 * b["uniform"]  # the channel counts are most of it here
    assert b["per_channel"] <= b["per_channel_ef"] < b["elias_fano"]
    assert c["vs_previous"] < 0.3 * c["uniform"] and a["vs_previous"] > 0.9 * a["uniform"]


def test_shaped_starts_each_rank_like_a_node_and_refuses_bad_arguments(capsys):
    from lightning_gradcomp.bench import shaped

    topo = netns.Topology(2, "100mbit", tag="t")  # not brought up: its names and addresses only
    args = SimpleNamespace(port=29640, hosts=2, python="python", out="/tmp/out")
    cmd = shaped.rank_command(args, topo, 1, ["recipes/cifar10.py", "--trainer.strategy.codec", "auto"])
    assert cmd[: len(topo.exec_prefix(1))] == topo.exec_prefix(1)
    assert {"NODE_RANK=1", "WORLD_SIZE=2", "LOCAL_RANK=0", "MASTER_ADDR=10.77.0.1", "GLOO_SOCKET_IFNAME=gc1v"} <= set(
        cmd
    )
    tail = cmd[cmd.index("recipes/cifar10.py") :]
    assert tail[tail.index("--trainer.num_nodes") + 1] == "2" and tail[tail.index("--trainer.devices") + 1] == "1"
    assert tail[-2:] == ["--trainer.strategy.codec", "auto"]  # the user's arguments come last and win
    assert bench_main(["shaped", "--out", "/tmp/out"]) == 2
    assert "give the recipe after --" in capsys.readouterr().err
    assert bench_main(["shaped", "--change-rate", "10mbit", "--out", "/tmp/out", "--", "r.py"]) == 2
    assert "go together" in capsys.readouterr().err


def test_tta_charges_the_bytes_a_run_recorded_up_to_the_step_not_the_whole_run():
    """A run whose light steps came after the target pays nothing for them; without the recorded
    bytes the whole run's extra bytes are charged to its first steps (the estimate of older runs)."""
    acc, link_data = _tta_inputs()
    for row in acc["rows"]:
        if row["codec"] == "lgc":
            # steady ratio 100; 150 steps sent 150/10 gradients' worth in all, but up to step 50
            # only 50/100 + 2 dense steps' worth (the warm-up), all of it afterwards
            row.update(compression_ratio=10.0, compression_ratio_last=100.0, steps=150)
            raw = 1e6  # a gradient's fp32 all-reduce, per step
            sent = {50: (50 / 100 + 2 * (1 - 1 / 100)) * raw, 100: 8 * raw, 150: 15 * raw}
            for p in row["history"]:
                p.update(bytes_sent=sent[p["step"]], raw_bytes=p["step"] * raw)
    # lgc reaches 0.5 at step 50 (both seeds); the target 0.5 is given
    exact = {(r["codec"], r["rate"]): r for r in tta.compute(acc, link_data, ["100mbit"], target=0.5)["rows"]}
    lgc = exact["lgc", "100mbit"]
    assert lgc["steps_to_target"] == 50 and lgc["dense_steps"] == pytest.approx(2.0)
    assert lgc["tta_s"] == pytest.approx(50 * 1.25 + 2 * (4.0 - 1.25))
    # the step to none's final metric (0.55): 150, all of the run's extra bytes by then
    whole = (150 / 10 - 150 / 100) / (1 - 1 / 100)
    assert lgc["steps_to_none_final"] == 150
    assert lgc["tta_none_final_s"] == pytest.approx(150 * 1.25 + whole * (4.0 - 1.25))
    # one run without the bytes: the whole-run estimate for every step
    for p in acc["rows"][7]["history"]:
        del p["bytes_sent"]
    lgc = {(r["codec"], r["rate"]): r for r in tta.compute(acc, link_data, ["100mbit"], target=0.5)["rows"]}
    assert lgc["lgc", "100mbit"]["dense_steps"] == pytest.approx(whole)
    assert lgc["lgc", "100mbit"]["tta_s"] == pytest.approx(50 * 1.25 + whole * (4.0 - 1.25))


def test_link_repeats_alternate_the_order_and_keep_each_codecs_median_run(tmp_path, monkeypatch):
    monkeypatch.setattr(netns, "available", lambda: (True, ""))
    calls = []
    # per run, the step times of floor / none / topk: topk is slow in the second run only
    times = [
        {"floor": 1.0, "none": 2.0, "topk": 3.0},
        {"floor": 1.2, "none": 2.4, "topk": 9.0},
        {"floor": 1.1, "none": 2.2, "topk": 3.3},
    ]

    def fake_run(args, codecs, hosts, rate, out):
        calls.append(list(codecs))
        t = times[len(calls) - 1]
        ranks = [[{"codec": c, "step_s": t[c], "wire_bytes": 8.0 * len(calls)} for c in codecs]] * hosts
        return {"hosts": hosts, "rate": rate, "ranks": ranks, "error": None, "wall_s": 0.0}

    monkeypatch.setattr(link, "run_config", fake_run)
    out = tmp_path / "l"
    argv = ["link", "--codecs", "none,topk", "--hosts", "2", "--rates", "100mbit", "--repeats", "3"]
    assert bench_main(argv + ["--out", str(out)]) == 0
    assert calls == [["floor", "none", "topk"], ["topk", "none", "floor"], ["floor", "none", "topk"]]
    data = json.loads((out / "link.json").read_text())
    rows = {r["codec"]: r for r in data["rows"]}
    assert sorted(rows) == ["floor", "none", "topk"]
    # the median run's row, whole: topk's third run (3.3 s, its bytes), not the mean with the outlier
    assert rows["topk"]["step_s"] == 3.3 and rows["topk"]["wire_bytes"] == 24.0
    assert rows["topk"]["step_s_repeats"] == [3.0, 9.0, 3.3]
    assert rows["topk"]["step_s_spread"] == pytest.approx((9.0 - 3.0) / 3.3)
    assert rows["none"]["step_s"] == 2.2 and rows["none"]["x_floor"] == pytest.approx(2.2 / 1.1)
    assert [c["repeat"] for c in data["runs"]] == [1, 2, 3]
    # one run: the rows as they were, with no repeat columns
    assert link.combine_repeats([[{"codec": "none", "step_s": 2.0}]]) == [{"codec": "none", "step_s": 2.0}]
    with pytest.raises(SystemExit, match="--repeats must be >= 1"):
        bench_main(argv[:-1] + ["0", "--out", str(out)])


def test_pcaquant_measures_the_quantization_choices_of_gradiveq_on_real_gradients(shared_data, tmp_path, capsys):
    """bench pcaquant: every row shares the PCA error; rounding to the nearest level loses less than
    stochastic rounding with either scale, and the scale per component less than the one per layer."""
    import json

    from lightning_gradcomp.bench.__main__ import main

    out = tmp_path / "pcaquant"
    argv = ["pcaquant", "--task", "cifar10", "--data", str(shared_data / "cifar10-jpeg.tar.gz")]
    assert main([*argv, "--batch-size", "8", "--warmup", "1", "--steps", "2", "--out", str(out)]) == 0
    rows = {
        (r["quant_scale"], r["quant_rounding"]): r
        for r in json.loads((out / "pcaquant_cifar10.json").read_text())["rows"]
    }
    assert len(rows) == 4 and len({round(r["pca_error"], 9) for r in rows.values()}) == 1
    for scale in ("component", "layer"):
        assert rows[(scale, "nearest")]["quant_error"] < rows[(scale, "stochastic")]["quant_error"]
    assert rows[("component", "nearest")]["quant_error"] < rows[("layer", "nearest")]["quant_error"]
    assert 0 < rows[("component", "nearest")]["total_error"] < 1
    assert "quant_scale" in capsys.readouterr().out


def test_pcabasis_the_sums_own_basis_captures_the_most_of_the_sum(shared_data, tmp_path, capsys):
    """bench pcabasis: the top k directions of the summed gradient's own slices capture at least as
    much of it as k directions fitted on anything else (they are the optimum), and the cuts compared
    at equal values a step send as many values."""
    import json

    from lightning_gradcomp.bench.__main__ import main

    out = tmp_path / "pcabasis"
    argv = ["pcabasis", "--task", "cifar10", "--data", str(shared_data / "cifar10-jpeg.tar.gz")]
    assert main([*argv, "--batch-size", "8", "--warmup", "1", "--steps", "1", "--out", str(out)]) == 0
    rows = json.loads((out / "pcabasis_cifar10_d64_k4.json").read_text())["rows"]
    by = {(r["basis"], r["cut"]): r for r in rows}
    best = by[("the sum itself", "d=64")]["captured"]
    for basis in ("leader", "every rank", "the previous sum"):
        assert 0 < by[(basis, "d=64")]["captured"] <= best + 1e-9
    assert 0 < best < 1
    assert len({r["values"] for r in rows if r["cut"] != "rank r of (rows, rest)"}) == 1
    lowrank = by[("leader", "rank r of (rows, rest)")]["values"]
    assert abs(lowrank - rows[0]["values"]) < 0.01 * rows[0]["values"]
    assert "energy captured" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--warmup and --steps must be >= 1"):
        main([*argv, "--warmup", "0", "--out", str(out)])


def test_accuracy_summary_pairs_each_seed_with_none_and_spreads_the_differences():
    def row(codec, seed, metric):
        return {"task": "cifar10", "codec": codec, "seed": seed, "metric": metric, "max_epochs": 1, "status": "ok"}

    rows = [row("none", 0, 0.60), row("none", 1, 0.70), row("topk", 0, 0.58), row("topk", 1, 0.69)]
    topk = next(s for s in accuracy.summarize(rows) if s["codec"] == "topk")
    # the metric spreads 0.11 across the seeds; what topk did, -0.02 and -0.01, spreads 0.01
    assert topk["metric_spread"] == pytest.approx(0.11) and topk["vs_none_mean"] == pytest.approx(-0.015)
    assert topk["vs_none_spread"] == pytest.approx(0.01)


def test_tta_charges_a_warm_up_only_up_to_the_step_reached():
    # 10 steps of 1 s after a 30-step warm-up at none's 4 s: the 10 steps reached were all warm-up
    assert tta.seconds_to_step(10, 1.0, 30, 4.0) == pytest.approx(40.0)
    assert tta.seconds_to_step(50, 1.0, 30, 4.0) == pytest.approx(50 + 30 * 3.0)
    assert tta.seconds_to_step(50, 1.0, 30, None) == pytest.approx(50.0)


def test_tta_reads_the_steady_ratio_of_a_run_at_one_level_from_its_last_step():
    one_level = {"compression_ratio_last": 50.0, "level_steps": {"1": 781}}
    two_levels = {"compression_ratio_last": 4.0, "raw": {"level_steps": {"0": 151, "1": 630}}}
    assert not tta.level_changed(one_level) and tta.level_changed(two_levels)
    assert tta._steady_ratio(one_level, 70.0) == 50.0  # the run's own steady ratio, not the timed steps'
    assert tta._steady_ratio(two_levels, 70.0) == 70.0  # its last step was a light one


def test_tta_curves_keep_the_last_configuration_of_a_codec():
    def run(codec, seed, epochs, metric):
        row = {"task": "cifar10", "codec": codec, "seed": seed, "max_epochs": epochs, "metric": metric}
        return {**row, "history": [{"step": 10, "metric": metric}]}

    rows = [run("topk", 0, 1, 0.5), run("topk", 1, 1, 0.6), run("topk", 0, 2, 0.7)]
    curves, warnings = tta.accuracy_curves(rows, "cifar10")
    assert curves["topk"]["final_metric"] == pytest.approx(0.7) and curves["topk"]["seeds"] == [0]
    assert any("runs of 2 configurations; the last one's (1 run(s)) used" in w for w in warnings)


# --------------------------------------------------------------------------------------------------
# score: a stand-in recipe whose `main` reads its "checkpoint" (JSON: the accuracy on 5,000 test
# images and on all of them) and the test-set size its saved configuration and the command line
# give, and records each call
SCORE_RECIPE = """
import json, sys
from types import SimpleNamespace

def main(args):
    assert args[0] == "validate" and "--trainer.logger" in args and "--trainer.devices" in args
    opts = dict(zip(args[1::2], args[2::2]))
    subset = json.loads(open(opts["--config"]).read())["val_subset"]
    subset = opts.get("--data.val_subset", subset)
    weights = json.loads(open(opts["--ckpt_path"]).read())
    with open(weights["calls"], "a") as f:
        f.write(opts["--ckpt_path"] + " " + str(subset) + "\\n")
    acc = weights["all"] if subset == "null" else weights["half"]
    return SimpleNamespace(trainer=SimpleNamespace(callback_metrics={"val/acc": acc, "val/loss": 1.0}))
"""


def _scored_run(runs: Path, codec: str, seed: int, half: float, full: float, calls: Path) -> None:
    version = runs / f"cifar10-{codec}-seed{seed}.cwd" / "lightning_logs" / "resnet_cifar10" / "version_0"
    (version / "checkpoints").mkdir(parents=True)
    (version / "config.yaml").write_text(json.dumps({"val_subset": 5000}))  # JSON is YAML
    for step, acc in ((390, 0.1), (781, half)):  # an earlier checkpoint is not the final one
        weights = {"half": acc, "all": full if step == 781 else 0.1, "calls": str(calls)}
        (version / "checkpoints" / f"epoch=0-step={step}.ckpt").write_text(json.dumps(weights))
    (version / "checkpoints" / "last.ckpt").write_text("a copy, never read")


def test_score_finds_a_runs_final_checkpoint_beside_its_configuration(tmp_path):
    from lightning_gradcomp.bench.score import find_checkpoint

    _scored_run(tmp_path, "none", 0, 0.6, 0.61, tmp_path / "calls")
    run = tmp_path / "cifar10-none-seed0.cwd"
    ckpt, config = find_checkpoint(run, 781)
    assert ckpt.name == "epoch=0-step=781.ckpt" and config.name == "config.yaml"
    assert find_checkpoint(run, 390)[0].name == "epoch=0-step=390.ckpt"  # the run's own last step
    assert find_checkpoint(run, None)[0].name == "epoch=0-step=781.ckpt"  # else the highest step
    (config).unlink()
    assert find_checkpoint(run, 781) is None  # no configuration, nothing to score it with


def test_score_checks_each_checkpoint_then_scores_it_on_every_image_paired_with_none(tmp_path, capsys):
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "resnet_cifar10.py").write_text(SCORE_RECIPE)
    acc_dir, calls = tmp_path / "acc", tmp_path / "calls"
    runs = acc_dir / "runs"
    # (codec, seed): recorded accuracy on 5,000 images, its checkpoint's on 5,000 and on all
    runs_made = {
        ("none", 0): (0.60, 0.60, 0.62),
        ("none", 1): (0.62, 0.62, 0.61),
        ("topk", 0): (0.58, 0.58, 0.615),
        ("topk", 1): (0.61, 0.61, 0.60),
        ("topk", 2): (0.59, 0.55, 0.50),  # its checkpoint no longer gives the recorded number
    }
    rows = []
    for (codec, seed), (recorded, half, full) in runs_made.items():
        _scored_run(runs, codec, seed, half, full, calls)
        rows.append({"task": "cifar10", "codec": codec, "seed": seed, "status": "ok", "metric": recorded})
        rows[-1].update({"metric_name": "val/acc", "steps": 781, "machine": "M"})
    rows.append({"task": "cifar10", "codec": "none", "seed": 3, "status": "ok", "metric": 0.6, "machine": "M"})
    rows.append({"task": "cifar10", "codec": "fp16", "seed": 0, "status": "failed (exit 1)", "machine": "M"})
    (acc_dir / "accuracy.json").write_text(json.dumps({"rows": rows}))
    out = tmp_path / "score"
    args = ["score", "--accuracy", str(acc_dir / "accuracy.json"), "--recipes-dir", str(recipes)]
    args += ["--recipe-args", "--data.val_subset null", "--out", str(out)]
    assert bench_main([*args, "--seeds", "0,1,2,3"]) == 1  # seed 2 did not reproduce, seed 3 has no checkpoint
    data = json.loads((out / "score.json").read_text())
    got = {(r["codec"], r["seed"]): r for r in data["rows"]}
    assert got[("topk", 0)]["status"] == "ok" and got[("topk", 0)]["reproduced"] is True
    assert got[("topk", 0)]["metric_check"] == 0.58 and got[("topk", 0)]["metric_scored"] == 0.615
    assert got[("topk", 0)]["step"] == 781 and got[("topk", 0)]["checkpoint"].endswith("step=781.ckpt")
    assert got[("topk", 2)]["status"].startswith("not reproduced") and got[("topk", 2)]["reproduced"] is False
    assert got[("none", 3)]["status"].startswith("no checkpoint")
    assert ("fp16", 0) not in got  # a failed run has no final weights to score
    # both validations ran on the final checkpoint: first the saved configuration, then every image
    lines = calls.read_text().splitlines()
    assert len(lines) == 10 and all(line.split()[0].endswith("step=781.ckpt") for line in lines)
    assert [line.split()[1] for line in lines[:2]] == ["5000", "null"]
    summary = {s["codec"]: s for s in data["summary"]}
    # topk vs none, paired by seed on every image: -0.5 and -1.0 points; on the recorded half: -2, -1
    assert summary["topk"]["vs_none_scored"] == pytest.approx(-0.0075)
    assert summary["topk"]["vs_none_scored_se"] == pytest.approx(0.0025)
    assert summary["topk"]["vs_none_recorded"] == pytest.approx(-0.015)
    assert summary["topk"]["seeds"] == "0,1" and summary["none"]["vs_none_scored"] is None
    # --resume keeps what was scored; only the runs that failed are tried again
    assert bench_main([*args, "--seeds", "0,1,2", "--resume"]) == 1
    assert len(calls.read_text().splitlines()) == 12
    argv = json.loads((out / "score.json").read_text())["meta"]["argv"]
    assert argv.count("+") == 1 and argv.count("0,1,2,3") == 1 and argv.count("0,1,2") == 1  # both commands kept
    with pytest.raises(SystemExit, match="no run with status ok"):
        bench_main([*args, "--codecs", "lgc"])
