"""Compression ratio, relative error and encode+decode time of the ``fft`` codec on ResNet-18 gradients.

One process, one thread. Gradients of torchvision's ResNet-18 in CIFAR shape (3x3 stem, stride 1,
no max-pool) on a batch of 32 real CIFAR-10 images from ``../shared/data/cifar10-jpeg.tar.gz`` (random
images when it is absent). Layers below ``min_numel`` (1,024) travel as fp32 and count in the ratio.

    python scripts/measure_fft.py                      # the default table
    python scripts/measure_fft.py --block-sizes 256 1024 4096 --selections layer block --no-baselines
"""

from __future__ import annotations

import argparse
import io
import tarfile
import time
from pathlib import Path

import torch


def cifar_batch(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    tar_path = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "cifar10-jpeg.tar.gz"
    if not tar_path.exists():
        g = torch.Generator().manual_seed(0)
        return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    from PIL import Image
    from torchvision.transforms.functional import normalize, to_tensor

    images, labels, classes = [], [], {}
    with tarfile.open(tar_path) as tar:
        for m in tar:
            if m.isfile() and "/train/" in f"/{m.name}" and m.name.endswith(".jpg"):
                cls = m.name.split("/")[-2]
                if sum(1 for c in labels if c == classes.get(cls, -1)) >= n // 10 + 1:
                    continue
                classes.setdefault(cls, len(classes))
                img = Image.open(io.BytesIO(tar.extractfile(m).read())).convert("RGB")
                images.append(normalize(to_tensor(img), [0.49, 0.48, 0.45], [0.25, 0.24, 0.26]))
                labels.append(classes[cls])
                if len(images) == n:
                    break
    return torch.stack(images), torch.tensor(labels)


def resnet18_grads(steps: int = 1) -> dict[str, torch.Tensor]:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = torch.nn.Identity()
    x, y = cifar_batch()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return {n: p.grad.detach().reshape(-1).clone() for n, p in model.named_parameters()}


def measure(grads: dict[str, torch.Tensor], codec, repeats: int = 3) -> dict[str, float]:
    raw = sent = 0
    err = ref = 0.0
    best = float("inf")
    for r in range(repeats):
        t = 0.0
        for name, g in grads.items():
            if g.numel() < codec.min_numel:
                if r == 0:
                    raw += 4 * g.numel()
                    sent += 4 * g.numel()
                continue
            t0 = time.perf_counter()
            enc = codec.encode(g, name, g, 5)
            out = codec.decode(enc.payload, enc.ctx, g.numel(), 1)
            t += time.perf_counter() - t0
            if r == 0:
                raw += 4 * g.numel()
                sent += sum(p.numel() * p.element_size() for p in enc.payload)
                err += float((out - g).double().pow(2).sum())
                ref += float(g.double().pow(2).sum())
        best = min(best, t)
    return {"ratio": raw / sent, "rel_error": (err / ref) ** 0.5, "ms": best * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--thetas", type=float, nargs="+", default=[0.0, 0.9, 0.99])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4096])
    parser.add_argument("--bits", type=int, nargs="+", default=[8])
    parser.add_argument("--selections", nargs="+", default=["block"])
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from lightning_gradcomp import make_codec

    grads = resnet18_grads()
    print(f"{sum(g.numel() for g in grads.values()):,} gradient values in {len(grads)} tensors")
    print("codec            setting                         ratio  rel_error  enc+dec ms (best of repeats)")
    for sel in args.selections:
        for B in args.block_sizes:
            for bits in args.bits:
                for theta in args.thetas:
                    codec = make_codec("fft", theta=theta, block_size=B, bits=bits, selection=sel)
                    m = measure(grads, codec, args.repeats)
                    setting = f"{sel} theta={theta} B={B} bits={bits}"
                    print(f"fft              {setting:<29} {m['ratio']:7.1f}  {m['rel_error']:9.4f}  {m['ms']:8.1f}")
    if args.no_baselines:
        return
    for name, opts in (
        ("topk", {"ratio": 0.01}),
        ("topk", {"ratio": 0.04}),
        ("rangefloat", {"bits": 8}),
        ("rangefloat", {"bits": 10}),
    ):
        m = measure(grads, make_codec(name, **opts), args.repeats)
        setting = " ".join(f"{k}={v}" for k, v in opts.items())
        print(f"{name:<16} {setting:<29} {m['ratio']:7.1f}  {m['rel_error']:9.4f}  {m['ms']:8.1f}")


if __name__ == "__main__":
    main()
