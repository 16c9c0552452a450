"""Does a long compressed run hold memory flat? Peak and current RSS per rank, early and late.

Two gloo ranks train a small MLP with plain DDP and a codec hook for ``--steps`` optimizer steps
and print, per rank, VmRSS and VmHWM (peak RSS) from /proc/self/status after the warm-up
(``--start`` steps) and at the end. A leak in the hook (residuals, staged state, statistics,
futures) shows up as an end value well above the start value.

    python scripts/long_run_memory.py --steps 3000 --codec topk
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def memory_mib() -> dict[str, float]:
    """VmRSS and VmHWM of this process in MiB (``resource`` gives only the peak)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value, _unit = line.split()
                    out[key[:-1]] = int(value) / 1024
    except OSError:
        import resource

        out["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from lightning_gradcomp import make_comm_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = DDP(model)
    state, hook = make_comm_hook(args.codec, ddp)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    report = {}
    t0 = time.perf_counter()
    for step in range(args.steps):
        x = torch.randn(32, 32, generator=gen)
        y = torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        if not state.consume_skip():
            opt.step()
        state.stats.pop()  # as the Lightning monitor does every step
        if step + 1 == args.start:
            report["start"] = memory_mib()
    report["end"] = memory_mib()
    report["seconds"] = time.perf_counter() - t0
    report["residual_norm"] = state.memory.norm()
    queue.put((rank, report))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--start", type=int, default=100, help="step at which the start values are taken")
    ap.add_argument("--codec", default="topk")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    reports = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    print(f"codec={args.codec} steps={args.steps} (start = after step {args.start})")
    for rank in sorted(reports):
        r = reports[rank]
        s, e = r["start"], r["end"]
        print(
            f"rank {rank}: RSS {s['VmRSS']:.1f} -> {e['VmRSS']:.1f} MiB, "
            f"peak RSS {s['VmHWM']:.1f} -> {e['VmHWM']:.1f} MiB, "
            f"{r['seconds']:.1f} s, residual norm {r['residual_norm']:.3g}"
        )


if __name__ == "__main__":
    main()
