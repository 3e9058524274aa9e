"""`deepspeed.utils.torch`: `required_torch_version`, as DeepSpeed's."""

from __future__ import annotations

import torch
from packaging import version


def required_torch_version(min_version: str | float | None = None, max_version: str | float | None = None) -> bool:
    """Whether the installed torch is at least `min_version` and at most `max_version`."""
    assert min_version or max_version, "Must provide a min_version or max_version argument"
    installed = version.parse(torch.__version__)
    if min_version and version.parse(str(min_version)) > installed:
        return False
    if max_version and version.parse(str(max_version)) < installed:
        return False
    return True
