"""hfzero: ZeRO (Rajbhandari et al.) for Hugging Face models."""

from hfzero.config import ConfigError, ZeroConfig
from hfzero.roles import MODEL_STATE_ROLES, MemoryRole

__all__ = ["ConfigError", "MODEL_STATE_ROLES", "MemoryRole", "ZeroConfig"]
__version__ = "0.1.0"
