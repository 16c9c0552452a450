"""Per-step statistics: what one bucket adds, what a step's totals log, and what a resume keeps."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_gradcomp.stats import StatsAccumulator, StepStats, record_bucket


def test_a_bucket_counts_its_own_bytes_and_the_codecs_extra_round_on_their_collectives():
    stats = StatsAccumulator()
    buf = torch.zeros(1000, dtype=torch.bfloat16)  # 2,000 bytes as DDP hands them over
    record_bucket(stats.add, buf, 4, "allgather", 100, extra_bytes=40, extra_collective="broadcast", encode_s=0.002)
    step = stats.pop()
    assert (step.buckets, step.raw_bytes, step.payload_bytes) == (1, 2000, 140)
    # an all-gather sends its message to three ranks, a broadcast once; a plain all-reduce 1.5 times
    assert step.wire_bytes == 3 * 100 + 40 and step.raw_wire_bytes == 1.5 * 2000
    assert step.compression_ratio == pytest.approx(3000 / 340) and step.compressed


def test_the_logged_scalars_name_their_units():
    step = StepStats(
        buckets=2,
        raw_bytes=8000,
        payload_bytes=500,
        wire_bytes=600.0,
        raw_wire_bytes=12000.0,
        encode_s=0.004,
        decode_s=0.002,
        comm_s=0.001,
        err_sq=4.0,
        ref_sq=16.0,
        compressed=True,
        extra={"pca_k": 4},
    )
    assert step.as_scalars() == {
        "compression_ratio": 20.0,
        "bytes_sent": 600.0,
        "payload_bytes": 500.0,
        "raw_bytes": 8000.0,
        "encode_ms": 4.0,
        "decode_ms": 2.0,
        "comm_ms": 1.0,
        "phase": 1.0,
        "rel_error": 0.5,  # sqrt(err_sq / ref_sq): a norm's ratio, not a squared one
        "pca_k": 4.0,
    }
    # nothing sent yet: a ratio of 1 (not an infinite or zero one), no error without a reference
    empty = StepStats()
    assert empty.compression_ratio == 1.0 and empty.rel_error is None
    assert "rel_error" not in empty.as_scalars() and empty.as_scalars()["phase"] == 0.0


def test_a_step_without_buckets_is_none_and_its_codec_scalars_wait_for_the_next_one():
    stats = StatsAccumulator()
    stats.set_extra(theta=0.9)
    assert stats.pop() is None and stats.last is None
    stats.set_extra(pca_k=4)  # added to what is waiting, not in its place
    stats.add(buckets=1, raw_bytes=10, wire_bytes=5.0, raw_wire_bytes=10.0)
    step = stats.pop()
    assert step.extra == {"theta": 0.9, "pca_k": 4} and stats.last is step
    stats.add(buckets=1, raw_bytes=10)
    assert stats.pop().extra == {}  # a new step starts without them


def test_the_running_totals_survive_a_resume_field_by_field():
    stats = StatsAccumulator()
    for _ in range(3):  # three steps of two buckets each
        for _ in range(2):
            stats.add(buckets=1, raw_bytes=50, payload_bytes=5, wire_bytes=5.0, raw_wire_bytes=50.0)
            stats.add(encode_s=0.25, decode_s=0.125, comm_s=0.0625)
        assert stats.pop().raw_bytes == 100  # a step adds its buckets up
    saved = stats.totals_tensor()
    resumed = StatsAccumulator()
    resumed.load_totals_tensor(saved)
    for name in StatsAccumulator.TOTALS_FIELDS:
        value = getattr(resumed.totals, name)
        assert value == getattr(stats.totals, name) and type(value) is type(getattr(StepStats(), name)), name
    assert resumed.totals.comm_s == 0.375 and resumed.totals.buckets == 6
    assert math.isclose(resumed.totals.compression_ratio, 10.0)
