"""The package version and the torch floor, a leaf every layer may import (lower layers never import the package root).

``check_torch()`` runs when ``hfzero`` is imported: below ``TORCH_FLOOR`` it raises at once, naming the floor and the
installed version, instead of a failure deep inside a training step. It reads the installed distribution's version
(``importlib.metadata``), so ``import hfzero`` still does not import torch (the dashboard's profile reader stays light).
Why the floor is 2.10: docs/engine.md, "Torch versions".
"""

from __future__ import annotations

import re
from importlib import metadata

__version__ = "0.1.0"

TORCH_FLOOR = (2, 10)
"""The oldest torch (major, minor) hfzero runs on; pyproject.toml declares the same (tests/test_torch_floor.py)."""


def torch_release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string: "2.11.0+cu130" -> (2, 11), "2.10.0a0+git1234" -> (2, 10);
    None when the string does not start with two numbers.

    Pre-releases and local builds count as their release: NVIDIA's containers ship "2.10.0a0+..." builds of 2.10.
    """
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def installed_torch_version() -> str | None:
    """The version of the installed torch distribution, or None when there is none (torch from a source tree
    on ``sys.path``, or no torch at all: the profile reader needs none)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def check_torch(version: str | None = None) -> None:
    """Raise ImportError when the installed torch (or ``version``) is older than ``TORCH_FLOOR``.

    Nothing is checked when no torch distribution is found or its version cannot be read: a source build
    without metadata is taken as it is (its own import then fails where a feature is missing).
    """
    version = installed_torch_version() if version is None else version
    release = torch_release(version) if version else None
    if release is None or release >= TORCH_FLOOR:
        return
    floor = ".".join(map(str, TORCH_FLOOR))
    raise ImportError(
        f"hfzero {__version__} needs torch>={floor}, found torch {version}: older torch lacks what hfzero's "
        f"pipeline and engine rely on (docs/engine.md, \"Torch versions\"). Upgrade with pip install 'torch>={floor}'; "
        f"README \"Tested versions\" names the versions CI tests.")
