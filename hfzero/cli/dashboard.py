"""``hfzero dashboard RUN_DIR [RUN_DIR ...]``: browse profiles in the Streamlit dashboard.

Replaces itself with ``streamlit run dashboard/app.py`` (headless, no usage statistics, bound to
127.0.0.1 unless ``--host`` says otherwise) and passes it the run directories. A directory may be a
run directory or a parent of run directories (the app's run picker lists each). See
``docs/dashboard.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_PORT = 8501
DEFAULT_HOST = "127.0.0.1"


def register(subparsers: Any) -> None:
    """Add the ``dashboard`` subcommand."""
    parser = subparsers.add_parser(
        "dashboard", help="browse profile runs in a Streamlit dashboard",
        description="Serve the hfzero dashboard (Streamlit + plotly) for profile run directories written by "
        "hfzero.profiler.ZeroProfiler. Each RUN_DIR is a run directory or a directory holding run directories.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="profile run directory, or a parent of them")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to serve on (default {DEFAULT_PORT})")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to bind (default {DEFAULT_HOST}: this machine only; 0.0.0.0 exposes it)")
    parser.set_defaults(func=run)


def app_path() -> Path:
    """``dashboard/app.py``: from the installed ``dashboard`` package, else next to this source tree."""
    spec = importlib.util.find_spec("dashboard")
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent / "app.py"
    return Path(__file__).resolve().parents[2] / "dashboard" / "app.py"


def check_run_dirs(paths: list[str]) -> list[str]:
    """One problem line per path that does not exist or holds no profile run directory."""
    sys.path.insert(0, str(app_path().parent.parent))  # a source checkout without an install
    from dashboard.data import resolve_paths

    _, problems = resolve_paths(paths)
    return problems


def build_command(args: argparse.Namespace) -> list[str]:
    """The ``streamlit run`` command line for ``args``."""
    return [
        sys.executable, "-m", "streamlit", "run", str(app_path()),
        "--server.port", str(args.port), "--server.address", args.host, "--server.headless", "true",
        "--browser.gatherUsageStats", "false", "--global.developmentMode", "false", "--client.toolbarMode", "viewer",
        "--", "--run", *[str(Path(p).resolve()) for p in args.run_dirs],
    ]


def run(args: argparse.Namespace) -> int:
    """Validate the paths (one error line and exit 2 on a bad one), then serve until interrupted."""
    if not 0 < args.port < 65536:
        print(f"hfzero dashboard: error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    problems = check_run_dirs(args.run_dirs)
    if problems:
        print(f"hfzero dashboard: error: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1
                                                            else ""), file=sys.stderr)
        return 2
    print(f"hfzero dashboard: serving on http://{args.host}:{args.port} (Ctrl+C stops it)", flush=True)
    sys.stderr.flush()
    # Become the streamlit server (no child process): a signal to this process reaches the server
    # itself, so stopping `hfzero dashboard` never leaves an orphaned server behind.
    command = build_command(args)
    os.execv(command[0], command)
    return 0  # not reached


def build_parser_for_tests() -> argparse.ArgumentParser:
    """The full ``hfzero`` parser (for tests that check this subcommand's arguments)."""
    from hfzero.cli import build_parser

    return build_parser()
