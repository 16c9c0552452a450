"""Gradient codecs. Each module holds one codec; :mod:`.base` holds the contract they share,
re-exported here."""

from lightning_gradcomp.codecs import base
from lightning_gradcomp.codecs.base import *  # noqa: F403

__all__ = list(base.__all__)
