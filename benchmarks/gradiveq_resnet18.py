"""GradiVeQ on real ResNet-18 (CIFAR shape) gradients, one process: bytes, error, encode+decode time.

The model trains for ``--fit-steps`` SGD steps on CIFAR-10 batches (or synthetic ones when the
data set is absent); the bases are fitted on those steps' gradients, exactly as the codec's
warm-up would (``observe_dense`` then ``on_step_end``), and every setting is then evaluated on the
gradients of the next ``--eval-steps`` steps, which the fit never saw.

Reported per setting: wire bytes a step for two ranks (ring all-reduce sends the payload
``2 (N-1)/N = 1`` times), the compression ratio against the fp32 all-reduce, the relative error
``||x - x_hat|| / ||x||`` over all parameters (small layers travel exactly), and encode + decode
milliseconds a step (one core; indicative only on a shared machine). ``t_100mbit`` adds the wire
time at 11.1 MB/s to the measured 0.68 s no-communication step.

    python benchmarks/gradiveq_resnet18.py --data ../shared/data/cifar10-jpeg.tar.gz
"""

from __future__ import annotations

import argparse
import io
import tarfile
import time

import torch
import torchvision

from lightning_gradcomp.codecs.base import CodecContext
from lightning_gradcomp.registry import make_codec

FLOOR_S = 0.68  # no-communication step of this model, batch 32, one core (see the docs)
LINK_BPS = 11.1e6  # 100 Mbit/s of payload


def resnet18_cifar() -> torch.nn.Module:
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = torch.nn.Identity()
    return m


def cifar_batches(path: str | None, n: int, batch: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    if path is None:
        for _ in range(n):
            yield torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
        return
    from PIL import Image

    classes, imgs, labels = {}, [], []
    with tarfile.open(path, "r:gz") as tar:
        for i, member in enumerate(tar):
            if not (member.isfile() and member.name.startswith("train/")) or i % 37:
                continue
            cls = member.name.split("/")[1]
            img = Image.open(io.BytesIO(tar.extractfile(member).read())).convert("RGB")
            imgs.append(torchvision.transforms.functional.to_tensor(img))
            labels.append(classes.setdefault(cls, len(classes)))
    x = torch.stack(imgs)
    x = (x - x.mean((0, 2, 3), keepdim=True)) / x.std((0, 2, 3), keepdim=True)
    y = torch.tensor(labels)
    for _ in range(n):
        idx = torch.randint(0, len(y), (batch,), generator=gen)
        yield x[idx], y[idx]


def collect(path: str | None, steps: int, batch: int) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = resnet18_cifar()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    grads = []
    for x, y in cifar_batches(path, steps, batch):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads.append({n: p.grad.detach().reshape(-1).clone() for n, p in model.named_parameters()})
        opt.step()
    return grads


def evaluate(grads_fit, grads_eval, world: int = 2, **opts) -> dict[str, float]:
    codec = make_codec("gradiveq", warmup_steps=len(grads_fit), refresh_every=0, **opts)
    codec.setup(CodecContext(0, world, torch.device("cpu")))
    for step, g in enumerate(grads_fit):
        for key, v in g.items():
            if v.numel() >= codec.min_numel:
                codec.observe_dense(key, v, step)
    codec.on_step_end(len(grads_fit) - 1)
    err, ref, ms, nbytes = 0.0, 0.0, 0.0, 0
    for i, g in enumerate(grads_eval):
        step = len(grads_fit) + i
        comp = [(k, v, v) for k, v in g.items() if v.numel() >= codec.min_numel]
        dense = sum(v.numel() for v in g.values() if v.numel() < codec.min_numel)
        t0 = time.perf_counter()
        codec.prepare_bucket(comp, step)
        encs = [codec.encode(v, k, p, step) for k, v, p in comp]
        # with `world` identical ranks the sum is world x each payload; decode and divide as the hook does
        outs = [
            codec.decode([t * world for t in e.payload], e.ctx, v.numel(), world).div_(world)
            for e, (k, v, p) in zip(encs, comp)
        ]
        ms += (time.perf_counter() - t0) * 1e3
        for out, (k, v, p) in zip(outs, comp):
            err += float((out - v).double().pow(2).sum())
        ref += sum(float(v.double().pow(2).sum()) for v in g.values())
        nbytes = 4 * (sum(t.numel() for e in encs for t in e.payload) + dense + 1)
    raw = 4 * sum(v.numel() for v in grads_eval[0].values())
    wire = 2 * (world - 1) / world * nbytes
    return {
        "MB": wire / 1e6,
        "ratio": raw / nbytes,
        "rel_err": (err / ref) ** 0.5,
        "ev": codec.explained_variance,
        "k": codec.k,
        "enc_dec_ms": ms / len(grads_eval),
        "t_100mbit": FLOOR_S + wire / LINK_BPS,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=None, help="cifar10-jpeg.tar.gz (synthetic batches when omitted)")
    ap.add_argument("--fit-steps", type=int, default=10)
    ap.add_argument("--eval-steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    grads = collect(args.data, args.fit_steps + args.eval_steps, args.batch)
    fit, ev = grads[: args.fit_steps], grads[args.fit_steps :]
    settings = [
        dict(),  # the defaults: slice_dim=64, num_components=4, quant_levels=7
        dict(slice_dim=32, num_components=4, quant_levels=0),
        dict(slice_dim=32, num_components=4, quant_levels=0, basis="shared"),
        dict(slice_dim=32, num_components=4, quant_levels=0, center=True),
        dict(slice_dim=16, num_components=2, quant_levels=0),
        dict(slice_dim=64, num_components=8, quant_levels=0),
        dict(slice_dim=64, num_components=4, quant_levels=0),
        dict(slice_dim=64, num_components=4, quant_levels=0, basis="shared"),
        dict(slice_dim=64, num_components=2, quant_levels=0),
        dict(slice_dim=128, num_components=2, quant_levels=0),
        dict(slice_dim=32, num_components=32, quant_levels=0),
        dict(slice_dim=32, variance_target=0.9, quant_levels=0),
        dict(slice_dim=32, num_components=4, quant_levels=127),
        dict(slice_dim=32, num_components=4, quant_levels=7),
        dict(slice_dim=64, num_components=2, quant_levels=7),
        dict(slice_dim=64, num_components=4, quant_levels=1),
        dict(slice_dim=64, num_components=4, quant_levels=3),
        dict(slice_dim=128, num_components=4, quant_levels=7),
    ]
    print(f"raw fp32 gradient: {4 * sum(v.numel() for v in grads[0].values()) / 1e6:.1f} MB")
    print(
        "| setting | MB/step (2 ranks) | ratio | rel. error | k | EV (fit sample) | enc+dec ms "
        "| est. step @100 Mbit/s (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for opts in settings:
        r = evaluate(fit, ev, **opts)
        name = ", ".join(f"{k}={v}" for k, v in opts.items()) or "defaults (d=64, k=4, s=7)"
        print(
            f"| {name} | {r['MB']:.3f} | {r['ratio']:.1f} | {r['rel_err']:.3f} | {r['k']:.1f} | {r['ev']:.3f} "
            f"| {r['enc_dec_ms']:.0f} | {r['t_100mbit']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
