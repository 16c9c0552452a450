"""Codec names and the factory that builds codecs from them.

Built-in codecs are imported lazily (a codec module may pull in heavier code), so
``available_codecs()`` is cheap and importing the package does not import every codec.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable, TypeVar

from lightning_gradcomp.codecs.base import Codec

__all__ = ["register_codec", "make_codec", "available_codecs", "codec_class"]

# name -> "module:Class" for the codecs that ship with the package
_BUILTIN: dict[str, str] = {
    "none": "lightning_gradcomp.codecs.none:NoCompression",
    "fp16": "lightning_gradcomp.codecs.fp16:FP16Codec",
    "topk": "lightning_gradcomp.codecs.topk:TopKCodec",
    "qsgd": "lightning_gradcomp.codecs.qsgd:QSGDCodec",
    "terngrad": "lightning_gradcomp.codecs.terngrad:TernGradCodec",
    "powersgd": "lightning_gradcomp.codecs.powersgd:PowerSGDCodec",
    "gradiveq": "lightning_gradcomp.codecs.gradiveq:GradiVeQCodec",
    "fft": "lightning_gradcomp.codecs.fft:FFTCodec",
    "rangefloat": "lightning_gradcomp.codecs.rangefloat:RangeFloatCodec",
    "lgc": "lightning_gradcomp.codecs.lgc:LGCCodec",
    "iwp": "lightning_gradcomp.codecs.iwp:IWPCodec",
}
_USER: dict[str, type[Codec]] = {}

C = TypeVar("C", bound=type[Codec])


def register_codec(name: str) -> Callable[[C], C]:
    """Class decorator: make a :class:`Codec` subclass available as ``make_codec(name)``."""

    def deco(cls: C) -> C:
        if not (isinstance(cls, type) and issubclass(cls, Codec)):
            raise TypeError(f"register_codec({name!r}) expects a Codec subclass, got {cls!r}")
        cls.name = name
        if name not in _BUILTIN or _BUILTIN[name] != f"{cls.__module__}:{cls.__qualname__}":
            _USER[name] = cls
        return cls

    return deco


def _builtin_present(name: str) -> bool:
    module = _BUILTIN[name].split(":")[0]
    return importlib.util.find_spec(module) is not None


def available_codecs() -> list[str]:
    """Names accepted by :func:`make_codec` and by ``CompressedDDPStrategy(codec=...)``."""
    return sorted({n for n in _BUILTIN if _builtin_present(n)} | set(_USER))


def codec_class(name: str) -> type[Codec]:
    if not isinstance(name, str):
        raise TypeError(f"codec name must be a string, got {type(name).__name__}")
    if name in _USER:
        return _USER[name]
    if name in _BUILTIN and _builtin_present(name):
        module, cls = _BUILTIN[name].split(":")
        return getattr(importlib.import_module(module), cls)
    raise ValueError(f"unknown codec {name!r}; available codecs: {', '.join(available_codecs())}")


def make_codec(name: str, **options: Any) -> Codec:
    """Build the codec registered as ``name`` with its hyper-parameters.

    Raises:
        ValueError: for an unknown name (the message lists the valid ones) or an invalid option.
    """
    cls = codec_class(name)
    try:
        return cls(**options)
    except TypeError as err:  # an option the codec does not take: list the ones it does
        import inspect

        params = [
            p for c in (cls, Codec) for p in inspect.signature(c.__init__).parameters if p not in ("self", "kwargs")
        ]
        raise ValueError(f"invalid option for codec {name!r}: {err}. Valid options: {', '.join(params)}") from None
