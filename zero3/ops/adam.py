"""`deepspeed.ops.adam.FusedAdam` and `DeepSpeedCPUAdam`, with DeepSpeed's arguments.

zero3 runs any elementwise torch optimizer over its shards, so these build torch's own:
AdamW (decoupled weight decay, DeepSpeed's default `adamw_mode=True`) or Adam (L2 weight
decay, `adamw_mode=False`), fused on CUDA parameters. They are functions that return the
optimizer, so the result is a plain torch optimizer (its state dict, its hyper-parameters).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _adam(params: Iterable, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
          amsgrad: bool, adamw_mode: bool, bias_correction: bool, who: str) -> torch.optim.Optimizer:
    if not bias_correction:
        raise ValueError(f"{who}(bias_correction=False) has no torch equivalent; use bias_correction=True")
    params = list(params)
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    fused = bool(tensors) and all(p.is_cuda for p in tensors)
    kind = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    return kind(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                fused=fused or None)


def FusedAdam(params: Iterable, lr: float = 1e-3, bias_correction: bool = True,  # noqa: N802 - DeepSpeed's name
              betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
              weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> torch.optim.Optimizer:
    """DeepSpeed's FusedAdam: torch AdamW (adam_w_mode) or Adam."""
    del set_grad_none  # zero3 always drops gradients after the step
    return _adam(params, lr, betas, eps, weight_decay, amsgrad, adam_w_mode, bias_correction, "FusedAdam")


def DeepSpeedCPUAdam(model_params: Iterable, lr: float = 1e-3, bias_correction: bool = True,  # noqa: N802
                     betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                     amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True
                     ) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adam: torch AdamW (adamw_mode) or Adam over the (offloaded) shards."""
    if not fp32_optimizer_states:
        raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False): zero3 keeps optimizer states in fp32")
    return _adam(model_params, lr, betas, eps, weight_decay, amsgrad, adamw_mode, bias_correction,
                 "DeepSpeedCPUAdam")
