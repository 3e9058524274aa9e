"""Ulysses sequence parallelism and the long_sequence section under the engine, on real gloo
ranks (2 and 4): losses and gradients equal the run on whole sequences (fp32, within 1e-5),
resume is exact under the same degree and continues under none; the tiled pieces equal the
untiled model (within 1e-6), with LoRA and with HF gradient checkpointing; DeepSpeed's data
loader adapter cuts batches as DeepSpeed's does; bad inputs are clear errors on every rank."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed: pip install zero3[hf]")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import sp_cases  # noqa: E402
import torch  # noqa: E402
from harness import run_ranks  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent),
                                                             os.environ.get("PYTHONPATH", "")])}


def _close(a: dict, b: dict, atol: float, rtol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _check_parity_and_resume(results: list[dict], sp: int) -> None:
    for rank, r in enumerate(results):
        assert r["sp"]["losses"] == pytest.approx(r["whole"]["losses"], abs=1e-5, rel=0), rank
        _close(r["sp"]["grads"], r["whole"]["grads"], atol=1e-5)
        _close(r["sp_params"], r["whole_params"], atol=1e-5)
        assert r["sp_resumed"]["losses"] == r["sp"]["losses"][1:], "resume under the same degree is exact"
        _equal(r["sp_resumed_params"], r["sp_params"])
        assert r["whole_resumed"]["losses"] == pytest.approx(r["sp"]["losses"][1:], abs=1e-5, rel=0)
        _close(r["whole_resumed_params"], r["sp_params"], atol=1e-5)
    for group_start in range(0, len(results), sp):  # the ranks of a group agree on the sequence's loss
        group = results[group_start:group_start + sp]
        assert all(r["sp"]["losses"] == group[0]["sp"]["losses"] for r in group)


def test_sp2_on_two_ranks_matches_whole_sequences_and_resumes(tmp_path):
    _check_parity_and_resume(run_ranks(sp_cases.parity_and_resume, 2, 2, str(tmp_path), timeout=400, env=ENV), 2)


def test_sp4_with_fewer_kv_heads_than_ranks(tmp_path):
    """4 query heads and 2 key/value heads over 4 ranks: each kv head serves two ranks."""
    _check_parity_and_resume(run_ranks(sp_cases.parity_and_resume, 4, 4, str(tmp_path), timeout=600, env=ENV), 4)


def test_sp2_times_dp2_on_four_ranks_with_lora_and_the_tiled_pieces(tmp_path):
    """The hidden states go to NVMe swap files here (no host share): they come back exactly."""
    (tmp_path / "hidden").mkdir()
    pieces = {"tiled_mlp": True, "mlp_tiles": 3, "tiled_loss": True, "loss_tile_bytes": 1024,
              "offload_hidden_states": True, "host_bytes": 0, "nvme_path": str(tmp_path / "hidden")}
    results = run_ranks(sp_cases.parity_and_resume, 4, 2, str(tmp_path), pieces, True, timeout=600, env=ENV)
    _check_parity_and_resume(results, 2)
    assert results[0]["whole"]["losses"] != results[2]["whole"]["losses"], "the two groups read distinct batches"
    assert all(r["spilled_bytes"] > 0 for r in results), "every rank's layer inputs went through the swap files"
    assert not list((tmp_path / "hidden" / "zero3_swap").glob("*/hidden*.swp")), "destroy() removes them"


@pytest.mark.parametrize("lora,hf_checkpointing", [(False, False), (True, True)])
def test_tiled_pieces_equal_the_untiled_model(lora, hf_checkpointing):
    results = run_ranks(sp_cases.tiled_parity, 2, lora, hf_checkpointing, timeout=400, env=ENV)
    for r in results:
        assert r["tiled"]["losses"] == pytest.approx(r["plain"]["losses"], abs=1e-6, rel=1e-6)
        _close(r["tiled"]["grads"], r["plain"]["grads"], atol=1e-6, rtol=1e-6)
        _close(r["tiled_params"], r["plain_params"], atol=1e-5)  # after 3 AdamW steps: 1e-6 gradient noise, amplified
        assert r["tiled_late"] == r["plain_late"] == 0
        expected = {"TiledLossLlamaForCausalLM", "TiledLlamaMLP"}
        if not hf_checkpointing:
            expected.add("HostCheckpointedLlamaDecoderLayer")
        assert set(r["classes_while"]) == expected
        assert r["tiled_classes_after"] == r["plain_classes_after"], "destroy() puts the classes back"


def test_data_loader_adapter_cuts_every_ranks_batch_for_the_group():
    results = run_ranks(sp_cases.loader_batches, 2, timeout=300, env=ENV)
    for rank, (length, *got) in enumerate(results):
        assert length == 4
        assert [b["tag"] for b in got] == ["r0b0", "r1b0", "r0b1", "r1b1"]
        for batch, (source, index) in zip(got, [(0, 0), (1, 0), (0, 1), (1, 1)]):
            ids = torch.arange(6) + 100 * source + 10 * index
            shift = torch.cat([ids[1:], torch.tensor([-100])])
            part = slice(3 * rank, 3 * rank + 3)
            assert torch.equal(batch["input_ids"][0], ids[part])
            assert torch.equal(batch["position_ids"][0], torch.arange(6)[part])
            assert torch.equal(batch["shift_labels"][0], shift[part])
            assert "labels" not in batch


def test_bad_inputs_are_clear_errors_on_every_rank():
    for seen in run_ranks(sp_cases.bad_inputs, 2, timeout=300, env=ENV):
        assert seen["heads"][0] == "ValueError" and "1 attention heads do not split" in seen["heads"][1]
        assert seen["eager"][0] == "ValueError" and "cannot be split" in seen["eager"][1]
        assert seen["config_degree"][0] == "ConfigError" and "does not divide the world size 2" in seen["config_degree"][1]
        assert seen["mpu_size"] == 2 and seen["groups"][0] == 2
        assert seen["odd_length"][0] == "ValueError" and "pad_to_multiple_of" in seen["odd_length"][1]
        assert seen["no_positions"][0] == "ValueError" and "position_ids" in seen["no_positions"][1]
        assert seen["mismatched_mpu"][0] == "ConfigError" and "mpu" in seen["mismatched_mpu"][1]


def test_trainer_with_parallelism_config_sp_matches_one_rank_without(tmp_path):
    """zero3.hf.Trainer with TrainingArguments(parallelism_config=ParallelismConfig(sp_backend=
    "deepspeed", sp_size=2)) on 2 ranks trains on the sequences that one rank without sequence
    parallelism trains on, in the same order (each group shares its ranks' rows), with the
    same losses and weights; the long_sequence pieces on top change nothing beyond rounding."""
    alone = run_ranks(sp_cases.trainer_run, 1, str(tmp_path), 1, timeout=300, env=ENV)[0]
    split = run_ranks(sp_cases.trainer_run, 2, str(tmp_path), 2, timeout=300, env=ENV)
    tiled = run_ranks(sp_cases.trainer_run, 2, str(tmp_path), 2,
                      {"tiled_mlp": True, "mlp_tiles": 2, "tiled_loss": True, "loss_tile_bytes": 1024,
                       "offload_hidden_states": True}, timeout=300, env=ENV)
    assert len(alone["losses"]) == 4
    for run in (*split, *tiled):
        assert run["losses"] == pytest.approx(alone["losses"], abs=1e-5, rel=0)
        # 4 AdamW steps at lr 1e-2: a gradient that differs by rounding where it is near zero moves
        # a weight by up to a fraction of lr; 1e-4 is 1% of lr
        _close(run["weights"], alone["weights"], atol=1e-4)
