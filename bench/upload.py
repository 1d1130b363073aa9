"""Upload throughput: fleetd's checkpoint uploader vs boto3's ``upload_file``, same file, same run.

    .venv/bin/python bench/upload.py                 # 1 GiB against a moto_server it starts
    .venv/bin/python bench/upload.py --size-mb 64    # quicker
    .venv/bin/python bench/upload.py --endpoint http://127.0.0.1:5000   # an existing S3 endpoint

Both clients upload the same generated file to the same server (a ``moto_server`` process unless
``--endpoint`` is given), alternating which goes first on each repetition; objects are deleted
between runs so the server's memory does not grow. fleetd's time is the whole ``upload_step``
(stale-upload check, file upload, receipt, manifest, ``latest``), boto3's is one ``upload_file``
with its default TransferConfig. The best run of each is reported. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
from botocore.config import Config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.checkpoint_store import CheckpointStore, UploadTuning  # noqa: E402
from fleetd.shared.logs import configure_logging  # noqa: E402
from fleetd.shared.settings import AwsConfig, CheckpointConfig  # noqa: E402
from tests.harness import moto as moto_harness  # noqa: E402
from tests.harness.ports import free_port, wait_port  # noqa: E402

MiB = 1 << 20
BUCKET = "fleetd-bench"


def make_file(path: Path, size_mb: int) -> None:
    block = os.urandom(16 * MiB)  # incompressible; repeated blocks are fine for a network bench
    with open(path, "wb") as f:
        left = size_mb * MiB
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n


def start_moto(size_mb: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    # Keep objects in memory: moto spools anything over ~5 MiB to temp files by default, and disk
    # write-back on a shared box adds seconds of noise to both clients alike.
    env = {**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str((size_mb + 1) * MiB)}
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    wait_port("127.0.0.1", port, timeout=30)
    return proc, f"http://127.0.0.1:{port}"


def empty_bucket(s3) -> None:
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})


def run_boto3(s3, path: Path) -> float:
    t0 = time.perf_counter()
    s3.upload_file(str(path), BUCKET, "boto3/checkpoint.bin")
    return time.perf_counter() - t0


async def run_fleetd(endpoint: str, path: Path, step: int, tuning: UploadTuning, state: Path) -> float:
    cfg = CheckpointConfig(bucket=BUCKET, prefix="bench", local_dir=state, keep=1)
    async with CheckpointStore.connect(cfg, AwsConfig(endpoint_url=endpoint), job="bench", tuning=tuning) as store:
        t0 = time.perf_counter()
        result = await store.upload_step(step, [path], writer="bench")
        elapsed = time.perf_counter() - t0
    assert result.complete, "fleetd upload did not publish its manifest"
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--endpoint", default=None, help="S3 endpoint (default: start a moto_server)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each client (alternating order)")
    ap.add_argument("--concurrency", type=int, default=UploadTuning().concurrency)
    ap.add_argument("--part-size-mb", type=int, default=0, help="0: fleetd chooses per file")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()

    moto_harness.use_fake_credentials()
    configure_logging("warning", json=False, stream=sys.stderr)
    proc = None
    endpoint = args.endpoint
    if endpoint is None:
        proc, endpoint = start_moto(args.size_mb)
    work = Path(tempfile.mkdtemp(prefix="fleetd-bench-", dir=args.workdir))
    tuning = UploadTuning(
        concurrency=args.concurrency,
        part_size=args.part_size_mb * MiB if args.part_size_mb else None,
    )
    try:
        s3 = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", config=Config(s3={"addressing_style": "path"})
        )
        s3.create_bucket(Bucket=BUCKET)
        path = work / "checkpoint.bin"
        t0 = time.perf_counter()
        make_file(path, args.size_mb)
        print(f"generated {args.size_mb} MiB in {time.perf_counter() - t0:.1f}s at {path}", flush=True)
        times: dict[str, list[float]] = {"fleetd": [], "boto3": []}
        for i in range(args.repeats):
            order = ("fleetd", "boto3") if i % 2 == 0 else ("boto3", "fleetd")
            for who in order:
                if who == "boto3":
                    dt = run_boto3(s3, path)
                else:
                    dt = asyncio.run(run_fleetd(endpoint, path, i + 1, tuning, work / "state"))
                times[who].append(dt)
                print(f"run {i + 1} {who:6s}: {dt:6.2f}s  {args.size_mb / dt:7.1f} MiB/s", flush=True)
                empty_bucket(s3)
        fleetd_mb_s = args.size_mb / min(times["fleetd"])
        boto3_mb_s = args.size_mb / min(times["boto3"])
        ratio = fleetd_mb_s / boto3_mb_s
        print(f"best: fleetd {fleetd_mb_s:.1f} MiB/s, boto3 upload_file {boto3_mb_s:.1f} MiB/s, ratio {ratio:.2f}")
        print(
            json.dumps(
                {
                    "size_mb": args.size_mb,
                    "fleetd_mb_s": round(fleetd_mb_s, 1),
                    "boto3_mb_s": round(boto3_mb_s, 1),
                    "ratio": round(ratio, 3),
                    "fleetd_s": [round(t, 3) for t in times["fleetd"]],
                    "boto3_s": [round(t, 3) for t in times["boto3"]],
                    "concurrency": tuning.concurrency,
                    "part_size_mb": args.part_size_mb or "auto",
                    "endpoint": "moto_server" if proc else endpoint,
                }
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
