"""CompressedDDPStrategy in real 2-process Lightning runs on CPU (gloo), and the fallback policy."""

import json
import os
import time

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
from dist_utils import run_gloo
from torch.nn.parallel import DistributedDataParallel as DDP

import lightning_gradcomp as gc
from lightning_gradcomp import CompressedDDPStrategy, make_comm_hook


class TinyClassifier(pl.LightningModule):
    def __init__(self, out_dir: str = "") -> None:
        super().__init__()
        self.out_dir = out_dir
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1024, 32, generator=g)
        y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)

    def on_train_end(self) -> None:
        ddp = self.trainer.strategy.model
        facts = {
            "comm_hook": ddp._get_ddp_logging_data().get("comm_hook"),
            "backend": torch.distributed.get_backend(),
            "steps": self.trainer.strategy.hook_state.step,
            "net": type(self.net).__name__,
            "weights": [float(p.detach().double().sum()) for p in self.parameters()],
        }
        with open(os.path.join(self.out_dir, f"rank{self.global_rank}.json"), "w") as f:
            json.dump(facts, f)


def _two_cpu_trainer(tmp_path, strategy: CompressedDDPStrategy, max_steps: int, **more) -> pl.Trainer:
    """Two CPU processes, no logger or progress bar."""
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **more,
    )


def _topk_trainer(tmp_path, max_steps: int, **more) -> pl.Trainer:
    """Two CPU processes, topk at 5 %, no logger or progress bar."""
    strategy = CompressedDDPStrategy(codec="topk", codec_options={"ratio": 0.05}, start_method="spawn")
    return _two_cpu_trainer(tmp_path, strategy, max_steps, **more)


def test_codec_runs_on_cpu_and_checkpoint_holds_every_rank(tmp_path):
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = _topk_trainer(tmp_path, 10, callbacks=[checkpoint])
    trainer.fit(TinyClassifier(str(tmp_path)))
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for f in facts:
        assert f["comm_hook"] == "codec_hook"  # registered on CPU, unlike lightning's DDPStrategy
        assert f["backend"] == "gloo"
        assert f["steps"] == 10
    assert facts[0]["weights"] == facts[1]["weights"]
    m = trainer.callback_metrics
    assert float(m["gradcomp/phase"]) == 1.0
    assert float(m["gradcomp/compression_ratio"]) > 5
    assert float(m["ratio"]) == float(m["gradcomp/compression_ratio"])  # the progress bar shows the step's
    assert float(m["gradcomp/compression_ratio_run"]) < float(m["gradcomp/compression_ratio"])  # 2 dense steps
    assert float(m["gradcomp/bytes_sent"]) < float(m["gradcomp/raw_bytes"])
    # the checkpoint holds both ranks' residuals and loads without unpickling arbitrary objects
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    saved = ckpt["gradcomp"]
    assert saved["codec"] == "topk" and saved["world_size"] == 2 and saved["shared"]["step"] == 10
    assert saved["parameter_order"] is True  # a resume takes its residuals as they are
    r0, r1 = saved["ranks"]
    assert set(r0) == set(r1) and any(k.startswith("residual.") for k in r0)
    assert any(not torch.equal(r0[k], r1[k]) for k in r0)  # residuals differ per rank


class ManualClassifier(TinyClassifier):
    """Manual optimization, as Lightning documents it: ``manual_backward``, then the optimizer's
    ``step``. The loss is NaN on rank 1 at step ``BAD_MANUAL``: the strategy skips that step."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir)
        self.automatic_optimization = False
        self.weights_after: list[float] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.global_step == BAD_MANUAL and self.global_rank == 1:
            loss = loss * float("nan")
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.weights_after.append(float(sum(p.detach().double().sum() for p in self.parameters())))

    def configure_optimizers(self):
        # weight decay moves the weights even on a zeroed gradient: only a skipped step leaves them
        return torch.optim.SGD(self.parameters(), lr=0.1, weight_decay=0.1)

    def on_train_end(self) -> None:
        super().on_train_end()
        state = self.trainer.strategy.hook_state
        facts = {"weights_after": self.weights_after, "nonfinite": state.nonfinite_steps, "compressed": state.step}
        with open(os.path.join(self.out_dir, f"manual{self.global_rank}.json"), "w") as f:
            json.dump(facts, f)


class CompiledClassifier(TinyClassifier):
    """The network compiled in each process (``torch.compile`` in ``configure_model``, as
    Lightning suggests; ``aot_eager`` runs the captured graphs without a C++ compiler), so that
    backward runs AOTAutograd's graph and DDP gets its gradients from it."""

    def configure_model(self) -> None:
        self.net = torch.compile(self.net, backend="aot_eager")


