"""The groups ZeRO runs over and the parallelism built on the engine.

- data_parallel.py: ``hfzero.prepare``, the public entry point: ZeRO over the world, a given group, or HSDP's
  dp_replicate x dp_shard mesh (``ZeroConfig.shard_size``), then the engine (runtime/prepare.py), which takes the
  resolved groups and never builds a mesh;
- mesh.py: the pp x dp mesh and the HSDP shard / replicate groups inside a pipeline stage or a tp mesh;
- pipeline/, tensor.py, sequence/, expert.py: pipelines, tensor, sequence and expert parallelism.

Each wrapper prepares with ``hfzero.prepare`` over the groups it builds: a pipeline stage over its dp group
(docs/pipeline.md), sequence parallelism over the whole world with ``average_over`` = the dp replicas
(docs/sequence.md).
"""
