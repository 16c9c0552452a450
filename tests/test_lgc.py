"""Learned Gradient Compression (``lgc``): stages, both variants on 2 gloo ranks, checkpoints."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_gloo
from torch import nn

from lightning_gradcomp.codecs.lgc import MIN_AE_LEN, GradientAutoencoder, LGCCodec
from lightning_gradcomp.codecs.positions import choose_encoding, encoded_nbytes
from lightning_gradcomp.registry import make_codec

WARMUP, AE_STEPS, STAGE3 = 3, 5, 3
RATIO, INNOV, LATENT = 0.1, 0.01, 4
OPTS = dict(
    code="autoencoder",
    warmup_steps=WARMUP,
    ae_train_steps=AE_STEPS,
    ratio=RATIO,
    innovation_ratio=INNOV,
    ae_epochs=3,
    min_numel=1000,
    max_recon_error=100.0,  # every layer uses the AE, whatever it learned from a few random batches
    dense_layers="none",  # a three-layer model: the default would keep its first and last layer dense
)


def _mlp() -> nn.Module:
    # layer sizes 16384, 65536, 2560: K = 1639, 6554, 256 (all >= MIN_AE_LEN); biases go dense
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


# --------------------------------------------------------------------------------------------------
# construction
@pytest.mark.parametrize(
    "opts, match",
    [
        (dict(variant="tree"), "variant must be one of"),
        (dict(ratio=0.0), "ratio must be in"),
        (dict(ratio=0.01, innovation_ratio=0.02), "innovation_ratio must be below ratio"),
        (dict(ae_train_steps=0), "ae_train_steps must be >= 1 step"),
        (dict(ae_train_steps=1.5), "ae_train_steps must be an integer >= 0 .steps. or a float in .0, 1."),
        (dict(warmup_steps=-1), "warmup_steps must be an integer >= 0"),
        (dict(latent_channels=0), "latent_channels"),
        (dict(ae_lr=0.0), "ae_lr must be a finite number > 0"),
        (dict(ae_time_budget_s=-1), "ae_time_budget_s"),
        (dict(selection="random"), "selection must be one of"),
        (dict(start_step=5), "warmup_steps and ae_train_steps"),
        (dict(max_recon_error=0), "max_recon_error must be a number > 0"),
        (dict(density_warmup=-3), "density_warmup must be an integer >= 0"),
        (dict(density_warmup_start=1.5), "density_warmup_start must be in"),
        (dict(warmup_codec="fp16"), "warmup_codec must be one of"),
        (dict(warmup_rank=0), "warmup_rank"),
        (dict(light_ratio=0.0), "light_ratio must be in"),
        (dict(ratio=0.05, light_ratio=0.01), r"light_ratio .* must be at least ratio \(0.05\)"),
        (dict(warmup_codec="powersgd", momentum=0.9), "warmup_codec='powersgd' .* momentum correction"),
    ],
)
def test_invalid_options_name_the_option(opts, match):
    with pytest.raises(ValueError, match=match):
        make_codec("lgc", **opts)


@pytest.mark.parametrize(
    "opts, light",
    [
        (dict(ratio=0.01), 0.1),
        (dict(ratio=0.07), 0.25),
        (dict(ratio=0.4), 0.4),
        (dict(ratio=0.07, light_ratio=1.0), 1.0),
    ],
)
def test_the_light_level_keeps_light_ratio_of_each_layer(opts, light):
    """Level 1 keeps ``ratio``, level 0 ``light_ratio`` (ten times ``ratio``, at most 0.25 but
    never less than ``ratio``, unless given), each halfway level the geometric mean; at a light
    ratio of 1 the whole layer travels."""
    codec = make_codec("lgc", **opts)
    ratio = opts["ratio"]
    assert codec.kept_fraction == pytest.approx(ratio)
    codec.set_level(0.0)
    assert codec.kept_fraction == pytest.approx(light)
    assert codec.k_for(65536) == math.ceil(light * 65536)
    codec.set_level(0.5)
    assert codec.kept_fraction == pytest.approx(math.sqrt(light * ratio))


def test_autoencoder_code_is_a_sixteenth_of_its_input_per_channel():
    ae = GradientAutoencoder(width=8, latent_channels=LATENT)
    for k in (MIN_AE_LEN, 1000, 6554):
        z = ae.encode(torch.randn(2, k))
        assert z.shape == (2, LATENT, GradientAutoencoder.latent_len(k))
        assert z.numel() / 2 <= LATENT * k / 16 + LATENT  # the code is ~latent/16 of the input
        assert ae.decode(z, k).shape == (2, k)


def test_stages_follow_the_warmup_and_the_trained_autoencoder():
    c = LGCCodec(warmup_steps=10, ae_train_steps=5)
    assert [c.stage(s) for s in (0, 9, 10, 14, 15)] == [1, 1, 2, 2, 2]  # 3 only once trained
    c._ae_state["trained"] = True
    assert c.stage(15) == 3 and c.stage(14) == 2
    assert not c.is_compressing(9) and c.is_compressing(10)


@pytest.mark.parametrize("variant", ["rar", "ps"])
def test_state_dict_round_trip_restores_the_autoencoder(variant):
    """Train on synthetic correlated samples, save with torch.save, load with weights_only=True."""
    c = LGCCodec(
        code="autoencoder", variant=variant, ae_epochs=1, ratio=RATIO, innovation_ratio=INNOV, max_recon_error=100.0
    )
    g = torch.Generator().manual_seed(0)
    common = torch.randn(300, generator=g)
    for step in range(6):
        v = torch.stack([common + 0.3 * torch.randn(300, generator=g) for _ in range(2)]) * 1e-3
        c._samples.append(("w", step, step % 2, 3000, v))
    c.train_autoencoder()
    assert c.ae_trained and math.isfinite(c.ae_loss) and math.isfinite(c.ae_recon_error)
    # one layer: its relative error, which the gate reads, is the aggregate's ||v_hat - v|| / ||v||
    assert 0 < c.ae_recon_error != 1 and c.ae_layers["w"] == pytest.approx(c.ae_recon_error)
    buf = io.BytesIO()
    torch.save(c.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    d = LGCCodec(code="autoencoder", variant=variant, ratio=RATIO, innovation_ratio=INNOV, seed=1)
    assert d.ae_digest() != c.ae_digest()
    d.load_state_dict(state)
    assert d.ae_digest() == c.ae_digest() and d.ae_trained and d.ae_loss == c.ae_loss
    assert d.ae_layers == c.ae_layers
    z = c.ae.encode(torch.randn(1, 300, generator=g))
    u = torch.zeros(1, 300)
    assert torch.equal(c.ae.decode(z, 300, u), d.ae.decode(z, 300, u))
    assert list(c.ae_layers) == ["w"]


def test_poor_code_is_gated_off():
    """A layer whose held-out error exceeds max_recon_error keeps sending exact values."""
    c = LGCCodec(code="autoencoder", ae_epochs=1, ratio=RATIO, max_recon_error=1e-6)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        c._samples.append(("w", step, step % 2, 3000, torch.randn(2, 300, generator=g)))
    c.train_autoencoder()
    assert c.ae_trained and c.ae_layers == {} and c.ae_recon_error > 1e-6


def test_a_light_steps_sample_cut_below_the_autoencoders_length_is_left_out_of_its_training():
    """Stage 2 at the level controller's light steps keeps a support ten times denser; the switch
    cuts each sample to the configured support. A layer whose configured support is shorter than
    MIN_AE_LEN bypasses the AE, so its cut samples are left out of the AE's training (they used to
    reach its convolutions, which cannot take them: the switch raised on every rank)."""
    c = LGCCodec(code="autoencoder", ae_epochs=1, ratio=0.01, max_recon_error=100.0)
    g = torch.Generator().manual_seed(0)
    common = torch.randn(300, generator=g)
    for step in range(6):
        v = torch.stack([common + 0.3 * torch.randn(300, generator=g) for _ in range(2)]) * 1e-3
        c._samples.append(("short", step, step % 2, 3000, v))  # configured support: 30 values
        c._samples.append(("long", step, step % 2, 30000, v.clone()))  # configured support: all 300
    assert math.ceil(0.01 * 3000) < MIN_AE_LEN <= 300
    c.train_autoencoder()
    assert c.ae_trained and math.isfinite(c.ae_loss) and list(c.ae_layers) == ["long"]


# --------------------------------------------------------------------------------------------------
# two real gloo ranks, raw DDP
def _train_both_variants(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    out = {}
    for variant in ("rar", "ps"):
        torch.manual_seed(0)
        model = _mlp()
        ref = _mlp()
        ddp = DDP(model)
        state, hook = make_comm_hook("lgc", ddp, variant=variant, **OPTS)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(100 + rank)  # every rank sees different data
        steps = []
        for step in range(WARMUP + AE_STEPS + STAGE3):
            x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
            ref.load_state_dict(model.state_dict())
            nn.functional.cross_entropy(ref(x), y).backward()
            dense = [p.grad.clone() for p in ref.parameters()]
            for t in dense:
                dist.all_reduce(t)
                t /= world
            ref.zero_grad()
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            st = state.stats.pop()
            grads = [p.grad.clone() for p in model.parameters()]
            steps.append(
                {
                    "stage": state.codec.stage(step),
                    "wire": st.wire_bytes,
                    "payload": st.payload_bytes,
                    "ratio": st.compression_ratio,
                    "grads": [g.numpy().copy() for g in grads],
                    "dense_err": max(float((g - d).abs().max()) for g, d in zip(grads, dense)),
                }
            )
            opt.step()
        out[variant] = {
            "steps": steps,
            "digest": state.codec.ae_digest(),
            "trained": state.codec.ae_trained,
            "ae_loss": state.codec.ae_loss,
        }
    return out


def _expected_wire(stage: int, variant: str, world: int) -> float:
    sizes = [p.numel() for p in _mlp().parameters() if p.numel() >= 1000]
    dense = sum(p.numel() for p in _mlp().parameters() if p.numel() < 1000)
    # gathered steps send the dense layers in bfloat16 (lgc's default) and the non-finite flag in fp32
    gathered_dense = 2 * dense + 4
    ks = [math.ceil(RATIO * n) for n in sizes]
    codes = sum(encoded_nbytes(choose_encoding("auto", k, n), k, n) for k, n in zip(ks, sizes))
    if stage == 2:  # positions broadcast as a compact code; values all-gathered
        return codes + (world - 1) * (4 * sum(ks) + gathered_dense)
    bcast = codes + 8 * len(ks)  # positions, one scale and one guard flag per layer
    lat = [LATENT * GradientAutoencoder.latent_len(k) for k in ks]
    if variant == "rar":  # latents summed in the ring all-reduce, with the dense layers and the flag in fp32
        return bcast + 2 * (world - 1) / world * 4 * (sum(lat) + dense + 1)
    inn = [max(1, math.ceil(INNOV * n)) for n in sizes]  # ps: leader's latents, everyone's innovation
    return bcast + 4 * sum(lat) + (world - 1) * (8 * sum(inn) + gathered_dense)


def test_both_variants_stage_alike_and_decode_identically_on_two_ranks():
    res = run_gloo(_train_both_variants, world_size=2, timeout=300)
    sizes = [p.numel() for p in _mlp().parameters()]
    for variant in ("rar", "ps"):
        r0, r1 = res[0][variant], res[1][variant]
        assert r0["trained"] and r1["trained"] and r0["digest"] == r1["digest"], "AE must be identical"
        assert [s["stage"] for s in r0["steps"]] == [1] * WARMUP + [2] * AE_STEPS + [3] * STAGE3
        for s0, s1 in zip(r0["steps"], r1["steps"]):
            # every rank decodes the same aggregate, bit for bit
            assert all((a == b).all() for a, b in zip(s0["grads"], s1["grads"])), (variant, s0["stage"])
            if s0["stage"] == 1:
                assert s0["dense_err"] < 1e-6  # stage 1 is the dense average
                continue
            # compressed layers are nonzero only on the k shared positions
            for g, n in zip(s0["grads"], sizes):
                if n >= 1000:
                    assert (g != 0).sum() <= math.ceil(RATIO * n)
            for s in (s0, s1):
                assert s["wire"] == pytest.approx(_expected_wire(s["stage"], variant, 2)), (variant, s["stage"])
        raw = r0["steps"][0]["wire"]
        stage2 = [s["ratio"] for s in r0["steps"] if s["stage"] == 2]
        stage3 = [s["ratio"] for s in r0["steps"] if s["stage"] == 3]
        # after warm-up the bytes drop by about 1 / (2 ratio) (values + indices), then further
        assert min(stage2) > 0.8 / (2 * RATIO) and min(stage3) > 1.3 * max(stage2), (variant, stage2, stage3)
        assert raw / r0["steps"][-1]["wire"] == pytest.approx(r0["steps"][-1]["ratio"], rel=1e-4)


# --------------------------------------------------------------------------------------------------
# Lightning: the strategy with defaults-but-short stages, the callback's logs, a resumed run
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402


class MLPModule(pl.LightningModule):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.net = _mlp()
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(640, 64, generator=g), torch.randint(0, 10, (640,), generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _two_rank_trainer(strategy, max_steps: int, callbacks: list, **extra):
    """A quiet two-process CPU Trainer for ``strategy`` (no logger, checkpoints or progress bar)."""
    from lightning.pytorch import Trainer

    return Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        **extra,
    )


class Digest(Callback):
    """Writes each rank's AE digest, trained flag and step at train start and end."""

    def __init__(self, out_dir: str, tag: str) -> None:
        self.out_dir, self.tag = out_dir, tag

    def _write(self, trainer, when):
        codec = trainer.strategy.codec
        Path(self.out_dir, f"{self.tag}-{when}-rank{trainer.global_rank}.txt").write_text(
            f"{codec.ae_digest()} {int(codec.ae_trained)} {trainer.strategy.hook_state.step}"
        )

    def on_train_start(self, trainer, pl_module):
        self._write(trainer, "start")

    def on_train_end(self, trainer, pl_module):
        self._write(trainer, "end")
        if self.tag == "a":  # every rank takes part (the strategy gathers residuals), rank 0 writes
            trainer.save_checkpoint(str(Path(self.out_dir, "lgc.ckpt")))


