"""FSDP (fully_shard) on CPU/gloo with ElasticCheckpointer in DCP mode, under real torchrun: each
rank writes its own shard of every checkpoint, and a restarted job resumes every rank's shard of
model and optimizer from the newest step (the documented path for sharded jobs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.trainer import local_ckpt

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def torchrun(tmp_path: Path, steps: int) -> list[dict]:
    env = {
        **os.environ,
        "FLEETD_CKPT_DIR": str(tmp_path / "ckpt"),
        "FLEETD_CKPT_INTERVAL": "5",
        "FLEETD_EVENTS_FILE": str(tmp_path / "events.jsonl"),
        "OMP_NUM_THREADS": "1",
    }
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "agent.examples.train_fsdp",
            "--steps",
            str(steps),
            "--step-sleep",
            "0",
        ],
        env=env,
        check=True,
        timeout=240,
        capture_output=True,
    )
    return [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]


def test_fsdp_shards_save_and_resume(tmp_path: Path) -> None:
    first = torchrun(tmp_path, 7)
    step7 = local_ckpt.step_dir(tmp_path / "ckpt", 7)
    assert local_ckpt.is_complete(step7, "dcp")
    assert sorted(p.name for p in step7.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"], "one shard per rank"
    last_loss = {e["rank"]: e["loss"] for e in first if e["ev"] == "step" and e["step"] == 7}

    second = torchrun(tmp_path, 12)[len(first) :]
    assert sorted(e["from_step"] for e in second if e["ev"] == "resumed") == [7, 7]
    steps = sorted({e["step"] for e in second if e["ev"] == "step"})
    assert steps == list(range(8, 13))
    # Resumed state, not a fresh model: the loss goes on from where it was, far below step 1's.
    first_loss = {e["rank"]: e["loss"] for e in first if e["ev"] == "step" and e["step"] == 1}
    resumed_loss = {e["rank"]: e["loss"] for e in second if e["ev"] == "step" and e["step"] == 8}
    for rank in (0, 1):
        assert resumed_loss[rank] < first_loss[rank] and resumed_loss[rank] < 2 * last_loss[rank] + 0.05
