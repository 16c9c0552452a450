"""Every codec on a GPU: run with ``pytest -m gpu`` on a machine with CUDA (skipped elsewhere).

- each registered codec through ``Trainer(accelerator="gpu", devices=1)`` with an NCCL group of
  one rank, which exercises every NCCL call (NCCL rejects a CPU tensor);
- two processes sharing the one GPU over gloo with CUDA tensors (``make_comm_hook`` on plain DDP),
  which checks the multi-rank logic with GPU tensors and records the device of every tensor handed
  to a collective;
- a resume from a checkpoint on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from device_helpers import train_every_codec
from dist_utils import run_gloo
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from reliability_helpers import Net, short_options

from lightning_gradcomp import CompressedDDPStrategy, available_codecs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

STEPS = 12  # past every codec's short warm-up (lgc: stage 3 from step 6)


class CompressionCheck(Callback):
    """Fails the fit unless some step really compressed, every gradient stayed on the GPU and
    the timings were read."""

    def __init__(self) -> None:
        self.compressed = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        st = trainer.strategy.hook_state.stats.last
        if st is not None and st.compressed and st.wire_bytes < st.raw_wire_bytes:
            self.compressed += 1
            assert st.encode_s >= 0 and st.decode_s >= 0 and st.comm_s >= 0
        for p in pl_module.parameters():
            assert p.device.type == "cuda" and torch.isfinite(p).all()

    def on_train_end(self, trainer, pl_module) -> None:
        name = trainer.strategy.codec.name
        assert self.compressed > 0 or name == "none", f"{name}: no compressed step"


def _options(name: str) -> dict:
    opts = short_options(name)
    if name == "lgc":
        opts.update(ae_epochs=1)
    return opts


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("codec", available_codecs())
def test_every_codec_trains_on_one_gpu_with_nccl(codec: str, precision: str, tmp_path: Path) -> None:
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    strategy = CompressedDDPStrategy(
        codec=codec, codec_options=_options(codec), process_group_backend="nccl", start_method="spawn", fallback=False
    )
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=STEPS,
        callbacks=[CompressionCheck()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Net())


@pytest.fixture(scope="module")
def shared_gpu_runs():
    return run_gloo(train_every_codec, 2, args=("cuda",), timeout=900)


def test_two_ranks_share_one_gpu_over_gloo(shared_gpu_runs) -> None:
    r0, r1 = shared_gpu_runs
    for name in r0:
        assert r0[name]["compressed"] or name == "none", name
        assert torch.equal(r0[name]["weights"], r1[name]["weights"]), f"{name}: ranks differ"
        assert torch.isfinite(r0[name]["weights"]).all(), name
        devices = {d for _, d in r0[name]["devices"]}
        assert devices and all(d.startswith("cuda") for d in devices), (name, r0[name]["devices"])


def _fit(codec: str, root: Path, ckpt_path: str | None = None) -> torch.Tensor:
    model = Net(step_data=True, momentum=0.9)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=CompressedDDPStrategy(
            codec=codec, codec_options=_options(codec), start_method="spawn", fallback=False
        ),
        max_steps=16,
        callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=7, save_top_k=-1, filename="{step}")],
        logger=False,
        enable_progress_bar=False,
        default_root_dir=root,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])


@pytest.mark.parametrize("codec", ["topk", "gradiveq", "lgc", "fft", "iwp"])
def test_resume_on_the_gpu_continues_the_run(codec: str, tmp_path: Path) -> None:
    full = _fit(codec, tmp_path / "full")
    ckpt = tmp_path / "full" / "step=7.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (tmp_path / "full").iterdir())
    resumed = _fit(codec, tmp_path / "resumed", ckpt_path=str(ckpt))
    # scatter-adds on a GPU use atomics, so the sums may differ in the last bits between runs
    torch.testing.assert_close(resumed, full, rtol=1e-4, atol=1e-5)
