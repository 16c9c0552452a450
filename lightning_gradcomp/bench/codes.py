"""What a code of ``lgc``'s shared-support values carries, learned or not, at equal bytes.

``N`` ranks are simulated in one process on real data: each step every rank computes its gradient
on its own batch. After ``--warmup`` dense steps the run goes on as ``lgc``'s stage 2 does: a
leader (rank ``step % N``) takes each compressed layer's top ``ratio`` positions ``S`` of its
compensated gradient, every rank's values ``v_i = x_i[S]`` are averaged exactly, and what is off
``S`` stays in each rank's residual. The values of ``--collect`` such steps are kept. The last
eighth of them are held out; every code that learns fits on the rest (as ``lgc`` does at its
switch) and every code is scored on the held-out steps:

* the relative error of the decoded mean, ``sqrt(sum ||m_hat - m||^2 / sum ||m||^2)`` with
  ``m = mean_i v_i`` over the held-out steps and layers;
* each rank's error, ``sqrt(sum ||v_hat_i - v_i||^2 / sum ||v_i||^2)``, where a code has a
  per-rank reconstruction;
* bytes per support value, the mean over ranks of what each rank sends for the values (the
  positions of ``S`` are the same for every code and are left out).

All values are in units of the leader's RMS on ``S`` per layer and step, the scale ``lgc``'s
autoencoder (AE) sees, so every layer weighs by its number of values. The codes: the AE per layer
(``lgc``'s ``rar`` and ``ps`` variants, trained by the codec's own code), one AE over the whole
model's concatenated values (the layout of the paper's public re-implementation), latents rounded
to 8 bits, the range-based float at 8 and 4 bits, a scaled sign (1 bit), and the leader's values
alone, scaled by a factor fitted on the training steps (what the other ranks would add if their
values were redundant).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_gradcomp.bench import paths
from lightning_gradcomp.bench.results import Column, format_table, machine_info, write_json

TASKS = ("cifar10", "camvid")


DEFAULT_BATCH = {"cifar10": 32, "camvid": 4}  # per rank


def add_task_arguments(p: argparse.ArgumentParser, task: str) -> None:
    """The task, its data and the simulated ranks: what every verb on :func:`make_task` takes."""
    p.add_argument("--task", choices=TASKS, default=task, help="ResNet-18 on CIFAR-10 or PSPNet on CamVid")
    p.add_argument("--data", default=None, help="the CIFAR-10 tarball or tree, or the CamVid directory")
    p.add_argument("--ranks", type=int, default=2, help="simulated ranks (default 2)")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default 32 for cifar10, 4 for camvid)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_task_arguments(p, "cifar10")
    p.add_argument("--warmup", type=int, default=20, help="dense steps before collecting (default 20)")
    p.add_argument("--collect", type=int, default=80, help="stage-2 steps whose values are kept (default 80)")
    p.add_argument("--ratio", type=float, default=1e-2, help="support fraction per layer (lgc's default 1e-2)")
    p.add_argument("--ae-epochs", type=int, default=3, help="AE passes over the samples (lgc's default 3)")
    p.add_argument("--ae-budget-s", type=float, default=60.0, help="cap on each AE's training, seconds")
    p.add_argument(
        "--light",
        type=int,
        default=0,
        help="of the collected steps, the first LIGHT run the level controller's ten times denser support; the "
        "learned codes then fit on those (cut to the leader's top `ratio`, as lgc cuts them) and are scored on the "
        "last eighth of the steps at `ratio` (default 0: every step at `ratio`)",
    )
    p.add_argument("--no-autoencoders", action="store_true", help="leave out the autoencoder rows (minutes each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="result directory (default docs/results/codes)")


# --------------------------------------------------------------------------------------------------
# capture: N simulated ranks, dense warm-up, then lgc's stage 2 with exact sums
@dataclass
class Capture:
    numels: dict[str, int]
    steps: list[dict[str, Tensor]] = field(default_factory=list)  # per step: layer -> (N, K) values
    leaders: list[int] = field(default_factory=list)
    seconds: float = 0.0
    # per step: layer -> the support's sorted positions (the configured one), for position_bits
    supports: list[dict[str, Tensor]] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


def _cifar_task(data: str | None, batch: int, seed: int) -> tuple[nn.Module, Iterator, Callable, torch.optim.Optimizer]:
    from lightning_gradcomp import zoo
    from lightning_gradcomp.bench.data import load_cifar10

    path = Path(data or (paths.checkout() or Path(".")).parent / "shared" / "data" / "cifar10-jpeg.tar.gz")
    x_all, y_all = load_cifar10(path, every=5)  # 10,000 training images
    g = torch.Generator().manual_seed(seed)

    def draw() -> Iterator[tuple[Tensor, Tensor]]:
        while True:
            idx = torch.randint(0, len(y_all), (batch,), generator=g)
            yield x_all[idx], y_all[idx]

    model = zoo.cifar_resnet(18)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    return model, draw(), F.cross_entropy, opt


def _camvid_task(
    data: str | None, batch: int, seed: int
) -> tuple[nn.Module, Iterator, Callable, torch.optim.Optimizer]:
    spec = importlib.util.spec_from_file_location("pspnet_camvid", paths.recipes_dir() / "pspnet_camvid.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    # the recipe's crops, scales and flips draw from Python's random, which the recipe seeds through
    # seed_everything and torch.manual_seed does not: seeded here, a run repeats its batches
    random.seed(seed)
    dataset = recipe.CamVid(recipe.find_data_dir(data), "train", crop=256, scale=(0.75, 1.25))
    loader = torch.utils.data.DataLoader(
        dataset, batch, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed)
    )

    def draw() -> Iterator[tuple[Tensor, Tensor]]:
        while True:
            yield from loader

    model = recipe.pspnet("resnet18", len(recipe.CLASSES), None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    return model, draw(), lambda out, y: F.cross_entropy(out, y, ignore_index=recipe.VOID), opt


def make_task(
    task: str, data: str | None, batch: int | None, seed: int
) -> tuple[nn.Module, Iterator, Callable, torch.optim.Optimizer]:
    """The model, an endless iterator of real batches, the loss and the optimizer of ``task``;
    ``batch`` per rank, None for the task's default."""
    batch = batch or DEFAULT_BATCH[task]
    return (_cifar_task if task == "cifar10" else _camvid_task)(data, batch, seed)