def test_a_compiled_model_keeps_the_codec_hook_and_the_ranks_identical(tmp_path):
    trainer = _topk_trainer(tmp_path, 10)
    trainer.fit(CompiledClassifier(str(tmp_path)))
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [f["comm_hook"] for f in facts] == ["codec_hook"] * 2 and facts[0]["steps"] == 10
    assert [f["net"] for f in facts] == ["OptimizedModule"] * 2
    assert facts[0]["weights"] == facts[1]["weights"]
    assert float(trainer.callback_metrics["gradcomp/compression_ratio"]) > 5


BAD_MANUAL = 5


def test_manual_optimization_compresses_and_skips_a_non_finite_step(tmp_path):
    trainer = _topk_trainer(tmp_path, 8, enable_checkpointing=False)
    trainer.fit(ManualClassifier(str(tmp_path)))
    ranks = [json.loads((tmp_path / f"manual{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["weights_after"] == ranks[1]["weights_after"]  # identical at every step
    for r in ranks:
        w = r["weights_after"]  # w[s]: after optimizer step s
        assert len(w) == 8 and r["nonfinite"] == 1 and r["compressed"] == 8
        assert w[BAD_MANUAL] == w[BAD_MANUAL - 1] and w[BAD_MANUAL + 1] != w[BAD_MANUAL]
    assert float(trainer.callback_metrics["gradcomp/compression_ratio"]) > 5


class SlowIdentity(gc.Codec):
    """A lossless codec that costs 40 ms a layer: compression can never pay for it."""

    collective = "allreduce"

    def encode(self, x, key, param, step):
        time.sleep(0.04)
        return gc.EncodeResult([x.clone()], local=x)

    def decode(self, payload, ctx, numel, count):
        return payload[0]


def fallback_worker(rank: int, world: int):
    """The same run with the fallback on and off, in one spawn of two ranks."""
    out = {}
    for enabled in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        ddp = DDP(model)
        state, hook = make_comm_hook(SlowIdentity(), ddp, fallback=enabled)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        phases = []
        for _ in range(11):
            x = torch.randn(16, 64)
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
            phases.append(state.stats.pop().compressed)
        out[enabled] = (phases, sorted(state.fallback.fallback), state.fallback.decisions)
    return out


@pytest.fixture(scope="module")
def fallback_runs():
    return run_gloo(fallback_worker, 2)


def test_fallback_sends_plainly_when_the_codec_costs_more(fallback_runs):
    r0, r1 = fallback_runs[0][True], fallback_runs[1][True]
    phases, fallback, decisions = r0
    assert fallback and fallback == r1[1]  # every rank took the same decision
    assert phases[:2] == [False, False] and all(phases[2:5])  # plain, then 3 probe steps compressed
    # not a clear win: 3 plain probe steps, decided at the start of step 8, then plain for good
    assert not any(phases[5:])
    assert all(c > d for c, d in decisions.values())


def test_fallback_off_always_compresses(fallback_runs):
    phases, fallback, _ = fallback_runs[0][False]
    assert fallback == [] and all(phases[2:])


def test_fallback_at_its_default_decides_alike_on_every_rank(monkeypatch):
    """The default user path: CompressedDDPStrategy(codec="topk") with the fallback left at None and
    no environment override (the suite turns it off elsewhere), in a real two-process Lightning run.
    Which buckets fall back depends on timing; that every rank takes the same decision does not."""
    from reliability_helpers import from_bytes, lightning_worker

    monkeypatch.delenv("LIGHTNING_GRADCOMP_FALLBACK", raising=False)  # spawned ranks inherit this
    run = {"codec": "topk", "codec_options": {"min_numel": 256}, "max_steps": 12}
    ranks = [from_bytes(b)["runs"][0] for b in run_gloo(lightning_worker, 2, args=({"runs": [run]},), timeout=300)]
    for out in ranks:
        assert out["error"] is None, out.get("message")
        assert out["fallback"]["enabled"] and out["fallback"]["decided"]
        assert bool(torch.isfinite(out["final"]).all())
    assert ranks[0]["fallback"] == ranks[1]["fallback"]
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])


def _saved_topk_run(world_size: int) -> dict:
    """What the strategy writes for a topk run of ``world_size`` ranks at step 9, every rank
    holding a residual for "w"."""
    from lightning_gradcomp.hook import CodecHookState

    state = CodecHookState(gc.make_codec("topk"))
    state.step = 9
    state.memory.set("w", torch.ones(3))
    return {
        "version": 1,
        "codec": "topk",
        "options": state.codec.config(),
        "world_size": world_size,
        "shared": state.state_dict(),
        "ranks": [state.rank_state_dict() for _ in range(world_size)],
    }


def test_a_checkpoint_of_another_codec_or_world_size_does_not_load_what_cannot_apply():
    from lightning_gradcomp.hook import CodecHookState

    # another codec: nothing of its state is taken (the step counter included), and the user is told
    strategy = CompressedDDPStrategy(codec="fp16")
    state = CodecHookState(strategy.codec)
    with pytest.warns(UserWarning, match="the checkpoint's gradient codec was 'topk', this run uses 'fp16'"):
        strategy._apply_checkpoint(state, _saved_topk_run(1))
    assert state.step == 0 and state.memory.keys() == []
    # another world size (two ranks wrote it, one reads it here): the shared state is taken, the
    # per-rank residuals cannot be mapped to the new ranks and start from zero
    strategy = CompressedDDPStrategy(codec="topk")
    state = CodecHookState(strategy.codec)
    with pytest.warns(UserWarning, match="written by 2 ranks and this run has 1: per-rank residuals"):
        strategy._apply_checkpoint(state, _saved_topk_run(2))
    assert state.step == 9 and state.memory.keys() == []


class ConvClassifier(pl.LightningModule):
    """Three convolutions, their weights in ``channels_last`` memory order if asked. DDP then
    lays each such weight's gradient out in the bucket in that order (output channel, kernel row,
    kernel column, input channel), while the codecs index a layer's values as the weight's shape
    says (output, input, row, column)."""

    def __init__(self, out_dir: str, tag: str, channels_last: bool, momentum: float = 0.9) -> None:
        super().__init__()
        self.out_dir, self.tag, self.channels_last, self.momentum = out_dir, tag, channels_last, momentum
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )
        if channels_last:
            self.net.to(memory_format=torch.channels_last)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=self.momentum)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(512, 3, 8, 8, generator=g), torch.randint(0, 10, (512,), generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)

    def on_train_end(self) -> None:
        layouts = [p.is_contiguous(memory_format=torch.channels_last) for p in self.parameters() if p.dim() == 4]
        weights = torch.cat([p.detach().reshape(-1) for p in self.parameters()])
        torch.save(
            {"weights": weights, "channels_last": layouts},
            os.path.join(self.out_dir, f"{self.tag}{self.global_rank}.pt"),
        )


