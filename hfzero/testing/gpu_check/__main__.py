"""``python -m hfzero.testing.gpu_check --out DIR [--device cuda|cpu] [--quick] [--sections a,b]``.

Exit status 0 when no section failed (skips allowed), 1 otherwise; see docs/gpu.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from hfzero.logging import get_logger
from hfzero.testing.gpu_check.common import SECTIONS, Options
from hfzero.testing.gpu_check.report import environment, write_json, write_markdown
from hfzero.testing.gpu_check.runner import run_all

logger = get_logger(__name__)


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(prog="python -m hfzero.testing.gpu_check",
                                     description="Validate hfzero on one GPU (docs/gpu.md); writes gpu_check.json "
                                                 "and gpu_check.md under --out.")
    parser.add_argument("--out", required=True, help="output folder (created)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (default when a GPU is present) or cpu (the CPU-possible parts, on gloo)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, fewer repetitions (CI)")
    parser.add_argument("--sections", default="", help=f"comma-separated subset of {[s.name for s in SECTIONS]}")
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
    results = run_all(options, names or None)
    env = environment()
    write_json(out / "gpu_check.json", options, results, env)
    write_markdown(out / "gpu_check.md", options, results, env)
    failed = [r.name for r in results if r.status == "fail"]
    logger.info("gpu_check: %d of %d section(s) passed or skipped; failed: %s; report: %s",
                len(results) - len(failed), len(results), failed or "none", out / "gpu_check.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
