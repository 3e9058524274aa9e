"""What `zero3 checkpoint export-deepspeed` refuses because DeepSpeed's layout cannot hold it.

Two zero3 checkpoints of one run on 2 ranks (a model whose second layer is used on the
first step only; AdamW):

- `clash`, saved after step 1 with a client_state key that is one of DeepSpeed's own
  model-file entries (`global_steps`): DeepSpeed writes the client_state into that same
  dict, so it would read the client's value as its step counter;
- `uneven`, saved after step 2: the second layer's parameters have Adam step 1, the
  first layer's step 2, and DeepSpeed keeps one step per sub-group.

Each export fails with exit status 1, an error naming what and how to fix it, and
nothing written; the fix the error names (another sub_group_size) then exports.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import run_ranks
from torch import nn

WORLD = 2


class SkipsSecond(nn.Module):
    """`first` always runs; `second` only while `use_second` (the same on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.use_second = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.use_second:
            h = self.second(h)
        return h.square().mean()


def save_worker(rank: int, world: int, root: str) -> None:
    import zero3

    torch.manual_seed(0)
    model = SkipsSecond()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                       config=config)
    for step in range(2):
        engine.module.use_second = step == 0
        loss = engine(torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + rank)))
        engine.backward(loss)
        engine.step()
        if step == 0:
            engine.save_checkpoint(f"{root}/clash", client_state={"global_steps": 99, "epoch": 1})
    engine.save_checkpoint(f"{root}/uneven")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("refusals")
    run_ranks(save_worker, WORLD, str(root), timeout=300)
    return root


def _export(src: Path, dst: Path, *extra: str) -> int:
    from zero3.cli import main

    return main(["checkpoint", "export-deepspeed", str(src), str(dst), "--world-size", str(WORLD), *extra])


def _nothing_written(dst: Path) -> bool:
    return not dst.exists() or not any(dst.iterdir())


def test_a_sub_group_whose_parameters_have_different_step_counts_is_refused(saved, tmp_path, capsys):
    dst = tmp_path / "ds"
    assert _export(saved / "uneven", dst) == 1
    err = capsys.readouterr().err
    assert "optimizer state 'step' differs within DeepSpeed sub-group 0" in err
    assert "'first.weight': 2.0" in err and "'second.weight': 1.0" in err  # which, with their counts
    assert "--sub-group-size" in err and "zero_optimization.sub_group_size" in err  # how to fix it
    assert _nothing_written(dst)


def test_the_sub_group_size_the_refusal_names_exports_each_count_in_its_own_sub_group(saved, tmp_path):
    from zero3.checkpoint.deepspeed.unpickle import load_deepspeed_file

    dst = tmp_path / "ds"
    # per rank: first.weight 8 + first.bias 2 elements reach 10: the second layer starts sub-group 1
    assert _export(saved / "uneven", dst, "--sub-group-size", "10") == 0
    for rank in range(WORLD):
        optim = load_deepspeed_file(dst / "global_step2" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        state = optim["optimizer_state_dict"]["optimizer_state_dict"]["state"]
        assert [float(state[i]["step"]) for i in sorted(state)] == [2.0, 1.0]


def test_client_state_keys_that_are_deepspeeds_own_names_are_refused(saved, tmp_path, capsys):
    dst = tmp_path / "ds"
    assert _export(saved / "clash", dst) == 1
    err = capsys.readouterr().err
    assert "client_state keys ['global_steps'] are names DeepSpeed uses" in err  # what ('epoch' is fine)
    assert "rename them in the client_state given to save_checkpoint" in err  # how to fix it
    assert _nothing_written(dst)