def test_lightning_run_logs_stages_and_resume_restores_the_learned_code(tmp_path):
    from lightning.pytorch import Trainer

    from lightning_gradcomp import CompressedDDPStrategy
    from lightning_gradcomp.callbacks import AutoencoderWarmup

    def trainer(max_steps: int, tag: str) -> Trainer:
        strategy = CompressedDDPStrategy(
            codec="lgc",
            codec_options=dict(ratio=RATIO, min_numel=1000, ae_epochs=2, max_recon_error=100.0, dense_layers="none"),
            start_method="spawn",
        )
        callbacks = [AutoencoderWarmup(warmup_steps=3, ae_train_steps=4), Digest(str(tmp_path), tag)]
        return _two_rank_trainer(strategy, max_steps, callbacks, default_root_dir=str(tmp_path))

    first = trainer(9, "a")
    first.fit(MLPModule())
    metrics = first.callback_metrics
    # reported by the codec (LGCCodec.scalars) and logged by CompressionMonitor
    assert float(metrics["gradcomp/lgc_stage"]) == 3.0
    assert math.isfinite(float(metrics["gradcomp/ae_loss"])) and "gradcomp/ae_recon_error" in metrics
    assert float(metrics["gradcomp/ae_params"]) >= 2 and float(metrics["gradcomp/ae_train_s"]) > 0
    assert 0 <= float(metrics["gradcomp/ae_layers"]) <= float(metrics["gradcomp/ae_layers_eligible"])
    ckpt = tmp_path / "lgc.ckpt"
    saved = torch.load(ckpt, weights_only=True)["gradcomp"]
    assert saved["shared"]["codec"]["ae_trained"] is True

    second = trainer(11, "b")
    second.fit(MLPModule(), ckpt_path=str(ckpt))
    assert float(second.callback_metrics["gradcomp/lgc_stage"]) == 3.0  # the restored code, reported again
    end_a = {Path(tmp_path, f"a-end-rank{r}.txt").read_text().split()[0] for r in range(2)}
    start_b = [Path(tmp_path, f"b-start-rank{r}.txt").read_text().split() for r in range(2)]
    assert len(end_a) == 1, "ranks ended the first run with different autoencoders"
    assert {s[0] for s in start_b} == end_a and all(s[1] == "1" for s in start_b)
    assert all(s[2] == "9" for s in start_b)  # the step counter resumed too


