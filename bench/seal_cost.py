"""Cost of sealing: one release + gather of a parameter's storage, raw vs sealed.

    .venv/bin/python bench/seal_cost.py

`released.release_storage` / `restore_storage` add a `__class__` change to the storage
resize; this prints both per parameter, alternating, so the difference is visible
against the noise.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from zero3.params.released import release_storage, restore_storage

PARAMS = [nn.Parameter(torch.randn(64, 64)) for _ in range(200)]
REPEATS = 200


def raw() -> None:
    for p in PARAMS:
        p.untyped_storage().resize_(0)
    for p in PARAMS:
        p.untyped_storage().resize_(p.numel() * p.element_size())


def sealed() -> None:
    for p in PARAMS:
        release_storage(p)
    for p in PARAMS:
        restore_storage(p)


def per_parameter_us(fn) -> float:
    start = time.perf_counter()
    for _ in range(REPEATS):
        fn()
    return (time.perf_counter() - start) / REPEATS / len(PARAMS) * 1e6


if __name__ == "__main__":
    for round_ in range(3):
        r, s = per_parameter_us(raw), per_parameter_us(sealed)
        print(f"round {round_}: raw {r:.2f} us, sealed {s:.2f} us per parameter release+gather "
              f"(+{s - r:.2f} us, ratio {s / r:.2f})")
