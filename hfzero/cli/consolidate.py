"""``hfzero consolidate CKPT_DIR OUT_DIR``: export a hfzero checkpoint as a Hugging Face model directory.

See docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``consolidate`` subcommand."""
    parser = subparsers.add_parser(
        "consolidate",
        help="export a sharded hfzero checkpoint (any world size/stage) as a from_pretrained-loadable directory",
        description="Assemble the full parameters of a hfzero checkpoint, tensor by tensor (memory: about the "
        "largest tensor), into OUT_DIR: config.json plus safetensors weights, sharded with an index above "
        "--max-shard-size.",
    )
    parser.add_argument("ckpt_dir", metavar="CKPT_DIR", help="a directory written by hfzero save_checkpoint")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the Hugging Face model directory to write")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest weight file, in bytes or e.g. 500MB, 5GB, 2GiB (default 5GB)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="cast floating-point parameters (default: the dtype each trained in)")
    parser.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of the checkpoint files")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    parser.add_argument("--json", action="store_true", help="print what was written as JSON")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hfzero.checkpoint import CheckpointError, consolidate

    try:
        result = consolidate(args.ckpt_dir, args.out_dir, max_shard_size=args.max_shard_size, dtype=args.dtype,
                             verify=not args.no_verify, overwrite=args.overwrite)
    except CheckpointError as exc:
        print(f"hfzero consolidate: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(f"wrote {result.out_dir}: {result.tensors} tensors, {result.total_bytes / 1e6:.1f} MB in "
              f"{len(result.files)} file(s)" + ("" if result.has_config else " (no config.json: the model had none)"))
    return 0
