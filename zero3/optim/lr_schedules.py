"""Learning-rate schedulers with the names, parameters and behaviour of DeepSpeed 0.19.8.

These are the schedulers a DeepSpeed config names in its ``scheduler`` section::

    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 100}}

Each one wraps a plain ``torch.optim.Optimizer`` (or an object with an ``.optimizer``
attribute holding one) and writes the learning rate of every param group itself.  They
count *batches* (optimizer steps), not epochs:

* ``last_batch_iteration`` is the index of the last batch the schedule was stepped to.
  ``-1`` (the default) means "not started": the constructor then writes the schedule's
  starting lr into the optimizer.  Any other value means "resuming": the constructor leaves
  the optimizer alone and the next ``step()`` moves on from there.
* ``step(i=None)`` advances to batch ``i`` (default: the next one), computes the lr for it
  and writes it into every param group.
* ``get_lr()`` computes the lr for ``last_batch_iteration`` without writing it;
  ``get_last_lr()`` returns what the last write put into the param groups.
* ``state_dict()`` is ``{"last_batch_iteration": int}`` and nothing else (as DeepSpeed's),
  so it loads with ``torch.load(weights_only=True)`` and checkpoints are interchangeable.
  ``load_state_dict()`` only restores the counter; the optimizer's lr changes on the next
  ``step()`` (the engine restores the optimizer's own state, lr included, separately).

The DeepSpeed engine constructs the scheduler after the optimizer, does not step it at
construction, and steps it once after every optimizer step (at the gradient-accumulation
boundary), skipping steps whose fp16 gradients overflowed.  So the first optimizer step
runs with the lr the constructor wrote (batch "-1"), the second with batch 0's, and so on.

Where a parameter is documented as "float or list", a list/tuple gives one value per param
group (its length must match) and a scalar is used for all groups.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence, Union

import torch
from torch.optim import Optimizer

__all__ = [
    "LRRangeTest",
    "OneCycle",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "SCHEDULERS",
    "WARMUP_LOG_RATE",
    "WARMUP_LINEAR_RATE",
]

logger = logging.getLogger(__name__)

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

FloatOrList = Union[float, Sequence[float]]
Lr = Union[float, torch.Tensor]


# ---------------------------------------------------------------------------------------
# helpers


def _torch_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer itself, or the one a wrapper keeps in ``.optimizer``."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer "
                    "(nor wraps one in an 'optimizer' attribute)")


def _per_group(optimizer: Optimizer, value: Any, name: str) -> list:
    """``value`` as one entry per param group: a list/tuple is checked, a scalar repeated."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: expected {n} values (one per param group), got {len(value)}")
        return list(value)
    return [value] * n


def _write_lrs(param_groups: list[dict], lrs: Sequence[Lr]) -> list[Lr]:
    """Put ``lrs`` into the param groups (in place for tensor lrs); return the groups' lrs."""
    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def _check_warmup_steps(warmup_num_steps: Any) -> int:
    if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    # A one-step warmup would divide by log(1) = 0; DeepSpeed silently uses two.
    return max(2, warmup_num_steps)


def _check_warmup_type(warmup_type: str) -> str:
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        logger.warning("unknown warmup_type %r; using %r", warmup_type, WARMUP_LOG_RATE)
        return WARMUP_LOG_RATE
    return warmup_type


def _warmup_fraction(warmup_type: str, it: int, warmup_num_steps: int) -> float:
    """Warmup progress in [0, 1) at batch ``it`` (0 <= it < W):

    * ``log``:    log(it + 1) / log(W)
    * ``linear``: it / W
    """
    if warmup_type == WARMUP_LOG_RATE:
        # (1 / log W) * log(it + 1): the same rounding as DeepSpeed, so curves match bit for bit
        return (1.0 / math.log(warmup_num_steps)) * math.log(it + 1)
    return it / warmup_num_steps


# ---------------------------------------------------------------------------------------
# base


