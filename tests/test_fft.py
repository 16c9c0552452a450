"""The FFT codec: exact anchors (theta = 0), the selection, fixed-size messages, and error feedback
conserving mass in a real 2-process gloo run."""

import copy
import math

import pytest
import torch
import torch.nn as nn
from dist_utils import run_gloo
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import make_codec, make_comm_hook
from lightning_gradcomp.codecs.base import AdjustableCompression
from lightning_gradcomp.codecs.fft import FFTCodec


def grad_like(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # a smooth part plus noise and a few outliers, like a flattened conv gradient
    t = torch.arange(n, dtype=torch.float32)
    x = torch.sin(t / 37.0) * 0.3 + 0.1 * torch.randn(n, generator=g)
    x[torch.randint(0, n, (5,), generator=g)] *= 50
    return x * 1e-3


def roundtrip(codec: FFTCodec, x: torch.Tensor) -> tuple[torch.Tensor, object]:
    enc = codec.encode(x, "w", x, 5)
    out = codec.decode(enc.payload, enc.ctx, x.numel(), 1)
    assert torch.equal(out, enc.local)  # what the residual assumes is what the receivers get
    return out, enc


@pytest.mark.parametrize("n", [1024, 5000, 4097, 70001])
def test_theta_zero_without_quantization_is_exact(n):
    x = grad_like(n)
    out, enc = roundtrip(make_codec("fft", theta=0.0, bits=None), x)
    assert enc.ctx[3] == "none"  # no positions are sent when nothing is dropped
    assert torch.allclose(out, x, rtol=0, atol=1e-6 * float(x.abs().max()))


@pytest.mark.parametrize("bits", [8, 10, 16])
def test_theta_zero_reconstructs_to_quantizer_precision(bits):
    # every real and imaginary part is within the range-float's relative bound, so by Parseval
    # (per block) the reconstruction error is too, up to the few values below the range
    x = grad_like(20_000, seed=bits)
    codec = make_codec("fft", theta=0.0, bits=bits)
    out, enc = roundtrip(codec, x)
    bound = codec._fmt.max_relative_error(enc.payload[0])
    rel = float((out - x).norm() / x.norm())
    assert rel <= bound * 1.001 + 1e-6
    assert rel > 0  # it does quantize


def reference_blockwise_topk(x: torch.Tensor, theta: float, B: int) -> torch.Tensor:
    n = x.numel()
    nb = -(-n // B)
    X = torch.fft.rfft(torch.nn.functional.pad(x, (0, nb * B - n)).view(nb, B), dim=1)
    C = B // 2 + 1
    k = C - int(theta * C)
    keep = torch.zeros_like(X.real, dtype=torch.bool)
    keep.scatter_(1, X.abs().topk(k, dim=1).indices, True)
    return torch.fft.irfft(torch.where(keep, X, torch.zeros_like(X)), n=B, dim=1).reshape(-1)[:n]


def reference_layer_topk(x: torch.Tensor, theta: float, B: int) -> torch.Tensor:
    n = x.numel()
    nb = -(-n // B)
    X = torch.fft.rfft(torch.nn.functional.pad(x, (0, nb * B - n)).view(nb, B), dim=1).reshape(-1)
    K = X.numel() - int(theta * X.numel())
    keep = torch.zeros(X.numel(), dtype=torch.bool)
    keep[X.abs().topk(K).indices] = True
    return torch.fft.irfft(torch.where(keep, X, torch.zeros_like(X)).view(nb, -1), n=B, dim=1).reshape(-1)[:n]


@pytest.mark.parametrize(
    "theta, B, selection, n, positions",
    [
        (0.9, 1024, "block", 9000, "bitmap"),
        (0.99, 1024, "block", 9000, "indices"),
        (0.5, 256, "block", 9000, "bitmap"),
        (0.9, 256, "layer", 9000, "bitmap"),  # small layer: exact top-K
        (0.99, 1024, "layer", 300_000, "indices"),  # sampled threshold, then exact top-K
        (0.9, 4096, "layer", 300_000, "bitmap"),
    ],
)
def test_sparsification_keeps_the_largest_coefficients(theta, B, selection, n, positions):
    x = grad_like(n, seed=1)
    codec = make_codec("fft", theta=theta, block_size=B, bits=None, selection=selection)
    out, enc = roundtrip(codec, x)
    assert enc.ctx[3] == positions  # 'auto' takes the smaller encoding, deterministically
    ref = (reference_blockwise_topk if selection == "block" else reference_layer_topk)(x, theta, B)
    assert torch.allclose(out, ref, atol=1e-6 * float(x.abs().max()))
    # dropping coefficients loses energy but never adds any (Parseval, orthogonal projection)
    assert float(out.norm()) < float(x.norm())


def test_messages_have_a_fixed_size_and_the_stated_ratio():
    codec = make_codec("fft", theta=0.9, block_size=1024)  # 8 bits
    sizes = set()
    for seed in range(4):
        enc = codec.encode(grad_like(100_000, seed) * (10.0**seed), "w", None, 5)
        sizes.add(tuple((p.numel(), p.dtype) for p in enc.payload))
    assert len(sizes) == 1
    nbytes = sum(n * torch.empty(0, dtype=d).element_size() for n, d in sizes.pop())
    assert nbytes == codec.payload_nbytes(100_000) + 8  # + the range header
    # 98 blocks: 52 kept coefficients (104 bytes) + a 513-bit bitmap (65 bytes) per 4 KiB block
    assert 22 < 400_000 / nbytes < 25
    codec.set_level(0.99)
    enc = codec.encode(grad_like(100_000), "w", None, 5)
    assert enc.ctx[2:] == (98 * 6, "indices") and 400_000 / sum(p.numel() * p.element_size() for p in enc.payload) > 150
    # a block's positions take ceil(log2 513) = 10 bits: 588 of them 735 bytes, beside 1176 one-byte values
    assert codec.payload_nbytes(100_000) == 2 * 588 + 735


def test_layer_positions_take_the_fewest_bits_that_hold_them():
    # 4 blocks of 30 values: 4 x 16 = 64 coefficients, so a layer-wide position fits 6 bits exactly
    codec = make_codec("fft", theta=0.9, block_size=30, selection="layer")
    assert codec.layout(120) == (4, 16, 7, "indices")
    assert codec.payload_nbytes(120) == 2 * 7 + math.ceil(7 * 6 / 8)
    out, _ = roundtrip(codec, grad_like(120))
    assert torch.allclose(
        out, reference_layer_topk(grad_like(120), 0.9, 30), atol=1e-2 * float(grad_like(120).abs().max())
    )


def test_aggregate_is_the_sum_of_decodes():
    codec = make_codec("fft", theta=0.8, block_size=512, bits=10)
    xs = [grad_like(7000, s) for s in range(3)]
    encs = [codec.encode(x, "w", x, 5) for x in xs]
    total = codec.aggregate([e.payload for e in encs], encs[0].ctx, 7000)
    assert torch.allclose(total, sum(e.local for e in encs), atol=1e-9)


def test_theta_is_a_live_knob_capped_by_the_compression_limit():
    codec = make_codec("fft", theta=0.9)
    assert isinstance(codec, AdjustableCompression)
    assert not isinstance(make_codec("rangefloat"), AdjustableCompression)
    codec.set_level(0.5)
    assert codec.layout(4096)[2] == 1025  # one block of 2049 coefficients
    codec.compression_limit = 0.3
    assert codec.compression_level == 0.3 and codec.layout(4096)[2] == 2049 - int(0.3 * 2049)
    state = codec.state_dict()
    fresh = make_codec("fft")
    fresh.load_state_dict(state)
    assert (fresh.theta, fresh.compression_limit) == (0.5, 0.3)
    with pytest.raises(ValueError, match="compression_limit"):
        codec.compression_limit = 1.5
    with pytest.raises(ValueError, match="theta"):  # theta = 1 would drop every coefficient
        codec.set_level(1.0)
    with pytest.raises(ValueError, match=r"does not know the state entries \['rank'\]"):
        fresh.load_state_dict({**state, "rank": 2})


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"theta": 1.0}, "theta"),
        ({"theta": -0.1}, "theta"),
        ({"block_size": 1023}, "block_size"),
        ({"block_size": 8}, "block_size"),
        ({"bits": 2}, "bits"),
        ({"positions": "csr"}, "positions"),
        ({"selection": "row"}, "selection"),
        ({"rounding": "down"}, "rounding"),
    ],
)
def test_invalid_options_name_the_option(kwargs, option):
    with pytest.raises(ValueError, match=option):
        make_codec("fft", **kwargs)


