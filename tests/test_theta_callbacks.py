"""ThetaDecay schedules and AccuracyDropRollback, including a rollback in a real 2-process Lightning run."""

import hashlib
import json
import os
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn

from lightning_gradcomp import CompressedDDPStrategy, make_codec
from lightning_gradcomp.callbacks import AccuracyDropRollback, CompressionMonitor, CompressionReport, ThetaDecay
from lightning_gradcomp.callbacks.theta_decay import theta_at


@pytest.mark.parametrize("schedule", ["cosine", "linear", "step"])
def test_schedules_diminish_from_start_to_end(schedule):
    values = [theta_at(s, 100, 0.9, 0.5, schedule) for s in range(0, 131)]
    assert values[0] == pytest.approx(0.9) and values[100] == pytest.approx(0.5) and values[130] == pytest.approx(0.5)
    assert all(b <= a + 1e-12 for a, b in zip(values, values[1:]))  # never rises
    assert all(0.5 - 1e-12 <= v <= 0.9 + 1e-12 for v in values)


def test_theta_schedules_reach_their_documented_values():
    assert theta_at(50, 100, 0.9, 0.5, "cosine") == pytest.approx(0.7)
    assert theta_at(25, 100, 0.9, 0.5, "linear") == pytest.approx(0.8)
    step = [theta_at(s, 100, 0.9, 0.5, "step", (0.5, 0.75)) for s in (49, 50, 74, 75)]
    assert step == pytest.approx([0.9, 0.7, 0.7, 0.5])
    assert theta_at(30, 100, 0.9, 0.6, "step", (10, 30, 60)) == pytest.approx(0.7)  # step numbers
    assert theta_at(1, 100, 0.9, 0.5, "step", (1, 50)) == pytest.approx(0.7)  # 1 is step 1, not the end


@pytest.mark.parametrize(
    "cls, kwargs, option",
    [
        (ThetaDecay, {"schedule": "exp"}, "schedule"),
        (ThetaDecay, {"theta_end": 1.0}, "theta_end"),
        (ThetaDecay, {"theta_start": 0.3, "theta_end": 0.5}, "theta_end"),
        (ThetaDecay, {"total_steps": 0}, "total_steps"),
        (ThetaDecay, {"milestones": (0.7, 0.2)}, "milestones"),
        (AccuracyDropRollback, {"mode": "up"}, "mode"),
        (AccuracyDropRollback, {"tolerance": -1}, "tolerance"),
        (AccuracyDropRollback, {"factor": 1.0}, "factor"),
        (AccuracyDropRollback, {"patience": 0}, "patience"),
        (AccuracyDropRollback, {"tolerance": True}, "tolerance"),
        (AccuracyDropRollback, {"min_level": True}, "min_level"),
        (AccuracyDropRollback, {"monitor": None}, "monitor must be a metric's name"),
        (CompressionReport, {"monitor": 3}, "monitor must be a metric's name"),
        (CompressionReport, {"metrics_json": True}, "metrics_json must be a path"),
        # a string from a YAML file is not a switch: bool("false") is True
        (CompressionReport, {"validate_last_step": "false"}, "validate_last_step must be True or False"),
        (CompressionMonitor, {"prog_bar": "false"}, "prog_bar must be True or False"),
    ],
)
def test_invalid_arguments_name_the_option(cls, kwargs, option):
    with pytest.raises(ValueError, match=option):
        cls(**kwargs)


def test_callback_state_round_trips():
    cb = ThetaDecay()
    cb.load_state_dict({"start": 0.9, "total": 50, "theta": 0.8})
    assert ThetaDecay().state_dict() != cb.state_dict()
    assert cb.state_dict() == {"start": 0.9, "total": 50, "theta": 0.8}
    rb = AccuracyDropRollback()
    saved = {"best": 0.7, "bad_checks": 1, "rollbacks": 2, "last_good_step": 40}
    rb.load_state_dict(saved)
    assert (rb.best, rb.bad_checks, rb.rollbacks) == (0.7, 1, 2) and rb.state_dict() == saved
    assert AccuracyDropRollback(monitor="a").state_key != AccuracyDropRollback(monitor="b").state_key


