"""Sharded loading where users call ``from_pretrained`` (hook.py, see docs/loading.md), and sharded
construction for stage 3 (construct.py: ``hfzero.from_pretrained_sharded``, ``hfzero.init_sharded``).

``sharded_init()`` (context manager), ``enable()`` / ``disable()`` (process-wide, used by
``hfzero run --zero_stage N`` and ZeroTrainingArguments, stages 0-3), ``is_enabled()``.
"""

from hfzero.loading.hook import disable, enable, enable_while, is_enabled, sharded_init, wanted

__all__ = ["disable", "enable", "enable_while", "is_enabled", "sharded_init", "wanted"]
