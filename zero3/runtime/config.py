"""`deepspeed.runtime.config`: its exception class and optimizer-name constants.

The names are DeepSpeed's (lower case, as its config compares them). zero3 builds Adam,
AdamW and SGD from a config's `optimizer` section; the others name DeepSpeed's own
optimizers and are refused there with a ConfigError that says so."""

from zero3.config import ConfigError, DeepSpeedConfigError

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER,
    ZERO_ONE_ADAM_OPTIMIZER, MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER,
]
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True

__all__ = ["ConfigError", "DeepSpeedConfigError", "DEEPSPEED_OPTIMIZERS", "ADAM_OPTIMIZER", "ADAMW_OPTIMIZER"]
