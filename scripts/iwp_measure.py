"""Measure the ``iwp`` codec on ResNet-18 (CIFAR shape) gradients.

    python scripts/iwp_measure.py codec            # one process: bytes with indices, encode/decode ms
    python scripts/iwp_measure.py wire --ranks 2 4 # real gloo ranks: bytes on the wire, iwp vs topk

``codec`` takes one real gradient (random images, batch 32) of torchvision's resnet18(num_classes=10)
with conv1 3x3 stride 1 and no max-pool, groups its layers the way DDP does (reverse order, 25 MB
buckets, the first one 1 MB) and times what a rank does per step on one thread. ``wire`` runs a few
DDP steps on N local gloo ranks and compares the bytes the hook counted with the formulas of
``lightning_gradcomp.comm.wire_bytes``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_gradcomp.codecs.iwp import (
    choose_encoding,
    decode_positions,
    encode_positions,
    importance,
    select_top,
)
from lightning_gradcomp.comm import wire_bytes
from lightning_gradcomp.registry import make_codec


def resnet18_cifar() -> torch.nn.Module:
    import torchvision

    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = torch.nn.Identity()
    return m


def ddp_like_buckets(model: torch.nn.Module, cap_mb: float = 25.0, first_mb: float = 1.0) -> list[list[str]]:
    buckets, cur, size, cap = [], [], 0, first_mb * 2**20
    for name, p in reversed(list(model.named_parameters())):
        cur.append(name)
        size += p.numel() * 4
        if size >= cap:
            buckets.append(cur)
            cur, size, cap = [], 0, cap_mb * 2**20
    return buckets + ([cur] if cur else [])


def _ms(fn, reps: int) -> tuple[float, object]:
    fn()
    times, out = [], None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times), out


def codec_main(keep_fraction: float, reps: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = resnet18_cifar()
    loss = torch.nn.functional.cross_entropy(model(torch.randn(32, 3, 32, 32)), torch.randint(10, (32,)))
    loss.backward()
    codec = make_codec("iwp", keep_fraction=keep_fraction)
    params = dict(model.named_parameters())
    n_all = sum(p.numel() for p in params.values())
    rows, t_root, t_other, t_enc, t_dec, idx_bytes, vals, dense = [], 0.0, 0.0, 0.0, 0.0, 0, 0, 0
    gen = torch.Generator().manual_seed(0)
    for names in ddp_like_buckets(model):
        layers = [(n, params[n].grad.reshape(-1).clone(), params[n]) for n in names]
        comp = [(n, x, p) for n, x, p in layers if codec.should_compress(n, p)]
        dense += sum(x.numel() for n, x, p in layers if not codec.should_compress(n, p))
        if not comp:
            continue
        n = sum(x.numel() for _, x, _ in comp)
        k = codec.k_for(n)
        enc = choose_encoding(codec.index_encoding, k, n)
        s = torch.empty(n)

        def select():
            off = 0
            for _, x, p in comp:
                importance(x, p, codec.eps, out=s[off : off + x.numel()])
                off += x.numel()
            return select_top(s, k, codec.sample_fraction, gen)

        ms_sel, pos = _ms(select, reps)
        ms_code, code = _ms(lambda: encode_positions(pos, n, enc), reps)
        ms_uncode, _ = _ms(lambda: decode_positions(code, k, n, enc), reps)
        codec.prepare_bucket(comp, step=2)  # world size 1: plans the layers from this rank's choice
        plans = {key: codec._plan[key] for key, _, _ in comp}

        def encode_all():
            out = []
            for key, x, p in comp:
                codec._plan[key] = plans[key]
                out.append(codec.encode(x, key, p, 2))
            return out

        ms_e, encs = _ms(encode_all, reps)
        ms_d, _ = _ms(lambda: [codec.decode(e.payload, e.ctx, x.numel(), 2) for e, (_, x, _) in zip(encs, comp)], reps)
        t_root += ms_sel + ms_code
        t_other += ms_uncode
        t_enc += ms_e
        t_dec += ms_d
        idx_bytes += code.numel()
        vals += k
        rows.append(
            {
                "layers": len(comp),
                "n": n,
                "k": k,
                "encoding": enc,
                "index_bytes": code.numel(),
                "select_ms": round(ms_sel, 1),
                "code_ms": round(ms_code, 1),
                "uncode_ms": round(ms_uncode, 1),
                "encode_ms": round(ms_e, 1),
                "decode_ms": round(ms_d, 1),
            }
        )
    print(json.dumps(rows, indent=1))
    print(
        f"parameters {n_all:,}, compressed {n_all - dense:,}, dense {dense:,}; kept values {vals:,}; "
        f"index bytes {idx_bytes:,} ({8 * idx_bytes / vals:.2f} bits a position)"
    )
    for world in (2, 4, 8, 64):
        raw = wire_bytes("allreduce", 4 * n_all, world)
        iwp = wire_bytes("allreduce", 4 * (vals + dense), world) + wire_bytes("broadcast", idx_bytes, world)
        topk = wire_bytes("allgather", 8 * vals + 4 * dense, world)  # small layers ride in its all-gather
        print(
            f"N={world:>3}: iwp {iwp / 1e6:.3f} MB/rank (ratio {raw / iwp:.1f}x, values only "
            f"{raw / wire_bytes('allreduce', 4 * (vals + dense), world):.1f}x); topk {topk / 1e6:.3f} MB "
            f"(ratio {raw / topk:.1f}x); dense {raw / 1e6:.2f} MB"
        )
    print(
        f"per step, ms (median of {reps}, one thread): root selection + index code {t_root:.1f}; "
        f"index decode on other ranks {t_other:.1f}; encode (all ranks) {t_enc:.1f}; decode {t_dec:.1f}"
    )


# --------------------------------------------------------------------------------------------------
def _wire_worker(rank: int, world: int, port: int, outdir: str, codecs: list, batch: int, steps: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gradcomp.api import make_comm_hook

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {}
        for name, opts in codecs:
            torch.manual_seed(0)
            model = resnet18_cifar()
            ddp = DDP(model)
            state, hook = make_comm_hook(name, ddp, **opts)
            ddp.register_comm_hook(state, hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
            gen = torch.Generator().manual_seed(rank)
            per_step = []
            for _ in range(steps):
                opt.zero_grad()
                x = torch.randn(batch, 3, 32, 32, generator=gen)
                torch.nn.functional.cross_entropy(ddp(x), torch.randint(10, (batch,), generator=gen)).backward()
                opt.step()
                s = state.stats.pop()
                per_step.append(
                    {
                        "compressed": s.compressed,
                        "payload_bytes": s.payload_bytes,
                        "wire_bytes": s.wire_bytes,
                        "raw_wire_bytes": s.raw_wire_bytes,
                        "ratio": s.compression_ratio,
                        "encode_ms": 1e3 * s.encode_s,
                        "decode_ms": 1e3 * s.decode_s,
                    }
                )
            result[name] = per_step
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def wire_main(ranks: list[int], keep_fraction: float, batch: int, steps: int) -> None:
    from tests.dist_utils import free_port

    codecs = [("iwp", {"keep_fraction": keep_fraction}), ("topk", {"ratio": keep_fraction})]
    for world in ranks:
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_wire_worker, args=(world, free_port(), d, codecs, batch, steps), nprocs=world)
            res = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]
        for name, _ in codecs:
            last = res[0][name][-1]
            same = all(r[name][-1]["wire_bytes"] == last["wire_bytes"] for r in res)
            print(
                f"N={world} {name:>4}: wire {last['wire_bytes'] / 1e6:.4f} MB/rank, payload "
                f"{last['payload_bytes'] / 1e6:.4f} MB, ratio {last['ratio']:.1f}x, equal on all ranks: {same}, "
                f"encode {last['encode_ms']:.0f} ms, decode {last['decode_ms']:.0f} ms (loaded machine)"
            )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["codec", "wire"])
    ap.add_argument("--keep-fraction", type=float, default=1 / 64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    if a.what == "codec":
        codec_main(a.keep_fraction, a.reps)
    else:
        wire_main(a.ranks, a.keep_fraction, a.batch, a.steps)