@pytest.mark.parametrize("codec", ["iwp", "lgc", "topk+momentum"])
def test_channels_last_weights_and_gradient_bucket_views_train_as_contiguous_ones(tmp_path, codec):
    """A codec whose choices depend on values alone trains the same whatever the memory order of
    the weights, and whether or not DDP makes the gradients views of its buckets. ``iwp`` ranks
    each gradient entry by ``|g| / |w|``: it must pair an entry with its own weight, not with the
    one at its place in the bucket. ``lgc`` scales and names its values per output channel. With
    momentum correction the codec adds ``weight_decay * w`` to each entry and keeps the velocity
    (the optimizer then has no momentum of its own)."""
    from reliability_helpers import short_options

    codec, _, extra = codec.partition("+")
    options = short_options(codec, {"momentum": 0.9, "weight_decay": 0.01} if extra else None)
    optimizer_momentum = 0.0 if extra else 0.9

    runs = {
        "contiguous": (False, {}),
        "channels_last": (True, {}),
        "bucket_views": (True, {"gradient_as_bucket_view": True}),
    }
    for tag, (channels_last, ddp) in runs.items():
        strategy = CompressedDDPStrategy(codec=codec, codec_options=options, start_method="spawn", **ddp)
        trainer = _two_cpu_trainer(tmp_path, strategy, 12, enable_checkpointing=False)
        trainer.fit(ConvClassifier(str(tmp_path), tag, channels_last, optimizer_momentum))
        assert float(trainer.callback_metrics["gradcomp/compression_ratio"]) > 3  # the last steps compressed
    out = {tag: [torch.load(tmp_path / f"{tag}{r}.pt", weights_only=True) for r in range(2)] for tag in runs}
    assert [r["channels_last"] for r in out["channels_last"]] == [[True] * 3] * 2
    reference = out["contiguous"][0]["weights"]
    for tag, ranks in out.items():
        assert torch.equal(ranks[0]["weights"], ranks[1]["weights"]), tag
        # the convolutions' kernels add in another order in channels_last: equal up to rounding
        torch.testing.assert_close(ranks[0]["weights"], reference, rtol=0, atol=1e-5, msg=tag)


