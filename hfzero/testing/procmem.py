"""The process's resident memory as Linux reports it, for tests and benchmarks that measure real peaks.

``status("VmHWM")`` is the peak resident set since the process started or since the last
``reset_peak()`` (which writes 5 to /proc/self/clear_refs: VmHWM := VmRSS now). Linux only; callers
skip where /proc is missing. Holds nothing.
"""

from __future__ import annotations

import gc


def status(field: str, path: str = "/proc/self/status") -> int:
    """A figure of /proc/self/status (VmRSS, VmHWM, ...) or, with ``path``, /proc/meminfo, in bytes."""
    with open(path, encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> int:
    """Collect garbage, reset VmHWM to the current RSS and return that RSS (bytes)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    return status("VmRSS")