def rank_gradients(model: nn.Module, batches: Iterator, loss_fn: Callable, ranks: int) -> list[dict[str, Tensor]]:
    """One step of ``ranks`` simulated ranks: each one's flat gradient of every trainable
    parameter, on its own next batch (the model's ``.grad`` holds the last rank's afterwards)."""
    grads = []
    for _ in range(ranks):
        x, y = next(batches)
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        grads.append({n: p.grad.detach().flatten().clone() for n, p in model.named_parameters() if p.requires_grad})
    return grads


def step_on_mean(model: nn.Module, opt: torch.optim.Optimizer, grads: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Dense training: set every parameter's ``.grad`` to the ranks' mean gradient and step the
    optimizer; returns the mean, flat, by parameter name."""
    mean = {name: sum(g[name] for g in grads) / len(grads) for name in grads[0]}
    for name, p in model.named_parameters():
        if name in mean:
            p.grad = mean[name].view_as(p)
    opt.step()
    return mean


def capture(
    task: str,
    data: str | None,
    ranks: int,
    batch: int | None,
    warmup: int,
    collect: int,
    ratio: float,
    seed: int,
    light: int = 0,
) -> Capture:
    """Train ``warmup`` dense steps and ``collect`` stage-2 steps; keep the stage-2 values. The
    first ``light`` of those steps run a ten times denser support (the level controller's light
    setting, ``min(10 ratio, 0.25)``); their values are kept cut to the leader's top ``ratio``, as
    ``lgc`` cuts them for its levels."""
    from lightning_gradcomp.codecs.lgc import MIN_AE_LEN
    from lightning_gradcomp.codecs.sampling import keep_count
    from lightning_gradcomp.registry import make_codec

    torch.manual_seed(seed)
    model, batches, loss_fn, opt = make_task(task, data, batch, seed)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    policy = make_codec("lgc")  # lgc's own layer policy: the stem and the classifier stay dense
    policy.plan_layers(named)
    compressed = [n for n, p in named if policy.should_compress(n, p) and keep_count(ratio, p.numel()) >= MIN_AE_LEN]
    cap = Capture({n: p.numel() for n, p in named if n in compressed})
    cap.shapes = {n: tuple(p.shape) for n, p in named if n in compressed}
    residual = [{n: torch.zeros(cap.numels[n]) for n in compressed} for _ in range(ranks)]
    t0 = time.perf_counter()
    model.train()
    for step in range(warmup + collect):
        grads = rank_gradients(model, batches, loss_fn, ranks)
        kept: dict[str, Tensor] = {}
        supports: dict[str, Tensor] = {}
        leader = step % ranks
        fraction = min(10 * ratio, 0.25) if warmup <= step < warmup + light else ratio
        for n, p in named:
            if step < warmup or n not in compressed:
                mean = torch.stack([g[n] for g in grads]).mean(0)
            else:
                xs = [g[n] + residual[r][n] for r, g in enumerate(grads)]
                k = keep_count(ratio, cap.numels[n])
                support = xs[leader].abs().topk(keep_count(fraction, cap.numels[n]), sorted=False).indices.sort().values
                values = torch.stack([x[support] for x in xs])
                for r, x in enumerate(xs):
                    x[support] = 0.0
                    residual[r][n] = x
                mean = torch.zeros(cap.numels[n])
                mean[support] = values.mean(0)
                if values.shape[1] > k:  # a light step: kept as lgc keeps it, cut to the configured support
                    cut = values[leader].abs().topk(k, sorted=False).indices.sort().values
                    values, support = values[:, cut], support[cut]
                kept[n] = values
                supports[n] = support
            p.grad = mean.view_as(p)
        opt.step()
        if kept:
            cap.steps.append(kept)
            cap.leaders.append(leader)
            cap.supports.append(supports)
    cap.seconds = time.perf_counter() - t0
    return cap


# --------------------------------------------------------------------------------------------------
# the positions: what the shared support's positions cost, as sent and at three lower bounds
def _log2_binomial(n: int, k: int) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def position_bits(supports: list[dict[str, Tensor]], shapes: dict[str, tuple[int, ...]]) -> dict[str, float]:
    """Bits a position of the shared support, over ``supports`` (per step: layer -> sorted positions
    in the flattened parameter of shape ``shapes[layer]``):

    - ``elias_fano``: what ``lgc`` sends (:func:`~lightning_gradcomp.codecs.positions.encoded_nbytes`);
    - ``uniform``: ``log2 C(n, k)``, the least any code needs if every ``k``-subset were as likely;
    - ``per_channel``: each output channel's count (``log2(n_c + 1)`` bits each) and then its subset,
      ``sum_c log2 C(n_c, k_c)``: what a code gains from the support's crowding into a few channels;
    - ``vs_previous``: the previous step's support as side information: which of its positions
      stay (a mask at its binary entropy) and the new ones among the rest;
    - ``per_channel_ef``: a code one could send: the counts as above, then an Elias-Fano code of
      each channel's positions.

    ``uniform``, ``per_channel`` and ``vs_previous`` are enumerative bounds (an arithmetic code
    comes within a few bits of each)."""
    from lightning_gradcomp.codecs.positions import channel_counts, encoded_nbytes

    total = {"elias_fano": 0.0, "uniform": 0.0, "per_channel": 0.0, "vs_previous": 0.0, "per_channel_ef": 0.0}
    count = 0
    previous: dict[str, Tensor] = {}
    for step in supports:
        for key, pos in step.items():
            shape = shapes[key]
            n, k = math.prod(shape), pos.numel()
            count += k
            total["elias_fano"] += 8 * encoded_nbytes("delta", k, n)
            total["uniform"] += _log2_binomial(n, k)
            channels, per = shape[0], n // shape[0]
            counts = channel_counts(pos, channels, per).tolist()
            count_bits = channels * math.log2(per + 1)
            total["per_channel"] += count_bits + sum(_log2_binomial(per, c) for c in counts)
            total["per_channel_ef"] += count_bits + sum(8 * encoded_nbytes("delta", c, per) for c in counts if c)
            before = previous.get(key)
            if before is None:
                total["vs_previous"] += _log2_binomial(n, k)
            else:
                stay = int(torch.isin(pos, before).sum())
                q = stay / before.numel()
                mask = 0.0 if q in (0.0, 1.0) else -(q * math.log2(q) + (1 - q) * math.log2(1 - q))
                total["vs_previous"] += before.numel() * mask + _log2_binomial(n - before.numel(), k - stay)
            previous[key] = pos
    return {name: bits / max(count, 1) for name, bits in total.items()}


# --------------------------------------------------------------------------------------------------
# the codes: each maps held-out (N, K) values to (mean estimate, per-rank estimates or None, bytes/value)
Code = Callable[[Tensor, int, str], tuple[Tensor, Tensor | None, float]]


def _normalized(cap: Capture) -> list[dict[str, Tensor]]:
    out = []
    for kept, leader in zip(cap.steps, cap.leaders):
        out.append({k: v / v[leader].pow(2).mean().sqrt().clamp_min(1e-30) for k, v in kept.items()})
    return out


def _fit_lgc(train: list, held: list, leaders: list[int], variant: str, width: int, args: argparse.Namespace):
    """An lgc codec whose AE the codec's own training code fitted on ``train`` (+ ``held``, which
    its split holds out: the last eighth of the steps)."""
    from lightning_gradcomp.registry import make_codec

    codec = make_codec(
        "lgc", variant=variant, ae_width=width, ae_epochs=args.ae_epochs, ae_time_budget_s=args.ae_budget_s,
        ae_samples=10**6, seed=args.seed,
    )  # fmt: skip
    samples = []
    for step, (kept, lead) in enumerate(zip(train + held, leaders)):
        samples.extend((key, step, lead, v.shape[1] * 100, v) for key, v in kept.items())
    codec._samples = samples
    t0 = time.perf_counter()
    loss, _ = codec._fit()  # the codec's own training, on these samples
    return codec, time.perf_counter() - t0, loss


def _quantize8(z: Tensor) -> Tensor:
    """Round to 256 levels between the vector's min and max (8 bits a latent value)."""
    lo, hi = z.min(), z.max()
    scale = (hi - lo).clamp_min(1e-30) / 255
    return torch.round((z - lo) / scale) * scale + lo


