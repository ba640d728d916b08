"""The one-command GPU validation: ``python -m hfzero.testing.gpu_check --out DIR`` (see docs/gpu.md).

Each section is a module of this package with ``run(options) -> dict`` (its figures and checks; see
common.py). The runner (runner.py) runs every section in a process of its own under a time limit (two
lanes on the GPU, step_time alone, a 300 s deadline), records pass / fail / skip, figures and error text,
never stops the run on one section's failure, and writes as it goes (results.jsonl, then gpu_check.json and
gpu_check.md after every section, logs.txt; at most 8 files). ``--device cpu --quick`` runs the same code on CPU / gloo
with tiny sizes (tests/test_gpu_check.py), so the command cannot rot between GPU runs.
"""

from hfzero.testing.gpu_check.common import SECTIONS, Options

__all__ = ["SECTIONS", "Options"]
