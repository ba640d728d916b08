"""``hfzero run [torchrun options] SCRIPT [script args]``: torchrun with ``--zero_*`` options for Trainer scripts.

See hfzero/integrations/launch.py and docs/integrations.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hfzero.config import ConfigError, ZeroConfig

_USAGE = """usage: hfzero run [torchrun options] SCRIPT [script args] [--zero_<option> VALUE ...]

Launch SCRIPT on N processes with torch.distributed.run (torchrun). --zero_* options anywhere among
the script's arguments are removed from them, validated before anything starts, and make the
script's transformers.Trainer / TrainingArguments and accelerate.Accelerator train with hfzero's ZeRO
(no hfzero import needed in the script). A script that prepares no model with hfzero (neither
Trainer nor Accelerator) fails with "ZeRO was NOT applied" (exit status 3): options are never
ignored silently. Without --zero_* options this is plain torchrun.

example:
  hfzero run --nproc_per_node 2 examples/train_clm.py --output_dir out --zero_stage 2

ZeRO options:
"""


def _help() -> str:
    lines = [_USAGE]
    for name in ZeroConfig.field_names():
        default = getattr(ZeroConfig(), name)
        lines.append(f"  --zero_{name} (default {default!r})\n      {ZeroConfig.field_doc(name)}")
    lines.append("  --zero_profile_dir DIR\n      write hfzero profiler files (per-rank memory by role, "
                 "communication, phase times) to DIR")
    lines.append("\ntorchrun options: see `python -m torch.distributed.run --help`.")
    return "\n".join(lines)


def register(subparsers: Any) -> None:
    """Add the ``run`` subcommand (arguments are parsed by torchrun's own parser, not argparse here)."""
    parser = subparsers.add_parser(
        "run", help="launch a Trainer/accelerate script on N processes (torchrun) with --zero_* options",
        prefix_chars="+", add_help=False)  # every token, options included, goes to torchrun's parser
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hfzero.integrations.launch import launch

    argv = list(args.argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_help())
        return 0 if argv else 2
    try:
        return launch(argv)
    except ConfigError as error:
        print(f"hfzero run: error: {error}", file=sys.stderr)
        return 2