def _ae_codes(codec, quantize_latent: bool) -> Code:
    ae, c = codec.ae, codec.ae.latent_channels

    @torch.no_grad()
    def code(v: Tensor, leader: int, key: str) -> tuple[Tensor, Tensor | None, float]:
        n, k = v.shape
        L = type(ae).latent_len(k)
        q = _quantize8 if quantize_latent else (lambda t: t)
        latent_bytes = c * L * (1 if quantize_latent else 4)
        z = torch.stack([q(zi) for zi in ae.encode(v)])  # (N, c, L)
        if codec.options.variant == "rar":
            return ae.decode(z.mean(0, keepdim=True), k)[0], ae.decode(z, k), latent_bytes / k
        pos, u = codec._innovation(v, 100 * k)
        per_rank = ae.decode(z[leader : leader + 1].expand(n, -1, -1), k, u)
        ki = pos.shape[1]
        return per_rank.mean(0), per_rank, (latent_bytes + n * 8 * ki) / (n * k)

    return code


def _rangefloat(bits: int) -> Code:
    from lightning_gradcomp.codecs.rangefloat import RangeFloat

    fmt = RangeFloat(bits)

    def code(v: Tensor, leader: int, key: str) -> tuple[Tensor, Tensor | None, float]:
        per_rank = torch.stack([fmt.decode(fmt.encode(x), x.numel()) for x in v])
        return per_rank.mean(0), per_rank, (fmt.nbytes(v.shape[1]) + 8) / v.shape[1]

    return code