# --------------------------------------------------------------------------------------------------
# rel_error reports what was really sent, the autoencoder's error included
def _stage3_error_and_residual(rank: int, world: int, ae_error_feedback: bool) -> list[tuple[int, float, float]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    torch.manual_seed(0)
    model = _mlp()
    ddp = DDP(model)
    state, hook = make_comm_hook("lgc", ddp, stats_every=1, ae_error_feedback=ae_error_feedback, **OPTS)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7 + rank)
    out = []
    for step in range(WARMUP + AE_STEPS + 2):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        st = state.stats.pop()
        residual_sq = sum(float(r.double().pow(2).sum()) for r in state.memory.residuals.values())
        out.append((state.codec.stage(step), st.err_sq, residual_sq))
        opt.step()
    return out


def _stage3_error_both_ways(rank: int, world: int) -> dict:
    return {flag: _stage3_error_and_residual(rank, world, flag) for flag in (True, False)}


@pytest.fixture(scope="module")
def stage3_errors():
    return run_gloo(_stage3_error_both_ways, world_size=2, timeout=300)[0]


@pytest.mark.parametrize("ae_error_feedback", [True, False])
def test_rel_error_includes_the_autoencoder_error(stage3_errors, ae_error_feedback):
    rows = stage3_errors[ae_error_feedback]
    stage2 = [r for r in rows if r[0] == 2]
    stage3 = [r for r in rows if r[0] == 3]
    assert stage2 and stage3
    for _, err_sq, residual_sq in stage2:  # exact values on the support: the error is what stays behind
        assert err_sq == pytest.approx(residual_sq, rel=1e-6)
    for _, err_sq, residual_sq in stage3:
        if ae_error_feedback:  # the residual keeps the AE's error, so it is exactly what was not sent
            assert err_sq == pytest.approx(residual_sq, rel=1e-6)
        else:  # the residual keeps only what is off the support; the statistic adds the AE's error
            assert err_sq > 1.01 * residual_sq


