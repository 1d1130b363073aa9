"""Folder mode's pieces: when a folder's version counts as complete (pure), and the sync to a real
S3 store (moto server): upload complete versions only, number them, restore into an empty folder."""

from __future__ import annotations

import os
from pathlib import Path

from agent.checkpoint_store import CheckpointStore
from agent.supervise.folder_sync import FolderSync
from agent.supervise.folder_watch import FolderWatch, in_progress_name, open_for_writing, scan
from fleetd.shared.settings import AwsConfig, CheckpointConfig, JobConfig

V1 = {"snapshot.pt": (10, 1)}
V2 = {"snapshot.pt": (12, 2)}


def test_a_version_is_complete_once_settled_and_closed() -> None:
    w = FolderWatch(settle_s=2.0)
    assert w.observe(V1, set(), now=0.0) is None, "first sight: not settled yet"
    assert w.observe(V1, set(), now=1.9) is None
    assert w.observe(V1, {"snapshot.pt"}, now=5.0) is None, "open for writing: not complete"
    assert w.observe(V1, set(), now=5.0) == V1
    w.uploaded(V1)
    assert w.observe(V1, set(), now=9.0) is None, "already uploaded"
    assert w.observe(V2, set(), now=9.5) is None, "changed: the clock starts again"
    assert w.observe(V2, set(), now=11.0) is None
    assert w.observe(V2, set(), now=11.6) == V2
    assert w.observe({}, set(), now=20.0) is None and w.observe({}, set(), now=30.0) is None, "empty: nothing"


