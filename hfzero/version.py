"""The package version, a leaf every layer may import (lower layers never import the package root)."""

__version__ = "0.1.0"
