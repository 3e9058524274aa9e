"""The zero3 package version (one place, read by the package and by checkpoints)."""

__version__ = "0.1.0"