def test_names_still_being_written_are_left_out(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for name in ("snapshot.pt", ".snapshot.pt.swp", "x.tmp", "y.partial", "z~", "sub/model.bin", "sub/.hidden"):
        (tmp_path / name).write_bytes(b"1234")
    os.symlink(tmp_path / "snapshot.pt", tmp_path / "link.pt")
    assert sorted(scan(tmp_path)) == ["snapshot.pt", "sub/model.bin"]
    assert in_progress_name(".a/b") and not in_progress_name("a/b")


def test_open_for_writing_sees_a_writer(tmp_path: Path) -> None:
    (tmp_path / "done.pt").write_bytes(b"x")
    with open(tmp_path / "snapshot.pt", "wb") as f:
        f.write(b"partial")
        f.flush()
        with open(tmp_path / "done.pt", "rb"):
            assert open_for_writing([os.getpid()], tmp_path) == {"snapshot.pt"}
    assert open_for_writing([os.getpid()], tmp_path) == set()


def test_job_settings_are_off_by_default() -> None:
    job = JobConfig()
    assert job.checkpoint_dir is None and job.checkpoint_signal == "none" and job.checkpoint_settle_s == 2.0


async def test_sync_uploads_complete_versions_and_restores_them(tmp_path: Path, aws_client_kwargs) -> None:
    cfg = CheckpointConfig(bucket="folder-unit", prefix="ck", local_dir=tmp_path / "agent")
    aws = AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"])
    async with CheckpointStore.connect(cfg, aws, job="j", client_config=aws_client_kwargs["config"]) as store:
        await store.ensure_bucket()
        folder = tmp_path / "node-a"
        sync = FolderSync(folder, tmp_path / "stage-a", store, "node-a", settle_s=1.0, job_pids=lambda: [os.getpid()])
        assert await sync.restore() is None, "nothing durable yet"
        (folder / "ckpt").mkdir()
        (folder / "ckpt" / "model.bin").write_bytes(b"m" * 1000)
        writer = open(folder / "snapshot.pt", "wb")  # noqa: SIM115 - held open on purpose
        writer.write(b"s" * 500)
        writer.flush()
        assert await sync.poll(now=0.0) is None
        assert await sync.poll(now=5.0) is None, "a file held open for writing is not complete"
        writer.close()
        assert await sync.poll(now=6.0) == 1, "closed, and unchanged for 6 s: complete"
        assert await sync.poll(now=20.0) is None, "unchanged: nothing new"
        (folder / "snapshot.pt").write_bytes(b"t" * 600)
        assert await sync.poll(now=30.0) is None
        assert await sync.poll(now=31.5) == 2
        assert sorted(await store.complete_steps()) == [1, 2]

        # A replacement: empty folder, newest durable version restored into it.
        other = FolderSync(tmp_path / "node-b", tmp_path / "stage-b", store, "node-b")
        assert await other.restore() == 2
        assert (tmp_path / "node-b" / "snapshot.pt").read_bytes() == b"t" * 600
        assert (tmp_path / "node-b" / "ckpt" / "model.bin").read_bytes() == b"m" * 1000
        assert await other.poll(now=0.0) is None and await other.poll(now=100.0) is None, "restored: not re-uploaded"
        (tmp_path / "node-b" / "snapshot.pt").write_bytes(b"u" * 10)
        await other.poll(now=200.0)
        assert await other.poll(now=203.0) == 3, "numbers continue after the restored one"
        # A folder that already holds files is this node's own: left alone.
        assert await FolderSync(folder, tmp_path / "stage-c", store, "node-a").restore() is None
        assert (folder / "snapshot.pt").read_bytes() == b"t" * 600


async def test_a_newcomer_takes_newer_versions_until_its_workers_start(tmp_path: Path, aws_client_kwargs) -> None:
    cfg = CheckpointConfig(bucket="folder-refresh", prefix="ck", local_dir=tmp_path / "agent")
    aws = AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"])
    async with CheckpointStore.connect(cfg, aws, job="j", client_config=aws_client_kwargs["config"]) as store:
        await store.ensure_bucket()
        survivor = FolderSync(tmp_path / "a", tmp_path / "stage-a", store, "a", settle_s=1.0)
        (tmp_path / "a").mkdir()
        (tmp_path / "a" / "old.pt").write_bytes(b"1")
        await survivor.poll(now=0.0)
        assert await survivor.poll(now=2.0) == 1
        newcomer = FolderSync(tmp_path / "c", tmp_path / "stage-c", store, "c")
        assert await newcomer.restore() == 1
        # The survivor saves again while the newcomer waits to join: a new file, the old one gone.
        (tmp_path / "a" / "old.pt").unlink()
        (tmp_path / "a" / "new.pt").write_bytes(b"2")
        await survivor.poll(now=3.0)
        assert await survivor.poll(now=5.0) == 2
        checks = iter([False, False, True])
        await newcomer.refresh_until_started(lambda: next(checks), poll_s=0.01)
        assert sorted(scan(tmp_path / "c")) == ["new.pt"] and newcomer.last_version == 2
        # Once the workers started, the folder is theirs: no more refreshes.
        (tmp_path / "a" / "new.pt").write_bytes(b"33")
        await survivor.poll(now=6.0)
        assert await survivor.poll(now=8.0) == 3
        await newcomer.refresh_until_started(lambda: True)
        assert (tmp_path / "c" / "new.pt").read_bytes() == b"2"


def test_the_agent_picks_folder_mode_when_the_job_declares_a_folder(tmp_path: Path) -> None:
    from agent.config import AgentConfig
    from agent.main import default_hooks_factory
    from agent.supervise.elastic_hooks import ElasticHooks
    from agent.supervise.folder_hooks import FolderHooks, FolderSettings

    plain = AgentConfig()
    assert default_hooks_factory(plain) == ElasticHooks.from_context
    folder = AgentConfig(
        job=JobConfig(checkpoint_dir=tmp_path / "job", checkpoint_signal="SIGUSR1", checkpoint_settle_s=3.0)
    )
    assert default_hooks_factory(folder) == FolderHooks.from_context
    assert FolderSettings.from_job(folder.job) == FolderSettings(tmp_path / "job", "SIGUSR1", 3.0)
    assert FolderSettings.from_job(plain.job) is None
