"""The platform under everything: the device, the process group and the collectives.

- `device.py`: which device a process computes on (the `Accelerator` that DeepSpeed
  scripts reach through `zero3.accelerator.get_accelerator()`);
- `process_group.py`: joining the process group (`zero3.init_distributed`) and leaving it
  at exit;
- `collectives.py`: the `Communicator`, the one object every collective of the engine
  goes through, with its call and byte counters and its in-order asynchronous queue.

May import: torch only. Must not import any other part of zero3.
"""