# --------------------------------------------------------------------------------------------------
# 2 gloo ranks, plain DDP: what the hook averages plus what stays in the residuals is what the ranks had
def _train(rank: int, steps: int, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 16))  # 6144 and 1536 weights
    plain = copy.deepcopy(model)
    ddp = DDP(model)
    state, hook = make_comm_hook("fft", ddp, start_step=0, nonfinite="zero", **options)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + rank)
    records = []
    for _ in range(steps):
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 16, (16,), generator=g)
        plain.load_state_dict(model.state_dict())
        plain.zero_grad()
        nn.functional.cross_entropy(plain(x), y).backward()
        local = {n: p.grad.clone() for n, p in plain.named_parameters()}
        e_old = {k: v.clone() for k, v in state.memory.residuals.items()}
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        averaged = {n: p.grad.clone() for n, p in model.named_parameters()}
        e_new = {k: v.clone() for k, v in state.memory.residuals.items()}
        records.append((local, e_old, averaged, e_new))
        opt.step()
    return records


def _ef_worker(rank: int, world: int):
    torch.set_num_threads(1)
    return {
        "sparse": _train(rank, 5, theta=0.9, block_size=256, bits=8),
        "dense": _train(rank, 4, theta=0.0, bits=None),
    }


@pytest.fixture(scope="module")
def gloo_runs():
    return run_gloo(_ef_worker, 2)


