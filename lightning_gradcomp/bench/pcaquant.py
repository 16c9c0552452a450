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
import math
from pathlib import Path

import torch

from lightning_gradcomp.bench import paths
from lightning_gradcomp.bench.codes import add_task_arguments, make_task, rank_gradients, step_on_mean
from lightning_gradcomp.bench.results import Column, format_table, machine_info, write_json
from lightning_gradcomp.codecs.base import CodecContext
from lightning_gradcomp.codecs.gradiveq import QUANT_ROUNDINGS, QUANT_SCALES, _directions, _scaled_gram
from lightning_gradcomp.registry import make_codec

COLUMNS = [
    Column("quant_scale", "quant_scale"),
    Column("quant_rounding", "rounding"),
    Column("pca_error", "PCA", "{:.3f}"),
    Column("quant_error", "quant", "{:.3f}"),
    Column("total_error", "total", "{:.3f}"),
    Column("per_rank_quant_error", "per rank", "{:.3f}"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_task_arguments(p, "camvid")
    p.add_argument("--warmup", type=int, default=10, help="dense steps before measuring (default 10)")
    p.add_argument("--steps", type=int, default=10, help="measured steps (default 10)")
    p.add_argument("--quant-levels", type=int, default=7, help="s, as gradiveq's quant_levels (default 7)")
    p.add_argument("--num-components", type=int, default=4, help="k (gradiveq's default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="result directory (default docs/results/pcaquant)")


def main(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    model, batches, loss_fn, opt = make_task(args.task, args.data, args.batch_size, args.seed)
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
    energy, rank_energy, pca = 0.0, 0.0, 0.0  # of the mean gradient, of the ranks' own, left out by U
    quant = {v: 0.0 for v in variants}
    own = {v: 0.0 for v in variants}  # the ranks' own coefficients' error
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(args.warmup + args.steps):
        grads = rank_gradients(model, batches, loss_fn, n)
        step_on_mean(model, opt, grads)
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
            rank_energy += sum(g.pow(2).sum().item() for g in slices)
            pca += (mean - mean_c @ u.T).pow(2).sum().item()
            for v, codec in codecs.items():
                shared = torch.stack([codec._local_scale(c) for c in coefs]).amax(0)
                decoded = [
                    codec._from_level_sums(codec._quantize(c, shared, gen)[: c.numel()], shared, 1).view_as(c)
                    for c in coefs
                ]
                quant[v] += (sum(decoded) / n - mean_c).pow(2).sum().item()
                own[v] += sum((q - c).pow(2).sum().item() for c, q in zip(coefs, decoded))
    rows = []
    pca_error = math.sqrt(pca / energy)  # U is the same for every variant
    for v in variants:
        q = math.sqrt(quant[v] / energy)
        rows.append(
            {
                "quant_scale": v[0],
                "quant_rounding": v[1],
                "pca_error": pca_error,
                "quant_error": q,
                "total_error": math.sqrt(pca_error**2 + q**2),  # U's span and its complement are orthogonal
                "per_rank_quant_error": math.sqrt(own[v] / rank_energy),
            }
        )
    print(f"{args.task}, {n} ranks, k={k}, s={args.quant_levels}, {args.steps} steps after {args.warmup} dense ones")
    print(format_table(rows, COLUMNS))
    path = write_json(
        Path(args.out or paths.results_dir("pcaquant")) / f"pcaquant_{args.task}.json",
        {
            "command": "python -m lightning_gradcomp.bench " + " ".join(args.argv),
            "machine": machine_info(),
            "rows": rows,
        },
    )
    print(f"wrote {path}")
    return 0
