"""Folder mode's gate (agent/supervise/folder_gate.py): every node's workers start on the
world's newest folder version. The rule alone; the gate over a real c10d TCPStore with three
nodes in threads; and the agent's side (agent/supervise/folder_sync.py) answering a gate's
request against S3 (moto)."""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from agent.checkpoint_store import CheckpointStore
from agent.supervise.folder_gate import (
    FolderState,
    FolderWant,
    GateConfig,
    Held,
    gate,
    read_state,
    read_want,
    version_to_take,
    write_model,
)
from agent.supervise.folder_sync import FolderSync
from agent.supervise.folder_watch import scan
from fleetd.shared.settings import AwsConfig, CheckpointConfig


def test_the_newest_number_wins_unless_the_content_is_the_same() -> None:
    survivor_a, survivor_b, newcomer = Held(30, "e10"), Held(31, "e10"), Held(27, "e9")
    world = [survivor_a, survivor_b, newcomer]
    assert version_to_take(newcomer, world) == 31
    # The same save uploaded by two survivors under two numbers: neither downloads it again.
    assert version_to_take(survivor_a, world) is None
    assert version_to_take(survivor_b, world) is None
    # Content of unknown origin (an agent restarted over its own folder) takes the newest.
    assert version_to_take(Held(0, ""), [Held(0, ""), Held(5, "x")]) == 5
    assert version_to_take(Held(0, ""), [Held(0, "")]) is None, "nothing anywhere: start as is"


def _node(tmp_path: Path, name: str, state: FolderState | None, timeout_s: float = 20.0) -> GateConfig:
    folder = tmp_path / name / "snapshots"
    folder.mkdir(parents=True)
    for rel in state.files if state else {}:
        (folder / rel).write_bytes(b"x")
    cfg = GateConfig(
        folder=folder, state=tmp_path / name / "state.json", want=tmp_path / name / "want.json", timeout_s=timeout_s
    )
    if state is not None:
        write_model(cfg.state, state.model_copy(update={"files": scan(folder)}))
    return cfg


def _store(world: int):  # type: ignore[no-untyped-def]
    from torch.distributed import PrefixStore, TCPStore

    server = TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    return server, [
        PrefixStore("round.3", TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30)))
        for _ in range(world)
    ]


