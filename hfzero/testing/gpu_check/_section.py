"""Entry point of one section's process: ``python -m hfzero.testing.gpu_check._section NAME OPTIONS RESULT``.

Imports ``hfzero.testing.gpu_check.<NAME>``, calls its ``run(options, checks)`` and writes the outcome as
JSON to RESULT: status ("pass", "fail" or "skip"), figures, checks and the error text of an exception.
Each check is also appended to ``<out>/results.jsonl`` as the section records it (common.Checks).
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import traceback

from hfzero.logging import get_logger
from hfzero.testing.gpu_check.common import Checks, Options, SectionSkip

logger = get_logger(__name__)


def main(argv: list[str]) -> int:
    name, options, result_path = argv[0], Options.from_json(argv[1]), argv[2]
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # to stderr: the runner keeps it in logs.txt
    checks = Checks(options.out, name)
    outcome: dict = {"figures": {}, "error": None}
    try:
        module = importlib.import_module(f"hfzero.testing.gpu_check.{name}")
        outcome["figures"] = module.run(options, checks) or {}
        outcome["status"] = "pass" if checks.ok and checks.items else "fail"
        if not checks.items:
            outcome["error"] = "the section recorded no check"
    except SectionSkip as skip:
        outcome.update(status="skip", error=str(skip))
    except BaseException:  # noqa: BLE001 - the runner reports it; other sections go on
        outcome.update(status="fail", error=traceback.format_exc()[-4000:])
        logger.error("gpu_check section %s failed:\n%s", name, outcome["error"])  # into logs.txt too
    outcome["checks"] = checks.items
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(outcome, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