def _scaled_sign(v: Tensor, leader: int, key: str) -> tuple[Tensor, Tensor | None, float]:
    per_rank = v.sign() * v.abs().mean(1, keepdim=True)
    return per_rank.mean(0), per_rank, (math.ceil(v.shape[1] / 8) + 4) / v.shape[1]


def _uniform_magnitude(bits: int) -> Code:
    """Sign and ``bits - 1`` bits of magnitude, levels spread evenly between the message's smallest
    and largest ``|v|`` (two fp32 in the header)."""

    def code(v: Tensor, leader: int, key: str) -> tuple[Tensor, Tensor | None, float]:
        a = v.abs()
        lo, hi = a.min(1, keepdim=True).values, a.max(1, keepdim=True).values
        step = (hi - lo).clamp_min(1e-30) / (2 ** (bits - 1) - 1)
        per_rank = v.sign() * (torch.round((a - lo) / step) * step + lo)
        return per_rank.mean(0), per_rank, (math.ceil(v.shape[1] * bits / 8) + 8) / v.shape[1]

    return code


def _learned_levels(bits: int, train: list[dict[str, Tensor]]) -> Code:
    """Sign and ``bits - 1`` bits of magnitude, on levels fitted by Lloyd-Max to each layer's
    training values in units of each rank's RMS (one fp32 per message)."""
    from lightning_gradcomp.codecs import levels as lv

    fitted = {
        key: lv.fit_levels(torch.cat([lv.relative_magnitudes(s[key]) for s in train]), 2 ** (bits - 1))
        for key in train[0]
    }

    def code(v: Tensor, leader: int, key: str) -> tuple[Tensor, Tensor | None, float]:
        per_rank = torch.stack([lv.dequantize(*lv.quantize(x, fitted[key]), fitted[key]) for x in v])
        return per_rank.mean(0), per_rank, (math.ceil(v.shape[1] * bits / 8) + 4) / v.shape[1]

    return code


