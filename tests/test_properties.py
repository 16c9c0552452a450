"""Property tests (hypothesis) of every registered codec, single process.

Each codec in ``available_codecs()`` is covered automatically: one-element layers, odd lengths,
fp32/fp16/bf16 gradients (upcast to fp32 as the hook does), all zeros, huge (1e30) and tiny
(1e-30) magnitudes. Checked: no crash, the right shape, finite output wherever the codec's wire
format can represent the input, decode of one payload equals the codec's own reconstruction, and
the codec's stated error bound (:meth:`Codec.error_bound`) holds.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_gradcomp import CodecContext, available_codecs, make_codec
from lightning_gradcomp.codecs.base import Codec
from lightning_gradcomp.registry import codec_class

torch.set_num_threads(1)


def _encodable() -> list[str]:
    """Codecs that encode layer by layer (``custom`` ones run their own protocol; ``none`` never
    compresses)."""
    out = []
    for name in available_codecs():
        cls = codec_class(name)
        if cls.collective != "custom" and cls.encode is not Codec.encode:
            out.append(name)
    return out


CODECS = _encodable()
# how far a wire format reaches: fp16 overflows beyond 65504 (the hook catches that, see
# test_reliability::test_nonfinite_raw_ddp); everything else must stay finite at 1e30
FINITE_LIMIT = {"fp16": 6.0e4}

lengths = st.one_of(st.just(1), st.integers(2, 40).map(lambda n: 2 * n + 1), st.integers(1000, 3000))
scales = st.sampled_from([0.0, 1e-30, 1e-8, 1.0, 1e4, 1e30])
dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


def _fresh(name: str) -> Codec:
    codec = make_codec(name)
    codec.setup(CodecContext(0, 1, torch.device("cpu")))
    return codec


def _encode_at_compressing_step(codec: Codec, x: torch.Tensor, key: str, param: torch.Tensor):
    """Show learned codecs their warm-up (``observe_dense``), then encode on a compressing step."""
    step = 0
    while not codec.is_compressing(step) and step < 64:
        codec.observe_dense(key, x, step)
        codec.on_step_end(step)
        step += 1
    step = max(step, 2)
    codec.prepare_bucket([(key, x, param)], step)
    return codec.encode(x, key, param, step), step


@pytest.mark.parametrize("name", CODECS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=lengths, scale=scales, dtype=dtypes, seed=st.integers(0, 2**16))
def test_codec_properties(name: str, n: int, scale: float, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    grad = (torch.randn(n, generator=g) * scale).to(dtype)
    assume(bool(torch.isfinite(grad).all()))  # a non-finite gradient is the hook's business
    x = grad.float()  # the hook upcasts every layer to fp32
    param = torch.zeros(n, dtype=dtype)
    codec = _fresh(name)
    enc, _ = _encode_at_compressing_step(codec, x, "layer", param)
    local = enc.local if enc.local is not None else codec.decode_local(enc, n)
    assert local.shape == (n,) and local.dtype == torch.float32
    # what the other ranks compute from this payload alone
    if codec.collective == "allreduce":
        remote = codec.decode([p.clone() for p in enc.payload], enc.ctx, n, 1)
    else:
        remote = codec.aggregate([[p.clone() for p in enc.payload]], enc.ctx, n)
    assert remote.shape == (n,)
    limit = FINITE_LIMIT.get(name, math.inf)
    if float(x.abs().max()) <= limit:
        assert bool(torch.isfinite(local).all()), f"{name}: non-finite reconstruction at scale {scale}"
        assert bool(torch.isfinite(remote).all())
        # deterministic codecs reconstruct the same on every rank as locally
        torch.testing.assert_close(remote, local, rtol=1e-5, atol=1e-30 + 1e-6 * float(local.abs().max()))
    if scale == 0.0:
        assert float(local.abs().max()) == 0.0, f"{name}: zero gradient decodes to non-zero"
    bound = codec.error_bound(x)
    if bound is not None and math.isfinite(bound):
        err = float((x.double() - local.double()).norm())
        assert err <= bound, f"{name}: error {err} above its stated bound {bound} (n={n}, scale={scale})"


def test_stated_bounds_are_tight_enough() -> None:
    """The bounds mean something: topk's is exact and fp16's is 2^-11 relative."""
    x = torch.randn(4001, generator=torch.Generator().manual_seed(0))
    topk = _fresh("topk")
    enc = topk.encode(x, "w", x, 2)
    err = float((x - enc.local).double().norm())
    assert abs(topk.error_bound(x) - err) <= 1e-6 * err
    fp16 = _fresh("fp16")
    assert fp16.error_bound(x) <= 2.0**-10 * float(x.norm())
    assert fp16.error_bound(x * 1e6) == math.inf  # beyond fp16's range: no bound is claimed
    assert _fresh("qsgd").error_bound(x) is None  # codecs that state nothing


def test_every_codec_is_covered() -> None:
    assert {"fp16", "topk", "qsgd", "terngrad"} <= set(CODECS)
