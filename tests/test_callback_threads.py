"""Every rank decodes with the same arithmetic, whichever thread runs the decode.

Lightning's launchers (and ``dist_utils.run_gloo``) call ``torch.set_num_threads`` at run time,
which sets OpenMP's and MKL's thread counts for the calling thread only. A ``.then`` callback runs
on a gloo worker thread or inline, depending on timing, and MKL can round a matrix product
differently there: ranks that decode the same sum on different kinds of thread end one rounding
step apart (seen with torch's PowerSGD hook in about a third of loaded two-rank runs).
"""

import threading
import time

import torch
import torch.distributed as dist
from dist_utils import run_gloo
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import make_comm_hook
from lightning_gradcomp.comm import then_like_caller


def _products() -> list[tuple[torch.Tensor, torch.Tensor]]:
    # the shapes of a PowerSGD decompression (rank 2 and 4) of a 10 x 256 classifier, and larger
    g = torch.Generator().manual_seed(0)
    shapes = [(10, 2, 256), (10, 4, 256), (256, 2, 64), (256, 4, 256)]
    return [(torch.randn(1, n, r, generator=g), torch.randn(1, r, m, generator=g) * 1e-3) for n, r, m in shapes]


def _callback_products(rank: int, world: int) -> dict:
    pairs = _products()
    on_caller = [torch.bmm(p, q) for p, q in pairs]
    seen: list[tuple[int, list[torch.Tensor]]] = []

    def decode(f: torch.futures.Future) -> None:
        f.value()
        seen.append((threading.get_ident(), [torch.bmm(p, q) for p, q in pairs]))

    if rank == 1:
        time.sleep(0.3)  # rank 0 attaches its callback long before its all-reduce can finish
    fut = dist.all_reduce(torch.ones(1 << 20), async_op=True).get_future()
    then_like_caller(fut, decode).wait()
    return {"caller": threading.get_ident(), "on_caller": on_caller, "seen": seen[0]}


def test_a_decode_in_a_callback_rounds_as_the_calling_thread_does():
    # without then_like_caller (a plain fut.then) the first two products differed from the
    # caller's in their last bit on this project's 2-core machine
    r0 = run_gloo(_callback_products, 2)[0]
    thread, products = r0["seen"]
    assert thread != r0["caller"]  # the decode ran on a gloo worker thread
    assert all(torch.equal(a, b) for a, b in zip(products, r0["on_caller"]))


def _powersgd_threads(rank: int, world: int) -> dict:
    threads: set[int] = set()
    orthogonalize = torch_powersgd._orthogonalize

    def recording(*args, **kwargs):  # torch's hook calls it inside its chained callbacks
        threads.add(threading.get_ident())
        return orthogonalize(*args, **kwargs)

    torch_powersgd._orthogonalize = recording
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        ddp = DDP(model, bucket_cap_mb=0.2)  # several buckets, as in the deadlock once seen
        state, hook = make_comm_hook("powersgd", ddp, rank=2, fallback=False)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(6):
            x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    finally:
        torch_powersgd._orthogonalize = orthogonalize
    return {"threads": threads, "caller": threading.get_ident(), "params": [p.detach() for p in model.parameters()]}


def test_torch_powersgd_runs_its_whole_chain_on_the_calling_thread_on_gloo():
    r0, r1 = run_gloo(_powersgd_threads, 2)
    for r in (r0, r1):
        assert r["threads"] == {r["caller"]}  # P's and Q's orthogonalization ran, and inline
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
