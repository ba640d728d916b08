"""The ``hfzero`` command line: one module per subcommand in this package.

Each subcommand module defines ``register(subparsers) -> None``, which adds its parser and sets
``func`` (called with the parsed namespace, returning an exit code). Modules are discovered, so a
new subcommand is a new file.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hfzero", description="ZeRO for Hugging Face models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from hfzero.logging import configure

    configure()
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