def test_error_feedback_conserves_mass_across_ranks(gloo_runs):
    r0, r1 = gloo_runs[0]["sparse"], gloo_runs[1]["sparse"]
    for step in range(2, 5):  # steps 0 and 1 are plain all-reduce (DDP rebuilds its buckets)
        (g0, e0, out0, n0), (g1, e1, out1, n1) = r0[step], r1[step]
        for name in ("0.weight", "2.weight"):
            assert torch.equal(out0[name], out1[name])  # both ranks apply the same gradient
            z = torch.zeros_like(g0[name]).reshape(-1)
            had = (g0[name].reshape(-1) + e0.get(name, z)) + (g1[name].reshape(-1) + e1.get(name, z))
            kept = n0[name] + n1[name]
            sent = 2 * out0[name].reshape(-1)
            # sent + new residuals == old residuals + gradients, summed over the ranks
            assert torch.allclose(sent + kept, had, atol=1e-6 * float(had.abs().max()))
            assert float(n0[name].norm()) > 0.1 * float(g0[name].norm())  # theta = 0.9 really drops
        if step >= 3:
            assert "0.weight" in e0  # the residual of the previous step was carried in


def test_theta_zero_without_quantization_matches_dense_ddp(gloo_runs):
    r0, r1 = gloo_runs[0]["dense"], gloo_runs[1]["dense"]
    for step in range(4):
        (g0, _, out0, n0), (g1, _, out1, _) = r0[step], r1[step]
        for name, out in out0.items():
            mean = (g0[name] + g1[name]) / 2
            assert torch.allclose(out, mean, atol=1e-6 * float(mean.abs().max()) + 1e-9), (step, name)
            assert torch.equal(out, out1[name])
        if step >= 2:
            assert all(float(r.abs().max()) < 1e-6 for r in n0.values())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_encodes_without_error(bad):
    # the hook detects non-finite buckets through its flag and discards them; encode must not raise
    x = grad_like(5000)
    x[17] = bad
    codec = make_codec("fft", theta=0.9, block_size=1024)
    enc = codec.encode(x, "w", x, 5)
    assert sum(p.numel() * p.element_size() for p in enc.payload) == codec.payload_nbytes(5000) + 8
