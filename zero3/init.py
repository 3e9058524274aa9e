"""`zero3.Init()`: build a model already partitioned.

Not yet available: entering the context raises, so that a script relying on it does not
silently build the whole model on every rank.
"""

from __future__ import annotations


class Init:
    """DeepSpeed's `zero.Init` context (construction-time partitioning)."""

    def __init__(self, *args, enabled: bool = True, **kwargs) -> None:
        self.enabled = enabled

    def __enter__(self) -> "Init":
        if self.enabled:
            raise NotImplementedError(
                "zero3.Init() (partitioning while the model is built) is not available yet; "
                "build the model normally and pass it to zero3.initialize, which shards it, "
                "or use zero3.Init(enabled=False)"
            )
        return self

    def __exit__(self, *exc) -> None:
        return None