def test_a_resumed_theta_decay_continues_its_schedule_from_the_start_it_recorded():
    # the codec comes back at the decayed theta; the schedule's start (the codec's theta when the
    # run began) and length are the ones the run began with, though the resumed run is longer
    codec = make_codec("fft", theta=0.9)
    trainer = SimpleNamespace(strategy=SimpleNamespace(codec=codec), global_step=0, estimated_stepping_batches=50)
    module = SimpleNamespace(log=lambda *args, **kwargs: None)
    first = ThetaDecay(theta_end=0.5, schedule="linear")
    first.on_fit_start(trainer, module)
    trainer.global_step = 25
    first.on_train_batch_start(trainer, module, None, 0)
    assert codec.compression_level == pytest.approx(0.7)
    resumed = ThetaDecay(theta_end=0.5, schedule="linear")
    resumed.load_state_dict(first.state_dict())
    trainer.global_step, trainer.estimated_stepping_batches = 30, 80
    for callback in (first, resumed):  # a second fit() of the same run, and a resumed run
        callback.on_fit_start(trainer, module)
        callback.on_train_batch_start(trainer, module, None, 0)
        assert codec.compression_level == pytest.approx(0.66)  # 0.9 - 0.4 * 30 / 50


def test_theta_decay_starts_from_the_codecs_theta():
    codec = make_codec("fft", theta=0.8)
    trainer = SimpleNamespace(strategy=SimpleNamespace(codec=codec), global_step=0, estimated_stepping_batches=40)
    decay = ThetaDecay(theta_end=0.4, schedule="linear")
    decay.on_fit_start(trainer, SimpleNamespace())
    trainer.global_step = 10
    decay.on_train_batch_start(trainer, SimpleNamespace(log=lambda *args, **kwargs: None), None, 0)
    assert codec.compression_level == pytest.approx(0.7)  # 0.8 - 0.4 * 10 / 40


def _validations(rollback: AccuracyDropRollback, values: list[float], codec=None) -> list[dict]:
    """Feed ``rollback`` one validation value a step (one rank, no Lightning loop); a step's weights
    are its number, so a restored state shows whose it was. Returns, after each value: the weight,
    the rollbacks so far, the best value and the codec's limit."""
    codec = codec if codec is not None else make_codec("fft", theta=0.9)
    module = nn.Linear(1, 1, bias=False)
    strategy = SimpleNamespace(broadcast=lambda value, src=0: value, codec=codec, hook_state=None)
    trainer = SimpleNamespace(
        sanity_checking=False,
        fast_dev_run=False,
        lightning_module=module,
        optimizers=[],
        strategy=strategy,
        logger=None,
    )
    seen = []
    for step, value in enumerate(values, start=1):
        with torch.no_grad():
            module.weight.fill_(step)
        trainer.global_step, trainer.callback_metrics = step, {"val_loss": torch.tensor(value)}
        rollback.on_validation_end(trainer, module)
        seen.append(
            {
                "weight": module.weight.item(),
                "rollbacks": rollback.rollbacks,
                "best": rollback.best,
                "limit": float(codec.compression_limit),
            }
        )
    return seen