class _BatchScheduler:
    """Shared counter, ``get_last_lr`` and state handling; subclasses define ``get_lr``."""

    optimizer: Optimizer
    last_batch_iteration: int

    def get_lr(self) -> list[Lr]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _advance(self, batch_iteration: int | None) -> None:
        self.last_batch_iteration = (self.last_batch_iteration + 1
                                     if batch_iteration is None else batch_iteration)
        self._last_lr = _write_lrs(self.optimizer.param_groups, self.get_lr())

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Move to batch ``last_batch_iteration`` (default: the next) and write its lr."""
        self._advance(last_batch_iteration)

    def get_last_lr(self) -> list[Lr]:
        """The lrs last written into the param groups (``step()`` must have run, or the
        constructor must have written the starting lr)."""
        last = getattr(self, "_last_lr", None)
        if last is None:
            raise AssertionError("need to call step() first")
        return last

    def state_dict(self) -> dict[str, int]:
        it = self.last_batch_iteration
        return {"last_batch_iteration": it.item() if torch.is_tensor(it) else it}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_batch_iteration = state_dict["last_batch_iteration"]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(last_batch_iteration={self.last_batch_iteration})"


# ---------------------------------------------------------------------------------------
# LRRangeTest


class LRRangeTest(_BatchScheduler):
    """Learning-rate range test: grow the lr from ``lr_range_test_min_lr`` without bound.

    With ``n = last_batch_iteration + 1``, ``S = lr_range_test_step_size`` and
    ``r = lr_range_test_step_rate``::

        interval = n / S                   (floor(n / S) if lr_range_test_staircase)
        lr       = min_lr * (1 + r * interval)

    At construction (``last_batch_iteration == -1``) every group's lr is set to ``min_lr``.
    """

    def __init__(self,
                 optimizer: Optimizer,
                 lr_range_test_min_lr: FloatOrList = 1e-3,
                 lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1) -> None:
        self.optimizer = _torch_optimizer(optimizer)
        self.min_lr = _per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        if not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size <= 0:
            raise ValueError("lr_range_test_step_size must be a positive integer, "
                             f"got {lr_range_test_step_size!r}")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer.param_groups, self.min_lr)

    def _interval(self) -> float:
        n = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(n) if self.staircase else n

    def get_lr(self) -> list[Lr]:
        factor = 1 + self.step_rate * self._interval()
        return [lr * factor for lr in self.min_lr]

    def step(self, batch_iteration: int | None = None) -> None:
        """Move to batch ``batch_iteration`` (default: the next) and write its lr."""
        self._advance(batch_iteration)


# ---------------------------------------------------------------------------------------
# OneCycle


class OneCycle(_BatchScheduler):
    """1Cycle policy: one triangular lr cycle (momentum cycled the opposite way), then decay.

    Let ``n = last_batch_iteration + 1``, ``F = cycle_first_step_size``,
    ``G = cycle_second_step_size`` (default ``F``), ``T = F + G`` and ``rho = F / T``.

    **Cycle phase** (``last_batch_iteration < T``)::

        x     = 1 + n / T - floor(1 + n / T)           # position in the cycle, [0, 1)
        scale = x / rho                 if x <= rho    # rising half
              = (x - 1) / (rho - 1)     otherwise      # falling half
        lr    = cycle_min_lr  + (cycle_max_lr  - cycle_min_lr)  * scale
        mom   = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale

    With a stair count ``K > 0`` for the half in question (``cycle_first_stair_count``;
    ``cycle_second_stair_count`` defaults to it), the scale moves in ``K`` flat stairs,
    computed from the integer offset ``c = n mod T``::

        scale = floor(c * K / F) / K            if c <= F
              = floor((T - c) * K / G) / K      otherwise

    **Decay phase** (``last_batch_iteration >= T``), with ``d = last_batch_iteration - T + 1``
    and ``D = decay_step_size``::

        lr  = cycle_min_lr  / (1 + decay_lr_rate  * d / D)
        mom = cycle_max_mom * (1 + decay_mom_rate * d / D)

    If ``D`` is 0 (the default) or a rate is 0, that quantity stays at ``cycle_min_lr``
    (lr) or ``cycle_max_mom`` (momentum) after the cycle.

    **Momentum** is only cycled when ``cycle_momentum`` is true *and* the optimizer has
    ``betas`` in its defaults (Adam-style); otherwise a warning is logged and only the lr is
    scheduled (SGD's ``momentum`` is never touched).  Like DeepSpeed, the scheduler writes
    ``group["betas"] = (mom, 0.99)``: the second beta is replaced by 0.99.

    At construction (``last_batch_iteration == -1``) every group's lr is set to
    ``cycle_min_lr`` and, when momentum is cycled, its betas to ``(cycle_min_mom, 0.99)``.
    ``get_last_lr()`` is only available after the first ``step()``.
    """

    def __init__(self,
                 optimizer: Optimizer,
                 cycle_min_lr: FloatOrList,
                 cycle_max_lr: FloatOrList,
                 decay_lr_rate: float = 0.,
                 cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0,
                 cycle_momentum: bool = True,
                 cycle_min_mom: FloatOrList = 0.8,
                 cycle_max_mom: FloatOrList = 0.9,
                 decay_mom_rate: float = 0.,
                 last_batch_iteration: int = -1) -> None:
        self.optimizer = _torch_optimizer(optimizer)

        # cycle shape
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size!r}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {cycle_second_step_size!r}")
        self.first_step_size = first
        self.second_step_size = second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size

        # lr
        self.min_lrs = _per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        no_decay = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)

        # momentum
        self.cycle_momentum = bool(cycle_momentum)
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = True
        if self.cycle_momentum and "betas" not in self.optimizer.defaults:
            logger.warning("OneCycle: cycle_momentum disabled, %s has no 'betas' in its defaults",
                           type(self.optimizer).__name__)
            self.cycle_momentum = False
        if self.cycle_momentum:
            self.min_moms = [(m, 0.99) for m in _per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, 0.99) for m in _per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")]
            self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)

        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            _write_lrs(self.optimizer.param_groups, self.min_lrs)
            if self.cycle_momentum:
                self._write_moms(self.min_moms)

    # -- shape ---------------------------------------------------------------------------

    def _scale(self) -> float:
        """Height in the cycle at batch ``last_batch_iteration + 1``: 0 at the ends, 1 at the peak."""
        n = self.last_batch_iteration + 1
        pos = 1. + n / self.total_size
        x = pos - math.floor(pos)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            c = n % self.total_size
            if c <= self.first_step_size:
                stair = c * stairs / self.first_step_size
            else:
                stair = (self.total_size - c) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    # -- lr / momentum -------------------------------------------------------------------

    def get_lr(self) -> list[Lr]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The betas for ``last_batch_iteration`` (None when momentum is not cycled)."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [(hi - (hi - lo) * scale, b2) for (lo, b2), (hi, _) in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_interval()
        return [(hi * factor, b2) for hi, b2 in self.max_moms]

    def _write_moms(self, moms: Sequence[tuple[float, float]]) -> None:
        for group, betas in zip(self.optimizer.param_groups, moms):
            group["betas"] = betas

    def step(self, batch_iteration: int | None = None) -> None:
        """Move to batch ``batch_iteration`` (default: the next); write its lr (and betas)."""
        self._advance(batch_iteration)
        if self.cycle_momentum:
            self._write_moms(self.get_mom())


# ---------------------------------------------------------------------------------------
# Warmup family


class WarmupLR(_BatchScheduler):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``W`` batches, then hold.

    With ``it = last_batch_iteration`` and ``W = max(2, warmup_num_steps)``::

        gamma = log(it + 1) / log(W)   if it < W and warmup_type == "log"
              = it / W                 if it < W and warmup_type == "linear"
              = 1                      otherwise
        lr    = min_lr + (max_lr - min_lr) * gamma

    ``warmup_max_lr`` defaults to each param group's lr at construction.  An unknown
    ``warmup_type`` falls back to ``"log"`` with a warning.  Before the schedule starts
    (``it < 0``) the lr is ``min_lr``; in particular the constructor (with
    ``last_batch_iteration == -1``) writes ``warmup_min_lr`` into every group.
    """

    def __init__(self,
                 optimizer: Optimizer,
                 warmup_min_lr: FloatOrList = 0.0,
                 warmup_max_lr: FloatOrList | None = None,
                 warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1) -> None:
        num_steps = _check_warmup_steps(warmup_num_steps)
        self.optimizer = _torch_optimizer(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = num_steps
        self.warmup_type = _check_warmup_type(warmup_type)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer.param_groups, self.get_lr())

    def _get_gamma(self) -> float:
        """Fraction of ``max_lr - min_lr`` to add at ``last_batch_iteration`` (>= 0)."""
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, self.last_batch_iteration, self.warmup_num_steps)
        return 1.0

    def get_lr(self) -> list[Lr]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """Warm up like :class:`WarmupLR`, then decay linearly to 0 at ``total_num_steps``.

    With ``it = last_batch_iteration``, ``W = max(2, warmup_num_steps)`` and
    ``N = total_num_steps``, ``gamma`` is WarmupLR's for ``it < W``, and after that::

        gamma = max(0, (N - it) / max(1, N - W))
        lr    = min_lr + (max_lr - min_lr) * gamma

    so the lr reaches ``warmup_min_lr`` at batch ``N`` and stays there.  Unlike WarmupLR,
    ``warmup_max_lr`` defaults to 0.001.  ``N < W`` only logs a warning.
    """

    def __init__(self,
                 optimizer: Optimizer,
                 total_num_steps: int,
                 warmup_min_lr: FloatOrList = 0.0,
                 warmup_max_lr: FloatOrList = 0.001,
                 warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning("total_num_steps %s is less than warmup_num_steps %s",
                           total_num_steps, warmup_num_steps)

    def _get_gamma(self) -> float:
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, it, self.warmup_num_steps)
        remaining = float(self.total_num_steps - it)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_BatchScheduler):
    """Scale each group's own lr: warm up from a ratio to 1, then cosine-decay to a ratio.

    ``base_lr`` is each param group's lr when the scheduler is constructed.  With
    ``it = last_batch_iteration``, ``W = max(2, warmup_num_steps)``, ``N = total_num_steps``,
    ``a = warmup_min_ratio`` and ``b = cos_min_ratio``::

        warmup (it < W):  ratio = a + (1 - a) * f        f = log(it + 1) / log(W)  ("log")
                                                           f = it / W               ("linear")
        after:            p     = min(1, (it - W + 1) / max(1, N - W))
                          ratio = max(0, b + (1 - b) * (1 + cos(pi * p)) / 2)
        lr = base_lr * ratio

    Before the schedule starts (``it < 0``) the lr is 0: the constructor (with
    ``last_batch_iteration == -1``) writes 0.0 into every group.  The config gives no lr
    for this scheduler; it comes from the optimizer.  ``N < W`` only logs a warning (the
    ratio then drops to ``b`` right after warmup).
    """

    def __init__(self,
                 optimizer: Optimizer,
                 total_num_steps: int,
                 warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001,
                 warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1) -> None:
        num_steps = _check_warmup_steps(warmup_num_steps)
        self.optimizer = _torch_optimizer(optimizer)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_num_steps = num_steps
        self.warmup_type = _check_warmup_type(warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning("total_num_steps %s is less than warmup_num_steps %s",
                           total_num_steps, warmup_num_steps)
        self.org_lrs: list[Lr] = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"]
                                  for g in self.optimizer.param_groups]
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer.param_groups, self.get_lr())

    def get_lr_ratio(self) -> float:
        """The factor applied to every group's base lr at ``last_batch_iteration``."""
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            f = _warmup_fraction(self.warmup_type, it, self.warmup_num_steps)
            return self.warmup_min_ratio + f * (1. - self.warmup_min_ratio)
        progress = min(1.0, (it - self.warmup_num_steps + 1) /
                       max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1. - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[Lr]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.org_lrs]


SCHEDULERS: dict[str, type] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}
