"""lightning_gradcomp: gradient compression for data-parallel training in PyTorch Lightning.

>>> from lightning_gradcomp import CompressedDDPStrategy
>>> trainer = Trainer(accelerator="cpu", devices=2, strategy=CompressedDDPStrategy(codec="topk"))
"""

from lightning_gradcomp.api import make_comm_hook
from lightning_gradcomp.codecs.base import Codec, CodecContext, CodecOptions, EncodeResult
from lightning_gradcomp.hook import CodecHookState, codec_hook
from lightning_gradcomp.registry import available_codecs, make_codec, register_codec
from lightning_gradcomp.strategy import CompressedDDPStrategy

__version__ = "0.1.0"

__all__ = [
    "CompressedDDPStrategy",
    "make_codec",
    "available_codecs",
    "register_codec",
    "make_comm_hook",
    "Codec",
    "CodecOptions",
    "CodecContext",
    "EncodeResult",
    "CodecHookState",
    "codec_hook",
]