def _learned_levels_by_role(bits: int, train: list[dict[str, Tensor]], leaders: list[int]) -> Code:
    """``lgc``'s code: as :func:`_learned_levels`, with one set of levels for the leader's message
    (its own top-k values, all large) and one for the other ranks' (their values at the leader's
    positions, small ones among them), fitted by the codec's own ``levels.fit_roles``: every rank
    knows which it sends, so no byte more travels."""
    from lightning_gradcomp.codecs import levels as lv

    keys = list(train[0])
    samples = [(key, step, lead, 0, v) for step, (s, lead) in enumerate(zip(train, leaders)) for key, v in s.items()]
    fitted = torch.ones(len(keys), 2, 2 ** (bits - 1))
    lv.fit_roles(samples, keys, fitted)
    table = dict(zip(keys, fitted))

    def code(v: Tensor, leader: int, key: str) -> tuple[Tensor, Tensor | None, float]:
        rows = [table[key][lv.role(r, leader)] for r in range(v.shape[0])]
        per_rank = torch.stack([lv.dequantize(*lv.quantize(x, t), t) for x, t in zip(v, rows)])
        return per_rank.mean(0), per_rank, (math.ceil(v.shape[1] * bits / 8) + 4) / v.shape[1]

    return code


def _leader_scaled(train: list[dict[str, Tensor]], leaders: list[int]) -> Code:
    """``m ~ a v_lead`` with ``a`` the least-squares factor of each layer on the training steps."""
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    for kept, lead in zip(train, leaders):
        for key, v in kept.items():
            num[key] = num.get(key, 0.0) + float(v.mean(0) @ v[lead])
            den[key] = den.get(key, 0.0) + float(v[lead] @ v[lead])

    def code(v: Tensor, leader: int, key: str) -> tuple[Tensor, Tensor | None, float]:
        a = num[key] / max(den[key], 1e-30)
        return a * v[leader], None, 4.0 / v.shape[0]

    return code


def _whole_model(code: Code, keys: list[str]) -> Callable[[dict[str, Tensor], int], dict[str, tuple]]:
    """Apply a code to the concatenation of every layer's values, and split its output again."""

    def run(kept: dict[str, Tensor], leader: int) -> dict[str, tuple]:
        v = torch.cat([kept[k] for k in keys], dim=1)
        mean, per_rank, nbytes = code(v, leader, "__model__")
        sizes = [kept[k].shape[1] for k in keys]
        means = mean.split(sizes)
        ranks = per_rank.split(sizes, dim=1) if per_rank is not None else [None] * len(keys)
        return {k: (m, r, nbytes) for k, m, r in zip(keys, means, ranks)}

    return run


def score(held: list[dict[str, Tensor]], leaders: list[int], run: Callable) -> dict[str, float]:
    """Relative error of the mean and per rank, bytes per value and the inter-rank cosine."""
    err = ref = rank_err = rank_ref = nbytes = count = 0.0
    has_rank = True
    for kept, lead in zip(held, leaders):
        out = run(kept, lead)
        for key, v in kept.items():
            m_hat, v_hat, b = out[key]
            m = v.mean(0)
            err += float((m_hat - m).pow(2).sum())
            ref += float(m.pow(2).sum())
            if v_hat is None:
                has_rank = False
            else:
                rank_err += float((v_hat - v).pow(2).sum())
                rank_ref += float(v.pow(2).sum())
            nbytes += b * v.shape[1]
            count += v.shape[1]
    return {
        "mean_error": math.sqrt(err / ref),
        "rank_error": math.sqrt(rank_err / rank_ref) if has_rank else float("nan"),
        "bytes_per_value": nbytes / count,
    }


def _per_layer(code: Code) -> Callable:
    return lambda kept, lead: {k: code(v, lead, k) for k, v in kept.items()}


def inter_rank_cosine(held: list[dict[str, Tensor]]) -> float:
    """Mean over steps, layers and pairs of ranks of the cosine between two ranks' values on ``S``."""
    total, n = 0.0, 0
    for kept in held:
        for v in kept.values():
            u = F.normalize(v, dim=1)
            c = u @ u.T
            r = v.shape[0]
            total += float((c.sum() - c.diagonal().sum()) / max(r * (r - 1), 1))
            n += 1
    return total / max(n, 1)