def _strategy_for(codec: str, module: nn.Module, **options) -> CompressedDDPStrategy:
    """A strategy as it stands after registering its hook on ``module`` (no process group)."""
    from lightning_gradcomp.hook import CodecHookState

    strategy = CompressedDDPStrategy(codec=codec, codec_options=options)
    strategy._lightning_module = module
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.hook_state = CodecHookState.for_model(strategy.codec, module)
    return strategy


def test_a_model_the_codec_compresses_nothing_of_is_told_so():
    import warnings

    small = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.warns(
        UserWarning,
        match=r"codec 'topk' compresses none of this model's 4 trainable parameters: "
        r"the largest has 128 entries, below min_numel=1024.*codec_options=\{'min_numel': 128\}",
    ):
        _strategy_for("topk", small)._warn_nothing_to_compress()
    # a large layer that is frozen does not count; one that trains does
    frozen = nn.Sequential(nn.Linear(64, 64).requires_grad_(False), nn.Linear(16, 4))
    with pytest.warns(UserWarning, match="compresses none of this model's 2 trainable parameters"):
        _strategy_for("topk", frozen)._warn_nothing_to_compress()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _strategy_for("topk", nn.Sequential(nn.Linear(64, 64), nn.Linear(16, 4)))._warn_nothing_to_compress()
        _strategy_for("topk", small, min_numel=128)._warn_nothing_to_compress()
        _strategy_for("none", small)._warn_nothing_to_compress()  # compresses nothing by design
        _strategy_for("powersgd", small, min_compression_rate=1)._warn_nothing_to_compress()
    # PowerSGD takes every layer (min_numel 0) and torch's hook picks the matrices by its own rule:
    # no 16 x 8 or 4 x 16 weight is twice as large as its rank-4 factors
    with pytest.warns(UserWarning, match=r"'powersgd' compresses none .*rank-4 factors are min_compression_rate=2.0"):
        _strategy_for("powersgd", small)._warn_nothing_to_compress()


