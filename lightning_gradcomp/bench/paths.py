"""Where the benchmarks read and write by default, whatever the current directory.

Results of verb ``V`` go to, in this order:

1. ``$LIGHTNING_GRADCOMP_RESULTS/V`` when that variable is set;
2. ``<checkout>/docs/results/V`` when the package runs from a checkout of the repository
   (``pyproject.toml`` beside the package directory);
3. ``~/.cache/lightning_gradcomp/results/V`` otherwise (an installed package).

Figures follow the results: ``$LIGHTNING_GRADCOMP_RESULTS/figures``, ``<checkout>/docs/figures``,
or the cache's ``results/figures``. The recipes and ``docs/benchmarks.md`` exist only in a
checkout: outside one, :func:`recipes_dir` and :func:`benchmarks_markdown` say which option to pass.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["RESULTS_ENV", "benchmarks_markdown", "checkout", "figures_dir", "recipes_dir", "results_dir"]

RESULTS_ENV = "LIGHTNING_GRADCOMP_RESULTS"
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def checkout() -> Path | None:
    """The repository the package runs from, or ``None`` for an installed package."""
    root = _PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").is_file() else None


def _results_root() -> Path:
    env = os.environ.get(RESULTS_ENV)
    if env:
        return Path(env).expanduser()
    repo = checkout()
    if repo is not None:
        return repo / "docs" / "results"
    return Path.home() / ".cache" / "lightning_gradcomp" / "results"


def results_dir(verb: str | None = None) -> Path:
    """The directory of ``verb``'s results (or the root holding every verb's)."""
    root = _results_root()
    return root / verb if verb else root


def figures_dir() -> Path:
    """Where ``plot`` draws: ``docs/figures`` beside ``docs/results`` in a checkout."""
    repo = checkout()
    if repo is not None and not os.environ.get(RESULTS_ENV):
        return repo / "docs" / "figures"
    return _results_root() / "figures"


def _in_checkout(what: str, option: str) -> Path:
    repo = checkout()
    if repo is None:
        raise SystemExit(
            f"{what} come only with a checkout of the repository, and this package is installed at "
            f"{_PACKAGE_DIR}; pass {option}"
        )
    return repo


def recipes_dir() -> Path:
    """``<checkout>/recipes``; outside a checkout a ``SystemExit`` asking for ``--recipes-dir``."""
    return _in_checkout("the recipes", "--recipes-dir DIR") / "recipes"


def benchmarks_markdown() -> Path:
    """``<checkout>/docs/benchmarks.md``; outside a checkout a ``SystemExit`` asking for a file."""
    return _in_checkout("the docs", "--markdown FILE") / "docs" / "benchmarks.md"
