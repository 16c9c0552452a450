"""Reliability in real 2-process gloo runs: non-finite gradients, a dead or stalled rank,
mismatched codec settings, exact resume, unused parameters, accumulation, mixed precision.

Lightning runs go through ``reliability_helpers.lightning_worker``: ``run_gloo`` starts the ranks
and every rank builds its own Trainer (so ranks can be given different settings); several fits
share one pair of processes to keep the spawn cost down.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import free_port, run_gloo
from reliability_helpers import all_finite, from_bytes, lightning_worker, same, short_options, to_bytes

import lightning_gradcomp
from lightning_gradcomp.registry import codec_class

BAD = 4  # the optimizer step whose gradient is made non-finite on rank 1
HERE = Path(__file__).resolve().parent


def _lightning(runs: list[dict], timeout: float = 400.0) -> list[list[dict]]:
    """Per run, the list of per-rank outcomes."""
    per_rank = [from_bytes(b)["runs"] for b in run_gloo(lightning_worker, 2, args=({"runs": runs},), timeout=timeout)]
    return [[per_rank[r][i] for r in range(2)] for i in range(len(runs))]


# --------------------------------------------------------------------------------------------------
# non-finite gradients through the Lightning strategy
NONFINITE_RUNS = [
    {"codec": "fp16", "nonfinite": "skip", "model": {"bad_step": BAD}},
    {"codec": "topk", "nonfinite": "skip", "model": {"bad_step": BAD}},
    {"codec": "powersgd", "nonfinite": "skip", "model": {"bad_step": BAD, "bad_value": math.inf}},
    {"codec": "topk", "nonfinite": "zero", "model": {"bad_step": BAD, "bad_value": math.inf}},
    {"codec": "fp16", "nonfinite": "raise", "model": {"bad_step": BAD}},
    # lgc beside AdamW: its defaults there (the union support), the bad step inside stage 3 (which
    # starts at step 3), where every rank's names and guard flags are gathered before the values travel
    {
        "codec": "lgc",
        "codec_options": {"warmup_steps": 2, "ae_train_steps": 1, "min_numel": 256},
        "nonfinite": "skip",
        "model": {"bad_step": BAD, "optimizer": "adamw"},
    },
    # the uncompressed path (warm-ups, plain buckets, codecs that never compress): one rank's flag
    # must stop the step on both
    {"codec": "none", "nonfinite": "skip", "model": {"bad_step": BAD}},
    # gradiveq's leader at step BAD is rank 0 (step mod 2), which fits the step's bases on its own
    # gradient before any rank knows of the NaN: a NaN there keeps the previous bases
    {
        "codec": "gradiveq",
        "codec_options": {"min_numel": 256},
        "nonfinite": "skip",
        "model": {"bad_step": BAD, "bad_rank": 0},
    },
]


@pytest.fixture(scope="module")
def nonfinite_results() -> list[list[dict]]:
    return _lightning([{**r, "max_steps": 7} for r in NONFINITE_RUNS])


@pytest.mark.parametrize("i", [0, 1, 2, 5, 6, 7], ids=["fp16", "topk", "powersgd", "lgc-adamw", "none", "gradiveq"])
def test_nonfinite_gradient_skips_the_step_on_every_rank(nonfinite_results, i) -> None:
    ranks = nonfinite_results[i]
    for r, out in enumerate(ranks):
        assert out["error"] is None, out.get("message")
        if NONFINITE_RUNS[i]["codec"] == "lgc":  # the bad step is a coded one, after the levels' fit
            assert out["codec_config"]["support"] == "union" and out["codec_config"]["ratio"] == 0.14
            assert [row["stage"] for row in out["rows"]] == [1, 1, 2, 3, 3, 3, 3]
        rows = out["rows"]  # rows[s] is the state after optimizer step s
        assert len(rows) == 7
        # detected on every rank (rank 0's own gradient was finite), counted once, logged
        assert [row["nonfinite_steps"] for row in rows] == [0] * BAD + [1] * (7 - BAD), r
        assert out["metrics"]["gradcomp/nonfinite_steps"] == 1.0
        # the step was skipped: the weights did not move across it, and did again afterwards
        assert torch.equal(rows[BAD]["weights"], rows[BAD - 1]["weights"])
        assert not torch.equal(rows[BAD + 1]["weights"], rows[BAD]["weights"])
        assert BAD not in out["grads"]  # the optimizer (and its hooks) never ran on that step
        # residuals and codec state are those of before the bad step, and finite
        assert same(rows[BAD]["residuals"], rows[BAD - 1]["residuals"])
        assert same(rows[BAD]["codec_state"], rows[BAD - 1]["codec_state"])
        for row in rows:
            assert all_finite(row["residuals"]) and all_finite(row["codec_state"])
        assert bool(torch.isfinite(out["final"]).all())
    for a, b in zip(ranks[0]["rows"], ranks[1]["rows"]):  # ranks stay identical at every step
        assert torch.equal(a["weights"], b["weights"])
    if NONFINITE_RUNS[i]["codec"] in ("topk", "lgc"):  # residuals exist and are per rank
        assert ranks[0]["rows"][BAD]["residuals"] and not same(
            ranks[0]["rows"][BAD]["residuals"], ranks[1]["rows"][BAD]["residuals"]
        )


def test_a_skipped_step_takes_back_what_its_finite_buckets_committed():
    from lightning_gradcomp.memory import ResidualMemory

    memory = ResidualMemory()
    memory.set("a", torch.ones(3))
    memory.set("b", torch.full((3,), 2.0))
    memory.end_step()
    memory.stage("a", torch.zeros(3))
    memory.stage("c", torch.full((3,), 5.0))
    memory.commit(["a", "c"])  # a finite bucket settles first
    memory.drop(["b"])  # a plain bucket sent b's residual
    memory.stage("a", torch.full((3,), 7.0))
    memory.commit(["a"])  # changed twice in the step: what it held before the step comes back
    memory.stage("a", torch.full((3,), 9.0))  # staged by a bucket still in flight
    memory.revert_step()  # another bucket of the step was non-finite: the step is skipped
    assert sorted(memory.keys()) == ["a", "b"]
    assert torch.equal(memory.get("a"), torch.ones(3)) and torch.equal(memory.get("b"), torch.full((3,), 2.0))
    memory.commit(["a"])  # nothing staged survives the revert
    assert torch.equal(memory.get("a"), torch.ones(3))
    memory.end_step()  # a later step's commits are final once the step has settled
    memory.stage("a", torch.zeros(3))
    memory.commit(["a"])
    memory.end_step()
    memory.revert_step()
    assert torch.equal(memory.get("a"), torch.zeros(3))
    # nonfinite="zero": the replaced residuals are let go at once, and nothing can be taken back
    plain = ResidualMemory(revertible=False)
    plain.set("a", torch.ones(3))
    plain.stage("a", torch.zeros(3))
    plain.commit(["a"])
    plain.revert_step()
    assert torch.equal(plain.get("a"), torch.zeros(3))


def test_residual_memory_forgets_what_was_sent_or_discarded_and_refuses_a_changed_model():
    from lightning_gradcomp.memory import ResidualMemory

    memory = ResidualMemory()
    memory.set("a", torch.tensor([3.0, 0.0]))
    memory.set("b", torch.tensor([0.0, 4.0]))
    assert memory.norm() == pytest.approx(5.0)  # the L2 norm over every residual
    memory.drop(["a"])  # a's residual travelled in a plain bucket: adding it again would count it twice
    assert memory.keys() == ["b"] and torch.equal(memory.compensate("a", torch.ones(2)), torch.ones(2))
    memory.stage("b", torch.zeros(2))
    memory.discard(["b"])  # the bucket was non-finite: what it staged must never become current
    memory.commit(["b"])
    assert torch.equal(memory.get("b"), torch.tensor([0.0, 4.0]))
    memory.stage("b", torch.zeros(2))
    memory.reset()
    memory.commit(["b"])
    assert memory.keys() == []
    memory.set("stale", torch.ones(2))
    saved = {"a": torch.ones(2)}
    memory.load_state_dict(saved)  # a checkpoint's residuals replace every residual held before
    memory.scale("a", 2.0)  # in place, as momentum and lr-scaled feedback change residuals
    assert memory.keys() == ["a"] and torch.equal(saved["a"], torch.ones(2))
    memory.set("c", torch.zeros(3))
    with pytest.raises(RuntimeError, match=r"residual of 'c' has shape \(3,\).*\(4,\).*the model changed"):
        memory.compensate("c", torch.zeros(4))


def _nan_in_one_bucket(rank: int, world: int, nonfinite: str, codec: str = "topk", options: dict | None = None) -> dict:
    # a bucket a layer, and a NaN in the first layer's gradient only (as an overflow inside one
    # layer's backward would leave it): the other buckets are finite and settle on their own.
    # Recorded after every step: our residuals and momentum, and the codec's own state (PowerSGD
    # keeps its error, P and Q inside torch's state, and lgc's PowerSGD warm-up with it)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )
    ddp = DDP(model, bucket_cap_mb=0.001)
    options = {"min_numel": 256, "momentum": 0.9} if options is None else options
    state, hook = make_comm_hook(codec, ddp, nonfinite=nonfinite, **options)
    ddp.register_comm_hook(state, hook)
    model[0].weight.register_hook(lambda g: g * float("nan") if state.step == BAD and rank == 1 else g)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    rows = []
    for _ in range(BAD + 2):
        x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        if not state.consume_skip() or nonfinite == "zero":
            opt.step()
        shared = state.codec.state_dict()
        rows.append(
            {
                "residuals": state.memory.state_dict(),
                "momentum": state.momentum_buffers.state_dict(),
                "rank": state.codec.rank_state_dict(),
                "shared": _tensors(shared.get("warmup", shared)),
            }
        )
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"rows": rows, "nonfinite_steps": state.nonfinite_steps, "weights": weights}


def _tensors(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """A codec's nested state as one flat dict of tensors (numbers become tensors)."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_tensors(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float, bool, torch.Tensor)):
            out[f"{prefix}{k}"] = torch.as_tensor(v)
    return out


