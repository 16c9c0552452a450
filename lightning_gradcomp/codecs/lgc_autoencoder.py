"""``lgc``'s autoencoder (``code="autoencoder"``): the network and its training at the switch.

The paper's code (Abrahamyan et al., TNNLS 2021; the parameter-server part as in the public
LGC-PS re-implementation, SOFF). A stage-2 sample is ``(layer key, step, leader, numel, values)``
with ``values`` of shape ``(N, K)``: every rank's values on that step's shared support. Everything
here runs on rank 0 at the switch; :class:`~lightning_gradcomp.codecs.lgc.LGCCodec` broadcasts the
result.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MIN_AE_LEN", "GradientAutoencoder", "batches", "fit", "innovation", "recon_error"]

Sample = tuple[str, int, int, int, Tensor]  # key, step, leader, numel, (N, K) values


#: layers with fewer kept values than this bypass the AE (four stride-2 convolutions need ~31)
MIN_AE_LEN = 64


class GradientAutoencoder(nn.Module):
    """A 1-D convolutional autoencoder for vectors of kept gradient values.

    Encoder (SOFF's layout with widths ``w, 2w, 4w, w``): four ``Conv1d(k=3, stride=2)`` with
    LeakyReLU, then a linear ``Conv1d(k=1)`` to ``latent_channels``; a length-``K`` input becomes a
    ``latent_channels x L`` code with ``L ~ K / 16``. Decoder: four ``ConvTranspose1d(k=3,
    stride=2)`` (widths ``w/2, w, 2w, w/2``) with LeakyReLU, linear interpolation back to ``K``, and
    a ``Conv1d(k=1)`` head; with ``innovation=True`` the head also reads one channel of sparse
    node-specific values (SOFF's LGC-PS decoder).

    Args:
        width: ``w`` above (SOFF uses 64).
        latent_channels: channels of the code; the AE sends ``latent_channels / 16`` of its input.
        innovation: add the innovation input channel to the decoder head.
    """

    def __init__(self, width: int = 16, latent_channels: int = 4, innovation: bool = False) -> None:
        super().__init__()
        w, c, h = width, latent_channels, max(width // 2, 1)
        act = nn.LeakyReLU
        self.encoder = nn.Sequential(
            nn.Conv1d(1, w, 3, stride=2), act(),
            nn.Conv1d(w, 2 * w, 3, stride=2), act(),
            nn.Conv1d(2 * w, 4 * w, 3, stride=2), act(),
            nn.Conv1d(4 * w, w, 3, stride=2), act(),
            nn.Conv1d(w, c, 1),  # linear: latents are averaged across ranks (RAR)
        )  # fmt: skip
        self.decoder = nn.Sequential(
            nn.ConvTranspose1d(c, h, 3, stride=2), act(),
            nn.ConvTranspose1d(h, w, 3, stride=2), act(),
            nn.ConvTranspose1d(w, 2 * w, 3, stride=2), act(),
            nn.ConvTranspose1d(2 * w, h, 3, stride=2), act(),
        )  # fmt: skip
        self.head = nn.Conv1d(h + int(innovation), 1, 1)
        self.latent_channels = c
        self.innovation = innovation

    @staticmethod
    def latent_len(k: int) -> int:
        """Code length ``L`` for an input of length ``k`` (four unpadded stride-2, kernel-3 convs)."""
        for _ in range(4):
            k = (k - 3) // 2 + 1
        return k

    def encode(self, v: Tensor) -> Tensor:
        """``(B, K) -> (B, c, L)``."""
        return self.encoder(v.unsqueeze(1))

    def decode(self, z: Tensor, k: int, u: Tensor | None = None) -> Tensor:
        """``(B, c, L) -> (B, K)``; ``u`` is the ``(B, K)`` innovation channel when ``innovation``."""
        y = F.interpolate(self.decoder(z), size=k, mode="linear", align_corners=False)
        if self.innovation:
            y = torch.cat([y, (torch.zeros_like(y[:, :1]) if u is None else u.unsqueeze(1))], dim=1)
        return self.head(y).squeeze(1)


def batches(samples: list[Sample], size: int) -> list[list[Sample]]:
    """Group samples of one layer and one support length ``K`` into batches of at most ``size``."""
    groups: dict[tuple[str, int], list] = {}
    for s in samples:  # a layer's support changes size with the compression level
        groups.setdefault((s[0], s[4].shape[-1]), []).append(s)
    out = []
    for g in groups.values():
        out.extend(g[i : i + size] for i in range(0, len(g), size))
    return out


def normalized(batch: list[Sample], device: torch.device) -> tuple[Tensor, Tensor]:
    """The batch's values ``(B, N, K)`` in units of each step's leader RMS, and those RMS."""
    v = torch.stack([b[4] for b in batch]).to(device)
    lead = torch.tensor([b[2] for b in batch], device=device)
    s = v[torch.arange(len(batch), device=device), lead].pow(2).mean(-1).sqrt().clamp_min(1e-30)
    return v / s.view(-1, 1, 1), s


def innovation(v: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """PS: the positions of the ``k`` largest of the (scaled) values ``v`` along the last
    dimension, and the innovation channel (those values, zero elsewhere)."""
    pos = v.abs().topk(k, dim=-1).indices
    return pos, torch.zeros_like(v).scatter_(-1, pos, v.gather(-1, pos))


def loss(ae: GradientAutoencoder, variant: str, v: Tensor, k_innovation: int, rng: random.Random) -> Tensor:
    """``rar``: ``MSE(D(mean_i z_i), mean_i v_i) + 0.5 mean_i MSE(D(z_i), v_i)``; ``ps`` (SOFF):
    ``0.5 mean_i MSE(D(z_r, u_i), v_i)`` with a random rank ``r`` whose latent decodes every rank,
    plus ``0.5`` the mean pairwise MSE between latents."""
    b, n, k = v.shape
    c = ae.latent_channels
    z = ae.encode(v.reshape(b * n, k)).view(b, n, c, -1)
    if variant == "rar":
        agg = F.mse_loss(ae.decode(z.mean(1), k), v.mean(1))
        node = F.mse_loss(ae.decode(z.reshape(b * n, c, -1), k), v.reshape(b * n, k))
        return agg + 0.5 * node
    r = rng.randrange(n)
    zr = z[:, r : r + 1].expand(b, n, -1, -1).reshape(b * n, c, -1)
    rec = F.mse_loss(ae.decode(zr, k, innovation(v, k_innovation)[1].reshape(b * n, k)), v.reshape(b * n, k))
    sim = (z.unsqueeze(1) - z.unsqueeze(2)).pow(2).mean() * n / max(n - 1, 1) if n > 1 else z.sum() * 0
    return 0.5 * rec + 0.5 * sim


@torch.no_grad()
def recon_error(
    ae: GradientAutoencoder, variant: str, samples: list[Sample], device: torch.device, innovation_k: Callable
) -> dict[str, tuple[float, float]]:
    """Per layer: squared error and squared norm of the decoded aggregate (normalized units)."""
    out: dict[str, tuple[float, float]] = {}
    for batch in batches(samples, 8):
        v, _ = normalized(batch, device)
        b, n, k = v.shape
        z = ae.encode(v.reshape(b * n, k)).view(b, n, ae.latent_channels, -1)
        if variant == "rar":
            vhat = ae.decode(z.mean(1), k)
        else:
            lead = torch.tensor([x[2] for x in batch], device=device)
            zl = z[torch.arange(b, device=device), lead]
            u = innovation(v, innovation_k(batch[0][3]))[1]
            vhat = ae.decode(zl.repeat_interleave(n, 0), k, u.reshape(b * n, k)).view(b, n, k).mean(1)
        e, r = out.get(batch[0][0], (0.0, 0.0))
        out[batch[0][0]] = (e + float((vhat - v.mean(1)).pow(2).sum()), r + float(v.mean(1).pow(2).sum()))
    return out


def fit(
    ae: GradientAutoencoder, options: Any, train: list[Sample], val: list[Sample], innovation_k: Callable
) -> tuple[float, dict[str, tuple[float, float]]]:
    """Train ``ae`` in place (Adam, ``options.ae_epochs`` passes over batches of 8 steps, capped at
    ``options.ae_time_budget_s``) and return its last-epoch mean loss and :func:`recon_error` on
    ``val``. Seeded by ``options.seed``; ``innovation_k(numel)`` is a layer's innovation size."""
    device = next(ae.parameters()).device
    ae.requires_grad_(True)
    opt = torch.optim.Adam(ae.parameters(), lr=options.ae_lr)
    rng = random.Random(options.seed)
    todo = batches(train, 8)
    deadline = time.perf_counter() + options.ae_time_budget_s
    last = float("nan")
    # the hook runs inside DDP's backward, where autograd is off: a nested backward is allowed
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(options.seed)
        for _ in range(options.ae_epochs):
            rng.shuffle(todo)
            total, count = 0.0, 0
            for batch in todo:
                v, _ = normalized(batch, device)
                step_loss = loss(ae, options.variant, v, innovation_k(batch[0][3]), rng)
                opt.zero_grad(set_to_none=True)
                step_loss.backward()
                opt.step()
                total, count = total + float(step_loss.detach()), count + 1
                if time.perf_counter() > deadline:
                    break
            last = total / max(count, 1)
            if time.perf_counter() > deadline:
                break
    ae.requires_grad_(False)
    return last, recon_error(ae, options.variant, val, device, innovation_k)
