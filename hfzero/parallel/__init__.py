"""Parallelism beyond data parallelism, built on the ZeRO engine: the pp x dp mesh and pipelines.

The engine stays ignorant of pipelines: each pipeline stage is a module prepared with
``hfzero.prepare(..., process_group=dp_group)``; see docs/pipeline.md.
"""