def test_a_step_skipped_for_one_buckets_nan_leaves_every_residual_as_it_was():
    for nonfinite in ("skip", "zero"):
        ranks = run_gloo(_nan_in_one_bucket, 2, args=(nonfinite,))
        assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])
        for out in ranks:
            assert out["nonfinite_steps"] == 1
            before, after = out["rows"][BAD - 1], out["rows"][BAD]
            assert sorted(before["residuals"]) == ["0.weight", "2.weight", "4.weight"]
            assert {"0.weight", "2.weight", "4.weight"} <= set(before["momentum"])
            kept = sorted(k for k in before["residuals"] if torch.equal(after["residuals"][k], before["residuals"][k]))
            if nonfinite == "skip":  # the optimizer did not step: no bucket's residual or momentum moved
                assert kept == ["0.weight", "2.weight", "4.weight"]
                assert same(after["momentum"], before["momentum"])
            else:  # the finite buckets were applied, and kept what they committed
                assert kept == ["0.weight"]


@pytest.mark.parametrize("codec", ["powersgd", "gradiveq"])
def test_a_skipped_step_leaves_a_codecs_own_memory_as_it_was(codec):
    # gradiveq: the leader (rank 0 at step BAD) fits and broadcasts the step's bases before rank
    # 1's NaN is known; they are put back with the step
    options = {"min_numel": 256} if codec == "gradiveq" else {}
    ranks = run_gloo(_nan_in_one_bucket, 2, args=("skip", codec, options))
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])
    for out in ranks:
        assert out["nonfinite_steps"] == 1
        before, after, later = out["rows"][BAD - 1], out["rows"][BAD], out["rows"][BAD + 1]
        if codec == "powersgd":  # three weight matrices went through PowerSGD, in buckets of their own
            assert len([k for k in before["rank"] if k.startswith("error.")]) >= 3
        else:
            assert len([k for k in before["shared"] if k.startswith("bases.")]) == 3
        # PowerSGD's error, P, Q and iteration, gradiveq's bases: as if the step had not been
        assert same(after["rank"], before["rank"]) and same(after["shared"], before["shared"])
        assert not same(later["shared"], after["shared"])  # the next step changes them again


def test_a_skipped_last_step_of_lgcs_powersgd_warm_up_hands_over_the_error_from_before_it():
    # the bad step is stage 1's last: stage 2 takes over PowerSGD's error from before that step
    options = {"warmup_codec": "powersgd", "warmup_steps": BAD + 1, "ae_train_steps": 4, "min_numel": 256}
    ranks = run_gloo(_nan_in_one_bucket, 2, args=("skip", "lgc", options))
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])
    for out in ranks:
        assert out["nonfinite_steps"] == 1
        before, after = out["rows"][BAD - 1]["rank"], out["rows"][BAD]["rank"]
        held = [v for k, v in before.items() if k.startswith("warmup.error.")]
        handed = [v for k, v in after.items() if k.startswith("handoff.")]
        assert held and handed and not any(k.startswith("warmup.error.") for k in after)
        # every bucket's error, split into its layers: the same values, in another grouping
        assert torch.equal(torch.cat(held).sort().values, torch.cat(handed).sort().values)


def test_a_nonfinite_step_counts_once_however_many_of_its_buckets_held_one() -> None:
    # the runs above have one bucket a step; a larger model flags the same step from each bucket
    from lightning_gradcomp.hook import CodecHookState
    from lightning_gradcomp.registry import make_codec

    state = CodecHookState(make_codec("topk"))
    for _ in range(3):  # three buckets of one step
        state.note_nonfinite()
    assert state.nonfinite_steps == 1 and state.consume_skip() and not state.consume_skip()
    state.note_nonfinite()  # a later step
    assert state.nonfinite_steps == 2 and state.consume_skip()


def test_nonfinite_zero_steps_with_a_zeroed_gradient(nonfinite_results) -> None:
    for out in nonfinite_results[3]:
        assert out["error"] is None, out.get("message")
        assert float(out["grads"][BAD].abs().max()) == 0.0  # the optimizer stepped with zeros
        assert float(out["grads"][BAD - 1].abs().max()) > 0.0
        rows = out["rows"]
        assert torch.equal(rows[BAD]["weights"], rows[BAD - 1]["weights"])  # plain SGD: zero step
        assert same(rows[BAD]["residuals"], rows[BAD - 1]["residuals"])
        assert rows[-1]["nonfinite_steps"] == 1


