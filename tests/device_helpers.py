"""Checks that every tensor handed to ``torch.distributed`` lives on the model's device.

Gloo accepts CPU tensors whatever the model's device, so a tensor left on the CPU goes unnoticed
there and fails only under NCCL. Wrapping the collectives records the device of every tensor they
receive; the CPU test runs it on CPU tensors, the ``gpu`` test on CUDA tensors over gloo.

Not collected by pytest (no ``test_`` prefix); imported by the tests and by spawned ranks.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import available_codecs, make_comm_hook

COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter")

#: options that bring each codec to its compressing phase (and lgc to its learned code) in a few steps
FAST: dict[str, dict[str, Any]] = {
    "lgc": {"warmup_steps": 2, "ae_train_steps": 3, "ae_epochs": 1, "min_numel": 256},
    "gradiveq": {"warmup_steps": 2, "min_numel": 256},
    "powersgd": {},
}
STEPS = 9


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def record_collectives(seen: list[tuple[str, str]]) -> None:
    """Wrap the collectives of ``torch.distributed`` so that each call appends ``(name, device)``
    for every tensor argument to ``seen`` (in this process)."""
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_recorded", False):
            continue

        def wrapper(*args, __fn=fn, __name=name, **kwargs):
            for t in _tensors(list(args) + list(kwargs.values())):
                seen.append((__name, str(t.device)))
            return __fn(*args, **kwargs)

        functools.update_wrapper(wrapper, fn)
        wrapper._recorded = True  # type: ignore[attr-defined]
        setattr(dist, name, wrapper)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def train_every_codec(rank: int, world: int, device_name: str, names: list[str] | None = None) -> dict[str, Any]:
    """Each registered codec (or those of ``names``) on a plain DDP model on ``device_name``; per
    codec the final weights (on the CPU) and the devices every collective saw. An error names the
    codec it came from."""
    if device_name == "cuda":
        torch.cuda.set_device(0)  # two ranks may share one GPU: gloo does not care
    device = torch.device(device_name, 0) if device_name == "cuda" else torch.device("cpu")
    seen: list[tuple[str, str]] = []
    record_collectives(seen)
    out: dict[str, Any] = {}
    for name in names or available_codecs():
        try:
            out[name] = _train_one(name, rank, device, seen)
        except Exception as e:
            raise RuntimeError(f"codec {name}: {type(e).__name__}: {e}") from e
    return out


def _train_one(name: str, rank: int, device: torch.device, seen: list[tuple[str, str]]) -> dict[str, Any]:
    seen.clear()
    model = make_model().to(device)
    ddp = DDP(model, device_ids=[0] if device.type == "cuda" else None, bucket_cap_mb=0.01)
    opts = dict(FAST.get(name, {"start_step": 2, "min_numel": 256}))
    state, hook = make_comm_hook(name, ddp, stats_every=1, fallback=False, **opts)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    compressed = False
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
        opt.step()
        st = state.stats.pop()
        compressed |= bool(st is not None and st.compressed and st.wire_bytes < st.raw_wire_bytes)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return {"weights": weights, "devices": sorted(set(seen)), "compressed": compressed}
