"""`zero3 launch`: `accelerate launch` with an Accelerate DeepSpeed yaml, DeepSpeed not installed.

    zero3 launch --config_file ds_zero3.yaml train.py --the-script's-arguments

The flags and the yaml are Accelerate's own (its parser, its config reading). For a DeepSpeed
yaml, the processes get the environment Accelerate's DeepSpeed launcher gives them
(ACCELERATE_USE_DEEPSPEED, the ACCELERATE_DEEPSPEED_* settings of the yaml: its
deepspeed_config_file or zero_stage / offload devices / accumulation / clipping, mixed
precision; ACCELERATE_USE_CPU with use_cpu), and torchrun starts them on this machine (on
several machines, one `zero3 launch` each, as Accelerate's `deepspeed_multinode_launcher:
standard`). The script's `zero3.hf.Accelerator()` builds its engine from that environment. A
yaml without DeepSpeed is launched by Accelerate unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from accelerate.commands.launch import _run_torchrun, _validate_launch_command, launch_command, launch_command_parser
    from accelerate.utils import patch_environment
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = launch_command_parser()
    parser.prog = "zero3 launch"
    args, defaults, mixed_from_config = _validate_launch_command(parser.parse_args(argv))
    if not args.use_deepspeed:
        launch_command(parser.parse_args(argv))
        return 0
    if args.num_machines > 1 and args.deepspeed_multinode_launcher != "standard":
        raise SystemExit(f"zero3 launch: deepspeed_multinode_launcher {args.deepspeed_multinode_launcher!r} starts "
                         "DeepSpeed's own launcher; run `zero3 launch` on each machine with "
                         "deepspeed_multinode_launcher: standard (torchrun's rendezvous)")
    fields = list(defaults.deepspeed_config.keys()) if defaults else []
    if mixed_from_config:
        fields.append("mixed_precision")
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, environment = prepare_deepspeed_cmd_env(args)
    if args.cpu:
        environment["ACCELERATE_USE_CPU"] = "true"
    with patch_environment(**environment):
        _run_torchrun(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
