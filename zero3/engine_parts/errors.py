"""The engine's own error classes, importable by every engine part (build.py re-exports them)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine cannot do what was asked (the message says why and what to do)."""


class EngineUsageError(EngineError, AssertionError):
    """A call DeepSpeed refuses with an `assert` (a non-scalar loss, backward or scale without
    an optimizer): also an AssertionError, so DeepSpeed code that catches one still does."""
