"""The ``age_scaled_moment`` harness option: beside Adam, a coordinate that error feedback delivers
once every ``a`` steps enters the second moment as ``g**2 / a``.

Under Adam a pulse of ``a * g`` every ``a`` steps moves a coordinate about ``sqrt(a)`` times less
than ``g`` on every step; with the correction it moves as far as the dense one does.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_gloo
from reliability_helpers import from_bytes, lightning_worker, short_options

from lightning_gradcomp.hook import CodecHookState
from lightning_gradcomp.registry import make_codec


def _pulses(period: int, corrected: bool, steps: int = 400, **adam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Coordinate 0 receives 1 every step; coordinate 1 receives ``period`` every ``period`` steps
    (what error feedback delivers for a constant gradient of 1 sent every ``period`` steps)."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.0, **adam)
    state = CodecHookState(make_codec("topk", age_scaled_moment=corrected))
    for t in range(1, steps + 1):
        p.grad = torch.tensor([1.0, float(period) if t % period == 0 else 0.0])
        state.scale_arrivals_into_second_moment([("w", p, opt.param_groups[0], opt.state[p])])
        opt.step()
    return p.detach().clone(), opt.state[p]["exp_avg_sq"].clone()


@pytest.mark.parametrize("period", [4, 16])
def test_a_coordinate_sent_every_a_steps_moves_as_far_as_a_dense_one(period):
    plain, _ = _pulses(period, corrected=False)
    moved, v = _pulses(period, corrected=True)
    dense = float(moved[0])
    assert dense == pytest.approx(-0.4, rel=1e-4)  # 400 steps of lr 1e-3, Adam's unit step
    # uncorrected: about sqrt(period) times less; corrected: within the last pulse of dense
    assert float(plain[1]) / dense == pytest.approx(period**-0.5, rel=0.05)
    assert float(moved[1]) / dense == pytest.approx(1.0, abs=period / 400 + 0.01)
    # the second moment it keeps is the dense gradient's (1), not the pulse's square
    assert float(v[1]) == pytest.approx(float(v[0]), rel=0.05)
    # a coordinate that arrives every step is untouched
    assert torch.equal(plain[0], moved[0])


def test_the_moment_is_left_alone_where_it_cannot_be_corrected():
    off, _ = _pulses(4, corrected=False, amsgrad=True)
    on, _ = _pulses(4, corrected=True, amsgrad=True)
    assert torch.equal(off, on)  # amsgrad keeps the running maximum: the correction is skipped
    # Adam's coupled weight decay makes every coordinate's gradient non-zero: skipped too
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([p], lr=1e-3, weight_decay=0.1)
    p.grad = torch.tensor([1.0, 1.0])
    opt.step()
    v = opt.state[p]["exp_avg_sq"].clone()
    state = CodecHookState(make_codec("topk", age_scaled_moment=True))
    for _ in range(3):
        p.grad = torch.tensor([1.0, 0.0])
        state.scale_arrivals_into_second_moment([("w", p, opt.param_groups[0], opt.state[p])])
    assert torch.equal(opt.state[p]["exp_avg_sq"], v)
    # off (the default): not even the ages are kept
    plain = CodecHookState(make_codec("topk"))
    plain.scale_arrivals_into_second_moment([("w", p, opt.param_groups[0], opt.state[p])])
    assert plain.arrival_age == {}


STEPS, CUT = 12, 5


@pytest.fixture(scope="module")
def adamw_runs(tmp_path_factory) -> list[list[dict]]:
    d = tmp_path_factory.mktemp("age-scaled")
    options = {**short_options("topk"), "ratio": 0.05}
    common = {"codec": "topk", "max_steps": STEPS, "model": {"step_data": True, "optimizer": "adamw"}}
    runs = [
        {**common, "codec_options": {**options, "age_scaled_moment": True}, "ckpt_dir": str(d), "ckpt_every": CUT},
        {**common, "codec_options": {**options, "age_scaled_moment": True}, "ckpt_path": str(d / f"step={CUT}.ckpt")},
        {**common, "codec_options": options},
    ]
    runs[1]["weights_only"] = True
    per_rank = [from_bytes(b)["runs"] for b in run_gloo(lightning_worker, 2, args=({"runs": runs},), timeout=300)]
    out = [[per_rank[r][i] for r in range(2)] for i in range(len(runs))]
    for run in out:
        for rank in run:
            assert rank["error"] is None, rank.get("message")
    ckpt = torch.load(d / f"step={CUT}.ckpt", weights_only=True)
    out.append([ckpt["gradcomp"]["ranks"][r] for r in range(2)])
    return out


def test_two_ranks_stay_identical_and_the_correction_changes_the_training(adamw_runs):
    corrected, _, plain, _ = adamw_runs
    for run in (corrected, plain):
        assert torch.equal(run[0]["final"], run[1]["final"])
    assert not torch.equal(corrected[0]["final"], plain[0]["final"])


def test_a_resumed_run_keeps_the_ages_and_continues_exactly(adamw_runs):
    full, resumed, _, saved = adamw_runs
    ages = {k: v for k, v in saved[0].items() if k.startswith("arrival_age.")}
    assert ages and all(torch.equal(v, saved[1][k]) for k, v in ages.items())
    # some coordinate of a compressed layer waited: the ages are not all zero
    assert any(int(v.max()) > 0 for v in ages.values())
    for r in range(2):
        before = {row["global_step"]: row for row in full[r]["rows"]}
        after = {row["global_step"]: row for row in resumed[r]["rows"]}
        assert sorted(after) == list(range(CUT + 1, STEPS + 1))
        for s in after:
            assert torch.equal(after[s]["weights"], before[s]["weights"]), f"rank {r} differs at step {s}"