def test_three_nodes_agree_and_only_the_newcomer_fetches(tmp_path: Path) -> None:
    a = _node(tmp_path, "a", FolderState(version=30, fingerprint="e10", files={"snapshot.pt": (1, 1)}))
    b = _node(tmp_path, "b", FolderState(version=31, fingerprint="e10", files={"snapshot.pt": (1, 1)}))
    c = _node(tmp_path, "c", FolderState(version=27, fingerprint="e9", files={"snapshot.pt": (1, 1)}))
    _server, stores = _store(3)
    lines: dict[str, str] = {}

    def agent_of_c() -> None:
        """What the agent's sync does for a want: the newest version into the folder, then its state."""
        while (want := read_want(c.want)) is None:
            threading.Event().wait(0.02)
        (c.folder / "snapshot.pt").write_bytes(b"epoch 10")
        write_model(c.state, FolderState(version=want.at_least, fingerprint="e10", files=scan(c.folder)))

    threads = [threading.Thread(target=agent_of_c)] + [
        threading.Thread(target=lambda n=n, cfg=cfg, s=s, r=r: lines.__setitem__(n, gate(s, r, 3, cfg)))
        for r, (n, cfg, s) in enumerate(zip("abc", (a, b, c), stores, strict=True))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert "the newest of 3 node(s); 0 silent" in lines["a"] and "the newest of 3" in lines["b"], lines
    assert "moved from version 27 to 31" in lines["c"], lines
    assert (c.folder / "snapshot.pt").read_bytes() == b"epoch 10"
    assert read_want(a.want) is None and read_want(b.want) is None, "the survivors fetched nothing"


def test_a_dirty_folder_waits_for_its_upload_and_a_silent_node_costs_the_timeout(tmp_path: Path) -> None:
    cfg = _node(tmp_path, "a", FolderState(version=4, fingerprint="f4", files={"snapshot.pt": (1, 1)}), 1.0)
    (cfg.folder / "snapshot.pt").write_bytes(b"a save the agent has not uploaded yet")
    _server, (store, _peer) = _store(2)

    def upload_later() -> None:
        threading.Event().wait(0.3)
        write_model(cfg.state, FolderState(version=5, fingerprint="f5", files=scan(cfg.folder)))

    t = threading.Thread(target=upload_later)
    t.start()
    line = gate(store, 0, 2, cfg)  # rank 1 never answers
    t.join()
    assert "folder at version 5" in line and "1 silent" in line, line


async def test_the_agent_fetches_what_the_gate_asks_for(tmp_path: Path, aws_client_kwargs) -> None:  # type: ignore[no-untyped-def]
    cfg = CheckpointConfig(bucket="folder-gate", prefix="ck", local_dir=tmp_path / "agent")
    aws = AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"])
    async with CheckpointStore.connect(cfg, aws, job="j", client_config=aws_client_kwargs["config"]) as store:
        await store.ensure_bucket()
        survivor = FolderSync(
            tmp_path / "a", tmp_path / "stage-a", store, "a", settle_s=1.0, state_path=tmp_path / "a.state"
        )
        (tmp_path / "a").mkdir()
        (tmp_path / "a" / "snapshot.pt").write_bytes(b"epoch 1")
        await survivor.poll(now=0.0)
        assert await survivor.poll(now=2.0) == 1
        up = read_state(tmp_path / "a.state")
        assert up is not None and up.version == 1 and up.files == scan(tmp_path / "a") and up.fingerprint
        newcomer = FolderSync(
            tmp_path / "c",
            tmp_path / "stage-c",
            store,
            "c",
            state_path=tmp_path / "c.state",
            want_path=tmp_path / "c.want",
        )
        assert await newcomer.restore() == 1
        down = read_state(tmp_path / "c.state")
        assert down is not None and down.version == 1 and down.fingerprint == up.fingerprint, "one content, one print"
        # The survivor's last save before the join, durable only now.
        (tmp_path / "a" / "snapshot.pt").write_bytes(b"epoch 2")
        await survivor.poll(now=3.0)
        assert await survivor.poll(now=5.0) == 2
        write_model(tmp_path / "c.want", FolderWant(at_least=2))
        assert await newcomer.poll() == 2
        assert (tmp_path / "c" / "snapshot.pt").read_bytes() == b"epoch 2"
        held = read_state(tmp_path / "c.state")
        assert held is not None and held.version == 2 and held.files == scan(tmp_path / "c")
        assert await newcomer.poll() is None, "asked once, fetched once"


@pytest.mark.parametrize("raw", ['{"folder": "/x"}', "not json"])
def test_a_bad_gate_setting_leaves_torchrun_ungated(raw: str, capsys: pytest.CaptureFixture[str]) -> None:
    from agent.supervise.folder_gate import install

    assert install(raw) is False
    assert "folder gate off" in capsys.readouterr().err
    assert os.environ.get("FLEETD_FOLDER_GATE") is None


def test_a_folder_no_agent_syncs_starts_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No state file (no checkpoint store): nothing will ever be uploaded, so the gate never waits."""
    from agent.supervise import folder_gate

    def no_wait(_s: float) -> None:
        raise AssertionError("the gate waited for an upload nobody makes")

    cfg = _node(tmp_path, "a", None, timeout_s=30.0)
    (cfg.folder / "snapshot.pt").write_bytes(b"local only")
    _server, (store,) = _store(1)
    monkeypatch.setattr(folder_gate.time, "sleep", no_wait)
    assert "folder at version 0, the newest of 1 node(s)" in gate(store, 0, 1, cfg)


async def test_a_save_still_settling_at_a_drain_is_uploaded_before_the_node_says_ready(
    tmp_path: Path,
    aws_client_kwargs,  # type: ignore[no-untyped-def]
) -> None:
    """No signal: the drain cannot ask for a save, but the one the script just made (not settled
    yet) must not die with the node. FolderHooks' drain waits for it this way."""
    import time

    cfg = CheckpointConfig(bucket="folder-drain", prefix="ck", local_dir=tmp_path / "agent")
    aws = AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"])
    async with CheckpointStore.connect(cfg, aws, job="j", client_config=aws_client_kwargs["config"]) as store:
        await store.ensure_bucket()
        sync = FolderSync(tmp_path / "a", tmp_path / "stage-a", store, "a", settle_s=0.3, poll_s=0.05)
        (tmp_path / "a").mkdir()
        assert not await sync.pending()
        (tmp_path / "a" / "snapshot.pt").write_bytes(b"epoch 8, saved just before the drain")
        await sync.poll()  # seen, not settled: nothing uploaded
        assert await sync.pending() and sync.last_version == 0
        got = await sync.wait_new_version(sync.watch.changed_at - 1e-6, time.monotonic() + 30, lambda: True)
        assert got == 1 and not await sync.pending()
        assert await store.complete_steps() == [1]
