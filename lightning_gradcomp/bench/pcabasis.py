"""How much of the summed gradient a ``k``-dimensional slice basis captures, by where it comes from.

``N`` ranks are simulated in one process on real data (the tasks of ``bench codes``): each step
every rank computes its gradient on its own batch and the mean is applied by the task's optimizer
(dense training). On every step after ``--warmup``, for each layer ``gradiveq`` compresses, the
mean gradient ``m`` (cut into slices of ``d`` values, as the codec cuts it) is projected on bases
of ``k`` directions fitted on:

* ``leader``: the slices of one rank's own gradient (rank ``step % N``), the codec's default
  ``basis_source="leader"``;
* ``every rank``: the sum of every rank's ``d x d`` second moment, what an all-reduce of them would
  give each rank (the union of what the ranks see);
* ``the sum itself``: ``m``'s own slices, the best any ``k`` directions can do on this step;
* ``the previous sum``: the previous step's mean gradient, which every rank already holds after
  the last all-reduce, so no basis would have to travel.

Then, at the leader's basis and the same number of coefficients a step, two other cuts of each
layer: slices of ``2d`` values with ``2k`` directions, slices of ``d`` values taken across the
output channels (the weight seen as ``(rows, rest)`` and transposed), and, for comparison with
PowerSGD's shape, the rank-``r`` projection of the ``(rows, rest)`` matrix on the leader's ``r``
right singular vectors, ``r`` chosen so that ``r (rows + rest)`` is as many values. Reported,
summed over the measured steps and layers: the share of ``m``'s energy the basis captures (one
step, without error feedback), the values a step (coefficients or factors) and, apart, the values
that must travel for every rank to hold the basis (the leader's ``d k`` a layer; the upper
triangle of the ``d x d`` second moment a layer, all-reduced, for every rank's; none for the
previous sum, which every rank holds; the sum's own is an optimum that no rank can fit before
sending).

A basis fitted by another rank, or a step earlier, captures what the summed gradient's own does
when the ranks' slices share their principal directions: that is the redundancy between ranks the
summable code relies on.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import Tensor

from lightning_gradcomp.bench import paths
from lightning_gradcomp.bench.codes import add_task_arguments, make_task, rank_gradients, step_on_mean
from lightning_gradcomp.bench.results import Column, format_table, machine_info, write_json
from lightning_gradcomp.codecs.gradiveq import _directions, _scaled_gram
from lightning_gradcomp.registry import make_codec

COLUMNS = [
    Column("basis", "basis fitted on"),
    Column("cut", "slices"),
    Column("captured", "energy captured", "{:.3f}"),
    Column("values", "values a step", "{:,}"),
    Column("basis_values", "basis values a step", "{:,}"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_task_arguments(p, "cifar10")
    p.add_argument("--warmup", type=int, default=20, help="dense steps before measuring (default 20)")
    p.add_argument("--steps", type=int, default=10, help="measured steps (default 10)")
    p.add_argument("--num-components", type=int, default=4, help="k (gradiveq's default 4)")
    p.add_argument("--slice-dim", type=int, default=64, help="d (gradiveq's default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="result directory (default docs/results/pcabasis)")


def slices(x: Tensor, d: int) -> Tensor:
    """The first ``S d`` values of ``x`` as ``S`` rows of ``d``, as ``gradiveq`` cuts a layer."""
    s = x.numel() // d
    return x.reshape(-1)[: s * d].view(s, d)


def basis(gram: Tensor, k: int) -> Tensor:
    return _directions(torch.linalg.eigh(gram)[1], k)


def captured(x: Tensor, u: Tensor) -> float:
    """``||x u||^2``: the energy of ``x``'s rows in the span of ``u``'s orthonormal columns."""
    return (x.double() @ u.double()).pow(2).sum().item()


def right_singular(x: Tensor, r: int) -> Tensor:
    """The ``r`` leading right singular vectors of ``x`` (``rows x rest``, ``rows`` the smaller) as
    columns, from ``eigh`` of ``x x^T``: ``v_j = x^T u_j / sigma_j`` (an SVD of the wide matrix
    costs far more)."""
    x = x.double()
    lam, u = torch.linalg.eigh(x @ x.T)
    lam, u = lam[-r:], u[:, -r:]
    keep = lam > lam.max() * 1e-24  # directions of a zero singular value carry nothing
    return (x.T @ u[:, keep]) / lam[keep].sqrt()


def main(args: argparse.Namespace) -> int:
    if args.warmup < 1 or args.steps < 1:
        # the previous step's sum is one of the bases: the first measured step needs one before it
        raise SystemExit(f"--warmup and --steps must be >= 1, got {args.warmup} and {args.steps}")
    torch.manual_seed(args.seed)
    model, batches, loss_fn, opt = make_task(args.task, args.data, args.batch_size, args.seed)
    n, k = args.ranks, args.num_components
    codec = make_codec("gradiveq", num_components=k, slice_dim=args.slice_dim)
    d, min_numel = codec.options.slice_dim, codec.harness.min_numel
    shapes = {name: p.shape for name, p in model.named_parameters()}
    # each row, and what must travel a layer besides the values for every rank to hold its basis:
    # the leader's directions; the upper triangle of every rank's d x d second moment, all-reduced;
    # nothing for the previous sum (every rank holds it); the sum's own basis no rank can fit
    # before sending
    basis_cost = {
        ("leader", f"d={d}"): d * k,
        ("every rank", f"d={d}"): d * (d + 1) // 2,
        ("the sum itself", f"d={d}"): None,
        ("the previous sum", f"d={d}"): 0,
        ("leader", f"d={2 * d}, 2k"): 4 * d * k,
        ("leader", f"d={d} across output channels"): d * k,
        ("leader", "rank r of (rows, rest)"): 0,
    }
    got = dict.fromkeys(basis_cost, 0.0)
    values = dict.fromkeys(basis_cost, 0)

    def add(key: tuple[str, str], target: Tensor, fitted_on: Tensor, directions: int) -> None:
        """Project ``target``'s slices on the top ``directions`` of ``fitted_on``'s (same width)."""
        got[key] += captured(target, basis(_scaled_gram(fitted_on), directions))
        values[key] += target.shape[0] * directions

    layers = 0
    energy = 0.0
    previous: dict[str, Tensor] = {}
    for step in range(args.warmup + args.steps):
        grads = rank_gradients(model, batches, loss_fn, n)
        mean = step_on_mean(model, opt, grads)
        if step >= args.warmup:
            leader = grads[step % n]
            for name, m in mean.items():
                if m.numel() < max(min_numel, 2 * d) or name not in previous:
                    continue
                energy += m.double().pow(2).sum().item()
                layers += 1
                ms = slices(m, d)
                add(("leader", f"d={d}"), ms, slices(leader[name], d), k)
                # the rows of every rank's slices together: the sum of their second moments
                add(("every rank", f"d={d}"), ms, torch.cat([slices(g[name], d) for g in grads]), k)
                add(("the sum itself", f"d={d}"), ms, ms, k)
                add(("the previous sum", f"d={d}"), ms, slices(previous[name], d), k)
                add(("leader", f"d={2 * d}, 2k"), slices(m, 2 * d), slices(leader[name], 2 * d), 2 * k)
                rows = shapes[name][0] if len(shapes[name]) > 1 else 1
                across, lead_across = (t.view(rows, -1).T.contiguous() for t in (m, leader[name]))
                add(("leader", f"d={d} across output channels"), slices(across, d), slices(lead_across, d), k)
                mat = m.view(rows, -1)
                r = max(1, min(min(mat.shape), round(ms.shape[0] * k / sum(mat.shape))))
                key = ("leader", "rank r of (rows, rest)")
                got[key] += captured(mat, right_singular(leader[name].view(rows, -1), r))
                values[key] += r * sum(mat.shape)
        previous = mean
    per_step = args.steps
    per_layer = layers // per_step
    rows = [
        {
            "basis": b,
            "cut": c,
            "captured": got[(b, c)] / energy,
            "values": values[(b, c)] // per_step,
            "basis_values": None if basis_cost[(b, c)] is None else basis_cost[(b, c)] * per_layer,
        }
        for b, c in basis_cost
    ]
    print(f"{args.task}, {n} ranks, d={d}, k={k}, {args.steps} steps after {args.warmup} dense ones")
    print(format_table(rows, COLUMNS))
    path = write_json(
        Path(args.out or paths.results_dir("pcabasis")) / f"pcabasis_{args.task}_d{d}_k{k}.json",
        {
            "command": "python -m lightning_gradcomp.bench " + " ".join(args.argv),
            "machine": machine_info(),
            "rows": rows,
        },
    )
    print(f"wrote {path}")
    return 0
