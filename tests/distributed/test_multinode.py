"""Two torchrun "nodes" on 127.0.0.1 meet through c10d rendezvous and train like one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import free_port
from training import SINGLE, assert_same_metrics, parity_config, train

from temper.recipes.llama3 import llama3_debug

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


@pytest.mark.slow
def test_two_nodes_train_like_one_process(tmp_path: Path) -> None:
    reference_config = parity_config(llama3_debug, tmp_path, SINGLE)
    reference_config.training.steps = STEPS
    reference = train(reference_config, SINGLE)

    dump = tmp_path / "two_nodes"
    args = [
        *("--training.steps", str(STEPS), "--training.seq_len", "64"),
        *("--training.local_batch_size", "4", "--training.global_batch_size", "8"),
        *("--metrics.no_tensorboard", "--job.dump_folder", str(dump)),
    ]
    env = {
        **os.environ,
        "TEMPER_PYTHON": sys.executable,
        "NGPU": "1",
        "NNODES": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    logs = [tmp_path / f"node{index}.log" for index in range(2)]
    nodes = [
        subprocess.Popen(
            [str(ROOT / "run_train.sh"), *args],
            cwd=tmp_path,
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so a hung node goes down with its torchrun workers
        )
        for log in logs
    ]
    try:
        deadline = time.monotonic() + 300
        # A node that fails leaves the other waiting in rendezvous: stop at the first failure.
        while any(node.poll() is None for node in nodes) and time.monotonic() < deadline:
            if any(node.poll() not in (None, 0) for node in nodes):
                break
            time.sleep(0.5)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    outputs = [(node.wait(), log.read_text())[1] for node, log in zip(nodes, logs, strict=True)]
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-3000:]
    assert "world 2" in "".join(outputs)
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert_same_metrics(rows, reference.rows)
