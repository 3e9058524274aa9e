"""zero3 under the Hugging Face Trainer, TRL and Accelerate (the `hf` extra).

    import zero3.hf
    trainer = zero3.hf.Trainer(model=model, args=args, train_dataset=data, zero3_config="ds_config.json")
    SFTTrainer = zero3.hf.trainer_class(trl.SFTTrainer)

Launch with `torchrun` or `accelerate launch` (a plain multi-process config). DeepSpeed
need not be installed; `TrainingArguments.deepspeed` stays unset. An Accelerate custom loop
moves by one import: `from zero3.hf import Accelerator` (accelerator.py).
"""

from __future__ import annotations

import transformers

from zero3.hf.accelerator import Accelerator, Zero3AcceleratorError
from zero3.hf.config_fill import ConfigFillError, fill_from_arguments, fill_from_model
from zero3.hf.options import UnsupportedOptionError
from zero3.hf.trainer import trainer_class

Trainer = trainer_class(transformers.Trainer)

__all__ = ["Accelerator", "ConfigFillError", "Trainer", "UnsupportedOptionError", "Zero3AcceleratorError",
           "fill_from_arguments", "fill_from_model", "trainer_class"]
