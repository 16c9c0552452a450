"""The bytes a codec sends are pinned to its ``wire_format``.

Ranks compare ``config_hash`` at setup, and it digests each codec's ``wire_format``: ranks whose
package versions lay a message out differently refuse to start together, instead of decoding
each other's payloads wrongly. That holds only if a change of layout raises the number. Here the
payload of one fixed layer is digested for every codec whose arithmetic on it is exact (powers of
two, integer and bit operations, seeded draws), so the digest is the same on every machine: a
change of the bytes, even at the same size (another order of the digits), fails until the codec's
``wire_format`` is raised and the new digest recorded beside it. The codecs built on floating-point
transforms (``fft``, ``gradiveq``, ``powersgd``, ``lgc``'s fitted levels) round differently from
one machine's kernels to another's, so their bytes cannot be pinned as they are; their sizes are
tested with each codec. ``gradiveq``, ``fft`` and ``lgc`` are pinned all the same once what they
fit or transform is replaced by something exact (``EXACT_STATE``): ``gradiveq``'s fitted basis by
signed coordinate vectors, ``fft``'s FFT by a map that copies values into the real and imaginary
parts, ``lgc``'s fitted magnitude levels by dyadic ones. What is pinned is everything after that:
for ``gradiveq`` the quantization, the packing of the level fields, the scale and the tail; for
``fft`` the selection in each block, the range-based float's header and codes, and the packed
positions; for ``lgc`` the leader's message (the guard's flag and the support's positions, which
it broadcasts before the payload) and each rank's scale and codes. ``powersgd`` sends torch's own
factors, not pinned; the bytes it records are checked against what torch's hook all-reduces in
test_baselines.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from codec_driver import round_trip, set_up, warm_up

from lightning_gradcomp import make_codec
from lightning_gradcomp.registry import codec_class

#: codec, its options here, and (its wire_format, the first 16 hex digits of its payload's sha256)
PINNED = {
    "fp16": ({}, (1, "77469d81917c5eb3")),
    "topk": ({"ratio": 0.05}, (1, "5cbb8e58aae9e52c")),
    "randk": ({"ratio": 0.05}, (1, "fd9c8901934f05c4")),
    "terngrad": ({}, (2, "14f677b87802a8a1")),
    "qsgd": ({}, (2, "9265103d51807955")),
    "iwp": ({"keep_fraction": 0.05}, (1, "a69016d8e9036da1")),
    "rangefloat": ({}, (1, "2aef6ec6a05ff0e2")),
    # blocks of 64: 5 blocks (the last half padding), 4 of 33 coefficients kept in each, block-local
    # positions in 6 bits, the values in the range-based float's 8 bits
    "fft": ({"block_size": 64}, (1, "7b394f1d513a3dcf")),
    # stage 3 from step 7; a support of 72 of the 288 values (above the learned code's least), each
    # value in 2 bits: the leader's message (the run-time guard's flag, the positions) and the codes
    "lgc": ({"warmup_steps": 3, "ae_train_steps": 4, "ratio": 0.25}, (1, "84938a9fde7442d2")),
    # 288 values in slices of 7: 41 slices, 3 coefficients each, a tail of one value
    "gradiveq": (
        {"basis_source": "aggregate", "slice_dim": 7, "num_components": 3, "min_numel": 0, "warmup_steps": 2},
        (2, "c8b79fca17da69d9"),
    ),
}


def exact_basis(codec, step: int) -> bool:
    """Replace each fitted basis by signed coordinate vectors (each column ``±e_i``, no ``i`` twice)
    and its mean by zero: every coefficient is then one gradient value, on any machine's kernels."""
    gen = torch.Generator().manual_seed(1)
    for key, u in codec._bases.items():
        d, k = u.shape
        rows = torch.randperm(d, generator=gen)[:k]
        signs = torch.randint(0, 2, (k,), generator=gen).to(u.dtype) * 2 - 1
        exact = torch.zeros_like(u)
        exact[rows, torch.arange(k)] = signs
        codec._bases[key], codec._means[key] = exact, torch.zeros_like(codec._means[key])
    codec._refresh_working_copies()
    return True


