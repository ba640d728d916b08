"""Helpers for multi-process tests, examples and benchmarks (not needed at training time)."""

from hfzero.testing.spawn import WorkerFailure, run_distributed, run_fake_rank

__all__ = ["WorkerFailure", "run_distributed", "run_fake_rank"]
