"""How much of the gradient ``gradiveq``'s coefficient quantization loses, per scale and rounding.

``N`` ranks are simulated in one process on real data (the tasks of ``bench codes``): each step
every rank computes its gradient on its own batch and the mean is applied by the task's
optimizer (dense training). On every step after ``--warmup``, for each layer ``gradiveq``
compresses, the leader (rank ``step % N``) fits the ``k`` principal directions ``U`` of its
slices, as the codec's default ``"leader"`` source does, and every rank's coefficients
``c_i = G_i U`` are quantized by the codec's own code with each choice of ``quant_scale`` and
``quant_rounding`` (the scale shared over the ranks, as ``prepare_bucket``'s all-reduce(MAX)
makes it). Reported, summed over the measured steps and layers, relative to the mean gradient
``m``:

* ``PCA``: ``||m - U U^T m||``, what ``k`` components leave out, the same for every row;
* ``quant``: ``||U (mean_i q_i - mean_i c_i)||``, what the quantization adds on top;
* ``per rank``: the same for each rank's own coefficients, relative to its own gradient.

One step's loss, without error feedback (which sends it later): what differs between the rows.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from lightning_gradcomp.bench import paths
from lightning_gradcomp.bench.codes import TASKS, _camvid_task, _cifar_task
from lightning_gradcomp.codecs.base import CodecContext
from lightning_gradcomp.codecs.gradiveq import QUANT_ROUNDINGS, QUANT_SCALES, _directions, _scaled_gram
from lightning_gradcomp.registry import make_codec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", choices=TASKS, default="camvid", help="ResNet-18 on CIFAR-10 or PSPNet on CamVid")
    p.add_argument("--data", default=None, help="the CIFAR-10 tarball or tree, or the CamVid directory")
    p.add_argument("--ranks", type=int, default=2, help="simulated ranks (default 2)")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default 32 for cifar10, 4 for camvid)")
    p.add_argument("--warmup", type=int, default=10, help="dense steps before measuring (default 10)")
    p.add_argument("--steps", type=int, default=10, help="measured steps (default 10)")
    p.add_argument("--quant-levels", type=int, default=7, help="s, as gradiveq's quant_levels (default 7)")
    p.add_argument("--num-components", type=int, default=4, help="k (gradiveq's default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="result directory (default docs/results/pcaquant)")


def main(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    batch = args.batch_size or (32 if args.task == "cifar10" else 4)
    make_task = _cifar_task if args.task == "cifar10" else _camvid_task
    model, batches, loss_fn, opt = make_task(args.data, batch, args.seed)
    n, k = args.ranks, args.num_components
    variants = [(scale, rounding) for scale in QUANT_SCALES for rounding in QUANT_ROUNDINGS]
    codecs = {}
    for scale, rounding in variants:
        codec = make_codec(
            "gradiveq", quant_levels=args.quant_levels, num_components=k, quant_scale=scale, quant_rounding=rounding
        )
        codec.setup(CodecContext(0, n, torch.device("cpu")))
        codecs[(scale, rounding)] = codec
    some = next(iter(codecs.values()))
    d, min_numel = some.options.slice_dim, some.harness.min_numel
    energy, pca = 0.0, 0.0
    quant = {v: 0.0 for v in variants}
    own = {v: [0.0, 0.0] for v in variants}  # (error, energy) of the ranks' own coefficients
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(args.warmup + args.steps):
        grads = []
        for _ in range(n):
            x, y = next(batches)
            model.zero_grad()
            loss_fn(model(x), y).backward()
            grads.append({name: p.grad.detach().reshape(-1).clone() for name, p in model.named_parameters()})
        for name, p in model.named_parameters():
            p.grad = (sum(g[name] for g in grads) / n).view_as(p)
        opt.step()
        if step < args.warmup:
            continue
        leader = step % n
        for name in grads[0]:
            if grads[0][name].numel() < max(min_numel, d):
                continue
            s = grads[0][name].numel() // d
            slices = [g[name][: s * d].view(s, d) for g in grads]
            u = _directions(torch.linalg.eigh(_scaled_gram(slices[leader]))[1], k)
            coefs = [g @ u for g in slices]
            mean, mean_c = sum(slices) / n, sum(coefs) / n
            energy += mean.pow(2).sum().item()
            pca += (mean - mean_c @ u.T).pow(2).sum().item()
            for v, codec in codecs.items():
                shared = torch.stack([codec._local_scale(c) for c in coefs]).amax(0)
                decoded = [
                    codec._dequantize(codec._quantize(c, shared, gen), c.numel(), 1, k).view_as(c) for c in coefs
                ]
                quant[v] += (sum(decoded) / n - mean_c).pow(2).sum().item()
                for c, q, g in zip(coefs, decoded, slices):
                    own[v][0] += (q - c).pow(2).sum().item()
                    own[v][1] += g.pow(2).sum().item()
    rows = []
    for v in variants:
        q, p_ = math.sqrt(quant[v] / energy), math.sqrt(pca / energy)
        rows.append(
            {
                "quant_scale": v[0],
                "quant_rounding": v[1],
                "pca_error": p_,
                "quant_error": q,
                "total_error": math.sqrt(p_**2 + q**2),  # U's span and its complement are orthogonal
                "per_rank_quant_error": math.sqrt(own[v][0] / own[v][1]),
            }
        )
    head = f"{'quant_scale':>11}  {'rounding':>10}  {'PCA':>5}  {'quant':>5}  {'total':>5}  {'per rank':>8}"
    print(f"{args.task}, {n} ranks, k={k}, s={args.quant_levels}, {args.steps} steps after {args.warmup} dense ones")
    print(head)
    for r in rows:
        print(
            f"{r['quant_scale']:>11}  {r['quant_rounding']:>10}  {r['pca_error']:5.3f}  {r['quant_error']:5.3f}  "
            f"{r['total_error']:5.3f}  {r['per_rank_quant_error']:8.3f}"
        )
    out = Path(args.out or paths.results_dir("pcaquant"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"pcaquant_{args.task}.json"
    path.write_text(json.dumps({"argv": args.argv, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0
