"""Parameters: where each one lives, and how it is gathered and released around its use.

The first layer of the engine's core. The forward and backward data path of a step:
`units.py` groups parameters into fetch units (`fetch_unit.py`); `fetch.py` installs the
module hooks and holds that gather a unit's parameters before it runs and release them
after; `discovery.py` notices a parameter read outside its unit and gathers it there;
`lookahead.py` with `schedule.py` prefetch the next units on the order seen last step;
every gather goes through `wire.py` (one coalesced all-gather, guarded by the headers of
`divergence.py`, which turn ranks whose control flow differs into a named error).

A parameter's own state: `partition.py` (its shard and the SHARDED -> GATHERING -> FULL
state machine), `released.py` (a released parameter is sealed: named errors instead of
freed storage), `ownership.py` (which parameters a live engine manages),
`late_params.py` (modules attached after initialize), `nvme_shards.py` (the NVMe tier of
parameter shards: swap files, staging buffers read ahead of the gathers). Building a model already
partitioned: `init.py` (`zero3.Init`) and `init_gather.py` (its gathers).

May import: `zero3.platform`, `zero3.config`, `zero3.placement`, `zero3.nvme` (the foundation). Must not import grads, optim, engine_parts, checkpoint,
compat, hf, the engine or the command line.
"""