def test_a_checkpoint_of_before_the_parameter_order_resumes_its_channels_last_residuals_in_place():
    """Checkpoints written before the hook read bucket slices with their parameters' strides
    hold a ``channels_last`` weight's residual in the order of the weight's memory; resumed, it
    goes back to the entries it belongs to. A contiguous weight's, and a newer checkpoint's,
    stay as saved."""
    import warnings

    module = nn.Sequential(nn.Conv2d(3, 4, 2).to(memory_format=torch.channels_last), nn.Linear(5, 6))
    # not dense: DDP lays its gradient out C-contiguous, so its residual was saved in its own order
    module.register_parameter("sliced", nn.Parameter(torch.randn(4, 10)[:, ::2]))
    sliced_residual = torch.randn(20)
    conv = module[0].weight
    true_residual = torch.arange(conv.numel(), dtype=torch.float32).reshape(conv.shape)
    in_memory_order = true_residual.contiguous(memory_format=torch.channels_last).as_strided((conv.numel(),), (1,))
    assert not torch.equal(in_memory_order, true_residual.reshape(-1))  # the test means something
    linear_residual = torch.randn(30)
    saved = _saved_topk_run(1)
    saved["ranks"] = [
        {
            "residual.0.weight": in_memory_order.clone(),
            "residual.1.weight": linear_residual,
            "momentum.0.weight": 2 * in_memory_order,  # momentum correction's velocity, the same way
            "residual.sliced": sliced_residual,
        }
    ]

    strategy = _strategy_for("topk", module)
    with pytest.warns(UserWarning, match=r"before the hook read each gradient in its parameter's order.*1 parameter"):
        strategy._apply_checkpoint(strategy.hook_state, saved)
    memory = strategy.hook_state.memory
    assert torch.equal(memory.get("0.weight"), true_residual.reshape(-1))
    assert torch.equal(memory.get("1.weight"), linear_residual)
    assert torch.equal(memory.get("sliced"), sliced_residual)
    assert torch.equal(strategy.hook_state.momentum_buffers.get("0.weight"), 2 * true_residual.reshape(-1))

    saved["parameter_order"] = True  # written by this version: taken as it is, without a word
    strategy = _strategy_for("topk", module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy._apply_checkpoint(strategy.hook_state, saved)
    assert torch.equal(strategy.hook_state.memory.get("0.weight"), in_memory_order)

    # an older checkpoint without a residual or momentum of the channels_last weight (no error
    # feedback) has nothing to put in order, and nothing to warn of
    del saved["parameter_order"]
    saved["ranks"] = [{"residual.1.weight": linear_residual}]
    strategy = _strategy_for("topk", module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy._apply_checkpoint(strategy.hook_state, saved)
    assert torch.equal(strategy.hook_state.memory.get("1.weight"), linear_residual)


# --------------------------------------------------------------------------------------------------
# the strategy's parts that need no run


def test_the_group_is_destroyed_at_exit_unless_the_last_run_failed():
    from codec_driver import one_rank_group

    from lightning_gradcomp.strategy import _DestroyProcessGroupAtExit

    at_exit = _DestroyProcessGroupAtExit()
    at_exit.registered = True  # as if registered: this test calls it, not the interpreter's exit
    one_rank_group()
    CompressedDDPStrategy(codec="topk").on_exception(RuntimeError("a rank died"))  # the module's own instance
    from lightning_gradcomp.strategy import _DESTROY_AT_EXIT

    assert _DESTROY_AT_EXIT.last_run_failed
    _DESTROY_AT_EXIT.last_run_failed = False
    at_exit.last_run_failed = True
    at_exit()  # a peer may still wait in a collective: the group is left alone
    assert torch.distributed.is_initialized()
    at_exit.register()  # the next run starts: its own outcome decides
    assert not at_exit.last_run_failed
    at_exit()
    assert not torch.distributed.is_initialized()


def test_the_runs_length_is_lightnings_estimate_during_fit_only():
    from types import SimpleNamespace

    strategy = CompressedDDPStrategy(codec="topk")

    def module(fn: str, estimate) -> SimpleNamespace:
        return SimpleNamespace(
            trainer=SimpleNamespace(state=SimpleNamespace(fn=fn), estimated_stepping_batches=estimate)
        )

    strategy._lightning_module = module("fit", 120.0)
    assert strategy._estimated_total_steps() == 120
    strategy._lightning_module = module("validate", 120.0)
    assert strategy._estimated_total_steps() is None
    strategy._lightning_module = module("fit", float("inf"))  # max_steps=-1, max_epochs=-1
    assert strategy._estimated_total_steps() is None


def test_a_checkpoint_is_loaded_with_weights_only_unless_the_caller_asks_otherwise(tmp_path, monkeypatch):
    import pickle

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # flips torch.load's own default

    path = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}, "extra": _NotATensor()}, path)
    strategy = CompressedDDPStrategy(codec="topk")
    with pytest.raises(pickle.UnpicklingError):
        strategy.load_checkpoint(path)
    assert isinstance(strategy.load_checkpoint(path, weights_only=False)["extra"], _NotATensor)