def test_nonfinite_raise_stops_every_rank_at_the_bad_step(nonfinite_results) -> None:
    for out in nonfinite_results[4]:
        assert out["error"] == "FloatingPointError"
        assert f"step {BAD}" in out["message"]
        assert len(out["rows"]) == BAD  # stopped at the bad step, on every rank


# --------------------------------------------------------------------------------------------------
# the same with plain DDP and make_comm_hook
def _raw_nonfinite(rank: int, world: int) -> bytes:
    from reliability_helpers import Net, flat_params
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    # (codec, value injected on rank 1, where): 1e30 is finite but overflows fp16 on the wire;
    # "entry" puts the value in one entry of the first weight's gradient, which randk's shared
    # draw leaves out of the all-reduced sum (it would stay in the residual): only the flag that
    # travels with the sum tells the ranks
    cases = [
        ("fp16", math.nan, "loss"),
        ("fp16", 1e30, "loss"),
        ("topk", math.inf, "loss"),
        ("powersgd", math.nan, "loss"),
        ("randk", math.nan, "entry"),
    ]
    for codec, value, where in cases:
        net = Net()
        ddp = DDP(net)
        state, hook = lightning_gradcomp.make_comm_hook(codec, ddp)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        rec = []
        for step in range(6):
            torch.manual_seed(100 * step + rank)
            opt.zero_grad()
            loss = ddp(torch.randn(8, 16)).square().mean()
            handle = None
            if step == BAD and rank == 1 and where == "loss":
                loss = loss * value
            elif step == BAD and rank == 1:
                first = next(net.parameters())
                handle = first.register_hook(lambda g: g.flatten().index_fill(0, torch.tensor([0]), value).view_as(g))
            before = {k: v.clone() for k, v in state.memory.residuals.items()}
            loss.backward()
            if handle is not None:
                handle.remove()
            skip = state.consume_skip()
            if not skip:
                opt.step()
            grads = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
            rec.append(
                {
                    "skip": skip,
                    "grad_max": float(grads.abs().max()),
                    "weights": flat_params(net),
                    "residuals_kept": same(before, state.memory.state_dict()) if before else None,
                }
            )
        out[f"{codec}-{value}-{where}"] = rec
    return to_bytes(out)


def _raw_suite(rank: int, world: int) -> bytes:
    """All plain-DDP checks in one pair of processes (each spawn costs seconds)."""
    return to_bytes(
        {
            "nonfinite": from_bytes(_raw_nonfinite(rank, world)),
            "mismatch": from_bytes(_mismatch(rank, world)),
            "half": from_bytes(_half_params(rank, world)),
        }
    )


@pytest.fixture(scope="module")
def raw_results() -> list[dict]:
    return [from_bytes(b) for b in run_gloo(_raw_suite, 2, timeout=400)]


def test_nonfinite_gradient_with_plain_ddp_zeroes_the_bucket_on_every_rank(raw_results) -> None:
    r0, r1 = [r["nonfinite"] for r in raw_results]
    for case in r0:
        for rec in (r0[case], r1[case]):
            assert [x["skip"] for x in rec] == [s == BAD for s in range(6)], case
            assert rec[BAD]["grad_max"] == 0.0, case  # the bucket was zeroed on every rank
            if rec[BAD]["residuals_kept"] is not None:
                assert rec[BAD]["residuals_kept"], case
            assert all(bool(torch.isfinite(x["weights"]).all()) for x in rec)
        for a, b in zip(r0[case], r1[case]):
            assert torch.equal(a["weights"], b["weights"]), case


# --------------------------------------------------------------------------------------------------
# ranks started with different codec settings
def _mismatch(rank: int, world: int) -> bytes:
    import torch.distributed as dist

    errors = {}
    terngrad = codec_class("terngrad")
    layout = terngrad.wire_format
    for case, (name, opts) in {
        "option": ("topk", {"ratio": 0.01 if rank == 0 else 0.02}),
        "name": ("topk" if rank == 0 else "fp16", {}),
        "seed": ("qsgd", {"seed": rank}),
        "wire format": ("terngrad", {}),  # rank 1 plays a version whose codes had another layout
        "same": ("topk", {"ratio": 0.01}),
    }.items():
        if case == "wire format" and rank == 1:
            terngrad.wire_format = layout - 1
        try:
            lightning_gradcomp.make_comm_hook(name, None, **opts)
            errors[case] = None
        except RuntimeError as err:
            errors[case] = str(err)
        finally:
            terngrad.wire_format = layout
        dist.barrier()
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    lightning = from_bytes(
        lightning_worker(rank, world, {"runs": [{"codec": "topk", "rank_options": [{"ratio": 0.01}, {"ratio": 0.05}]}]})
    )["runs"][0]
    return to_bytes({"raw": errors, "lightning": {"error": lightning["error"], "message": lightning.get("message")}})


def test_mismatched_settings_fail_on_every_rank(raw_results) -> None:
    results = [r["mismatch"] for r in raw_results]
    for rank, res in enumerate(results):
        assert res["raw"]["same"] is None
        for case in ("option", "name", "seed", "wire format"):
            msg = res["raw"][case]
            assert msg and "different gradient-compression settings" in msg, (rank, case, msg)
        assert res["lightning"]["error"] == "RuntimeError", res["lightning"]
        assert "different gradient-compression settings" in res["lightning"]["message"]


# --------------------------------------------------------------------------------------------------
# a rank that dies or stalls
def _run_with_failing_rank(tmp_path: Path, timeout_s: float, hang: bool) -> tuple[int, float, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        str(HERE / "reliability_helpers.py"),
        "--port",
        str(port),
        "--timeout",
        str(timeout_s),
        "--die-step",
        "5",
        "--dir",
        str(tmp_path),
    ] + (["--hang"] if hang else [])
    procs = [
        subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for r in range(2)
    ]
    try:
        out, _ = procs[0].communicate(timeout=240)
        end = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    died = float((tmp_path / "died-1").read_text())
    return procs[0].returncode, end - died, out