def exact_spectrum(codec, step: int) -> bool:
    """Replace the FFT of each block by a map whose every output is one input value (the real parts
    the block's first ``C`` values, the imaginary parts its last ``C``), and check that no two
    coefficients tie at the edge of any block's kept set, so that the selection is the same on
    every machine."""
    size = codec.options.block_size
    blocks, _, kept_in_all, _ = codec.layout(288)
    kept = kept_in_all // blocks

    def spectrum(x: torch.Tensor, nb: int) -> torch.Tensor:
        blocks = torch.nn.functional.pad(x, (0, nb * size - x.numel())).view(nb, size)
        c = size // 2 + 1
        spec = torch.complex(blocks[:, :c], blocks[:, size - c :])
        power = (spec.real.square() + spec.imag.square()).sort(dim=1, descending=True).values
        assert bool((power[:, kept - 1] > power[:, kept]).all()), "a tie at the edge of the kept set"
        return spec

    codec._spectrum = spectrum
    return True


def exact_levels(codec, step: int) -> bool:
    """Once ``lgc`` is in stage 3, replace each layer's fitted magnitude levels by dyadic ones (the
    leader's row and the other ranks' apart, so which row is used is pinned too): with values
    ``k/16`` the sum of squares is exact in any order, and the RMS, the relative magnitudes and the
    nearest level are single correctly rounded IEEE operations, the same on any machine."""
    if codec.stage(step) != 3:
        return False
    for key, table in codec._levels.items():
        count = table.shape[-1]
        ladder = torch.arange(1, count + 1, dtype=table.dtype)
        codec._levels[key] = torch.stack([ladder / 2, ladder / 2 + 0.25])
    return True


#: codecs whose fitted state or floating-point transform is replaced by an exact one before the
#: pinned step
EXACT_STATE = {"gradiveq": exact_basis, "fft": exact_spectrum, "lgc": exact_levels}


def one_layer() -> tuple[torch.Tensor, torch.Tensor]:
    """A 8x4x3x3 convolution's gradient and weight on which every operation of these codecs is
    exact: distinct magnitudes k/16 (k = 1..288, so no ranking has ties and every sum of squares
    is exact in float32), random signs, and a weight of 0.5 everywhere."""
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.arange(1, 289, dtype=torch.float32)[torch.randperm(288, generator=g)] / 16
    signs = torch.randint(0, 2, (288,), generator=g).float() * 2 - 1
    return magnitudes * signs, torch.full((8, 4, 3, 3), 0.5)


def payload_digest(name: str, options: dict) -> str:
    codec = set_up(make_codec(name, **options))
    grad, weight = one_layer()
    ready = EXACT_STATE.get(name, lambda codec, step: True)
    step = warm_up(codec, grad, "conv.weight", weight, ready)  # its first compressing step
    broadcasts = []  # what a leader sends before the payload (lgc's support), on one rank a no-op
    send = codec.context.broadcast
    codec.context.broadcast = lambda t, src: broadcasts.append(t.clone()) or send(t, src)
    encoded, _ = round_trip(codec, grad, "conv.weight", weight, step)
    assert encoded is not None
    digest = hashlib.sha256()
    for part in [*broadcasts, *encoded.payload]:
        digest.update(f"{part.dtype} {tuple(part.shape)}".encode())
        digest.update(part.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(PINNED))
def test_a_codecs_message_bytes_change_only_with_its_wire_format(name):
    options, pinned = PINNED[name]
    measured = (codec_class(name).wire_format, payload_digest(name, options))
    assert measured == pinned, (
        f"codec {name!r} sends other bytes than the version that recorded {pinned}: now {measured}. If its "
        "layout changed, raise its wire_format (ranks of the two versions would misread each other's "
        "messages) and record the new pair here; if only wire_format was raised, record it here"
    )
