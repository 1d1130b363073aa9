"""`fleetd job submit` (fleetd/commands/job.py) and its daemon half (fleetd/jobs/submission.py):
the request file, the watcher that ships it once, the job watcher's new run after an ended job,
and the node's version as its agent reports it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleetd.config import FleetdConfig
from fleetd.intake.registry import NodeRegistry
from fleetd.intake.signals import TrainingSignals
from fleetd.job_record import CancelRequest, read_cancel, read_submit, write_cancel
from fleetd.jobs.job_file import load_job_file
from fleetd.jobs.pack import pack
from fleetd.jobs.publish import Published, apply_job
from fleetd.jobs.submission import SubmissionWatcher, submitted_job
from fleetd.policy.job_state import JobRecord, JobSettings, JobState
from fleetd.policy.model import Market, Node, NodePhase, PoolId
from fleetd.policy.observation import DesiredJob
from fleetd.protocol.messages import Status, TrainerExited
from tests.test_job_watch import Clock, ctx_with, say, watcher

EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "examples" / "ddp-job"


def _project(tmp_path: Path, name: str = "project") -> Path:
    shutil.copytree(EXAMPLE, tmp_path / name, ignore=shutil.ignore_patterns("snapshots"))
    return tmp_path / name / "job.toml"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetd.cli", *args], capture_output=True, text=True, timeout=60)


def test_submit_checks_the_file_here_and_hands_it_to_the_daemon(tmp_path: Path) -> None:
    job_file = _project(tmp_path)
    conf = tmp_path / "fleetd.toml"
    conf.write_text(f'[fleet]\nstate_dir = "{tmp_path / "state"}"\n[job]\nname = "ddp-tutorial"\n')
    (tmp_path / "state").mkdir()
    out = _cli("job", "submit", str(job_file), "--config", str(conf))
    assert out.returncode == 0, out.stderr
    request = read_submit(tmp_path / "state")
    digest = pack(job_file.parent).digest
    assert request is not None and request.file == job_file.resolve() and request.digest == digest
    assert f"version {digest[:12]} submitted" in out.stdout
    # Another job's file: this controller runs one job.
    other = conf.with_name("other.toml")
    other.write_text(f'[fleet]\nstate_dir = "{tmp_path / "other-state"}"\n[job]\nname = "another"\n')
    refused = _cli("job", "submit", str(job_file), "--config", str(other))
    assert refused.returncode == 2 and "runs 'another'" in refused.stderr
    # fleetd.toml that names the job only through its job file: the file's name is the job's.
    by_file = conf.with_name("by-file.toml")
    by_file.write_text(f'[fleet]\nstate_dir = "{tmp_path / "state"}"\n[job]\nfile = "{job_file}"\n')
    again = _cli("job", "submit", str(job_file), "--config", str(by_file))
    assert again.returncode == 0, again.stderr
    # A broken file is refused here, before anything reaches the daemon.
    job_file.write_text(job_file.read_text().replace('script = "train.py"', 'script = "../x.py"'))
    broken = _cli("job", "submit", str(job_file), "--config", str(conf))
    assert broken.returncode == 2 and "run.script" in broken.stderr
    kept = read_submit(tmp_path / "state")
    assert kept is not None and (kept.file, kept.digest) == (request.file, request.digest), (
        "the broken one never landed"
    )


def _cfg(tmp_path: Path, digest: str = "a" * 64, **capacity: object) -> FleetdConfig:
    base = FleetdConfig.model_validate(
        {"fleet": {"state_dir": str(tmp_path)}, "capacity": {"instance_types": ["g5.xlarge"], **capacity}}
    )
    running = tmp_path / "running" / "job.toml"
    job, _ = load_job_file(running if running.exists() else _project(tmp_path, "running"))
    return apply_job(base, job, Published("s3://b/old", digest, True, 3))


async def test_the_watcher_ships_each_request_once_and_refuses_what_it_cannot_ship(tmp_path: Path) -> None:
    from fleetd.job_record import SubmitRequest, write_submit

    cfg = _cfg(tmp_path)
    adopted: list[str] = []
    published: list[Path] = []
    digests = iter(["b" * 64, "b" * 64, "c" * 64])

    async def publish(wanted: FleetdConfig) -> tuple[FleetdConfig, Published]:
        assert wanted.job.file is not None
        published.append(wanted.job.file)
        if wanted.job.file.name == "broken.toml":
            raise OSError("permission denied")
        job, _ = load_job_file(wanted.job.file)
        p = Published("s3://b/new", next(digests), True, 3)
        return apply_job(wanted, job, p), p

    async def adopt(new: FleetdConfig) -> None:
        adopted.append(new.job.code_digest)

    w = SubmissionWatcher(cfg, publish, adopt)
    assert await w.check() is None, "nothing submitted"
    new_file = _project(tmp_path, "v2")
    write_submit(tmp_path, SubmitRequest(file=new_file, digest="b" * 64, submitted_at=1.0))
    assert await w.check() == "b" * 64 and adopted == ["b" * 64] and w.cfg.job.code_digest == "b" * 64
    assert await w.check() is None and len(published) == 1, "one request, shipped once"
    # Submitted again unchanged: packed again, nothing to adopt.
    write_submit(tmp_path, SubmitRequest(file=new_file, digest="b" * 64, submitted_at=2.0))
    assert await w.check() is None and adopted == ["b" * 64]
    # The daemon cannot read it: logged, the job keeps its version, not retried until resubmitted.
    broken = new_file.with_name("broken.toml")
    write_submit(tmp_path, SubmitRequest(file=broken, digest="d" * 64, submitted_at=3.0))
    assert await w.check() is None and await w.check() is None and published.count(broken) == 1
    write_submit(tmp_path, SubmitRequest(file=new_file, digest="c" * 64, submitted_at=4.0))
    assert await w.check() == "c" * 64 and adopted == ["b" * 64, "c" * 64]
    # A restarted daemon ships the submitted file, not fleetd.toml's.
    assert submitted_job(cfg).job.file == new_file
    # An operator's own launch template carries its own user data: a job file cannot reach it.
    named = SubmissionWatcher(_cfg(tmp_path, launch_template="ops-template"), publish, adopt)
    write_submit(tmp_path, SubmitRequest(file=new_file, digest="e" * 64, submitted_at=5.0))
    assert await named.check() is None and adopted == ["b" * 64, "c" * 64]


async def test_a_new_version_after_the_job_ended_is_a_new_run(tmp_path: Path) -> None:
    clock, sent = Clock(), []
    w, registry, signals = watcher(tmp_path, clock, sent, code_digest="a" * 64)
    ctx = ctx_with("i-1")
    say(registry, Status(instance_id="i-1", state="training"), clock.now)
    await w.tick(ctx)
    for _ in range(2):  # max_restarts 1: the second failure ends it
        clock.now += 30
        say(registry, TrainerExited(instance_id="i-1", exit_code=1, reason="failed"), clock.now)
        await w.tick(ctx)
    assert w.record.state is JobState.FAILED and signals.desired_job is DesiredJob.END
    write_cancel(tmp_path, CancelRequest(reason="late", requested_at=clock.now))
    resumed: list[str] = []

    async def resume(reason: str) -> None:
        resumed.append(reason)

    w.resume = resume
    await w.new_version("b" * 64, JobSettings(max_restarts=1, settle_s=5.0), None)
    assert len(resumed) == 1  # the last run's stop is undone: its rendezvous takes nodes again
    assert w.record.state is JobState.PENDING and w.record.restarts == 0 and w.code_digest == "b" * 64
    assert signals.desired_job is DesiredJob.RUN and read_cancel(tmp_path) is None
    # The old run's failures are not the new run's.
    clock.now += 1
    await w.tick(ctx)
    assert w.record.state is JobState.RUNNING and w.record.restarts == 0 and sent == [sent[0]]
    # A version change while the job runs keeps its state and restarts.
    await w.new_version("c" * 64, JobSettings(max_restarts=1, settle_s=5.0), 500)
    assert w.record.state is JobState.RUNNING and w.total_steps == 500 and w.code_digest == "c" * 64


def test_the_node_says_which_version_it_runs() -> None:
    clock = Clock()
    registry = NodeRegistry(clock=clock)
    node = Node("i-1", PoolId("g5.xlarge", "us-east-1a"), Market.SPOT, 0.5, launched_at=0.0, phase=NodePhase.RUNNING)
    assert registry.observe(node).code_digest == ""
    say(registry, Status(instance_id="i-1", state="starting", code_digest="f" * 64), clock.now)
    assert registry.observe(node).code_digest == "f" * 64
    with pytest.raises(ValueError, match="code_digest"):
        Status(instance_id="i-1", state="starting", code_digest="not a digest")
    signals = TrainingSignals(registry)
    signals.code_digest = "f" * 64
    assert signals.snapshot().code_digest == "f" * 64
    assert JobRecord().state is JobState.PENDING


async def test_a_host_taking_the_lead_runs_the_version_the_fleet_adopted(tmp_path: Path) -> None:
    """HA: the other control host's files name the old version; the shared state store names the
    one the fleet adopted, and that one wins, once, when this host's watcher starts."""
    cfg = _cfg(tmp_path)
    adopted: list[str] = []
    shared = cfg.model_copy(update={"job": cfg.job.model_copy(update={"code_digest": "f" * 64})})

    async def publish(wanted: FleetdConfig) -> tuple[FleetdConfig, Published]:
        raise AssertionError("nothing is submitted here")

    async def adopt(new: FleetdConfig) -> None:
        adopted.append(new.job.code_digest)

    recalls: list[int] = []

    async def recall() -> FleetdConfig | None:
        recalls.append(1)
        return shared

    w = SubmissionWatcher(cfg, publish, adopt, recall)
    assert await w.check() is None and await w.check() is None
    assert adopted == ["f" * 64] and w.cfg.job.code_digest == "f" * 64 and len(recalls) == 1
    # The same version as the shared one: nothing to adopt.
    same = SubmissionWatcher(shared, publish, adopt, recall)
    await same.check()
    assert adopted == ["f" * 64]


