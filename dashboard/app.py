"""Entry point of the dashboard: ``streamlit run dashboard/app.py -- --run RUN_DIR [RUN_DIR ...]``.

``hfzero dashboard`` starts it for you. Run directories may also come from ``HFZERO_DASHBOARD_RUNS``.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import dashboard  # noqa: F401 - installed as a package
except ImportError:  # a source checkout: the package is this file's directory
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dashboard.pages import main

main()
