"""Writers of the check's outcome: ``gpu_check.json`` (everything) and ``gpu_check.md`` (a summary), rewritten
by the runner after every section."""

from __future__ import annotations

import dataclasses
import json
import platform
from pathlib import Path
from typing import Any

from hfzero.testing.gpu_check.common import SECTIONS, Options, SectionResult


def environment() -> dict[str, Any]:
    """Versions and the device the run saw."""
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=props.name, device_memory=props.total_memory, device_count=torch.cuda.device_count())
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def write_json(path: Path, options: Options, results: list[SectionResult], env: dict[str, Any]) -> None:
    payload = {"format_version": 1, "options": dataclasses.asdict(options), "environment": env,
               "passed": all(r.status != "fail" for r in results),
               "sections": [dataclasses.asdict(r) for r in results]}
    path.write_text(json.dumps(payload, indent=1, default=str))


def _cell(text: Any, width: int = 160) -> str:
    s = " ".join(str(text).split()).replace("|", "/")
    return s if len(s) <= width else s[: width - 3] + "..."


def write_markdown(path: Path, options: Options, results: list[SectionResult], env: dict[str, Any]) -> None:
    what = {s.name: s.checks for s in SECTIONS}
    lines = ["# hfzero GPU check", "",
             f"device `{options.device}`{' (quick)' if options.quick else ''}; torch {env.get('torch')}, "
             f"CUDA {env.get('cuda')}, {env.get('device_name', 'no CUDA device')}", "",
             "| section | status | seconds | what it checks |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | **{r.status}** | {r.seconds:.1f} / {r.limit_s} | {_cell(what.get(r.name, ''))} |")
    for r in results:
        lines += ["", f"## {r.name}: {r.status}", ""]
        if r.error:
            lines += ["```", r.error.strip()[-1500:], "```", ""]
        for check in r.checks:
            mark = "ok" if check["ok"] else "FAILED"
            lines.append(f"- {mark}: {check['name']}" + (f" ({_cell(check['detail'], 300)})" if check["detail"] else ""))
        summary = r.figures.get("summary")
        if summary:
            lines += ["", "```", json.dumps(summary, indent=1, default=str)[:4000], "```"]
    lines += ["", "Full figures: gpu_check.json; every check as it was recorded: results.jsonl; output: logs.txt."]
    path.write_text("\n".join(lines) + "\n")