async def test_the_daemon_records_what_it_adopted_where_every_host_reads_it(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from fleetd.jobs.submission import submission_component

    class Meta:
        def __init__(self) -> None:
            self.values: dict[str, object] = {}

        async def get_meta(self, key: str, default: object = None) -> object:
            return self.values.get(key, default)

        async def set_meta(self, key: str, value: object) -> None:
            self.values[key] = value

    templates: list[str] = []

    async def use_template_for(new: FleetdConfig) -> None:
        templates.append(new.job.code_digest)

    cfg = _cfg(tmp_path)
    registry = NodeRegistry()
    signals = TrainingSignals(registry)
    loop = SimpleNamespace(state=Meta(), ec2=SimpleNamespace(inner=SimpleNamespace(use_template_for=use_template_for)))
    ctx = SimpleNamespace(reconciler=loop, cfg=cfg, job=None, wake_loop=lambda: None)
    watcher = submission_component(cfg, ctx, signals).__self__  # type: ignore[attr-defined]
    new = cfg.model_copy(
        update={
            "job": cfg.job.model_copy(update={"code_digest": "c" * 64, "total_steps": 900}),
            "budget": cfg.budget.model_copy(update={"total_usd": 42.0}),
        }
    )
    await watcher.adopt(new)
    assert templates == ["c" * 64] and loop.cfg is new and ctx.cfg is new and signals.code_digest == "c" * 64
    recalled = await watcher.recall()
    assert recalled is not None and recalled.job == new.job and recalled.budget.total_usd == 42.0
