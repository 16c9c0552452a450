"""Gradient codecs. Each module holds one codec; :mod:`.base` holds the contract they share."""

from lightning_gradcomp.codecs.base import Codec, CodecContext, EncodeResult

__all__ = ["Codec", "CodecContext", "EncodeResult"]