def _check_last_checkpoint(tmp_path: Path) -> None:
    ckpts = sorted(tmp_path.glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    assert ckpts, "no checkpoint was written before the failure"
    ckpt = torch.load(ckpts[-1], weights_only=True)
    assert ckpt["global_step"] == 4
    assert ckpt["gradcomp"]["world_size"] == 2 and len(ckpt["gradcomp"]["ranks"]) == 2
    assert ckpt["gradcomp"]["shared"]["step"] == 4


def test_dead_rank_stops_the_survivor(tmp_path: Path) -> None:
    """Rank 1 exits abruptly after step 5: rank 0 fails with a clear error, the checkpoint of step 4 loads."""
    timeout_s = 5.0
    rc, elapsed, out = _run_with_failing_rank(tmp_path, timeout_s, hang=False)
    assert rc != 0
    assert elapsed < timeout_s + 30, elapsed
    assert "Connection" in out or "gradient communication failed" in out or "Timed out" in out, out[-2000:]
    _check_last_checkpoint(tmp_path)


@pytest.mark.slow
def test_stalled_rank_bounded_by_timeout(tmp_path: Path, request) -> None:
    """Rank 1 stops answering (alive, sockets open) after step 5: rank 0 waits one process-group
    timeout in the gradient collective, then fails with an error naming the step and the cause."""
    if "slow" not in (request.config.getoption("-m") or "") or "not slow" in request.config.getoption("-m"):
        pytest.skip("slow: run with -m slow")
    timeout_s = 5.0
    rc, elapsed, out = _run_with_failing_rank(tmp_path, timeout_s, hang=True)
    assert rc != 0
    assert timeout_s <= elapsed < timeout_s + 30, elapsed
    assert "gradient communication failed at optimizer step 5" in out, out[-2000:]
    _check_last_checkpoint(tmp_path)


# --------------------------------------------------------------------------------------------------
# resume: an interrupted run continues exactly like an uninterrupted one
RESUME_EXACT = ["fp16", "topk", "qsgd", "gradiveq", "lgc", "fft", "iwp"]
RESUME_CODECS = RESUME_EXACT + ["powersgd"]
STEPS, CUT = 16, 7
# checkpoints written at step CUT of the same runs by the previous release of the codec contract
# (commit afb9483, options scraped from the codec's attributes): they must resume unchanged
PREVIOUS = HERE / "data" / "checkpoints_afb9483"
PREVIOUS_CODECS = ["topk", "fft", "gradiveq", "lgc", "powersgd"]
# defaults changed since those checkpoints were written: the runs compared with them take the
# values the checkpoints were written with (lgc: its dense layers in fp32, a 1 % support)
PREVIOUS_OPTIONS = {"lgc": {"dense_dtype": "float32", "ratio": 0.01}}
# lgc beside AdamW at step CUT, written by commit ee6e149: before lgc took a 7 % support with the
# end layers compressed, the guard at 0.35 and the controller's peak rule there, it took a 3 %
# support alone
PREVIOUS_ADAMW = HERE / "data" / "checkpoints_ee6e149" / "lgc_adamw.ckpt"
# what that version ran with beside AdamW (a leader's support, which a support given keeps, and
# the plain light level, ten times the support up to 25 %: None given keeps it, and what travels
# exactly in fp32, and one scale a message at the light steps)
PREVIOUS_ADAMW_OPTIONS = {
    "ratio": 0.03,
    "dense_layers": "auto",
    "max_recon_error": 0.3,
    "support": "leader",
    "light_ratio": None,
    "plain_dtype": "float32",
    "light_scale": "message",
}


def _previous_options(codec: str) -> dict:
    return {**short_options(codec), **PREVIOUS_OPTIONS.get(codec, {})}


def _resume_run(codec: str, extra: dict | None = None, model: dict | None = None, **run: Any) -> dict:
    """A resume test's run of ``codec``: its short schedule (plus ``extra``), STEPS steps, the
    test model on per-step data with momentum 0.9 (plus ``model``), and ``run``'s other keys."""
    model = {"step_data": True, "momentum": 0.9, **(model or {})}
    return {"codec": codec, "codec_options": short_options(codec, extra), "max_steps": STEPS, "model": model, **run}


def _interrupted(run: dict, ckpt_dir: Path, cut: int = CUT) -> list[dict]:
    """``run`` uninterrupted, writing a checkpoint at step ``cut`` into ``ckpt_dir``, and ``run``
    resumed from that checkpoint."""
    return [
        {**run, "ckpt_dir": str(ckpt_dir), "ckpt_every": cut},
        {**run, "ckpt_path": str(ckpt_dir / f"step={cut}.ckpt"), "weights_only": True},
    ]


@pytest.fixture(scope="module")
def resume_results(tmp_path_factory) -> dict[str, list[list[dict]]]:
    present = [c for c in RESUME_CODECS if c in lightning_gradcomp.available_codecs()]
    runs, dirs = [], {}
    for c in present:
        d = tmp_path_factory.mktemp(f"resume-{c}")
        dirs[c] = d
        runs.extend(_interrupted(_resume_run(c), d))
    previous = [c for c in PREVIOUS_CODECS if c in present]
    for c in previous:
        # those checkpoints were written without the level controller, which lgc now attaches by
        # default: they resume without it, and are compared with an uninterrupted run without it
        common = {"codec": c, "codec_options": _previous_options(c), "max_steps": STEPS, "adaptive_level": False}
        runs.append({**common, "model": {"step_data": True, "momentum": 0.9}})
        runs[-1].update(ckpt_path=str(PREVIOUS / f"{c}.ckpt"), weights_only=True)
    controlled = [c for c in previous if codec_class(c).adaptive_by_default]
    for c in controlled:
        model = {"step_data": True, "momentum": 0.9}
        runs.append({"codec": c, "codec_options": _previous_options(c), "max_steps": STEPS, "model": model})
        runs[-1]["adaptive_level"] = False
    # lgc beside AdamW: the options, the layer plan and the controller's rule it takes there are
    # set again when the run resumes, as the run that wrote the checkpoint set them
    adamw = tmp_path_factory.mktemp("resume-lgc-adamw")
    common = {"codec": "lgc", "codec_options": short_options("lgc"), "max_steps": STEPS}
    common["model"] = {"step_data": True, "optimizer": "adamw"}
    runs.extend(_interrupted(common, adamw))
    # the earlier version's checkpoint beside AdamW, resumed with no options, and this version's
    # run with the options and the controller's rule that version took
    previous_adamw = {**common, "ckpt_path": str(PREVIOUS_ADAMW), "weights_only": True}
    runs.append(previous_adamw)
    runs.append({**common, "codec_options": {**common["codec_options"], **PREVIOUS_ADAMW_OPTIONS}})
    runs[-1]["adaptive_level"] = True
    # a checkpoint records what its run took beside Adam: that wins over this version's defaults
    edited = torch.load(PREVIOUS_ADAMW, weights_only=True)
    edited["gradcomp"]["optimizer_defaults"] = {"options": {"ratio": 0.05}, "controller": {"lr_reference": "peak"}}
    torch.save(edited, adamw / "recorded.ckpt")
    runs.append({**common, "ckpt_path": str(adamw / "recorded.ckpt"), "weights_only": True})
    # the same earlier checkpoints with their residuals zeroed, resumed as the originals are: what
    # losing the codec's state costs, the yardstick for runs compared across machines
    # (_assert_continues_as_it_ran); powersgd is compared with a tolerance of its own
    first = 2 * len(present)
    resumes = {c: runs[first + i] for i, c in enumerate(previous) if c != "powersgd"}
    resumes["adamw:lgc"] = previous_adamw
    zeroed_dir, zeroed_runs = tmp_path_factory.mktemp("resume-zeroed"), []
    for name, run in resumes.items():
        ckpt = torch.load(run["ckpt_path"], weights_only=True)
        for rank_state in ckpt["gradcomp"]["ranks"]:
            for key in [k for k in rank_state if k.startswith("residual.")]:
                rank_state[key] = torch.zeros_like(rank_state[key])
        path = zeroed_dir / f"{name.replace(':', '-')}.ckpt"
        torch.save(ckpt, path)
        zeroed_runs.append({**run, "ckpt_path": str(path)})
    results = _lightning(runs + zeroed_runs, timeout=600)
    out = {f"zeroed:{name}": result for name, result in zip(resumes, results[len(runs) :])}
    results = results[: len(runs)]
    out.update({c: (results[2 * i], results[2 * i + 1], dirs[c]) for i, c in enumerate(present)})
    out.update({f"previous:{c}": results[first + i] for i, c in enumerate(previous)})
    out.update({f"plain:{c}": results[first + len(previous) + i] for i, c in enumerate(controlled)})
    out["adamw:lgc"] = (results[-5], results[-4], adamw)
    out["previous-adamw:lgc"] = (results[-2], results[-3])
    out["recorded-adamw:lgc"] = results[-1]
    return out


def _rows_by_step(full: list[dict], resumed: list[dict], cut: int = CUT) -> list[tuple[dict, dict]]:
    """Per rank, the uninterrupted run's rows and the resumed run's, by global step; the resumed
    run ran without error, every step after the cut."""
    pairs = []
    for r in range(2):
        assert full[r]["error"] is None and resumed[r]["error"] is None, (
            full[r].get("message"),
            resumed[r].get("message"),
        )
        before = {row["global_step"]: row for row in full[r]["rows"]}
        after = {row["global_step"]: row for row in resumed[r]["rows"]}
        assert sorted(after) == list(range(cut + 1, STEPS + 1))
        pairs.append((before, after))
    return pairs


def _codec_state_saved(row: dict, unsaved: str | None) -> dict:
    """A step's codec state without the entries under the prefix ``unsaved`` (a checkpoint whose
    version did not save them)."""
    return {k: v for k, v in row["codec_state"].items() if unsaved is None or not k.startswith(unsaved)}


def _assert_continues_exactly(
    full: list[dict], resumed: list[dict], codec: str, cut: int = CUT, unsaved: str | None = None
) -> None:
    """The resumed run's steps after the cut are the uninterrupted run's, on both ranks; the codec
    state under the prefix ``unsaved`` is left out, for a checkpoint whose version did not save it."""
    for r, (before, after) in enumerate(_rows_by_step(full, resumed, cut)):
        for s in after:
            if codec == "powersgd":
                # torch's PowerSGD state is keyed by bucket index and a new DDP wrapper hands over
                # its first buckets in another order: two plain steps until the rebuild, so the
                # resumed run is close, not equal (docs/reliability.md)
                torch.testing.assert_close(after[s]["weights"], before[s]["weights"], rtol=0, atol=2e-2)
            else:
                assert torch.equal(after[s]["weights"], before[s]["weights"]), f"{codec}: rank {r} differs at step {s}"
                assert same(after[s]["residuals"], before[s]["residuals"])
                assert same(_codec_state_saved(after[s], unsaved), _codec_state_saved(before[s], unsaved))
        assert after[STEPS]["hook_step"] == before[STEPS]["hook_step"] == STEPS
    assert torch.equal(resumed[0]["final"], resumed[1]["final"])


def _checkpoint_weights(path: Path) -> torch.Tensor:
    """The model's parameters in a checkpoint, flattened in the order of ``flat_params``."""
    state = torch.load(path, weights_only=True)["state_dict"]
    return torch.cat([v.reshape(-1).float() for k, v in state.items() if v.is_floating_point() and "running_" not in k])


def _drift(full: list[dict], resumed: list[dict]) -> float:
    """Largest parameter difference, over both ranks and the steps after the cut."""
    pairs = _rows_by_step(full, resumed)
    return max(
        float((after[s]["weights"] - before[s]["weights"]).abs().max()) for before, after in pairs for s in after
    )


# an earlier version saved none of the messages rank 0 keeps for lgc's next refit
UNSAVED_BEFORE = "shared.refit_samples."


def _assert_continues_as_it_ran(
    full: list[dict], resumed: list[dict], zeroed: list[dict], path: Path, codec: str
) -> None:
    """A checkpoint that an earlier version wrote continues like this version's uninterrupted run.

    Exactly, where this machine's run reaches the checkpoint's weights bit for bit. Another CPU
    rounds the same run differently in the last bit (an AVX-512 kernel sums in another order), so
    the runs part by a few ulp before the cut; there the resumed run must stay within a hundredth
    of what zeroing the checkpoint's residuals costs, which shows the codec's state was taken."""
    steps = {row["global_step"]: row["weights"] for row in full[0]["rows"]}
    saved = _checkpoint_weights(path)
    assert saved.shape == steps[CUT].shape
    if torch.equal(saved, steps[CUT]):
        _assert_continues_exactly(full, resumed, codec, unsaved=UNSAVED_BEFORE)
        return
    # the same run (Adam turns ulp into lr-sized moves of near-zero gradients, so "near" is relative)
    to_cut, to_previous = (float((saved - steps[s]).abs().max()) for s in (CUT, CUT - 1))
    assert to_cut <= to_previous / 100, f"the checkpoint is not this run's step {CUT}: {to_cut:.3g}"
    for before, after in _rows_by_step(full, resumed):
        for s in after:
            assert after[s]["residuals"].keys() == before[s]["residuals"].keys()
            kept = [_codec_state_saved(row[s], UNSAVED_BEFORE).keys() for row in (after, before)]
            assert kept[0] == kept[1]
        assert after[STEPS]["hook_step"] == STEPS
    drift, lost = _drift(full, resumed), _drift(full, zeroed)
    assert drift <= lost / 100, f"{codec}: resumed run drifts {drift:.3g}, losing the residuals {lost:.3g}"
    assert torch.equal(resumed[0]["final"], resumed[1]["final"])


@pytest.mark.parametrize("codec", RESUME_CODECS)
def test_resume_matches_uninterrupted(resume_results, codec: str) -> None:
    if codec not in lightning_gradcomp.available_codecs():
        pytest.skip(f"codec {codec!r} is not in this build")
    full, resumed, ckpt_dir = resume_results[codec]
    ckpt = torch.load(ckpt_dir / f"step={CUT}.ckpt", weights_only=True)  # safe to load
    saved = ckpt["gradcomp"]
    assert saved["codec"] == codec and saved["shared"]["step"] == CUT and len(saved["ranks"]) == 2
    for r in range(2):
        # the residuals this rank saved are the ones it held at the cut
        before = {row["global_step"]: row for row in full[r]["rows"]}
        mine = {k[len("residual.") :]: v for k, v in saved["ranks"][r].items() if k.startswith("residual.")}
        assert same(mine, before[CUT]["residuals"])
    _assert_continues_exactly(full, resumed, codec)


@pytest.mark.parametrize("warm_start", [False, True])
def test_powersgds_fresh_qs_after_a_resume_are_the_ones_the_uninterrupted_run_draws(tmp_path, warm_start) -> None:
    # without warm start torch draws a fresh Q every step, and with it after every change of rank,
    # from its own seeded generator: a resumed codec must draw where the saved one left off
    from codec_driver import round_trip, set_up

    def codec() -> Any:
        return set_up(lightning_gradcomp.make_codec("powersgd", rank=2, warm_start=warm_start, seed=7))

    param = torch.zeros(32, 48)
    grads = [torch.randn(32 * 48, generator=torch.Generator().manual_seed(s)) for s in range(6)]
    running = codec()
    for step in range(3):
        round_trip(running, grads[step], "w", param, step)
    saved = tmp_path / "powersgd.pt"
    torch.save({"shared": running.state_dict(), "rank": running.rank_state_dict()}, saved)
    if warm_start:  # a new rank drops P and Q: the next step draws fresh ones
        running.set_level(0.5)
    uninterrupted = [round_trip(running, grads[step], "w", param, step)[1] for step in range(3, 6)]

    loaded = torch.load(saved, weights_only=True)
    resumed = codec()
    resumed.load_state_dict(loaded["shared"])
    resumed.load_rank_state_dict(loaded["rank"])
    if warm_start:
        resumed.set_level(0.5)
    for step, expected in zip(range(3, 6), uninterrupted):
        assert torch.equal(round_trip(resumed, grads[step], "w", param, step)[1], expected), step


def test_resume_with_a_bucket_a_layer(tmp_path) -> None:
    # DDP's first step after a resume runs on its initial buckets (the first holds up to 1 MiB, so
    # here both layers), then on the rebuilt ones (a bucket a layer): what a codec keeps or chooses
    # must not depend on the order or the grouping its layers arrive in. iwp's default cut spans a
    # bucket, and so spans both layers on that step: it resumes close, and exactly with a cut a layer.
    exact = [("lgc", {"refit_every": 4}), ("gradiveq", {}), ("topk", {}), ("fft", {}), ("iwp", {"scope": "layer"})]
    runs = []
    for i, (codec, extra) in enumerate([*exact, ("iwp", {})]):
        runs.extend(_interrupted(_resume_run(codec, extra, ddp={"bucket_cap_mb": 0.001}), tmp_path / str(i)))
    results = _lightning(runs)
    for i, (codec, _) in enumerate(exact):
        _assert_continues_exactly(results[2 * i], results[2 * i + 1], codec)
    full, resumed = results[-2:]
    for before, after in _rows_by_step(full, resumed):
        assert not torch.equal(after[CUT + 1]["weights"], before[CUT + 1]["weights"])
        torch.testing.assert_close(after[STEPS]["weights"], before[STEPS]["weights"], rtol=0, atol=2e-2)


# (codec, options, cut, model): the short schedules put the cuts inside warm-ups (step 3: the first
# compressed step; lgc: stage 1 at steps 0-2, stage 2 at 3-5, stage 3 from 6), right after a
# skipped step, and beside AdamW; randk, rangefloat and terngrad draw per step and layer
RESUME_AT = [
    ("fp16", {}, 3, {}),
    ("qsgd", {}, 4, {}),
    ("randk", {}, 4, {}),
    ("rangefloat", {}, 4, {}),
    ("terngrad", {}, 4, {}),
    ("fft", {}, 3, {}),
    ("iwp", {}, 3, {}),
    ("gradiveq", {}, 3, {}),
    ("topk", {}, 4, {"optimizer": "adamw"}),
    ("lgc", {}, 2, {}),
    ("lgc", {}, 4, {}),
    ("lgc", {"warmup_codec": "terngrad"}, 2, {}),
    ("lgc", {"warmup_steps": 0, "density_warmup": 4}, 2, {}),
    ("lgc", {"refit_every": 4}, 10, {"optimizer": "adamw"}),
    ("lgc", {"refit_every": 4}, 7, {"bad_step": 6}),
    ("gradiveq", {"basis_source": "aggregate", "warmup_steps": 7}, 7, {"bad_step": 6}),
]


def test_resume_at_every_stage_continues_exactly(tmp_path) -> None:
    runs = []
    for i, (codec, extra, cut, model) in enumerate(RESUME_AT):
        runs.extend(_interrupted(_resume_run(codec, extra, model), tmp_path / str(i), cut))
    results = _lightning(runs)
    for i, (codec, extra, cut, model) in enumerate(RESUME_AT):
        _assert_continues_exactly(results[2 * i], results[2 * i + 1], f"{codec} {extra} {model} at {cut}", cut)


def test_gradiveq_resumed_inside_or_at_the_end_of_its_warm_up_fits_what_it_would_have(tmp_path) -> None:
    # gradiveq (basis_source="aggregate") samples the averaged gradients of its warm-up and fits
    # its bases at the end of the warm-up's last step. A checkpoint at step CUT is written before
    # the end-of-step work of step CUT - 1 runs (it runs as step CUT starts). Warm-up CUT: the
    # resumed run must still fit, on the whole window's samples, or it sends plainly where the
    # uninterrupted run compresses. Warm-up CUT + 3: the resumed run fits on the samples from
    # before the cut too.
    runs, dirs = [], []
    for warmup in (CUT, CUT + 3):
        opts = short_options("gradiveq", {"basis_source": "aggregate", "warmup_steps": warmup})
        common = {"codec": "gradiveq", "codec_options": opts, "max_steps": STEPS, "model": {"step_data": True}}
        dirs.append(tmp_path / f"warmup{warmup}")
        runs.extend(_interrupted(common, dirs[-1]))
    results = _lightning(runs)
    for i, d in enumerate(dirs):
        saved = torch.load(d / f"step={CUT}.ckpt", weights_only=True)["gradcomp"]["shared"]
        assert saved["step"] == CUT and saved["step_end_pending"] and saved["codec"]["fits"] == 0
        assert saved["codec"]["samples"], "the window's samples travel in the checkpoint"
        _assert_continues_exactly(results[2 * i], results[2 * i + 1], "gradiveq")
        last = results[2 * i + 1][0]["rows"][-1]["codec_state"]
        assert any(k.startswith("shared.bases.") for k in last), "the resumed run fitted its bases"


def test_lgc_resumed_between_two_refits_of_its_levels_fits_what_it_would_have(tmp_path) -> None:
    # lgc refits its levels every refit_every stage-3 steps on rank 0's messages since the last
    # fit, and the refit's held-out error decides again which layers the code carries. Stage 3
    # starts at step 6 here and the refits follow steps 9 and 13: the first one's window holds
    # step 6, before the checkpoint at step CUT, and the resumed run must fit on it too: only rank
    # 0 keeps these messages, so the checkpoint (which rank 0 writes) holds them and only rank 0
    # loads them.
    full, resumed = _lightning(_interrupted(_resume_run("lgc", {"refit_every": 4}), tmp_path))
    saved = torch.load(tmp_path / f"step={CUT}.ckpt", weights_only=True)["gradcomp"]["shared"]["codec"]
    assert saved["refits"] == 0 and {d["step"] for d in saved["refit_samples"]} == set(range(6, CUT))
    _assert_continues_exactly(full, resumed, "lgc")


@pytest.mark.parametrize(
    ("code", "extra"),
    [("levels", {"warmup_steps": 5}), ("autoencoder", {"warmup_steps": CUT, "ratio": 0.1})],
    ids=["levels", "autoencoder"],
)
def test_lgc_resumed_inside_stage_2_fits_what_it_would_have(tmp_path, code: str, extra: dict) -> None:
    # stage 2 keeps every rank's values as the learned code's training data, for 5 steps here.
    # The first step after a resume hands DDP's buckets over in another order, so its layers'
    # samples come in another order too: the checkpoint and the fit take them by step and layer.
    # The levels resume inside stage 2 (the checkpoint holds steps 5 and 6). The autoencoder
    # resumes as stage 2 starts, on a support of 10 % so that both layers train it: it takes its
    # batches in the order of the first step's samples, and fitted other weights before.
    run = _resume_run("lgc", {"code": code, "ae_train_steps": 5, **extra})
    full, resumed = _lightning(_interrupted(run, tmp_path))
    saved = torch.load(tmp_path / f"step={CUT}.ckpt", weights_only=True)["gradcomp"]["shared"]["codec"]
    assert not saved["ae_trained"] and {d["step"] for d in saved["samples"]} == set(range(extra["warmup_steps"], CUT))
    _assert_continues_exactly(full, resumed, "lgc")
    assert resumed[0]["rows"][-1]["stage"] == 3


def test_a_second_fit_continues_the_hook_where_the_first_stopped() -> None:
    # trainer.fit() again on the same trainer: the strategy registers its hook on a new DDP
    # wrapper, which takes over the step counter, the residuals and the statistics
    # and the codec's step-end work of the first fit's last step: gradiveq, whose warm-up window
    # of 4 steps ends with the first fit, fits its bases on the window as the second fit starts
    # (it sent plainly until its next window before)
    run = {"codec": "topk", "codec_options": short_options("topk"), "max_steps": 4, "second_fit_max_steps": 7}
    window = short_options("gradiveq", {"basis_source": "aggregate", "warmup_steps": 4})
    fitted = {**run, "codec": "gradiveq", "codec_options": window}
    topk, gradiveq = _lightning([{**run, "model": {"step_data": True}}, {**fitted, "model": {"step_data": True}}])
    for out in topk + gradiveq:
        assert out["error"] is None, out.get("message")
        rows = out["rows"]
        assert [row["hook_step"] for row in rows] == list(range(1, 8)) and out["hook_step"] == 7
    for out in topk:
        rows = out["rows"]
        # the residuals the first fit left are the ones the second fit's first step added and renewed
        assert rows[3]["residuals"] and rows[4]["residuals"].keys() == rows[3]["residuals"].keys()
        assert not same(rows[4]["residuals"], rows[3]["residuals"])
    for out in gradiveq:
        rows = out["rows"]
        assert not any(k.startswith("shared.bases.") for k in rows[3]["codec_state"])
        assert any(k.startswith("shared.bases.") for k in rows[4]["codec_state"])


def test_a_second_fit_keeps_the_fallbacks_decision() -> None:
    # as a checkpoint carries it: a bucket that fell back stays plain, without timing again
    from lightning_gradcomp.hook import CodecHookState
    from lightning_gradcomp.registry import make_codec

    first = CodecHookState(make_codec("topk"), fallback=True)
    first.fallback.load_state_dict({"decided": True, "fallback": ["body.2.weight..body.0.bias[4]"]})
    second = CodecHookState(make_codec("topk"), fallback=True)
    assert second.fallback.wants_timing()
    second.continue_from(first)
    assert not second.fallback.wants_timing() and second.fallback.falls_back("body.2.weight..body.0.bias[4]")


def test_lgc_beside_adamw_resumes_like_an_uninterrupted_run(resume_results) -> None:
    full, resumed, ckpt_dir = resume_results["adamw:lgc"]
    saved = torch.load(ckpt_dir / f"step={CUT}.ckpt", weights_only=True)
    assert saved["gradcomp"]["codec"] == "lgc" and saved["gradcomp"]["shared"]["step"] == CUT
    assert any("AdaptiveCompression" in key for key in saved["callbacks"])  # the controller came along
    options = saved["gradcomp"]["options"]  # the defaults beside Adam, the end layer compressed too
    assert options["ratio"] == 0.14 and tuple(options["dense_layers"]) == ("none",)
    assert options["light_ratio"] == 0.5
    assert "residual.body.4.weight" in saved["gradcomp"]["ranks"][0]
    # and what the run took there, which a resumed run takes again
    recorded = saved["gradcomp"]["optimizer_defaults"]
    taken = {"ratio": 0.14, "dense_layers": ["none"], "max_recon_error": 0.35, "support": "union", "light_ratio": 0.5}
    taken.update(plain_dtype="bfloat16", light_scale="channel")
    assert recorded == {"options": taken, "controller": {"lr_reference": "peak"}}
    _assert_continues_exactly(full, resumed, "lgc")


def test_lgc_beside_adamw_resumes_a_previous_version_as_it_ran(resume_results) -> None:
    """A checkpoint written before lgc's defaults beside Adam changed (3 % support, end layer
    exact, the controller's default rule) resumes with those settings, not this version's, and
    continues exactly like this version's run given them; a checkpoint that records what its run
    took beside Adam resumes with that alone (here a ratio, so the end layer stays exact)."""
    saved = torch.load(PREVIOUS_ADAMW, weights_only=True)["gradcomp"]
    assert saved["shared"]["step"] == CUT and "optimizer_defaults" not in saved
    assert saved["options"]["ratio"] == 0.03 and saved["options"]["dense_layers"] == ["auto"]
    full, resumed = resume_results["previous-adamw:lgc"]
    for r in range(2):
        assert resumed[r]["codec_config"]["ratio"] == 0.03 and resumed[r]["codec_config"]["dense_layers"] == ["auto"]
    _assert_continues_as_it_ran(full, resumed, resume_results["zeroed:adamw:lgc"], PREVIOUS_ADAMW, "lgc")
    for out in resume_results["recorded-adamw:lgc"]:
        assert out["error"] is None, out.get("message")
        assert out["codec_config"]["ratio"] == 0.05 and out["codec_config"]["dense_layers"] == ["auto"]


@pytest.mark.parametrize("codec", PREVIOUS_CODECS)
def test_checkpoint_of_the_previous_contract_resumes_like_an_uninterrupted_run(resume_results, codec: str) -> None:
    """Checkpoint keys did not change with the codec contract: a run resumed from a checkpoint that
    commit afb9483 wrote continues like this version's uninterrupted run (exactly on a CPU that
    rounds as the one that wrote it)."""
    saved = torch.load(PREVIOUS / f"{codec}.ckpt", weights_only=True)["gradcomp"]
    assert saved["codec"] == codec and saved["shared"]["step"] == CUT
    full = resume_results.get(f"plain:{codec}") or resume_results[codec][0]
    if codec == "powersgd":  # close, not equal, on any machine (_assert_continues_exactly)
        _assert_continues_exactly(full, resume_results[f"previous:{codec}"], codec)
        return
    zeroed = resume_results[f"zeroed:{codec}"]
    _assert_continues_as_it_ran(full, resume_results[f"previous:{codec}"], zeroed, PREVIOUS / f"{codec}.ckpt", codec)


# --------------------------------------------------------------------------------------------------
# unused parameters, gradient accumulation, bf16 autocast
@pytest.fixture(scope="module")
def feature_results() -> list[list[dict]]:
    return _lightning(
        [
            {"codec": "topk", "model": {"unused": True}, "ddp": {"find_unused_parameters": True}, "max_steps": 6},
            {"codec": "fp16", "model": {"unused": True}, "ddp": {"find_unused_parameters": True}, "max_steps": 6},
            {"codec": "topk", "accumulate": 2, "max_steps": 5},
            {"codec": "topk", "precision": "bf16-mixed", "max_steps": 5},
            {"codec": "powersgd", "precision": "bf16-mixed", "max_steps": 5},
        ]
    )


@pytest.mark.parametrize("i", range(5), ids=["unused-topk", "unused-fp16", "accumulate", "bf16-topk", "bf16-powersgd"])
def test_lightning_features_keep_ranks_identical_while_compressing(feature_results, i: int) -> None:
    ranks = feature_results[i]
    for out in ranks:
        assert out["error"] is None, out.get("message")
        assert bool(torch.isfinite(out["final"]).all())
        assert out["metrics"]["gradcomp/phase"] == 1.0  # it did compress
        assert out["rows"][-1]["nonfinite_steps"] == 0
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])
    if i in (0, 1):  # the unused layer got no gradient and did not move
        n_unused = 64 * 32 + 32
        for out in ranks:
            first, last = out["rows"][0]["weights"], out["rows"][-1]["weights"]
            assert torch.equal(first[-n_unused:], last[-n_unused:])
            assert not torch.equal(first[:-n_unused], last[:-n_unused])
    if i == 2:  # 10 micro-batches, 5 optimizer steps: the hook counts optimizer steps
        assert ranks[0]["hook_step"] == 5 and len(ranks[0]["rows"]) == 10


