"""Checkpoint store against moto server: sharded round trip, verified restore with fallback,
retention, conditional `latest`, deadline reporting."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.checkpoint_store import CheckpointStore, PreconditionFailed, UploadTuning
from agent.checkpoint_store.uploader import MiB
from fleetd.protocol.digests import Checksum, Digest
from fleetd.shared.settings import AwsConfig, CheckpointConfig

BUCKET = "ckpt-test"
# 5 MiB parts (S3's minimum) so a 6 MiB shard already goes up as a real multipart upload.
TUNING = UploadTuning(concurrency=4, part_size=5 * MiB)


@pytest.fixture
def open_store(aws_client_kwargs, tmp_path):
    """open_store(name, keep=3) -> async context manager of a CheckpointStore: one per 'node'."""

    def make(node: str = "node", keep: int = 3, tuning: UploadTuning = TUNING):
        cfg = CheckpointConfig(bucket=BUCKET, prefix="runs", keep=keep, local_dir=tmp_path / node)
        aws = AwsConfig(region=aws_client_kwargs["region_name"], endpoint_url=aws_client_kwargs["endpoint_url"])
        return CheckpointStore.connect(cfg, aws, job="train", tuning=tuning, client_config=aws_client_kwargs["config"])

    return make


@pytest.fixture
async def store(open_store):
    async with open_store("node") as s:
        await s.ensure_bucket()
        yield s


def write(path: Path, nbytes: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(nbytes))
    return path


def digest_like(checksum: Checksum, path: Path) -> Checksum:
    d = Digest.like(checksum)
    d.update(path.read_bytes())
    return d.checksum()


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_sharded_checkpoint_from_three_writers_round_trips_verified(open_store, store, tmp_path):
    writers = ["i-a", "i-b", "i-c"]
    # Like torch DCP: one shard per node, rank 0's node also writes .metadata.
    shards = {
        "i-a": [write(tmp_path / "src/a/__0_0.distcp", 6 * MiB + 123), write(tmp_path / "src/a/.metadata", 2000)],
        "i-b": [write(tmp_path / "src/b/__1_0.distcp", 6 * MiB + 7)],
        "i-c": [write(tmp_path / "src/c/__2_0.distcp", 300_000)],
    }
    async with open_store("i-a") as a, open_store("i-b") as b, open_store("i-c") as c:
        nodes = {"i-a": a, "i-b": b, "i-c": c}
        # Step 10, one node at a time: nothing is durable until the last shard is confirmed.
        first = await a.upload_step(10, shards["i-a"], writer="i-a", expected_writers=writers)
        second = await b.upload_step(10, shards["i-b"], writer="i-b", expected_writers=writers)
        assert not first.complete and not second.complete
        assert await store.restore_latest(tmp_path / "early") is None
        last = await c.upload_step(10, shards["i-c"], writer="i-c", expected_writers=writers)
        assert last.complete and last.published and last.latest_step == 10
        assert await a.wait_complete(10, timeout_s=5)

        # Step 20, all nodes at once: whoever sees every receipt merges; the manifest is the same.
        results = await asyncio.gather(
            *(nodes[w].upload_step(20, shards[w], writer=w, expected_writers=writers, world_size=6) for w in writers)
        )
    assert any(r.complete for r in results) and any(r.published for r in results)
    assert await store.wait_complete(20, timeout_s=5)

    restored = await store.restore_latest(tmp_path / "restore")
    assert restored is not None and restored.step == 20 and restored.skipped == ()
    assert restored.manifest.writers == tuple(writers) and restored.manifest.world_size == 6
    originals = {p.name: p for ps in shards.values() for p in ps}
    assert {f.name for f in restored.manifest.files} == set(originals)
    for f in restored.manifest.files:
        # Multipart shards carry S3's composite SHA-256 (5 MiB parts), single PUTs a plain one.
        assert f.checksum.algorithm == ("sha256-composite" if f.size > 5 * MiB else "sha256")
        assert f.checksum == digest_like(f.checksum, originals[f.name])
        assert sha(restored.directory / f.name) == sha(originals[f.name])
    assert restored.directory == tmp_path / "restore" / "step-20"
    assert not (tmp_path / "restore" / "step-20.partial").exists()
    latest, _ = await store.publisher.read_latest()
    assert latest is not None and latest.step == 20


async def test_corrupted_object_is_detected_and_previous_checkpoint_restored(
    store, tmp_path, aio_session, aws_client_kwargs
):
    step1 = [write(tmp_path / "s1/model.pt", 6 * MiB), write(tmp_path / "s1/optim.pt", 1000)]
    step2 = [write(tmp_path / "s2/model.pt", 6 * MiB), write(tmp_path / "s2/optim.pt", 1000)]
    await store.upload_step(1, step1, writer="w")
    await store.upload_step(2, step2, writer="w")

    # Someone changes the bytes of step 2's shard after upload (same size, direct PUT).
    key = store.layout.file_key(2, "model.pt")
    tampered = bytearray(step2[0].read_bytes())
    tampered[4 * MiB] ^= 0xFF
    async with aio_session.create_client("s3", **aws_client_kwargs) as s3:
        # Parts went up with their CRC32 (S3 checks each part; moto only records the algorithm).
        head = await s3.head_object(Bucket=BUCKET, Key=key, ChecksumMode="ENABLED")
        assert "ChecksumCRC32" in head
        await s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(tampered))

    with capture_logs() as logs:
        restored = await store.restore_latest(tmp_path / "restore")
    assert restored is not None and restored.step == 1
    assert [s for s, _ in restored.skipped] == [2] and "mismatch" in restored.skipped[0][1]
    fallback = [e for e in logs if e["event"] == "checkpoint_restore_fallback"]
    assert len(fallback) == 1 and fallback[0]["restored_step"] == 1 and fallback[0]["log_level"] == "warning"
    assert sha(restored.directory / "model.pt") == sha(step1[0])
    assert not (tmp_path / "restore" / "step-2").exists()
    assert not (tmp_path / "restore" / "step-2.partial").exists()

    # A missing file, and a `latest` that names a step without a manifest, fall back the same way.
    await store.bucket.delete_keys([store.layout.file_key(1, "optim.pt")])
    step3 = [write(tmp_path / "s3/model.pt", 1000)]
    await store.upload_step(3, step3, writer="w")
    await store.bucket.delete_keys([store.layout.manifest_key(3)])
    restored = await store.restore_latest(tmp_path / "restore")
    assert restored is None  # 3: no manifest, 2: corrupt, 1: file missing -> nothing trustworthy
    step4 = [write(tmp_path / "s4/model.pt", 1000)]
    await store.upload_step(4, step4, writer="w")
    restored = await store.restore_latest(tmp_path / "restore")
    assert restored is not None and restored.step == 4 and restored.skipped == ()


async def test_retention_keeps_exactly_k_and_never_the_only_complete_one(open_store, tmp_path):
    async with open_store("w", keep=2) as store:
        await store.ensure_bucket()
        for step in (1, 2, 3, 4, 5):
            r = await store.upload_step(step, [write(tmp_path / f"s{step}/m.pt", 1000)], writer="w")
            assert await store.complete_steps() == list(range(step, max(0, step - 2), -1))
            assert r.deleted_steps == ((step - 2,) if step > 2 else ())
        # Deleted steps are gone entirely, not just their manifests.
        assert sorted((await store.publisher.steps()).keys()) == [4, 5]

    async with open_store("w", keep=1) as store:
        # A newer step that never completes (its second writer never reports) deletes nothing.
        await store.upload_step(6, [write(tmp_path / "s6/m.pt", 1000)], writer="w", expected_writers=["w", "gone"])
        assert await store.complete_steps() == [5, 4]
        # Retention with K=1 removes 4 but never 5, the only complete one left, nor the newer 6.
        assert await store.publisher.apply_retention(1) == [4]
        assert await store.publisher.apply_retention(1) == []
        assert await store.complete_steps() == [5]
        assert sorted((await store.publisher.steps()).keys()) == [5, 6]
        # Once a newer one is complete, the older complete one and the abandoned step 6 both go.
        r = await store.upload_step(7, [write(tmp_path / "s7/m.pt", 1000)], writer="w")
        assert r.deleted_steps == (5, 6)
        assert await store.complete_steps() == [7]
        assert sorted((await store.publisher.steps()).keys()) == [7]


async def test_latest_moves_only_forward_with_conditional_writes(store, tmp_path):
    await store.upload_step(5, [write(tmp_path / "m5", 100)], writer="w")
    _, etag = await store.publisher.read_latest()
    # moto honours If-Match / If-None-Match on PutObject: a stale ETag or a create over an
    # existing pointer is refused (real S3 answers 412 the same way).
    with pytest.raises(PreconditionFailed):
        await store.bucket.put_bytes(store.layout.latest_key(), b"{}", sha256_b64=_b64(b"{}"), if_match='"0000"')
    with pytest.raises(PreconditionFailed):
        await store.bucket.put_bytes(store.layout.latest_key(), b"{}", sha256_b64=_b64(b"{}"), if_none_match=True)
    # An older step completing late (a slow node) never moves `latest` back.
    late = await store.upload_step(3, [write(tmp_path / "m3", 100)], writer="w")
    assert late.complete and late.latest_step == 5
    latest, etag_after = await store.publisher.read_latest()
    assert latest.step == 5 and etag_after == etag


async def test_deadline_is_reported_and_bad_input_is_refused(store, tmp_path):
    f = write(tmp_path / "m.pt", 6 * MiB)
    now = datetime.now(UTC)
    ok = await store.upload_step(1, [f], writer="w", deadline=now + timedelta(minutes=2))
    late = await store.upload_step(2, [f], writer="w", deadline=now - timedelta(seconds=1))
    plain = await store.upload_step(3, [f], writer="w")
    assert (ok.beat_deadline, late.beat_deadline, plain.beat_deadline) == (True, False, None)
    event = ok.to_event("i-0abc")
    assert event.kind == "checkpoint-uploaded" and event.nbytes == 6 * MiB and event.beat_deadline
    with pytest.raises(ValueError):
        await store.upload_step(4, [f], writer="w", expected_writers=["x", "y"])
    with pytest.raises(ValueError):
        await store.upload_step(4, [tmp_path / "MANIFEST.json"], writer="w")
    with pytest.raises(ValueError):
        await store.upload_step(4, [f], writer="no/slashes")
    with pytest.raises(ValueError):
        await store.upload_step(4, [f, tmp_path / "other" / "m.pt"], writer="w")  # same name twice
    assert await store.complete_steps() == [3, 2, 1]  # nothing was uploaded for step 4


async def test_after_a_notice_the_newest_checkpoint_overtakes_older_uploads(open_store, tmp_path):
    # One slot: parts go strictly one at a time, so the order they get it in is the whole story.
    async with open_store("w", tuning=UploadTuning(concurrency=1, part_size=5 * MiB)) as store:
        await store.ensure_bucket()
        finished: list[int] = []

        async def upload(step: int, path: Path, **kw):
            r = await store.upload_step(step, [path], writer="w", **kw)
            finished.append(step)
            return r

        old = asyncio.create_task(upload(1, write(tmp_path / "s1/m.pt", 30 * MiB)))  # 6 parts
        while not await store.bucket.list_multipart_uploads(store.layout.step_prefix(1)):
            await asyncio.sleep(0.01)
        urgent = await upload(
            2, write(tmp_path / "s2/m.pt", 6 * MiB), deadline=datetime.now(UTC) + timedelta(minutes=2)
        )
        assert urgent.beat_deadline and urgent.complete and finished == [2]
        assert not old.done()  # step 1 still has parts queued behind step 2's
        await old
        assert finished == [2, 1]
        # Step 1 completed late, and `latest` stays on the newer step.
        latest, _ = await store.publisher.read_latest()
        assert latest.step == 2


def _b64(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


async def test_replicated_copies_from_several_nodes_all_count_as_durable(open_store, tmp_path):
    # DDP: every node uploads a whole copy of step 8 (its own completion marker differs).
    state = write(tmp_path / "src/state.pt", 50_000)
    copies = {}
    for node in ("i-a", "i-b"):
        d = tmp_path / "src" / node
        d.mkdir(parents=True)
        (d / "state.pt").write_bytes(state.read_bytes())
        (d / "fleetd-complete.json").write_text(f'{{"step": 8, "node": "{node}"}}')
        copies[node] = d
    async with open_store("i-a") as a, open_store("i-b") as b:
        await a.ensure_bucket()
        with capture_logs() as logs:
            first = await a.upload_step(8, sorted(copies["i-a"].iterdir()), writer="i-a", root=copies["i-a"])
            second = await b.upload_step(8, sorted(copies["i-b"].iterdir()), writer="i-b", root=copies["i-b"])
        assert first.complete and first.published
        assert second.complete and not second.published  # the first copy is the durable one
        assert not [e for e in logs if e["log_level"] == "error"], logs
        manifest = await a.publisher.read_manifest(8)
        assert manifest.writers == ("i-a",)
