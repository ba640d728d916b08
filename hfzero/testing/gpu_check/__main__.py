"""``python -m hfzero.testing.gpu_check --out DIR [--device cuda|cpu] [--quick] [--sections a,b]
[--lanes N] [--deadline S]``.

Exit status 0 when no section failed (skips allowed), 1 otherwise; see docs/gpu.md and runner.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from hfzero.logging import get_logger
from hfzero.testing.gpu_check.common import SECTIONS, Options
from hfzero.testing.gpu_check.report import environment
from hfzero.testing.gpu_check.runner import DEADLINE_S, run_all

logger = get_logger(__name__)


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(prog="python -m hfzero.testing.gpu_check",
                                     description="Validate hfzero on one GPU (docs/gpu.md); writes results.jsonl (as "
                                                 "it goes), gpu_check.json, gpu_check.md and logs.txt under --out.")
    parser.add_argument("--out", required=True, help="output folder (created)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (default when a GPU is present) or cpu (the CPU-possible parts, on gloo)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, fewer repetitions (CI)")
    parser.add_argument("--sections", default="", help=f"comma-separated subset of {[s.name for s in SECTIONS]}")
    parser.add_argument("--lanes", type=int, default=None,
                        help="sections sharing the GPU at a time (default 2 on cuda, 1 on cpu); step_time runs alone")
    parser.add_argument("--deadline", type=float, default=None,
                        help=f"seconds for the whole run (default {DEADLINE_S} on a full cuda run, none otherwise; "
                             "0: none); sections that cannot start before it are recorded as not run")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible; pass --device cpu to run the CPU parts")
    names = [n for n in args.sections.split(",") if n]
    known = {s.name for s in SECTIONS}
    if set(names) - known:
        parser.error(f"--sections: unknown {sorted(set(names) - known)}; choose from {[s.name for s in SECTIONS]}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    options = Options(device=args.device, quick=args.quick, out=str(out.resolve()))
    lanes = args.lanes if args.lanes is not None else (2 if args.device == "cuda" else 1)
    deadline = args.deadline if args.deadline is not None else (
        DEADLINE_S if args.device == "cuda" and not args.quick else 0)
    results = run_all(options, names or None, lanes=max(1, lanes), deadline_s=deadline or None, env=environment())
    failed = [r.name for r in results if r.status == "fail"]
    logger.info("gpu_check: %d of %d section(s) passed or skipped; failed: %s; report: %s",
                len(results) - len(failed), len(results), failed or "none", out / "gpu_check.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