# --------------------------------------------------------------------------------------------------
# half-precision parameters: the hook upcasts, every codec survives a short run
def _half_params(rank: int, world: int) -> bytes:
    from reliability_helpers import Net, flat_params
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        for codec in lightning_gradcomp.available_codecs():
            try:
                net = Net(dtype=str(dtype).split(".")[1])
                ddp = DDP(net)
                state, hook = lightning_gradcomp.make_comm_hook(codec, ddp, **short_options(codec, {"min_numel": 512}))
                ddp.register_comm_hook(state, hook)
                opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
                for step in range(6):
                    torch.manual_seed(100 * step + rank)
                    opt.zero_grad()
                    ddp(torch.randn(8, 16, dtype=dtype)).float().square().mean().backward()
                    if not state.consume_skip():
                        opt.step()
                    state.stats.pop()  # what the monitor callback does in a Lightning run
                out[f"{codec}-{dtype}"] = {
                    "weights": flat_params(net),
                    "nonfinite": state.nonfinite_steps,
                    "bytes": state.stats.last.wire_bytes,
                    "raw": state.stats.last.raw_wire_bytes,
                }
            except Exception as err:  # report per codec instead of stopping the others
                out[f"{codec}-{dtype}"] = {"error": f"{type(err).__name__}: {err}"}
    return to_bytes(out)


