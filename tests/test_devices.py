"""Device placement and the clocks, on the CPU: what the ``gpu`` tests check on CUDA, as far as a
CPU can check it (see tests/test_gpu.py for the rest)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from device_helpers import train_every_codec
from dist_utils import run_gloo

from lightning_gradcomp.codecs import rangefloat as rf
from lightning_gradcomp.stats import StatsAccumulator
from lightning_gradcomp.timing import Clock, Span, clock_for, resolve


@pytest.fixture(scope="module")
def cpu_runs():
    return run_gloo(train_every_codec, 2, args=("cpu",), timeout=600)


def test_every_collective_gets_tensors_on_the_model_device(cpu_runs):
    for name, result in cpu_runs[0].items():
        assert result["devices"], f"{name}: no collective was recorded"
        assert {d for _, d in result["devices"]} == {"cpu"}, (name, result["devices"])


def test_every_codec_keeps_ranks_identical(cpu_runs):
    r0, r1 = cpu_runs
    for name in r0:
        assert torch.equal(r0[name]["weights"], r1[name]["weights"]), name
        assert torch.isfinite(r0[name]["weights"]).all(), name


def test_cpu_clock_reads_the_host_clock():
    clock = clock_for("cpu")
    assert clock is clock_for(torch.device("cpu")) and not clock.cuda
    a = clock.mark()
    time.sleep(0.01)
    b = clock.mark()
    assert isinstance(a, float) and clock.elapsed(a, b) >= 0.009
    assert clock.seconds(b) == b
    assert Span(clock, a, b).seconds() == pytest.approx(b - a)
    assert resolve(torch.tensor(2.5)) == 2.5 and resolve(1) == 1.0
    clock.synchronize()  # a no-op on a CPU


def test_a_cuda_clock_without_cuda_falls_back_to_the_host_clock():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the gpu tests cover it")
    assert not Clock("cuda").cuda


def test_statistics_resolve_spans_and_device_tensors_when_popped():
    stats = StatsAccumulator()
    clock = clock_for("cpu")
    stats.add(buckets=1, encode_s=Span(clock, 1.0, 1.25), err_sq=torch.tensor(3.0, dtype=torch.float64))
    stats.add(buckets=1, encode_s=0.5, ref_sq=torch.tensor(12.0), comm_s=Span(clock, 2.0, 2.5))
    step = stats.pop()
    assert step.encode_s == pytest.approx(0.75) and step.comm_s == pytest.approx(0.5)
    assert step.err_sq == 3.0 and step.ref_sq == 12.0 and step.rel_error == pytest.approx(0.5)
    assert isinstance(step.err_sq, float) and not step.pending
    assert stats.totals.encode_s == pytest.approx(0.75)


def test_a_step_is_compressed_or_non_finite_when_any_of_its_buckets_was():
    # the buckets of a step finish in any order: a plain bucket last (a small layer, a fallback)
    # must not turn a compressed step into a plain one in the logs, nor hide a non-finite bucket
    stats = StatsAccumulator()
    stats.add(buckets=1, compressed=True, nonfinite=True)
    stats.add(buckets=1, compressed=False, nonfinite=False)
    step = stats.pop()
    assert step.compressed and step.nonfinite and step.as_scalars()["phase"] == 1.0
    stats.add(buckets=1, compressed=False)
    assert not stats.pop().compressed  # a new step starts plain


CASES = [
    torch.randn(1000),
    torch.randn(1000) * 1e-30,
    torch.randn(777) * 1e30,
    torch.zeros(10),
    torch.tensor([0.0, 1e-45, 3e-44]),
    torch.tensor([9.09817e-40, -3e-39, 1.1e-38]),  # fp32 subnormals: the range at its floor
    torch.tensor([float("inf"), 1.0]),
    torch.randn(4000) * torch.logspace(-20, 20, 4000),
    torch.tensor([-2.0, 2.0]),
]


FORMATS = [(b, e) for b, e in itertools.product([4, 8, 10, 16], [None, 1, 3]) if e is None or e <= b - 2]


@pytest.mark.parametrize("bits,exponent_bits", FORMATS)
def test_range_float_on_the_device_matches_the_host(bits, exponent_bits):
    # the CUDA path (range kept on the device) run on CPU tensors gives the host path's codes
    for x in CASES:
        h1, c1 = rf.rf_quantize(x, bits, exponent_bits)
        h2, c2 = rf._rf_quantize_device(x, bits, exponent_bits, None, "nearest", None)
        assert torch.equal(h1, h2) and torch.equal(c1, c2)
        if torch.isfinite(x).all():
            d1, d2 = rf.rf_dequantize(h1, c1, bits), rf._rf_dequantize_device(h1, c1, bits)
            assert torch.equal(d1.view(torch.int32), d2.view(torch.int32))


def test_stochastic_range_float_on_the_device_is_unbiased_and_bounded():
    x = torch.randn(20000)
    fmt = rf.RangeFloat(8, None, None, "stochastic")
    g = torch.Generator().manual_seed(0)
    header, codes = rf._rf_quantize_device(x, 8, None, None, "stochastic", g)
    q = rf._rf_dequantize_device(header, codes, 8)
    big = x.abs() >= 2.0 ** int(header[0])
    assert ((q - x).abs()[big] <= fmt.max_relative_error(header) * x.abs()[big] * (1 + 1e-6)).all()
    # the mean error over many values is far below one quantization step
    assert abs(float((q - x).mean())) < 1e-3
    # and so for values of one sign, where a bias toward zero would not cancel: 4/3 lies between
    # two 8-bit codes (1.9 sets the top binade), and their mean is 4/3
    x = torch.full((200_000,), 4.0 / 3.0)
    x[0] = 1.9
    header, codes = rf._rf_quantize_device(x, 8, None, None, "stochastic", g)
    q = rf._rf_dequantize_device(header, codes, 8)[1:]
    assert len(torch.unique(q)) == 2 and abs(float(q.double().mean()) - 4.0 / 3.0) < 1e-3