def main(args: argparse.Namespace) -> int:
    cap = capture(
        args.task, args.data, args.ranks, args.batch_size, args.warmup, args.collect, args.ratio, args.seed, args.light
    )
    steps = _normalized(cap)
    n_held = max(1, len(steps) // 8)
    n_train = args.light if args.light else len(steps) - n_held  # under the controller: fitted on the light steps
    train, held = steps[:n_train], steps[-n_held:]
    lead_train, lead_held = cap.leaders[:n_train], cap.leaders[-n_held:]
    keys = list(cap.numels)
    print(
        f"{args.task}: {len(keys)} layers compressed, "
        f"{sum(v.shape[1] for v in steps[0].values())} support values a step, "
        f"{len(train)} training and {len(held)} held-out steps of {args.ranks} ranks (capture {cap.seconds:.0f} s)",
        flush=True,
    )
    rows = []

    def add(name: str, run: Callable, fit_s: float = 0.0) -> None:
        r = {"code": name, **score(held, lead_held, run), "fit_s": fit_s}
        r["ratio_vs_fp32"] = 4.0 / r["bytes_per_value"]
        rows.append(r)
        print(f"  {name}: mean error {r['mean_error']:.3f}, rank error {r['rank_error']:.3f}, "
              f"{r['bytes_per_value']:.3f} B/value", flush=True)  # fmt: skip

    add("fp32 values (stage 2)", _per_layer(lambda v, lead, k: (v.mean(0), v, 4.0)))
    for variant in () if args.no_autoencoders else ("rar", "ps"):
        codec, fit_s, _ = _fit_lgc(train, held, lead_train + lead_held, variant, 16, args)
        add(f"AE per layer, {variant} (lgc today)", _per_layer(_ae_codes(codec, False)), fit_s)
        add(f"AE per layer, {variant}, 8-bit latent", _per_layer(_ae_codes(codec, True)), fit_s)
    if not args.no_autoencoders:  # one AE over the whole model's values (width 64 as the re-implementation)
        cat = lambda ss: [{"__model__": torch.cat([s[k] for k in keys], dim=1)} for s in ss]  # noqa: E731
        codec, fit_s, _ = _fit_lgc(cat(train), cat(held), lead_train + lead_held, "rar", 64, args)
        add("AE whole model, rar, width 64", _whole_model(_ae_codes(codec, False), keys), fit_s)
        add("AE whole model, rar, width 64, 8-bit latent", _whole_model(_ae_codes(codec, True), keys), fit_s)
    add("range float, 8 bits", _per_layer(_rangefloat(8)))
    add("range float, 4 bits", _per_layer(_rangefloat(4)))
    add("scaled sign, 1 bit", _per_layer(_scaled_sign))
    for bits in (2, 3):
        add(f"sign + uniform magnitude, {bits} bits", _per_layer(_uniform_magnitude(bits)))
        add(f"sign + learned levels, one set, {bits} bits", _per_layer(_learned_levels(bits, train)))
        add(
            f"sign + learned levels, the leader's and the others' (lgc), {bits} bits",
            _per_layer(_learned_levels_by_role(bits, train, lead_train)),
        )
    add("leader's values, scaled (fp32)", _per_layer(_leader_scaled(train, lead_train)))
    cosine = inter_rank_cosine(held)
    print(f"  cosine between two ranks' values on the support: {cosine:.3f}")
    positions = position_bits(cap.supports, cap.shapes)
    print("  bits a support position: " + ", ".join(f"{k} {v:.2f}" for k, v in positions.items()))
    columns = [
        Column("code", "code"),
        Column("bytes_per_value", "B/value", "{:.3f}"),
        Column("ratio_vs_fp32", "x fp32", "{:.1f}"),
        Column("mean_error", "mean err", "{:.3f}"),
        Column("rank_error", "rank err", "{:.3f}"),
        Column("fit_s", "fit s", "{:.0f}"),
    ]
    print(format_table(rows, columns))
    out = Path(args.out or paths.results_dir("codes"))
    write_json(
        out / f"codes_{args.task}{'_light' if args.light else ''}.json",
        {
            "command": "python -m lightning_gradcomp.bench " + " ".join(args.argv),
            "machine": machine_info(),
            "inter_rank_cosine": cosine,
            "position_bits": positions,
            "layers": len(keys),
            "capture_s": cap.seconds,
            "rows": rows,
        },
    )
    return 0
