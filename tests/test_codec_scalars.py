"""What a learned codec reports in ``LearnedState.scalars`` reaches the logger through
``CompressionMonitor``, and the benchmark reads it from there too. The two-process Lightning runs
are in test_lgc.py and test_gradiveq.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_gradcomp.bench.codecs import learned_summary
from lightning_gradcomp.callbacks import AutoencoderWarmup, CompressionMonitor, PCAWarmup
from lightning_gradcomp.codecs.base import Codec, EncodeResult, LearnedState
from lightning_gradcomp.hook.state import CodecHookState
from lightning_gradcomp.registry import make_codec


class CountingCodec(LearnedState, Codec):
    """Sends every value; "learns" how many dense gradients it saw."""

    collective = "allreduce"

    def __init__(self, **options):
        super().__init__(**options)
        self.seen = 0

    def encode(self, x, key, param, step):
        return EncodeResult([x.clone()], local=x.clone())

    def decode(self, payload, ctx, numel, count):
        return payload[0]

    def observe_dense(self, key, mean_grad, step):
        self.seen += 1

    def scalars(self, step, compressing):
        out = {"seen": self.seen, "step_seen": step, "compressing": float(compressing)}
        if self.seen >= 2:
            out["fitted"] = 1.0
        return out


class Recorder:
    """A LightningModule's ``log`` and ``log_dict``, recorded."""

    def __init__(self):
        self.logged: list[tuple[dict, dict]] = []

    def log_dict(self, values, **kwargs):
        self.logged.append((dict(values), kwargs))

    def log(self, name, value, **kwargs):
        self.logged.append(({name: value}, kwargs))


def _monitor_step(state: CodecHookState) -> dict:
    module = Recorder()
    trainer = SimpleNamespace(strategy=SimpleNamespace(hook_state=state))
    CompressionMonitor(prog_bar=False).on_train_batch_end(trainer, module, None, None, 0)
    merged = {}
    for values, kwargs in module.logged:
        assert kwargs["on_step"] is True and kwargs["on_epoch"] is False and kwargs["batch_size"] == 1
        merged.update(values)
    return merged


def test_monitor_logs_the_scalars_a_custom_learned_codec_reports():
    codec = CountingCodec()
    state = CodecHookState(codec)
    assert _monitor_step(state) == {}  # before the first step: nothing to report
    codec.observe_dense("w", torch.zeros(4), 0)
    state.step = 1  # step 0 communicated (no statistics recorded: an accumulation-like batch)
    assert _monitor_step(state) == {"gradcomp/seen": 1.0, "gradcomp/step_seen": 0.0, "gradcomp/compressing": 0.0}
    codec.observe_dense("w", torch.zeros(4), 1)
    state.step = 3  # the hook compresses from step 2
    logged = _monitor_step(state)
    assert logged["gradcomp/fitted"] == 1.0 and logged["gradcomp/step_seen"] == 2.0
    assert logged["gradcomp/compressing"] == 1.0
    assert all(isinstance(v, float) for v in logged.values())


def test_codecs_without_learned_state_report_nothing():
    state = CodecHookState(make_codec("topk"))
    state.step = 5
    assert state.codec_scalars() == {}  # topk's AdjustableLevel reports nothing by default
    state = CodecHookState(make_codec("fp16"))
    state.step = 5
    assert state.codec_scalars() == {}


def test_gradiveq_counts_a_compressing_phase_the_hook_did_not_compress_as_warmup():
    codec = make_codec("gradiveq", basis_source="leader")
    assert codec.phase_at(0) == "compress"
    assert codec.scalars(0, False) == {"pca_phase": 0.0, "pca_k": 0.0, "explained_variance": 0.0}
    assert codec.scalars(0, True)["pca_phase"] == 1.0
    refresh = make_codec("gradiveq", basis_source="aggregate", warmup_steps=3, refresh_every=2, refresh_window=1)
    assert [refresh.scalars(s, False)["pca_phase"] for s in range(6)] == [0, 0, 0, 0, 0, 2]


