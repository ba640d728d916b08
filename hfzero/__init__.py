"""hfzero: ZeRO (Rajbhandari et al.) for Hugging Face models."""

from hfzero.config import ConfigError, ZeroConfig
from hfzero.roles import MODEL_STATE_ROLES, MemoryRole
from hfzero.runtime.engine import ZeroEngine
from hfzero.runtime.optimizer import ZeroOptimizer
from hfzero.runtime.prepare import get_engine, prepare

__all__ = ["ConfigError", "MODEL_STATE_ROLES", "MemoryRole", "ZeroConfig", "ZeroEngine", "ZeroOptimizer",
           "get_engine", "prepare"]
__version__ = "0.1.0"
