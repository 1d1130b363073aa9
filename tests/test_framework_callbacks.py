"""The framework callbacks in one process (no torchrun): each resumes a job from fleetd's newest
local checkpoint, restores the optimizer and LR scheduler with the model, sets the framework's step
counter so ``max_steps`` counts the whole job, and saves the last step at the end. The
multi-node behaviour (agreed step on a notice, hold, peer state, salvage) is in
tests/test_framework_e2e.py with real torchrun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.config import AgentConfig
from agent.supervise.launch import WARM_PRELOAD, LaunchSpec
from agent.trainer import local_ckpt
from agent.trainer.integrations.core import torch_optimizer
from fleetd.demo import configs
from fleetd.shared.settings import load_settings


def run_example(module, argv: list[str], tmp_path: Path, monkeypatch) -> list[dict]:  # noqa: ANN001
    monkeypatch.setenv("FLEETD_CKPT_DIR", str(tmp_path / "ckpt"))
    monkeypatch.setenv("FLEETD_CKPT_INTERVAL", "10")
    monkeypatch.setenv("FLEETD_EVENTS_FILE", str(tmp_path / "events.jsonl"))
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "FLEETD_STORE"):
        monkeypatch.delenv(k, raising=False)
    assert module.main(argv) == 0
    return [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("job", ["hf", "lightning"])
def test_callback_resumes_where_the_job_left_off(job, tmp_path, monkeypatch) -> None:
    if job == "hf":
        from agent.examples import train_hf as module

        args = ["--step-sleep", "0", "--output-dir", str(tmp_path / "out")]
    else:
        from agent.examples import train_lightning as module

        args = ["--step-sleep", "0"]
    first = run_example(module, ["--steps", "25", *args], tmp_path, monkeypatch)
    assert [e["from_step"] for e in first if e["ev"] == "resumed"] == [0]
    assert [e["step"] for e in first if e["ev"] == "step"] == list(range(1, 26))
    assert local_ckpt.newest_complete(tmp_path / "ckpt", "state_dict") == 25, "the last step saved at the end"
    state = local_ckpt.load_plain(tmp_path / "ckpt", 25)
    assert state["optimizer"]["state"], "optimizer state saved with the model"
    assert state["stateful"], "the LR scheduler saved too"
    (sched,) = state["stateful"].values()
    assert sched["last_epoch"] == 25

    second = run_example(module, ["--steps", "40", *args], tmp_path, monkeypatch)[len(first) :]
    assert [e["from_step"] for e in second if e["ev"] == "resumed"] == [25]
    assert [e["step"] for e in second if e["ev"] == "step"] == list(range(26, 41)), "max_steps counts the whole job"
    assert local_ckpt.load_plain(tmp_path / "ckpt", 40)["stateful"][next(iter(state["stateful"]))]["last_epoch"] == 40

    third = run_example(module, ["--steps", "40", *args], tmp_path, monkeypatch)[len(first) + len(second) :]
    assert not [e for e in third if e["ev"] == "step"], "a finished job does not train (or report) again"
    assert local_ckpt.newest_complete(tmp_path / "ckpt", "state_dict") == 40, "nor save a step past the end"


def test_torch_optimizer_unwraps_framework_wrappers() -> None:
    import torch

    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    class Wrapper:  # accelerate's AcceleratedOptimizer and Lightning's LightningOptimizer keep it here
        def __init__(self, optimizer: object) -> None:
            self.optimizer = optimizer
            self.param_groups = inner.param_groups

    assert torch_optimizer(Wrapper(Wrapper(inner))) is inner
    assert torch_optimizer(inner) is inner


@pytest.mark.parametrize("job", sorted(configs.BAKED_JOBS))
def test_demo_jobs_load_as_agent_config(job, tmp_path) -> None:
    ep = configs.DemoEndpoints(
        aws_url="http://127.0.0.1:1", s3_url="http://127.0.0.1:1", mqtt_url="mqtt://127.0.0.1:1883", rdzv_port=29400
    )
    path = configs.agent_toml(tmp_path, ep, 2, "i-1", "127.0.0.2", "http://127.0.0.1:2", steps=100, job=job)
    cfg = load_settings(AgentConfig, path)
    assert cfg.job.entrypoint == configs.BAKED_JOBS[job][0]
    spec = LaunchSpec.from_config(cfg, "127.0.0.2")
    assert spec.warm_preload == WARM_PRELOAD + configs.BAKED_JOBS[job][1], "the framework is imported once per node"


def test_the_demos_toy_is_a_job_file_with_the_scenarios_steps(tmp_path) -> None:
    from fleetd.jobs.job_file import load_job_file

    group = configs.job_group("toy", 1200, tmp_path)
    job, workdir = load_job_file(Path(str(group["file"])))
    assert workdir == configs.TOY_JOB.parent and (workdir / "train_toy.py").is_file()
    assert job.run.module == "train_toy" and job.run.args == ("--steps", "1200")
    assert job.checkpoint.mode == "library" and job.setup
