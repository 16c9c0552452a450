"""Codec names and the factory that builds codecs from them.

A built-in codec is a module of :mod:`lightning_gradcomp.codecs` with a ``@register_codec(name)``
class: the first time the registry is asked for a name or the list, it imports every module of that
package once (:func:`pkgutil.iter_modules`), so a new file there is all a new codec needs. (The
strategy asks at import, to register ``compressed_ddp_<name>`` with Lightning; what that adds to
the package's import is in docs/design.md, "Adding a codec".)
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import warnings
from typing import Any, Callable, TypeVar

from lightning_gradcomp.codecs.base import COLLECTIVES, Codec, CodecOptions, HarnessOptions

__all__ = ["register_codec", "make_codec", "available_codecs", "codec_class", "resolve_codec"]

_PACKAGE = "lightning_gradcomp.codecs"
_BUILTIN: dict[str, type[Codec]] = {}  # registered by the modules of the codecs package
_USER: dict[str, type[Codec]] = {}  # registered anywhere else (they win over a built-in of the same name)
_discovered = False

C = TypeVar("C", bound=type[Codec])


def register_codec(name: str) -> Callable[[C], C]:
    """Class decorator: make a :class:`Codec` subclass available as ``make_codec(name)``."""

    def deco(cls: C) -> C:
        if not (isinstance(cls, type) and issubclass(cls, Codec)):
            raise TypeError(f"register_codec({name!r}) expects a Codec subclass, got {cls!r}")
        _check_options_class(name, cls)
        cls.name = name
        builtin = cls.__module__.startswith(_PACKAGE + ".")
        (_BUILTIN if builtin else _USER)[name] = cls
        return cls

    return deco


def _discover() -> None:
    """Import every module of the codecs package once, which registers the built-in codecs."""
    global _discovered
    if _discovered:
        return
    _discovered = True  # first, so that a module asking the registry while it loads does not recurse
    package = importlib.import_module(_PACKAGE)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        try:
            importlib.import_module(f"{_PACKAGE}.{info.name}")
        except ImportError as err:  # an optional dependency missing: that codec is not available
            warnings.warn(f"codec module {info.name!r} not loaded: {err}", RuntimeWarning, stacklevel=3)
        except BaseException:
            _discovered = False  # a broken module fails every time it is asked for, not once
            raise


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


def available_codecs() -> list[str]:
    """Names accepted by :func:`make_codec` and by ``CompressedDDPStrategy(codec=...)``, sorted."""
    _discover()
    return sorted(set(_BUILTIN) | set(_USER))


def codec_class(name: str) -> type[Codec]:
    if not isinstance(name, str):
        raise TypeError(f"codec name must be a string, got {type(name).__name__}")
    if name in _USER:
        return _USER[name]
    _discover()
    if name in _BUILTIN:
        return _BUILTIN[name]
    raise ValueError(f"unknown codec {name!r}; available codecs: {', '.join(available_codecs())}")


def make_codec(name: str, **options: Any) -> Codec:
    """Build the codec registered as ``name`` with its hyper-parameters.

    Raises:
        ValueError: for an unknown name (the message lists the valid ones) or an invalid option.
    """
    return codec_class(name)(**options)


def resolve_codec(codec: str | Codec, codec_options: dict[str, Any] | None = None) -> Codec:
    """A codec object from a registered name (with options) or a codec object itself."""
    if isinstance(codec, Codec):
        if codec_options:
            raise ValueError("codec_options are only used with a codec name, not with a codec object")
        return codec
    if isinstance(codec, str):
        return make_codec(codec, **(codec_options or {}))
    raise TypeError(f"codec must be a registered name or a Codec, got {type(codec).__name__}")
