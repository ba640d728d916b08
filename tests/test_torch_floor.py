"""The declared torch range is the tested range (README "Tested versions"): ``import hfzero`` below the floor fails
at once, naming the floor and the installed version, and at or above it imports without importing torch; the
floor is the same in hfzero/version.py, pyproject.toml and tests/floor/run.sh, and every test the floor subset
lists exists."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from hfzero import version

ROOT = Path(__file__).resolve().parents[1]
FLOOR = ".".join(map(str, version.TORCH_FLOOR))


@pytest.mark.parametrize("installed", ["2.9.1", "2.9.1+cu128", "2.4.0", "1.13.1", "2.9.0a0+git0123abc"])
def test_below_the_floor_raises_naming_floor_and_version(installed):
    with pytest.raises(ImportError) as raised:
        version.check_torch(installed)
    assert f"torch>={FLOOR}" in str(raised.value) and f"found torch {installed}" in str(raised.value)


@pytest.mark.parametrize("installed", [f"{FLOOR}.0", f"{FLOOR}.0+cu128", f"{FLOOR}.0a0+git0123abc", "2.11.0+cu130",
                                       "2.14.1", "3.0.0", "not a version"])
def test_at_or_above_the_floor_passes(installed):
    version.check_torch(installed)


def test_no_torch_distribution_is_not_checked(monkeypatch):
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(version.metadata, "version", missing)
    assert version.installed_torch_version() is None
    version.check_torch()


def _import_hfzero_with_torch(installed: str) -> subprocess.CompletedProcess:
    """``import hfzero`` in a fresh interpreter whose metadata reports torch ``installed``."""
    code = ("import sys; from importlib import metadata; real = metadata.version\n"
            f"metadata.version = lambda name: {installed!r} if name == 'torch' else real(name)\n"
            "import hfzero\n"
            "print('torch imported' if 'torch' in sys.modules else 'torch not imported')\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_import_below_the_floor_fails_at_once():
    proc = _import_hfzero_with_torch("2.9.1+cu128")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: hfzero") and f"needs torch>={FLOOR}, found torch 2.9.1+cu128" in last


def test_import_at_the_floor_does_not_import_torch():
    proc = _import_hfzero_with_torch(f"{FLOOR}.0+cu128")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "torch not imported"


def test_pyproject_and_floor_script_declare_the_same_floor():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch>=([0-9.]+)"', pyproject).group(1) == FLOOR
    script = (ROOT / "tests" / "floor" / "run.sh").read_text()
    assert re.search(r"^FLOOR_TORCH=([0-9.]+)$", script, re.M).group(1) == f"{FLOOR}.0"
    for name in ("transformers", "accelerate"):  # the floor run installs exactly the declared lower bounds
        declared = re.search(rf'"{name}>=([0-9.]+)"', pyproject).group(1)
        assert re.search(rf"^FLOOR_{name.upper()}=([0-9.]+)$", script, re.M).group(1) == declared, name


def _subset() -> list[str]:
    lines = (ROOT / "tests" / "floor" / "subset.txt").read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def test_every_floor_subset_entry_names_an_existing_test():
    entries = _subset()
    assert entries
    for entry in entries:
        path, _, test = entry.partition("::")
        source = ROOT / path
        assert source.is_file(), entry
        if test:
            names = {node.name for node in ast.walk(ast.parse(source.read_text()))
                     if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
            assert test.split("[")[0] in names, entry