def test_rollback_decides_on_the_best_value_in_its_mode_and_lowers_the_level_in_use():
    # mode="min": a lower loss is the new best (0.8), and 0.95, 0.15 above it, is a drop
    seen = _validations(AccuracyDropRollback(monitor="val_loss", mode="min", tolerance=0.1), [1.0, 0.8, 0.95])
    assert [s["best"] for s in seen] == pytest.approx([1.0, 0.8, 0.8])
    assert [s["rollbacks"] for s in seen] == [0, 0, 1]
    assert seen[-1]["weight"] == 2.0  # the state of step 2, the last good one
    assert seen[-1]["limit"] == pytest.approx(0.45)  # half the theta in use, 0.9
    # the second rollback halves the level in use (theta 0.3 under the limit 0.45), not the limit
    codec = make_codec("fft", theta=0.9)
    rollback = AccuracyDropRollback(monitor="val_loss", mode="min", tolerance=0.1)
    _validations(rollback, [1.0, 0.8, 0.95], codec)
    codec.set_level(0.3)
    seen = _validations(rollback, [0.8, 0.95], codec)
    assert [s["rollbacks"] for s in seen] == [1, 2] and seen[-1]["limit"] == pytest.approx(0.15)


def test_rollback_patience_counts_consecutive_bad_checks_only():
    rollback = AccuracyDropRollback(monitor="val_loss", mode="min", tolerance=0.1, patience=2)
    seen = _validations(rollback, [1.0, 1.5, 1.0, 1.5])  # bad, good, bad: never two in a row
    assert [s["rollbacks"] for s in seen] == [0, 0, 0, 0]
    seen = _validations(rollback, [1.5])  # the second bad check in a row
    assert seen[-1]["rollbacks"] == 1 and seen[-1]["weight"] == 3.0  # back to the last good state, step 3


def test_rollback_bounds_a_drop_by_the_tolerance_the_level_by_min_level_and_stops_at_max_rollbacks():
    # a fall of exactly the tolerance is not a drop (0.25 is exact in binary)
    seen = _validations(AccuracyDropRollback(monitor="val_loss", mode="max", tolerance=0.25), [1.0, 0.75])
    assert seen[-1]["rollbacks"] == 0 and seen[-1]["weight"] == 2.0
    # half of theta 0.9 is 0.45, below the floor 0.5
    seen = _validations(AccuracyDropRollback(monitor="val_loss", tolerance=0.1, min_level=0.5), [1.0, 0.5])
    assert seen[-1]["rollbacks"] == 1 and seen[-1]["limit"] == pytest.approx(0.5)
    # one rollback allowed: a second drop is only reported
    seen = _validations(AccuracyDropRollback(monitor="val_loss", tolerance=0.1, max_rollbacks=1), [1.0, 0.5, 0.5])
    assert [s["rollbacks"] for s in seen] == [0, 1, 1]


def test_rollback_ignores_the_sanity_check():
    # Lightning's sanity check validates a couple of batches of an untrained model: not a best value
    rollback = AccuracyDropRollback(monitor="val_acc")
    trainer = SimpleNamespace(sanity_checking=True, fast_dev_run=False, callback_metrics={"val_acc": torch.tensor(0.9)})
    rollback.on_validation_end(trainer, None)
    assert rollback.best is None and rollback.last_good_step is None


def test_a_rollback_starts_the_count_of_bad_checks_again():
    rollback = AccuracyDropRollback(monitor="val_loss", mode="min", tolerance=0.1, patience=2)
    seen = _validations(rollback, [1.0, 1.5, 1.5, 1.5])  # two bad checks roll back; the third is one
    assert [s["rollbacks"] for s in seen] == [0, 0, 1, 1] and rollback.bad_checks == 1


# --------------------------------------------------------------------------------------------------
# a 2-process run whose validation metric is scripted per epoch and per rank
VAL = {0: (0.80, 0.80), 1: (0.50, 0.80), 2: (0.80, 0.20)}  # epoch -> (rank 0, rank 1)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _facts(trainer: pl.Trainer) -> dict:
    module = trainer.lightning_module
    opt = trainer.optimizers[0]
    hook = trainer.strategy.hook_state
    codec = trainer.strategy.codec
    return {
        "model": _digest(module.state_dict().values()),
        "optimizer": _digest(s["momentum_buffer"] for s in opt.state.values()),
        "residuals": _digest(v for _, v in sorted(hook.memory.residuals.items())),
        "n_residuals": len(hook.memory.residuals),
        "theta": codec.theta,
        "limit": codec.compression_limit,
        "step": trainer.global_step,
    }


