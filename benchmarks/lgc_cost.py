"""Per-step cost of the ``lgc`` codec on ResNet-18 (CIFAR shape, 11.2 M parameters), one core.

Runs the codec's own methods in one process on gradient-shaped random tensors (two simulated
ranks with correlated gradients), without a network, so it measures compute only:

- leader's top-k selection, encoding and decoding per step, for both variants, stage 2 and 3;
- the one-off autoencoder training at the stage switch;
- the autoencoder's size and the bytes per step.

    python benchmarks/lgc_cost.py [--samples 64] [--repeat 5] [--cifar DIR]

With ``--cifar DIR`` (an unpacked ``cifar10-jpeg.tar.gz``: ``DIR/train/<class>/*.jpg``) the
gradients are real: the model trains with SGD on the average of two simulated ranks' gradients
(batch 32 each, different images), so the AE's reconstruction error is measured on real data.
"""

from __future__ import annotations

import argparse
import time

import torch
import torchvision

from lightning_gradcomp.codecs.base import CodecContext
from lightning_gradcomp.codecs.lgc import LGCCodec


def resnet18_cifar() -> torch.nn.Module:
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = torch.nn.Identity()
    return m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64, help="stage-2 steps kept for AE training")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cifar", default=None, help="unpacked CIFAR-10 JPEG folder: real gradients")
    ap.add_argument("--warmup", type=int, default=20, help="--cifar: dense steps before collecting")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = resnet18_cifar()
    params = [(n, p) for n, p in model.named_parameters()]
    total = sum(p.numel() for _, p in params)
    g = torch.Generator().manual_seed(0)
    real = None
    if args.cifar:
        import torchvision.transforms as T

        tf = T.Compose(
            [
                T.RandomCrop(32, padding=4),
                T.RandomHorizontalFlip(),
                T.ToTensor(),
                T.Normalize((0.49, 0.48, 0.45), (0.25, 0.24, 0.26)),
            ]
        )
        data = torchvision.datasets.ImageFolder(f"{args.cifar}/train", transform=tf)
        loader = iter(
            torch.utils.data.DataLoader(
                data, batch_size=32, shuffle=True, num_workers=0, generator=torch.Generator().manual_seed(0)
            )
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

        def real_step() -> list[list[torch.Tensor]]:
            out = []
            for _ in range(2):
                x, y = next(loader)
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                out.append([p.grad.detach().reshape(-1).clone() for _, p in params])
            for (_, p), a, b in zip(params, *out):
                p.grad = ((a + b) / 2).view_as(p)
            opt.step()
            return out

        for _ in range(args.warmup):
            real_step()
        real = real_step

    def grads(step: int) -> list[list[torch.Tensor]]:
        if real is not None:
            return real()
        # two ranks: a shared component plus rank noise, scaled per layer like real gradients
        out = [[], []]
        for _, p in params:
            common = torch.randn(p.numel(), generator=g) * 1e-3
            for r in range(2):
                out[r].append(common + 0.7e-3 * torch.randn(p.numel(), generator=g))
        return out

    for variant in ("rar", "ps"):
        codec = LGCCodec(variant=variant, warmup_steps=0, ae_train_steps=args.samples, ae_samples=args.samples)
        codec.setup(CodecContext(0, 1, torch.device("cpu")))
        keep = [(n, p) for n, p in params if codec.should_compress(n, p)]
        idx_keep = [i for i, (n, p) in enumerate(params) if codec.should_compress(n, p)]
        cost = codec.ae_cost()
        print(
            f"\n== variant {variant}: {len(keep)} of {len(params)} tensors compressed, "
            f"AE {int(cost['ae_params'])} parameters ({cost['ae_param_bytes'] / 1024:.1f} KiB)"
        )

        def one_step(step: int, g2: list[list[torch.Tensor]]) -> dict[str, float]:
            codec.is_compressing(step)
            layers = [(n, g2[0][i], p) for (n, p), i in zip(keep, idx_keep)]
            t0 = time.perf_counter()
            bcast = codec.prepare_bucket(layers, step * 1)  # world 1: this rank leads
            t1 = time.perf_counter()
            encs = [codec.encode(x, n, p, step) for n, x, p in layers]
            t2 = time.perf_counter()
            payload = 0
            for (n, x, p), e in zip(layers, encs):
                payload += sum(t.numel() * t.element_size() for t in e.payload)
                if codec.collective == "allreduce":
                    codec.decode([2 * t for t in e.payload], e.ctx, x.numel(), 2)
                else:
                    codec.aggregate([e.payload, e.payload], e.ctx, x.numel())
            t3 = time.perf_counter()
            return {
                "select_ms": 1e3 * (t1 - t0),
                "encode_ms": 1e3 * (t2 - t1),
                "decode_ms": 1e3 * (t3 - t2),
                "bcast_bytes": bcast,
                "payload_bytes": payload,
            }

        def report(name: str, rows: list[dict[str, float]]) -> None:
            med = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}
            print(
                f"{name}: select {med['select_ms']:.1f} ms, encode {med['encode_ms']:.1f} ms, "
                f"decode {med['decode_ms']:.1f} ms; broadcast {med['bcast_bytes'] / 1024:.1f} KiB, "
                f"payload {med['payload_bytes'] / 1024:.1f} KiB (dense fp32: {4 * total / 1024:.0f} KiB)"
            )

        # stage 2: collect samples (the aggregate of two correlated ranks is recorded)
        rows = []
        for step in range(args.samples):
            g2 = grads(step)
            codec.is_compressing(step)
            layers = [(n, g2[0][i], p) for (n, p), i in zip(keep, idx_keep)]
            t0 = time.perf_counter()
            codec.prepare_bucket(layers, step)
            t1 = time.perf_counter()
            encs = [codec.encode(x, n, p, step) for n, x, p in layers]
            t2 = time.perf_counter()
            for (n, x, p), e, i in zip(layers, encs, idx_keep):
                other = [g2[1][i][e.ctx[0]]]
                # the leader alternates; rank r's values sit in row r
                codec.aggregate([e.payload, other] if step % 2 == 0 else [other, e.payload], e.ctx, x.numel())
            rows.append(
                {
                    "select_ms": 1e3 * (t1 - t0),
                    "encode_ms": 1e3 * (t2 - t1),
                    "decode_ms": 1e3 * (time.perf_counter() - t2),
                    "bcast_bytes": 0,
                    "payload_bytes": 0,
                }
            )
        report("stage 2 (top-k on shared support)", rows)
        t0 = time.perf_counter()
        codec.train_autoencoder()
        print(
            f"AE training at the switch: {time.perf_counter() - t0:.1f} s "
            f"({codec.ae_epochs} epochs over {args.samples} steps), loss {codec.ae_loss:.4f}, "
            f"held-out relative error of the aggregate {codec.ae_recon_error:.3f}; "
            f"{len(codec.ae_layers)} layers pass the gate (max_recon_error={codec.max_recon_error})"
        )
        g2 = grads(0)
        rows = [one_step(args.samples + s, g2) for s in range(args.repeat)]
        report("stage 3 (learned code)", rows)


if __name__ == "__main__":
    main()