# --------------------------------------------------------------------------------------------------
# the headline usage: CompressedDDPStrategy(codec="lgc") with no callback fits its stages to the run
class StagesSeen(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.stages: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        state = trainer.strategy.hook_state
        self.stages.append(trainer.strategy.codec.stage(state.step - 1))

    def on_train_end(self, trainer, pl_module):
        codec = trainer.strategy.codec
        record = {"stages": self.stages, "total": codec.run_total_steps, "trained": codec.ae_trained}
        record["options"] = [codec.options.ratio, codec.harness.dense_dtype, codec.options.max_recon_error]
        record["plain_dtype"] = codec.harness.plain_dtype
        record["light_ratio"] = codec.options.light_ratio
        record["support"] = codec.options.support
        record["dense"] = sorted(codec.dense_keys)
        record["compressed"] = sorted(n for n, p in pl_module.named_parameters() if codec.should_compress(n, p))
        record["lr_reference"] = [cb.lr_reference for cb in trainer.callbacks if hasattr(cb, "lr_reference")]
        record["warmup"] = codec._warmup_codec is not None or codec._ternary is not None
        record["params"] = float(sum(p.double().sum() for p in pl_module.parameters()))
        Path(self.out_dir, f"stages{trainer.global_rank}.json").write_text(__import__("json").dumps(record))


# the options given: none, or a PowerSGD or TernGrad warm-up, which beside AdamW must survive the
# defaults adopted after setup (the PowerSGD one once lost its setup there and stopped at the first step)
@pytest.mark.parametrize(
    "optimizer, options",
    [
        ("sgd", {}),
        ("adamw", {}),
        ("adamw", {"warmup_codec": "powersgd", "warmup_rank": 2, "warmup_steps": 5}),
        ("adamw", {"warmup_codec": "terngrad", "warmup_steps": 5}),
    ],
)
def test_default_stages_are_fractions_of_the_run(tmp_path, optimizer, options):
    import json

    from lightning_gradcomp import CompressedDDPStrategy

    strategy = CompressedDDPStrategy(codec="lgc", codec_options=options, start_method="spawn")
    trainer = _two_rank_trainer(strategy, 40, [StagesSeen(str(tmp_path))])
    trainer.fit(MLPModule(optimizer))
    seen = [json.loads((tmp_path / f"stages{rank}.json").read_text()) for rank in (0, 1)]
    for rank in (0, 1):
        # 40 steps: stage 1 for 0.05 of them (2 steps), stage 2 for 0.1 (4 steps), then the AE
        assert seen[rank]["total"] == 40 and seen[rank]["trained"]
        # (a given warm-up, in steps: 5, of which PowerSGD sends the last 3; the first two are dense)
        warm = options.get("warmup_steps", 2)
        assert seen[rank]["stages"] == [1] * warm + [2] * 4 + [3] * (36 - warm)
        # beside AdamW the strategy gave lgc its denser support, compressed the end layers too
        # (the plan made when the hook was registered is made again) and set the controller's
        # peak rule; with SGD the small last layer stays exact ("auto") under the previous-step rule
        if optimizer == "adamw":
            assert seen[rank]["options"] == [0.14, "bfloat16", 0.35] and seen[rank]["dense"] == []
            assert seen[rank]["support"] == "union"  # every rank names its share of the support
            assert seen[rank]["light_ratio"] == 0.5  # the light steps keep half of each layer
            assert seen[rank]["plain_dtype"] == "bfloat16"  # what travels exactly, from stage 1 on
            assert seen[rank]["lr_reference"] == ["peak"]
        else:
            assert seen[rank]["options"] == [0.0075, "bfloat16", 0.3]
            assert seen[rank]["support"] == "leader" and seen[rank]["light_ratio"] is None
            assert seen[rank]["plain_dtype"] == "float32"
            assert seen[rank]["dense"] == ["net.4.bias", "net.4.weight"]
            assert seen[rank]["lr_reference"] == ["previous"]
        assert ("net.4.weight" in seen[rank]["compressed"]) is (optimizer == "adamw")
    assert seen[0]["params"] == seen[1]["params"]
    assert all(seen[rank]["warmup"] == ("warmup_codec" in options) for rank in (0, 1))


class FinalWeights(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, self.path)


def test_lgc_beside_adamw_runs_its_defaults_as_written_out(tmp_path):
    """lgc with no options beside AdamW trains bit for bit as the options the docs write out for
    it, given: the defaults adopted once the optimizers exist (the union support among them) set
    up nothing differently from the same options given at construction, so the accuracy rows
    measured with them given are the defaults' rows."""

    from lightning_gradcomp import CompressedDDPStrategy

    written_out = {
        "ratio": 0.14,
        "light_ratio": 0.5,
        "dense_layers": "none",
        "max_recon_error": 0.35,
        "support": "union",
        "plain_dtype": "bfloat16",
        "light_scale": "channel",
    }
    runs = [("defaults", {}, None), ("written", written_out, {"lr_reference": "peak"})]
    runs.append(("leader", {"support": "leader"}, None))  # the previous version's support, given
    weights = {}
    for name, options, level in runs:
        path = str(tmp_path / f"{name}.pt")
        strategy = CompressedDDPStrategy(codec="lgc", codec_options=options, adaptive_level=level, start_method="spawn")
        trainer = _two_rank_trainer(strategy, 40, [FinalWeights(path)])
        torch.manual_seed(0)  # the same initial weights for both runs
        trainer.fit(MLPModule("adamw"))
        weights[name] = torch.load(path, weights_only=True)
    assert weights["defaults"].keys() == weights["written"].keys()
    for key, value in weights["defaults"].items():
        assert torch.equal(value, weights["written"][key]), key
    # and the support matters on this model: on the leader's the same run ends elsewhere
    assert not torch.equal(weights["defaults"]["net.0.weight"], weights["leader"]["net.0.weight"])


# --------------------------------------------------------------------------------------------------
# the run-time guard: a code that no longer reconstructs is replaced by exact values, on every rank
def _guarded_stage3(rank: int, world: int, break_ae: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    torch.manual_seed(0)
    model = _mlp()
    ddp = DDP(model)
    state, hook = make_comm_hook("lgc", ddp, stats_every=1, **OPTS)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(11 + rank)
    rows = []
    for step in range(WARMUP + AE_STEPS + 3):
        if state.codec.ae_trained and break_ae and state.codec.options.max_recon_error > 1:
            # the same on both ranks: a code whose output is zero (relative error 1), and a
            # threshold that the guard, not the gate at the switch, now applies
            for p in state.codec.ae.parameters():
                p.data.zero_()
            state.codec.replace_options(max_recon_error=0.5)
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        st = state.stats.pop()
        rows.append(
            {
                "stage": state.codec.stage(step),
                "used": state.codec.ae_layers_used,
                "payload": st.payload_bytes,
                "err_sq": st.err_sq,
                "ref_sq": st.ref_sq,
                "grads": [p.grad.clone() for p in model.parameters()],
            }
        )
        opt.step()
    return {"rows": rows}


def _guarded_stage3_both_ways(rank: int, world: int) -> dict:
    return {flag: _guarded_stage3(rank, world, flag) for flag in (False, True)}


@pytest.fixture(scope="module")
def guarded_runs():
    return run_gloo(_guarded_stage3_both_ways, 2)


@pytest.mark.parametrize("break_ae", [False, True])
def test_run_time_guard_sends_exact_values_when_the_code_fails(guarded_runs, break_ae):
    r0, r1 = guarded_runs[0][break_ae], guarded_runs[1][break_ae]
    stage3 = [i for i, r in enumerate(r0["rows"]) if r["stage"] == 3]
    assert stage3, "the run never reached stage 3"
    sizes = [p.numel() for p in _mlp().parameters() if p.numel() >= 1000]
    ks = [math.ceil(RATIO * n) for n in sizes]
    dense = sum(p.numel() for p in _mlp().parameters() if p.numel() < 1000) + 1
    lat = [LATENT * GradientAutoencoder.latent_len(k) for k in ks]
    # the leader's message: positions, one scale and one guard flag per layer
    bcast = sum(encoded_nbytes(choose_encoding("auto", k, n), k, n) for k, n in zip(ks, sizes)) + 8 * len(ks)
    for i in stage3[1:]:  # from the first full step after the switch
        a, b = r0["rows"][i], r1["rows"][i]
        assert a["used"] == b["used"]  # the leader's flags: the same on every rank
        for ga, gb in zip(a["grads"], b["grads"]):
            assert torch.equal(ga, gb)
        if break_ae:  # every layer falls back to its exact values on the support
            assert a["used"] == (0, len(ks)) and a["payload"] == bcast + 4 * (sum(ks) + dense)
            assert a["err_sq"] < a["ref_sq"]  # exact on the support: less error than sending nothing
        else:
            assert a["used"] == (len(ks), len(ks)) and a["payload"] == bcast + 4 * (sum(lat) + dense)


# --------------------------------------------------------------------------------------------------
# the density warm-up: DGC's falling density on the shared support instead of a dense stage 1
DW_STEPS, DW_TRAIN, DW_STAGE3 = 4, 3, 2


def _density_warmup_run(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    torch.manual_seed(0)
    model = _mlp()
    ddp = DDP(model)
    opts = dict(OPTS, code="levels", warmup_steps=0, density_warmup=DW_STEPS, ae_train_steps=DW_TRAIN)
    state, hook = make_comm_hook("lgc", ddp, **opts)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    steps, sample_steps = [], []
    for step in range(DW_STEPS + DW_TRAIN + DW_STAGE3):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        st = state.stats.pop()
        nonzero = [int((p.grad != 0).sum()) for p in model.parameters() if p.numel() >= 1000]
        steps.append({"stage": state.codec.stage(step), "wire": st.wire_bytes, "nonzero": nonzero})
        sample_steps.extend(s[1] for s in state.codec._samples if s[1] not in sample_steps)
        opt.step()
    return {
        "steps": steps,
        "sample_steps": sample_steps,
        "switch": state.codec.ae_start_step,
        "trained": state.codec.ae_trained,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def test_density_warmup_sends_a_falling_share_then_the_learned_code_trains_on_the_target_density():
    """With ``warmup_steps=0, density_warmup=4`` only steps 0-1 are dense (the hook's floor): the
    shared support shrinks from 25 % (at step 0) towards ``ratio``, reached at step 4, stage 2 then
    collects ``ae_train_steps`` steps at ``ratio`` only (the code learns the values it will carry),
    and the switch comes after both."""
    res = run_gloo(_density_warmup_run, world_size=2, timeout=300)
    r0, r1 = res
    assert all((a == b).all() for a, b in zip(r0["params"], r1["params"])), "ranks diverged"
    assert r0["switch"] == DW_STEPS + DW_TRAIN and r0["trained"] and r1["trained"]
    assert [s["stage"] for s in r0["steps"]] == [1, 1] + [2] * (DW_STEPS + DW_TRAIN - 2) + [3] * DW_STAGE3
    sizes = [p.numel() for p in _mlp().parameters() if p.numel() >= 1000]
    target = [math.ceil(RATIO * n) for n in sizes]
    warm = r0["steps"][2:DW_STEPS]
    for s in warm:  # denser than the target, at most the warm-up's start
        assert all(t < k <= math.ceil(0.25 * n) for k, t, n in zip(s["nonzero"], target, sizes)), s["nonzero"]
    assert warm[0]["wire"] > warm[1]["wire"] > r0["steps"][DW_STEPS]["wire"]  # the share falls
    for s in r0["steps"][DW_STEPS : DW_STEPS + DW_TRAIN]:  # stage 2 at the target density
        assert all(k <= t for k, t in zip(s["nonzero"], target))
        assert s["wire"] == pytest.approx(_expected_wire(2, "rar", 2))
    # the levels learned only from steps at the target density
    assert r0["sample_steps"] and min(r0["sample_steps"]) >= DW_STEPS
    assert r0["steps"][0]["wire"] > 5 * warm[0]["wire"] > 0  # step 0 is the dense all-reduce


# --------------------------------------------------------------------------------------------------
# a PowerSGD stage 1: low-rank instead of dense, its error memory handed to stage 2
PW_WARM, PW_TRAIN, PW_STAGE3 = 5, 3, 2


def _warmup_options() -> dict:
    return dict(OPTS, code="levels", warmup_steps=PW_WARM, ae_train_steps=PW_TRAIN)


def _warmup_setup(rank: int, **hook_options) -> tuple:
    """Two copies of the MLP (one under DDP with ``lgc``'s hook and a warm-up codec, one to compute
    this rank's own gradient), the hook's state, the layer keys, the compressed ones, SGD and the
    rank's batch generator."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    torch.manual_seed(0)
    model, ref = _mlp(), _mlp()
    ddp = DDP(model)
    state, hook = make_comm_hook("lgc", ddp, fallback=False, **hook_options, **_warmup_options())
    ddp.register_comm_hook(state, hook)
    keys = [state.key_of(p) for p in model.parameters()]
    compressed = [k for k, p in zip(keys, model.parameters()) if state.codec.should_compress(k, p)]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    return model, ref, ddp, state, keys, compressed, opt, torch.Generator().manual_seed(100 + rank)


def _powersgd_warmup_run(rank: int, world: int) -> dict:
    model, ref, ddp, state, keys, compressed, opt, gen = _warmup_setup(rank, warmup_codec="powersgd", warmup_rank=2)
    codec, opts = state.codec, _warmup_options()
    steps, handoff, first, saved, restored = [], {}, {}, None, None
    for step in range(PW_WARM + PW_TRAIN + PW_STAGE3):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        own = {k: p.grad.reshape(-1).clone() for k, p in zip(keys, ref.parameters())}
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        steps.append({"stage": codec.stage(step), "wire": state.stats.pop().wire_bytes})
        if step == PW_WARM - 2:  # mid stage 1: PowerSGD's state survives a checkpoint
            shared, own_state = codec.state_dict(), codec.rank_state_dict()
            fresh = make_codec("lgc", warmup_codec="powersgd", warmup_rank=2, **opts)
            fresh.load_state_dict(shared)
            fresh.load_rank_state_dict(own_state)
            fresh.setup(codec.context)
            restored = (fresh.state_dict()["warmup"], fresh.rank_state_dict())
            saved = (shared["warmup"], own_state)
        if step == PW_WARM - 1:
            handoff = {k: v.clone() for k, v in codec._handoff.items()}
        if step == PW_WARM:  # the first step of stage 2: the residual of what it did not send
            first = {k: (own[k], state.memory.get(k).clone()) for k in compressed}
        opt.step()
    return {
        "steps": steps,
        "compressed": compressed,
        "keys": keys,
        "handoff": handoff,
        "first": first,
        "left": dict(codec._handoff),
        "saved": saved,
        "restored": restored,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _terngrad_warmup_run(rank: int, world: int) -> dict:
    model, ref, ddp, state, keys, compressed, opt, gen = _warmup_setup(rank, warmup_codec="terngrad", stats_every=1)
    codec = state.codec
    steps, stage1 = [], []
    for step in range(PW_WARM + PW_TRAIN + PW_STAGE3):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        # this rank's own gradient through TernGrad with the seeded rounding the hook uses
        coded = {
            k: codec._ternary.encode(p.grad.reshape(-1), k, p, step).local
            for k, p in zip(keys, ref.parameters())
            if k in compressed
        }
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        stats = state.stats.pop()
        steps.append({"stage": codec.stage(step), "wire": stats.wire_bytes, "rel_error": stats.rel_error})
        if 2 <= step < PW_WARM:
            gathered = {}
            for k, c in coded.items():
                parts = [torch.empty_like(c) for _ in range(world)]
                dist.all_gather(parts, c)
                gathered[k] = torch.stack(parts)
            averaged = {k: p.grad.reshape(-1).clone() for k, p in zip(keys, model.parameters())}
            memory = {k: state.memory.get(k) for k in compressed}
            stage1.append({"gathered": gathered, "averaged": averaged, "memory": memory})
        opt.step()
    return {
        "steps": steps,
        "compressed": compressed,
        "stage1": stage1,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def test_terngrad_warmup_sends_stage_1_as_every_ranks_ternary_codes():
    """With ``warmup_codec="terngrad"`` stage 1 sends every compressed layer from step 2 as
    TernGrad's 2-bit codes: the averaged gradient is exactly the mean of what each rank's own
    gradient codes to, the step sends a tenth of the dense step's bytes or less, the residual keeps
    nothing (the rounding is unbiased), ``rel_error`` counts the rounding, and the stages after it
    run as before, with the ranks bit-equal."""
    r0, r1 = run_gloo(_terngrad_warmup_run, world_size=2, timeout=300)
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
    assert [s["stage"] for s in r0["steps"]] == [1] * PW_WARM + [2] * PW_TRAIN + [3] * PW_STAGE3
    dense_wire = r0["steps"][0]["wire"]
    assert r0["steps"][0]["rel_error"] in (None, 0.0)  # steps 0 and 1 are dense
    for s in r0["steps"][2:PW_WARM]:
        assert 0 < s["wire"] < dense_wire / 10
        assert s["rel_error"] > 0.1
    assert r0["steps"][PW_WARM]["wire"] > r0["steps"][PW_WARM - 1]["wire"]  # stage 2's exact values
    assert len(r0["stage1"]) == PW_WARM - 2
    for r in (r0, r1):
        for seen in r["stage1"]:
            for k in r["compressed"]:
                codes = seen["gathered"][k]
                assert not torch.equal(codes[0], codes[1])  # each rank rounds its own gradient
                scales = codes.abs().amax(1, keepdim=True)
                assert torch.equal(codes.abs(), scales * (codes != 0))  # -s, 0 or s
                torch.testing.assert_close(seen["averaged"][k], codes.mean(0), rtol=0, atol=1e-7)
                assert seen["memory"][k] is None or not bool(seen["memory"][k].any())


def test_replaced_warmup_options_rebuild_the_warmup_and_are_checked_against_the_harness():
    codec = make_codec("lgc")
    assert not codec.bucket_keyed_state and not codec.is_compressing(0)
    codec.replace_options(warmup_codec="powersgd", warmup_rank=3)
    assert codec.bucket_keyed_state and codec.is_compressing(0) and codec._warmup_codec.options.rank == 3
    codec.replace_options(warmup_codec="allreduce")
    assert not codec.bucket_keyed_state and codec._warmup_codec is None
    with_momentum = make_codec("lgc", momentum=0.9)
    with pytest.raises(ValueError, match="warmup_codec='powersgd' .* momentum correction"):
        with_momentum.replace_options(warmup_codec="powersgd")
    assert with_momentum.options.warmup_codec == "allreduce" and with_momentum._warmup_codec is None


def test_powersgd_warmup_compresses_stage_1_and_hands_its_error_to_stage_2():
    """With ``warmup_codec="powersgd"`` stage 1 sends PowerSGD's factors from step 2 (the hook's
    floor) instead of the dense gradient; at its last step PowerSGD's error memory is kept per layer,
    and the first step of stage 2 sends it with that step's gradient: the residual it leaves is
    exactly ``g + e`` off the support (and zero on it). PowerSGD's state survives a checkpoint taken
    in stage 1, and the ranks stay bit-equal throughout."""
    r0, r1 = run_gloo(_powersgd_warmup_run, world_size=2, timeout=300)
    # bit-equal: torch's PowerSGD chain runs on the calling thread on gloo (test_callback_threads)
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
    stages = [1] * PW_WARM + [2] * PW_TRAIN + [3] * PW_STAGE3
    assert [s["stage"] for s in r0["steps"]] == stages
    dense_wire = r0["steps"][0]["wire"]
    for s in r0["steps"][2:PW_WARM]:  # rank-2 factors of 256 x 64, 256 x 256 and 10 x 256
        assert 0 < s["wire"] < dense_wire / 4
    for r in (r0, r1):
        (shared, own), (shared_back, own_back) = r["saved"], r["restored"]
        assert any(k.startswith("warmup.error.") for k in own) and own.keys() == own_back.keys()
        assert all(torch.equal(own[k], own_back[k]) for k in own)
        assert shared["iter"] == shared_back["iter"] and shared["q"].keys() == shared_back["q"].keys()
        assert set(r["handoff"]) == set(r["keys"])  # every parameter of the bucket, biases too
        assert not r["left"]  # consumed by stage 2 (and dropped for the layers it sends dense)
        for k in r["compressed"]:
            g, residual = r["first"][k]
            x = g + r["handoff"][k]
            assert float(r["handoff"][k].abs().max()) > 0
            kept = residual != 0
            assert 0 < int((~kept).sum()) <= math.ceil(RATIO * g.numel())  # the support was sent
            torch.testing.assert_close(residual[kept], x[kept], rtol=0, atol=1e-6)


def test_the_autoencoders_gate_reads_its_error_on_held_out_steps():
    # trained on one repeated pattern, tested on fresh noise: the error the fit reports (the one
    # the gate compares with max_recon_error) is the held-out one, above the training one
    from types import SimpleNamespace

    from lightning_gradcomp.codecs import lgc_autoencoder as aec

    gen = torch.Generator().manual_seed(0)
    pattern = torch.randn(2, 256, generator=gen)
    train = [("w", s, 0, 4096, pattern + 0.01 * torch.randn(2, 256, generator=gen)) for s in range(16)]
    held_out = [("w", 16 + s, 0, 4096, torch.randn(2, 256, generator=gen)) for s in range(8)]
    options = SimpleNamespace(ae_lr=3e-3, seed=0, ae_epochs=30, ae_time_budget_s=120.0, variant="rar")
    torch.manual_seed(0)
    ae = aec.GradientAutoencoder()
    _, reported = aec.fit(ae, options, train, held_out, lambda numel: 1)
    cpu = torch.device("cpu")
    assert reported == aec.recon_error(ae, "rar", held_out, cpu, lambda numel: 1)
    (e_train, r_train), (e_held, r_held) = aec.recon_error(ae, "rar", train, cpu, lambda n: 1)["w"], reported["w"]
    assert e_train / r_train < e_held / r_held  # (0.47 against 1.13 here)


# --------------------------------------------------------------------------------------------------
# the leader: who chooses the shared support
LEAD_N, LEAD_K = 4000, 40


class _Linear1d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(LEAD_N))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return (self.weight * t).sum()


def _leader_run(rank: int, world: int) -> list[list[int]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    model = _Linear1d()
    ddp = DDP(model)
    opts = dict(warmup_steps=0, ae_train_steps=100, ratio=LEAD_K / LEAD_N, min_numel=1000, dense_layers="none")
    state, hook = make_comm_hook("lgc", ddp, **opts)
    ddp.register_comm_hook(state, hook)
    # each rank's gradient is large on its own LEAD_K positions and tiny elsewhere
    target = 1e-4 * torch.randn(LEAD_N, generator=torch.Generator().manual_seed(rank))
    target[rank * LEAD_K : (rank + 1) * LEAD_K] = 10.0
    supports = []
    for _ in range(6):
        model.weight.grad = None
        ddp(target).backward()  # the gradient is `target`, reduced through the hook
        supports.append(model.weight.grad.nonzero().reshape(-1).tolist())
    return supports


def test_the_leader_who_chooses_the_support_takes_turns_by_step():
    """Step ``s``'s shared support is the top-k of rank ``s mod N``'s compensated gradient, so no
    rank's largest values are always the ones sent (steps 0 and 1 are dense)."""
    supports = run_gloo(_leader_run, 2)
    assert supports[0] == supports[1]
    for step, support in enumerate(supports[0][2:], start=2):
        leader = step % 2
        assert support == list(range(leader * LEAD_K, (leader + 1) * LEAD_K)), step


def test_the_run_time_guard_passes_a_code_within_max_recon_error_and_never_an_all_zero_layer():
    codec = LGCCodec(max_recon_error=0.3)
    v = torch.linspace(1.0, 2.0, 100)
    assert float(codec._within_gate(v, 0.71 * v)) == 1.0  # relative error 0.29
    assert float(codec._within_gate(v, 0.69 * v)) == 0.0  # 0.31
    # the code of zero is not zero: an all-zero layer travels exactly, however its code came back
    assert float(codec._within_gate(torch.zeros(100), torch.zeros(100))) == 0.0