def test_lgc_reports_its_stage_and_its_learned_code_only_once_trained():
    codec = make_codec("lgc", warmup_steps=3, ae_train_steps=2)
    assert codec.scalars(0, False) == {"lgc_stage": 1.0}
    assert codec.scalars(3, True) == {"lgc_stage": 2.0}
    codec._ae_state = {"trained": True, "loss": 0.5, "recon_error": 0.2, "train_s": 0.1}
    codec._ae_layers_used = (1, 2)
    got = codec.scalars(6, True)
    assert got == {
        "lgc_stage": 3.0,
        "ae_loss": 0.5,
        "ae_recon_error": 0.2,
        "ae_train_s": 0.1,
        "ae_layers": 1.0,
        "ae_layers_eligible": 2.0,
        "ae_values": 0.0,  # no support value counted yet
        "ae_params": codec.ae_cost()["ae_params"],
        "ae_refits": 0.0,
    }
    codec._ae_state["loss"] = float("nan")  # trained on nothing: no learned code to report
    assert codec.scalars(6, True) == {"lgc_stage": 3.0}


def test_bench_reads_the_learned_columns_from_the_reported_scalars():
    reported = {"lgc_stage": 3.0, "ae_train_s": 1.5, "ae_params": 8.0, "ae_recon_error": 0.25, "ae_loss": 0.1}
    assert learned_summary(reported) == {"ae_train_s": 1.5, "ae_params": 8.0, "ae_recon_error": 0.25}
    # gradiveq before its first fit, and bases whose variance no fit measured
    assert learned_summary({"pca_phase": 0.0, "pca_k": 0.0, "explained_variance": 0.0}) == {}
    assert learned_summary({"pca_k": 4.0, "explained_variance": 0.0}) == {"basis_k": 4.0}
    assert learned_summary({"ae_recon_error": float("nan")}) == {}


def test_schedule_callbacks_override_options_and_log_nothing():
    lgc = make_codec("lgc")
    trainer = SimpleNamespace(strategy=SimpleNamespace(codec=lgc))
    AutoencoderWarmup(warmup_steps=4).setup(trainer, None, "fit")
    assert lgc.options.warmup_steps == 4 and lgc.options.ae_train_steps == 0.1  # the other one kept
    # fractions of the run, as the codec's own options take them, and the codec's own refusals
    AutoencoderWarmup(warmup_steps=0.2, ae_train_steps=0.05).setup(trainer, None, "fit")
    assert (lgc.options.warmup_steps, lgc.options.ae_train_steps) == (0.2, 0.05)
    with pytest.raises(ValueError, match="ae_train_steps must be >= 1 step .or a fraction of the run."):
        AutoencoderWarmup(ae_train_steps=0)
    with pytest.raises(ValueError, match="warmup_steps must be an integer >= 0 .steps. or a float in .0, 1."):
        AutoencoderWarmup(warmup_steps=-1)
    assert AutoencoderWarmup(warmup_steps=0).overrides() == {"warmup_steps": 0}  # no dense warm-up
    with pytest.raises(ValueError, match="AutoencoderWarmup needs CompressedDDPStrategy.codec='lgc'."):
        AutoencoderWarmup().setup(SimpleNamespace(strategy=SimpleNamespace(codec=make_codec("topk"))), None, "fit")
    pca = make_codec("gradiveq")
    PCAWarmup(refresh_window=3).setup(SimpleNamespace(strategy=SimpleNamespace(codec=pca)), None, "fit")
    assert pca.options.refresh_window == 3
    # 0 is a value (never refit), not "keep the codec's own": only None keeps
    assert PCAWarmup(refresh_every=0).overrides() == {"refresh_every": 0}
    PCAWarmup(refresh_every=0).setup(SimpleNamespace(strategy=SimpleNamespace(codec=pca)), None, "fit")
    assert pca.options.refresh_every == 0 and pca.options.refresh_window == 3
    with pytest.warns(UserWarning, match="PCAWarmup only acts on"):
        PCAWarmup().setup(trainer, None, "fit")
    # the codec's scalars are logged once, by the monitor
    assert "on_train_batch_end" not in vars(AutoencoderWarmup) and "on_train_batch_end" not in vars(PCAWarmup)
