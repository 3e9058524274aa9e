"""Run by torchrun in test_multinode.py: `phase` "first" trains 4 steps straight (losses
recorded), then 2 steps in a new engine and saves; "second" loads that checkpoint in new
processes and trains the last 2 steps. The device comes from LOCAL_RANK (0 on each
single-process node), the shard from RANK."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import config, make_batches, make_model, two_param_groups  # noqa: E402

import zero3  # noqa: E402

MICRO, STEPS = 2, 4


def build():
    model = make_model()
    return zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                            config=config(MICRO, 1))[0]


def train(engine, steps, start):
    rank, world = engine.global_rank, engine.world_size
    batches = make_batches(STEPS * world, MICRO)
    losses = []
    for step in range(start, start + steps):
        x, y = batches[step * world + rank]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def main(phase: str, folder: str) -> None:
    zero3.init_distributed()
    rank = int(os.environ["RANK"])
    assert int(os.environ["LOCAL_RANK"]) == 0 and zero3.comm.get_local_rank() == 0
    engine = build()
    assert engine.global_rank == rank and engine.world_size == 2
    if phase == "first":
        straight = train(engine, STEPS, 0)
        engine.destroy()
        engine = build()
        train(engine, 2, 0)
        engine.save_checkpoint(folder)
        with open(os.path.join(folder, f"straight-{rank}.json"), "w") as f:
            json.dump(straight, f)
    else:
        path, _ = engine.load_checkpoint(folder)
        assert path.endswith("global_step2"), path
        resumed = train(engine, 2, 2)
        with open(os.path.join(folder, f"straight-{rank}.json")) as f:
            straight = json.load(f)
        assert resumed == straight[2:], (resumed, straight)
        with open(os.path.join(folder, f"resumed-{rank}.json"), "w") as f:
            json.dump(resumed, f)
    engine.destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