def test_half_precision_parameters_every_codec(raw_results) -> None:
    r0, r1 = [r["half"] for r in raw_results]
    failures = {k: v["error"] for k, v in r0.items() if "error" in v}
    assert not failures, failures
    for case in r0:
        assert r0[case]["nonfinite"] == 0, case
        assert bool(torch.isfinite(r0[case]["weights"]).all()), case
        assert torch.equal(r0[case]["weights"], r1[case]["weights"]), case
        if not case.startswith(("none", "fp16")):  # fp16 on 16-bit parameters saves nothing
            assert r0[case]["bytes"] < r0[case]["raw"], case  # the codec really ran


def _overflowing_sum(rank: int, world: int, codec: str) -> dict:
    """One gradient entry of 2e38 on both ranks, the rest small: each rank's bucket (and its sum)
    is finite, the decoded sum of the ranks (4e38) overflows fp32."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)
    ddp = DDP(model)
    state, hook = make_comm_hook(codec, ddp, min_numel=256, dense_layers="none", fallback=False)
    ddp.register_comm_hook(state, hook)
    x = torch.zeros(1, 64)
    x[0, 0] = 1.0  # the gradient of w[j, i] is x[i] times that of output j: column 0 only
    out = []
    for step in range(4):
        ddp.zero_grad()
        y = ddp(x)
        (y.sum() + (2e38 if step == 3 else 1.0) * y[0, 0]).backward()
        grad = model.weight.grad.clone()
        out.append({"grad": grad, "skip": state.consume_skip(), "compressed": state.compressing(step)})
    return {"steps": out, "nonfinite_steps": state.nonfinite_steps}


@pytest.mark.parametrize("codec", ["topk", "fp16"])
def test_a_sum_that_overflows_in_decoding_is_refused_on_every_rank(codec) -> None:
    ranks = run_gloo(_overflowing_sum, 2, args=(codec,))
    for r in ranks:
        last = r["steps"][3]
        assert last["compressed"] and float(r["steps"][2]["grad"].abs().max()) > 0
        # each rank's gradient was finite, the decoded mean is not: zeroed and the step skipped
        assert float(last["grad"].abs().max()) == 0.0 and last["skip"] and r["nonfinite_steps"] == 1
    assert torch.equal(ranks[0]["steps"][3]["grad"], ranks[1]["steps"][3]["grad"])


def _one_nan_entry(rank: int, world: int) -> dict:
    """lgc on the leader's support (rank 0 names the positions at even steps): at step 4 rank 1's
    gradient holds one NaN, in column 0 of the weight, where every input is 0: its gradient is 0
    on every rank at every step, so the leader never names it and no payload carries the NaN."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)
    ddp = DDP(model)
    options = {"warmup_steps": 2, "ae_train_steps": 4, "support": "leader", "ratio": 0.05}
    state, hook = make_comm_hook("lgc", ddp, min_numel=256, dense_layers="none", fallback=False, **options)
    ddp.register_comm_hook(state, hook)

    def one_nan(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[0, 0] = float("nan")
        return grad

    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(6):
        x = torch.randn(8, 64, generator=g)
        x[:, 0] = 0.0
        ddp.zero_grad()
        handle = model.weight.register_hook(one_nan) if step == 4 and rank == 1 else None
        ddp(x).pow(2).mean().backward()
        if handle is not None:
            handle.remove()
        residual = state.memory.get("weight")
        out.append(
            {
                "grad": model.weight.grad.clone(),
                "skip": state.consume_skip(),
                "residual_finite": residual is None or bool(torch.isfinite(residual).all()),
                "compressed": state.compressing(step),
            }
        )
    return {"steps": out}


def test_a_nan_no_payload_carries_still_stops_the_step_on_every_rank() -> None:
    ranks = run_gloo(_one_nan_entry, 2)
    for r in ranks:
        bad = r["steps"][4]
        assert bad["compressed"] and bad["skip"] and float(bad["grad"].abs().max()) == 0.0
        assert all(s["residual_finite"] for s in r["steps"])
        assert not r["steps"][5]["skip"] and float(r["steps"][5]["grad"].abs().max()) > 0
