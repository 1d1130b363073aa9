"""The shared checkpoint layout (fleetd.protocol.checkpoints) and the uploader's pure parts."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest

from agent.checkpoint_store.slots import PrioritySlots, priority
from agent.checkpoint_store.uploader import MiB, UploadTuning, choose_part_size
from fleetd.protocol.checkpoints import (
    CheckpointLayout,
    FileEntry,
    LatestPointer,
    Manifest,
    WriterReceipt,
    merge_receipts,
    parse_latest,
    parse_manifest,
    parse_receipt,
    shard_receipts_complete,
)
from fleetd.protocol.digests import Checksum, Digest
from fleetd.protocol.errors import ProtocolError


def entry(name: str, data: bytes = b"x") -> FileEntry:
    return FileEntry(name=name, size=len(data), checksum=Checksum.sha256(hashlib.sha256(data).digest()))


def receipt(writer: str, files: list[str], writers=("a", "b"), step: int = 7) -> WriterReceipt:
    return WriterReceipt(
        job="train",
        step=step,
        writer=writer,
        world_size=4,
        expected_writers=writers,
        files=tuple(entry(f) for f in files),
    )


def test_keys_follow_the_documented_layout():
    lay = CheckpointLayout("ckpt/runs", "train")
    assert lay.file_key(12, "__0_0.distcp") == "ckpt/runs/train/step-12/__0_0.distcp"
    assert lay.file_key(12, "sub/opt.pt") == "ckpt/runs/train/step-12/sub/opt.pt"
    assert lay.manifest_key(12) == "ckpt/runs/train/step-12/MANIFEST.json"
    assert lay.receipt_key(12, "i-0abc") == "ckpt/runs/train/step-12/_parts/i-0abc.json"
    assert lay.latest_key() == "ckpt/runs/train/latest"
    assert CheckpointLayout("", "train").step_prefix(0) == "train/step-0/"
    assert lay.step_of_prefix("ckpt/runs/train/step-12/") == 12
    assert lay.step_of_key("ckpt/runs/train/step-3/_parts/x.json") == 3
    for foreign in (
        "ckpt/runs/train/latest",
        "ckpt/runs/train/step-01/x",
        "other/train/step-1/x",
        "ckpt/runs/train/step-x/a",
    ):
        assert lay.step_of_key(foreign) is None


@pytest.mark.parametrize(
    "bad", ["../escape", "/abs", "a/../b", "MANIFEST.json", "_parts/x.json", "", "a//b", "sp ace", "a\\b"]
)
def test_file_names_that_would_escape_or_collide_are_rejected(bad):
    with pytest.raises(ValueError):
        CheckpointLayout("p", "train").file_key(1, bad)


def test_manifest_round_trips_and_parser_rejects_bad_objects():
    m = Manifest(job="train", step=7, world_size=2, writers=("a",), writer="a", files=(entry("b"), entry("a")))
    assert [f.name for f in m.files] == ["a", "b"]  # sorted, so two merges serialise alike
    assert parse_manifest(m.to_json(), source="k", job="train", step=7) == m

    raw = json.loads(m.to_json())
    cases = {
        b"not json": "not a valid Manifest",
        json.dumps({**raw, "schema_version": 99}).encode(): "schema_version 99",
        json.dumps({**raw, "surprise": 1}).encode(): "surprise",
        json.dumps({**raw, "files": []}).encode(): "at least one file",
        json.dumps({**raw, "files": [{**raw["files"][0], "name": "../../etc/passwd"}]}).encode(): "forbidden",
        json.dumps(
            {**raw, "files": [{**raw["files"][0], "checksum": {"algorithm": "sha256", "value": "zz"}}]}
        ).encode(): "hex",
        json.dumps({**raw, "files": [raw["files"][0], raw["files"][0]]}).encode(): "more than once",
    }
    for data, reason in cases.items():
        with pytest.raises(ProtocolError, match=reason):
            parse_manifest(data, source="s3://b/k", job="train", step=7)
    with pytest.raises(ProtocolError, match="not train/step-8"):
        parse_manifest(m.to_json(), source="k", job="train", step=8)


def test_receipt_and_latest_parsers_check_job_and_step():
    r = receipt("a", ["x"])
    assert parse_receipt(r.to_json(), source="k", job="train", step=7) == r
    with pytest.raises(ProtocolError):
        parse_receipt(r.to_json(), source="k", job="other", step=7)
    p = LatestPointer(job="train", step=3, writer="a")
    assert parse_latest(p.to_json(), source="k", job="train").step == 3
    with pytest.raises(ProtocolError):
        parse_latest(b'{"kind": "checkpoint-latest"}', source="k", job="train")


def test_merge_needs_every_expected_writer_and_distinct_files():
    a, b = receipt("a", ["__0_0.distcp", ".metadata"]), receipt("b", ["__1_0.distcp"])
    with pytest.raises(ProtocolError, match=r"missing from writers \['b'\]"):
        merge_receipts([a], job="train", step=7, merged_by="a")
    m1 = merge_receipts([a, b], job="train", step=7, merged_by="a")
    m2 = merge_receipts([b, a], job="train", step=7, merged_by="b")
    assert m1.writers == ("a", "b") and len(m1.files) == 3
    assert m1.same_content(m2) and m1.writer != m2.writer
    clash = receipt("b", ["__0_0.distcp"])
    with pytest.raises(ProtocolError, match="more than once"):
        merge_receipts([a, clash], job="train", step=7, merged_by="a")


def test_digest_reproduces_plain_and_s3_composite_sha256():
    data = bytes(range(256)) * 1000  # 256,000 bytes
    parts = [hashlib.sha256(data[i : i + 100_000]).digest() for i in range(0, len(data), 100_000)]
    want = hashlib.sha256(b"".join(parts)).hexdigest()  # S3's COMPOSITE ChecksumSHA256, in hex
    for chunk in (1, 4096, 100_000, 300_000):  # however the bytes arrive
        d = Digest("sha256-composite", 100_000)
        for i in range(0, len(data), chunk):
            d.update(data[i : i + chunk])
        assert d.checksum() == Checksum(algorithm="sha256-composite", value=want, part_size=100_000)
    plain = Digest("sha256")
    plain.update(data)
    assert plain.checksum().value == hashlib.sha256(data).hexdigest()
    with pytest.raises(ValueError, match="part_size"):
        Checksum(algorithm="sha256-composite", value=want)
    with pytest.raises(ProtocolError, match="cannot be verified"):
        Digest.like(Checksum(algorithm="crc32c", value="0a1b2c3d"))


def test_part_size_is_chosen_for_throughput_and_s3_limits():
    t = UploadTuning(concurrency=8)
    assert choose_part_size(1 << 30, t) == 8 * MiB  # 128 parts keep 8 slots busy
    assert choose_part_size(40 * MiB, t) == 8 * MiB
    wide = UploadTuning(concurrency=8, min_part_size=8 * MiB, max_part_size=64 * MiB)
    assert choose_part_size(1 << 30, wide) == 64 * MiB  # ~2 parts per slot within the bounds
    assert choose_part_size(200 << 30, t) >= (200 << 30) / 10_000  # S3's 10,000-part limit
    assert choose_part_size(40 * MiB, UploadTuning(part_size=5 * MiB)) == 5 * MiB
    with pytest.raises(ValueError):
        UploadTuning(part_size=1 * MiB)


async def test_free_slots_go_to_the_urgent_then_newest_upload_first():
    slots = PrioritySlots(1)
    order: list[str] = []
    gate = asyncio.Event()

    async def take(name: str, prio) -> None:
        async with slots.slot(prio):
            order.append(name)
            await gate.wait()

    holder = asyncio.create_task(take("holder", priority(1, False)))
    await asyncio.sleep(0)
    waiters = [
        asyncio.create_task(take("old", priority(5, False))),
        asyncio.create_task(take("new", priority(9, False))),
        asyncio.create_task(take("notice", priority(9, True))),
    ]
    cancelled = asyncio.create_task(take("cancelled", priority(99, True)))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    gate.set()
    await asyncio.gather(holder, *waiters)
    assert order == ["holder", "notice", "new", "old"]


def test_sharded_parts_complete_a_step_once_they_hold_every_file_its_metadata_names():
    def part(writer: str, files: list[str], step_files=None) -> WriterReceipt:
        return WriterReceipt(
            job="train",
            step=7,
            writer=writer,
            world_size=1,
            expected_writers=(writer,),
            files=tuple(entry(f) for f in files),
            step_files=step_files,
        )

    names = (".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp")
    meta = part("n0", [".metadata", "__0_0.distcp"], step_files=names)
    one, two = part("n1", ["__1_0.distcp"]), part("n2", ["__2_0.distcp"])
    replicated = part("n3", ["state.pt"])
    assert one.is_shard and meta.is_shard and not replicated.is_shard
    assert shard_receipts_complete([one, two]) is None  # nobody knows the whole list yet
    assert shard_receipts_complete([meta, one]) is None  # __2_0 still missing
    done = shard_receipts_complete([two, replicated, meta, one])
    assert done is not None and {r.writer for r in done} == {"n0", "n1", "n2"}
    merged = merge_receipts(done, job="train", step=7, merged_by="n2")
    assert {f.name for f in merged.files} == set(names)
    with pytest.raises(ValueError):
        part("n0", [".metadata"], step_files=("../escape",))  # names are checked like file names