class RecordingRollback(AccuracyDropRollback):
    """Writes what each rank holds when it snapshots and right after it restores."""

    def __init__(self, out_dir: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out_dir = out_dir

    def _write(self, trainer: pl.Trainer, label: str) -> None:
        path = os.path.join(self.out_dir, f"{label}.rank{trainer.global_rank}.json")
        with open(path, "w") as f:
            json.dump(_facts(trainer), f)

    def _take_snapshot(self, trainer):
        super()._take_snapshot(trainer)
        self._write(trainer, f"snap{trainer.current_epoch}")

    def _rollback(self, trainer, current, drop):
        self._write(trainer, "before_rollback")
        super()._rollback(trainer, current, drop)
        self._write(trainer, "restored")


class ScriptedModule(pl.LightningModule):
    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))  # 2048 weights compressed

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        # deliberately not synced: the ranks disagree, and rank 0's value must decide for both
        self.log("val_acc", VAL[self.current_epoch][self.global_rank], batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def _loader(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(256, 32, generator=g)
        y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)

    def train_dataloader(self):
        return self._loader(0)

    def val_dataloader(self):
        return self._loader(1)

    def on_train_end(self) -> None:
        with open(os.path.join(self.out_dir, f"final.rank{self.global_rank}.json"), "w") as f:
            json.dump(_facts(self.trainer), f)


def test_rollback_restores_identical_state_on_both_ranks_and_training_continues(tmp_path):
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=CompressedDDPStrategy(
            codec="fft", codec_options={"theta": 0.9, "block_size": 256, "start_step": 0}, start_method="spawn"
        ),
        max_epochs=3,
        limit_train_batches=4,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[
            ThetaDecay(theta_end=0.7, schedule="linear"),
            RecordingRollback(str(tmp_path), monitor="val_acc", tolerance=0.1, factor=0.5),
        ],
    )
    trainer.fit(ScriptedModule(str(tmp_path)))
    read = lambda label, r: json.loads((tmp_path / f"{label}.rank{r}.json").read_text())  # noqa: E731
    # epoch 0 was good (snapshot), epoch 1 dropped on rank 0 only: both ranks rolled back;
    # epoch 2 dropped on rank 1 only: neither did (one rollback, one later snapshot)
    assert not (tmp_path / "snap1.rank0.json").exists() and not (tmp_path / "snap1.rank1.json").exists()
    for r in range(2):
        snap, before, restored, final = (
            read("snap0", r),
            read("before_rollback", r),
            read("restored", r),
            read("final", r),
        )
        assert snap["step"] == 4 and restored["step"] == 8 and final["step"] == 12
        assert snap["n_residuals"] > 0  # the compressed layer carries a residual worth restoring
        for key in ("model", "optimizer", "residuals"):
            assert restored[key] == snap[key], (r, key)
            assert before[key] != snap[key], (r, key)  # there was something to undo
        assert restored["theta"] == snap["theta"]
        # compression lowered from the theta in use at the drop: 0.5 * theta(step 8)
        assert restored["limit"] == pytest.approx(0.5 * before["theta"])
        assert final["limit"] == pytest.approx(restored["limit"]) and final["theta"] > final["limit"]
        assert final["model"] != restored["model"]  # training went on from the restored state
        assert read("snap2", r)["step"] == 12
    for label in ("snap0", "restored", "final"):
        a, b = read(label, 0), read(label, 1)
        assert a["model"] == b["model"] and a["optimizer"] == b["optimizer"] and a["limit"] == b["limit"]
        assert a["residuals"] != b["residuals"]  # residuals are per rank, and each got its own back
    m = trainer.callback_metrics
    assert float(m["gradcomp/rollbacks"]) == 1.0
    assert float(m["gradcomp/theta"]) == pytest.approx(read("final", 0)["limit"])  # the capped theta in use