class _NotATensor:
    """What a checkpoint loaded with weights_only=True refuses to build."""


def test_each_parameter_gets_its_own_groups_rate_and_only_a_second_moment_of_its_shape():
    from types import SimpleNamespace

    from lightning_gradcomp.strategy import _learning_rates, _second_moments

    a, b = nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(4))
    adam = torch.optim.Adam([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.3}])
    names = {id(a): "a", id(b): "b"}
    wrapped = SimpleNamespace(optimizer=adam)  # as Lightning hands it over (LightningOptimizer)
    assert _learning_rates(wrapped, names) == {"a": 0.1, "b": 0.3}
    adam.state[a]["exp_avg_sq"] = torch.ones(2, 3)
    adam.state[b]["exp_avg_sq"] = torch.ones(2)  # a factored moment (Adafactor-like): not per coordinate
    assert set(_second_moments(wrapped, names)) == {"a"}


def test_a_checkpoint_records_its_order_and_defaults_and_a_resume_reads_them():
    from codec_driver import one_rank_group

    from lightning_gradcomp.hook import CodecHookState

    one_rank_group()
    strategy = CompressedDDPStrategy(codec="topk")
    strategy.hook_state = CodecHookState(strategy.codec)
    strategy.hook_state.memory.set("w", torch.ones(3))
    strategy.hook_state.step = 9
    strategy._optimizer_defaults = {"options": {"ratio": 0.1}, "controller": {"eta": 0.3}}
    saved = strategy.gradcomp_state_dict()
    assert saved["parameter_order"] is True and saved["world_size"] == 1
    assert saved["optimizer_defaults"] == {"options": {"ratio": 0.1}, "controller": {"eta": 0.3}}

    resumed = CompressedDDPStrategy(codec="topk", parallel_devices=[torch.device("cpu")])
    state = CodecHookState(resumed.codec)
    resumed._apply_checkpoint(state, saved)
    assert resumed._resumed_from is saved  # setup reads what that run took beside Adam from it
    assert state.step == 9 and torch.equal(state.memory.residuals["w"], torch.ones(3))
    # written by two ranks: the shared state is restored, the residuals start from zero
    other = CodecHookState(resumed.codec)
    with pytest.warns(UserWarning, match="written by 2 ranks and this run has 1"):
        resumed._apply_checkpoint(other, {**saved, "world_size": 2, "ranks": saved["ranks"] * 2})
    assert other.step == 9 and dict(other.memory.residuals) == {}


def test_the_level_controller_is_attached_once_and_a_users_own_is_kept():
    from types import SimpleNamespace

    from lightning_gradcomp.callbacks import AdaptiveCompression

    for given in ([], [AdaptiveCompression(eta=0.25)]):
        strategy = CompressedDDPStrategy(codec="gradiveq")  # on by default
        model = pl.LightningModule()
        model._trainer = SimpleNamespace(callbacks=list(given))
        strategy.connect(model)
        strategy.connect(model)  # a second fit connects again
        assert model._trainer.callbacks == (given or [strategy._adaptive_callback])


def test_no_codec_is_not_told_it_compresses_nothing():
    import warnings

    from lightning_gradcomp.hook import CodecHookState

    for codec, warns in (("none", False), ("topk", True)):
        strategy = CompressedDDPStrategy(codec=codec)
        strategy.hook_state = CodecHookState(strategy.codec)
        strategy._lightning_module = nn.Linear(3, 2)  # far below any codec's min_numel
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            strategy._warn_nothing_to_compress()
        assert any("compresses none" in str(w.message) for w in caught) == warns


