"""Run a function in real gloo processes, started from a fork server rather than forked from pytest.

A spawned rank imports torch, Lightning and this package again: about 6 s a two-rank launch on
two cores, most of the suite's time. A fork server imports them once; each rank is forked from
that clean, single-threaded server (never from pytest's own process, whose threads a fork would
copy half-way), so it starts as safely as a spawned one and in a fraction of the time.
Lightning's own launches in the tests still spawn: its launcher treats a fork server as it treats
``fork``, without handing the ranks the parent's random state."""

from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the fork server; every rank forked from it has them already.
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "lightning.pytorch", "lightning_gradcomp"]


def start_context() -> Any:
    """The ``forkserver`` context, its server preloading ``PRELOAD`` when this call starts it."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, queue: Any, environ: dict) -> None:
    # a forked rank has the server's environment, not the test's: take the test's, as a spawned one would
    os.environ.clear()
    os.environ.update(environ)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        # tensors would travel as shared-memory handles that die with this process: send bytes
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report the traceback to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_gloo(fn: Callable, world_size: int = 2, args: tuple = (), timeout: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank.

    ``fn`` must be a module-level function (it is pickled) and its result picklable.
    """
    ctx = start_context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, environ)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    errors.append(f"ranks {dead} died with exit codes {[procs[i].exitcode for i in dead]}")
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout:.0f} s with results from ranks {sorted(results)}")
                continue
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            else:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
