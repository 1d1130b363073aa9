"""The job's code made ready on a node (agent/supervise/workspace.py, job_setup.py): downloaded,
verified, unpacked once per version, set up in the job's own virtualenv; a failed setup is the
job's failure, reported, and run again on fleetd's restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.checkpoint_store.errors import StoreUnavailable
from agent.supervise.job_setup import until_ready
from agent.supervise.launch import LaunchSpec, build_env
from agent.supervise.workspace import JobWorkspace, SetupFailed, prepare
from fleetd.jobs.pack import pack
from fleetd.protocol.messages import TrainerExited

pytestmark = pytest.mark.timeout(120)


def _packed(tmp_path: Path) -> tuple[bytes, str]:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "train.py").write_text("print('training')\n")
    (src / "requirements.txt").write_text("numpy\n")
    packed = pack(src)
    return packed.data, packed.digest


def _workspace(tmp_path: Path, digest: str, *setup: str) -> JobWorkspace:
    return JobWorkspace(
        tmp_path / "node" / "jobs" / "j" / digest,
        f"s3://b/checkpoints/j/code/{digest}.tar.gz",
        digest,
        setup,
        {"JOB_FLAG": "on"},
        pip_cache=tmp_path / "node" / "pip-cache",
    )


class Bucket:
    def __init__(self, data: bytes, fail_first: int = 0) -> None:
        self.data, self.fail_first, self.gets = data, fail_first, 0

    async def fetch(self, bucket: str, key: str) -> bytes:
        self.gets += 1
        if self.gets <= self.fail_first:
            raise StoreUnavailable("S3 unreachable (test)")
        assert bucket == "b" and key.startswith("checkpoints/j/code/")
        return self.data


async def test_setup_runs_once_in_the_jobs_own_virtualenv_with_the_images_packages(tmp_path: Path) -> None:
    data, digest = _packed(tmp_path)
    ws = _workspace(
        tmp_path,
        digest,
        # The job's environment: its venv first on PATH, its env, its folder; the image's
        # packages (fleetd's, numpy) importable; pip installs an already-met requirement offline.
        "python -c \"import sys, os, fleetd, numpy; print(sys.prefix, os.environ['JOB_FLAG'])\" > where.txt",
        "python -m pip install --quiet --no-index -r requirements.txt",
        "echo again >> count.txt",
        'echo "$PIP_CACHE_DIR" > cache.txt',
    )
    bucket = Bucket(data)
    await prepare(ws, bucket.fetch)
    where = (ws.code / "where.txt").read_text().split()
    assert Path(where[0]) == ws.venv and where[1] == "on"
    assert (ws.code / "cache.txt").read_text().strip() == str(ws.pip_cache)  # pip's cache: the node's
    assert (ws.code / "train.py").read_text() == "print('training')\n"
    await prepare(ws, bucket.fetch)  # an agent restart: ready already
    assert bucket.gets == 1 and (ws.code / "count.txt").read_text() == "again\n"
    # torchrun then runs there, with the venv's python and the job's environment.
    spec = LaunchSpec(
        entrypoint="train.py",
        module=False,
        python=str(ws.python),
        cwd=ws.code,
        extra_env=tuple(ws.launch_env().items()),
    )
    env = build_env(spec, {"PATH": "/usr/bin"})
    assert env["VIRTUAL_ENV"] == str(ws.venv) and env["PATH"].startswith(str(ws.venv / "bin"))
    assert env["JOB_FLAG"] == "on" and str(ws.code) in env["PYTHONPATH"]


async def test_a_failed_setup_says_which_command_and_its_last_lines(tmp_path: Path) -> None:
    data, digest = _packed(tmp_path)
    ws = _workspace(tmp_path, digest, "echo preparing", "echo 'no such package: foo' >&2; exit 3")
    with pytest.raises(SetupFailed) as err:
        await prepare(ws, Bucket(data).fetch)
    assert err.value.exit_code == 3
    assert "exited 3" in err.value.detail and "no such package: foo" in err.value.detail
    assert not ws.ready_marker.exists()


async def test_an_archive_that_is_not_the_version_named_is_refused(tmp_path: Path) -> None:
    data, digest = _packed(tmp_path)
    ws = _workspace(tmp_path, digest)
    with pytest.raises(SetupFailed, match="refused"):
        await prepare(ws, Bucket(data + b"tampered").fetch)
    assert not ws.code.exists()


async def test_until_ready_reports_a_setup_failure_and_sets_up_again_on_fleetds_restart(tmp_path: Path) -> None:
    data, digest = _packed(tmp_path)
    ws = _workspace(tmp_path, digest, "test -e fixed")
    events: list[TrainerExited] = []
    stopped = asyncio.Event()

    async def publish(event: TrainerExited) -> None:
        events.append(event)

    async def wait_retry() -> None:
        (ws.code / "fixed").write_text("")  # what the restart finds fixed (a flaky mirror, say)

    bucket = Bucket(data, fail_first=1)  # and S3 away once: retried, not the job's fault
    ok = await until_ready(
        ws, bucket.fetch, instance_id="i-1", publish_event=publish, wait_retry=wait_retry, stopped=stopped
    )
    assert ok and ws.ready_marker.exists()
    assert len(events) == 1 and events[0].reason.startswith("setup-failed: setup `test -e fixed` exited 1")
    assert events[0].exit_code == 1 and bucket.gets == 2


async def test_until_ready_gives_up_when_the_agent_stops(tmp_path: Path) -> None:
    data, digest = _packed(tmp_path)
    stopped = asyncio.Event()
    stopped.set()

    async def never() -> None:
        raise AssertionError

    ok = await until_ready(
        _workspace(tmp_path, digest),
        Bucket(data).fetch,
        instance_id="i",
        publish_event=never,
        wait_retry=never,
        stopped=stopped,
    )  # type: ignore[arg-type]
    assert not ok
