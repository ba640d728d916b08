"""Parallelism beyond data parallelism, built on the ZeRO engine: the pp x dp mesh and pipelines, the dp x tp
mesh (tensor.py) and the dp x sp mesh of sequence parallelism (sequence/).

The engine stays ignorant of them: each pipeline stage is a module prepared with
``hfzero.prepare(..., process_group=dp_group)`` (docs/pipeline.md); sequence parallelism prepares over the
whole world with ``average_over`` = the dp replicas (docs/sequence.md).
"""
