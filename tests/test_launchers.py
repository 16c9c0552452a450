"""The quick start recipe under the launchers a cluster uses: torchrun, two nodes started by hand
(Lightning's own launcher with ``NODE_RANK``), and SLURM's environment. Each is a real two-process
gloo run on loopback; Lightning picks the cluster environment from the variables, and the
compressed hook must run under each as it does under Lightning's default launcher. Last, how each
process of a launch ends: the strategy destroys the process group at exit after a finished run."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from dist_utils import free_port

from lightning_gradcomp.strategy import _DestroyProcessGroupAtExit

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "digits_quickstart.py")
STEPS = 6


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _recipe_args(tmp: Path, *more: str) -> list[str]:
    return [
        "--trainer.max_steps",
        str(STEPS),
        "--trainer.max_epochs",
        "-1",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(tmp / "tb"),
        "--report.metrics_json",
        str(tmp / "metrics.json"),
        *more,
    ]


def _wait(procs: list[subprocess.Popen], timeout: float = 240) -> str:
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("a launch did not finish:\n" + "\n".join(p.communicate()[0][-3000:] for p in procs))
    for p, out in zip(procs, outs):
        assert p.returncode == 0, f"{p.args}\nexit code {p.returncode}\n{out[-5000:]}"
    return "\n".join(outs)


def _start(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _check_trained_compressed(tmp: Path, out: str, environment: str, nodes: int) -> None:
    result = json.loads((tmp / "metrics.json").read_text())
    assert result["world_size"] == 2 and result["steps"] == STEPS and result["codec"] == "lgc"
    assert result["cluster_environment"] == environment and result["num_nodes"] == nodes
    # the hook ran: fewer bytes than plain all-reduce would have sent (steps 0 and 1 are dense)
    assert 0 < result["bytes_sent"] < result["raw_bytes"] and result["compression_ratio_last"] > 2
    assert "MEMBER: 1/2" in out and "MEMBER: 2/2" in out  # both ranks joined one group of two


def test_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", RECIPE]
    out = _wait([_start(cmd + _recipe_args(tmp_path), _env(), tmp_path)])
    _check_trained_compressed(tmp_path, out, "TorchElasticEnvironment", 1)


def test_two_nodes_started_by_hand(tmp_path):
    # what docs/multi_node.md says to run on each node, with loopback as the first node's address
    port = str(free_port())
    args = _recipe_args(tmp_path, "--trainer.devices", "1", "--trainer.num_nodes", "2")
    procs = []
    for node in range(2):
        env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node))
        procs.append(_start([sys.executable, RECIPE, *args], env, tmp_path))
    _check_trained_compressed(tmp_path, _wait(procs), "LightningEnvironment", 2)


def test_slurm(tmp_path):
    # one task a node, as `srun` starts them under `#SBATCH --nodes=2 --ntasks-per-node=1`
    port = str(free_port())
    args = _recipe_args(tmp_path, "--trainer.devices", "1", "--trainer.num_nodes", "2")
    procs = []
    for task in range(2):
        env = _env(
            SLURM_JOB_ID="4242",
            SLURM_JOB_NAME="gradcomp",
            SLURM_NTASKS="2",
            SLURM_NTASKS_PER_NODE="1",
            SLURM_NNODES="2",
            SLURM_NODELIST="127.0.0.1",
            SLURM_PROCID=str(task),
            SLURM_LOCALID="0",
            SLURM_NODEID=str(task),
            MASTER_PORT=port,
        )
        procs.append(_start([sys.executable, RECIPE, *args], env, tmp_path))
    _check_trained_compressed(tmp_path, _wait(procs), "SLURMEnvironment", 2)


EXIT_PROBE = """
import atexit, json, os, sys
import lightning.pytorch as pl
import torch
from torch import nn
from lightning_gradcomp import CompressedDDPStrategy

out_dir, fail_at = sys.argv[1], int(sys.argv[2])


def record_exit():  # registered before the fit, so it runs after the strategy's own exit handler
    with open(os.path.join(out_dir, f"exit{trainer.global_rank}.json"), "w") as f:
        json.dump({"initialized": torch.distributed.is_initialized()}, f)


atexit.register(record_exit)


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(64, 64)

    def training_step(self, batch, batch_idx):
        if batch_idx == fail_at:
            raise RuntimeError("failed on purpose")
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 64))
        return torch.utils.data.DataLoader(data, batch_size=8)


trainer = pl.Trainer(
    accelerator="cpu", devices=2, strategy=CompressedDDPStrategy(codec="topk"), max_steps=3, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(Model())
"""


@pytest.mark.parametrize("fails", [False, True], ids=["finished", "failed"])
def test_a_finished_run_destroys_its_process_group_before_the_interpreter_exits(tmp_path, fails):
    # gloo's worker threads run the hook's Python callbacks; one that drops its last reference to a
    # callback while the interpreter shuts down aborts the process after a finished run. The strategy
    # destroys the group at exit, which joins them first; after a failure it leaves the group, since
    # a peer may still wait in a collective that destroying it would wait for.
    script = tmp_path / "exit_probe.py"
    script.write_text(EXIT_PROBE)
    cmd = [sys.executable, str(script), str(tmp_path), "1" if fails else "-1"]
    done = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    if fails:
        assert done.returncode != 0 and "failed on purpose" in done.stderr
        assert json.loads((tmp_path / "exit0.json").read_text()) == {"initialized": True}
    else:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        for rank in range(2):
            assert json.loads((tmp_path / f"exit{rank}.json").read_text()) == {"initialized": False}


def test_the_exit_handler_registers_once_forgets_an_old_failure_and_leaves_a_destroyed_group_alone(monkeypatch):
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    handler = _DestroyProcessGroupAtExit()
    handler.register()
    handler.last_run_failed = True  # a run raised; a later run on the same process finished
    handler.register()
    assert registered == [handler] and not handler.last_run_failed
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    handler()
    assert not dist.is_initialized()
    handler()  # the user destroyed it already (here: the first call): nothing to do, no error
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    handler.last_run_failed = True
    handler()
    assert dist.is_initialized()  # after a failed run the group is left as it is
