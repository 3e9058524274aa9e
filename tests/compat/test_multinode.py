"""Two torchrun agents (--nnodes=2, one process each) joined by a c10d rendezvous on
127.0.0.1 train, save to one shared directory, and resume in new processes exactly."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

WORKER = pathlib.Path(__file__).with_name("multinode_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_nodes(phase: str, folder: pathlib.Path) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZERO3_ACCELERATOR": "cpu"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=zero3-{phase}",
               "--max_restarts=0", str(WORKER), phase, str(folder)]
    agents = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=240)[0])
    finally:
        for agent in agents:
            agent.kill()
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output[-3000:]


def test_two_nodes_train_save_and_resume_exactly(tmp_path):
    launch_two_nodes("first", tmp_path)
    files = sorted(p.name for p in (tmp_path / "global_step2").iterdir())
    assert "rank00000-of-00002.safetensors" in files and "rank00001-of-00002.safetensors" in files
    launch_two_nodes("second", tmp_path)
    for rank in (0, 1):
        straight = json.loads((tmp_path / f"straight-{rank}.json").read_text())
        resumed = json.loads((tmp_path / f"resumed-{rank}.json").read_text())
        assert resumed == straight[2:]
    # RANK chose each process's batches and shard: the two nodes saw different data
    assert json.loads((tmp_path / "straight-0.json").read_text()) != json.loads((tmp_path / "straight-1.json").read_text())
