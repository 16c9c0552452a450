"""Codec names and the factory that builds codecs from them.

Built-in codecs are imported lazily (a codec module may pull in heavier code), so
``available_codecs()`` is cheap and importing the package does not import every codec.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Any, Callable, TypeVar

from lightning_gradcomp.codecs.base import COLLECTIVES, Codec, CodecOptions, HarnessOptions

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
        _check_options_class(name, cls)
        cls.name = name
        if name not in _BUILTIN or _BUILTIN[name] != f"{cls.__module__}:{cls.__qualname__}":
            _USER[name] = cls
        return cls

    return deco


def _check_options_class(name: str, cls: type[Codec]) -> None:
    opts = cls.Options
    if not (isinstance(opts, type) and issubclass(opts, CodecOptions) and dataclasses.is_dataclass(opts)):
        raise TypeError(f"codec {name!r}: Options must be a CodecOptions dataclass, got {opts!r}")
    if not opts.__dataclass_params__.frozen:
        raise TypeError(f"codec {name!r}: Options must be a frozen dataclass (@dataclass(frozen=True))")
    clash = {f.name for f in dataclasses.fields(opts)} & {f.name for f in dataclasses.fields(HarnessOptions)}
    if clash:
        raise TypeError(f"codec {name!r}: options {sorted(clash)} are harness options; use harness_defaults")
    if cls.collective not in COLLECTIVES:
        raise TypeError(f"codec {name!r}: collective must be one of {list(COLLECTIVES)}, got {cls.collective!r}")


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
    return codec_class(name)(**options)