def _registered(codec: str, module: nn.Module, checkpoint: dict | None = None, **ddp_kwargs) -> CompressedDDPStrategy:
    """A strategy as ``_register_ddp_hooks`` leaves it, on a one-rank DDP wrapper, optionally
    resuming ``checkpoint`` (no trainer: the run's length is unknown)."""
    from types import SimpleNamespace

    from codec_driver import one_rank_group

    one_rank_group()
    strategy = CompressedDDPStrategy(codec=codec, parallel_devices=[torch.device("cpu")], **ddp_kwargs)
    strategy._lightning_module = SimpleNamespace(trainer=None)
    strategy._model = DDP(module, **ddp_kwargs)
    strategy._pending_checkpoint = checkpoint
    strategy._register_ddp_hooks()
    return strategy


def test_static_graph_and_a_resume_move_the_first_compressed_step_of_a_bucket_keyed_codec():
    """DDP with ``static_graph`` rebuilds its buckets after step 1, so nothing is compressed before
    step 3; a resumed wrapper rebuilds them again, so a codec whose state is keyed by bucket
    (PowerSGD) waits as long again after the checkpoint's step, while other codecs go on at once."""
    from lightning_gradcomp.hook import CodecHookState

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))

    assert _registered("powersgd", model()).hook_state.first_compress_step == 2
    assert _registered("powersgd", model(), static_graph=True).hook_state.first_compress_step == 3
    for codec, first in (("powersgd", 9 + 2), ("topk", 2)):
        writer = CompressedDDPStrategy(codec=codec)
        writer.hook_state = CodecHookState(writer.codec)
        writer.hook_state.step = 9
        state = _registered(codec, model(), checkpoint=writer.gradcomp_state_dict()).hook_state
        assert (state.step, state.first_compress_step) == (9, first)


def test_an_adopted_layer_policy_replans_the_layers_of_the_wrapped_model():
    """Beside Adam ``lgc`` takes ``dense_layers="none"``: the end layers that the registered hook
    planned to send dense (``"auto"``) are compressed from the first step."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 512), nn.Linear(512, 512), nn.Linear(512, 4))
    strategy = _registered("lgc", module)
    assert strategy.codec.dense_keys == {"0.weight", "0.bias", "3.weight", "3.bias"}
    strategy._optimizers = [torch.optim.Adam(module.parameters())]
    strategy._adopt_adaptive_optimizer_defaults()
    assert strategy.codec.config()["dense_layers"] == ["none"] and strategy.codec.dense_keys == frozenset()


def test_a_second_fit_does_not_read_the_first_fits_checkpoint(monkeypatch):
    """What a checkpoint recorded is used by the setup of the fit that resumed it, and then
    forgotten: a later fit in the same process is not told again that its options differ."""
    import warnings
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy

    monkeypatch.setattr(DDPStrategy, "setup", lambda self, trainer: None)  # no model to wrap here
    strategy = CompressedDDPStrategy(codec="topk", codec_options={"ratio": 0.02})
    strategy._resumed_from = {"options": {**strategy.codec.config(), "ratio": 0.05}}
    trainer = SimpleNamespace(callbacks=[])
    with pytest.warns(UserWarning, match=r"ratio=0.05 there, 0.02 here"):
        strategy.setup(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy.setup(trainer)


def test_the_controllers_arguments_beside_adam_are_checked_only_where_they_apply(monkeypatch):
    """Beside an Adam-like optimizer the strategy sets the codec's ``adaptive_optimizer_controller``
    on the controller it attached by default to a codec named by a string, so that combination is
    checked before any process starts; a user's own ``adaptive_level`` is kept as given, and is
    not refused for it."""
    from lightning_gradcomp.registry import codec_class

    topk = codec_class("topk")
    monkeypatch.setattr(topk, "adaptive_by_default", {"high_level": 0.5})
    monkeypatch.setattr(topk, "adaptive_optimizer_controller", {"low_level": 0.9})
    with pytest.raises(ValueError, match=r"low_level \(0.9\) must not exceed high_level \(0.5\)"):
        CompressedDDPStrategy(codec="topk")
    strategy = CompressedDDPStrategy(codec="topk", adaptive_level={"high_level": 0.5})
    assert strategy._adaptive_callback.high_level == 0.5
    # nor is a codec given as an object, which the strategy keeps as it is
    assert CompressedDDPStrategy(codec=topk())._adaptive_callback.high_level == 0.5
