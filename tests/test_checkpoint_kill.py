"""An uploader process SIGKILLed in the middle of a multipart upload (no clean cancel, no abort):
`latest` stays on the previous complete checkpoint, and the next run aborts the stale upload."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from agent.checkpoint_store import CheckpointStore, UploadTuning
from agent.checkpoint_store.uploader import MiB
from fleetd.shared.settings import AwsConfig, CheckpointConfig

BUCKET = "ckpt-kill"
ROOT = Path(__file__).resolve().parents[1]


class StallingProxy:
    """TCP proxy in front of moto that forwards the first ``budget`` request bytes and then stops
    reading from the client: the upload in flight hangs mid-part, like a node about to vanish."""

    def __init__(self, upstream_port: int, budget: int):
        self.upstream_port = upstream_port
        self.budget = budget
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _client(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def up() -> None:
            while self.budget > 0 and (data := await cr.read(min(65536, self.budget))):
                self.budget -= len(data)
                uw.write(data)
                await uw.drain()
            await asyncio.Event().wait()  # budget spent: hold the connection open, forward nothing

        async def down() -> None:
            while data := await ur.read(65536):
                cw.write(data)
                await cw.drain()

        tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
        self.tasks.update(tasks)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            for w in (cw, uw):
                w.close()

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def uploader_env(endpoint: str, local_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "FLEETD_AWS__ENDPOINT_URL": endpoint,
        "FLEETD_CHECKPOINTS__BUCKET": BUCKET,
        "FLEETD_CHECKPOINTS__PREFIX": "runs",
        "FLEETD_CHECKPOINTS__LOCAL_DIR": str(local_dir),
        "FLEETD_CHECKPOINTS__PART_SIZE_MB": "5",
        "FLEETD_CHECKPOINTS__UPLOAD_CONCURRENCY": "1",
    }


async def run_uploader(env: dict, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agent.checkpoint_store",
        "--job",
        "train",
        "upload",
        *args,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


@pytest.mark.slow
async def test_killed_upload_leaves_latest_and_next_run_aborts_stale_multipart(
    aio_session, aws_client_kwargs, moto_endpoint, tmp_path
):
    cfg = CheckpointConfig(bucket=BUCKET, prefix="runs", keep=3, local_dir=tmp_path / "other-node")
    aws = AwsConfig(endpoint_url=moto_endpoint)
    (tmp_path / "s1").mkdir()
    (tmp_path / "s1/model.pt").write_bytes(os.urandom(1000))
    async with CheckpointStore.connect(
        cfg, aws, job="train", client_config=aws_client_kwargs["config"], tuning=UploadTuning(concurrency=2)
    ) as store:
        await store.ensure_bucket()
        await store.upload_step(1, [tmp_path / "s1/model.pt"], writer="i-a")

        big = tmp_path / "s2/model.pt"
        big.parent.mkdir()
        big.write_bytes(os.urandom(16 * MiB))  # 4 parts of 5 MiB, one at a time
        proxy = StallingProxy(int(moto_endpoint.rsplit(":", 1)[1]), budget=8 * MiB)
        port = await proxy.start()
        env = uploader_env(f"http://127.0.0.1:{port}", tmp_path / "node-a")
        proc = await run_uploader(env, "--step", "2", "--writer", "i-a", str(big))
        try:
            async with aio_session.create_client("s3", **aws_client_kwargs) as s3:
                # Wait until the child has a multipart upload with at least one part stored...
                upload = None
                for _ in range(300):
                    uploads = (await s3.list_multipart_uploads(Bucket=BUCKET)).get("Uploads", [])
                    if uploads:
                        parts = await s3.list_parts(
                            Bucket=BUCKET, Key=uploads[0]["Key"], UploadId=uploads[0]["UploadId"]
                        )
                        if parts.get("Parts"):
                            upload = uploads[0]
                            break
                    assert proc.returncode is None, "uploader exited before it was killed"
                    await asyncio.sleep(0.05)
                assert upload is not None and upload["Key"] == "runs/train/step-2/model.pt"
                # ...then kill it outright, mid-multipart.
                proc.send_signal(signal.SIGKILL)
                assert await asyncio.wait_for(proc.wait(), 30) == -signal.SIGKILL
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await proxy.close()

        latest, _ = await store.publisher.read_latest()
        assert latest is not None and latest.step == 1
        assert await store.complete_steps() == [1]
        restored = await store.restore_latest(tmp_path / "restore")
        assert restored is not None and restored.step == 1

        # Next run of the same writer (same node, same local state), straight to S3: it aborts its
        # stale upload (found through its local ledger), then uploads and publishes step 2.
        env = uploader_env(moto_endpoint, tmp_path / "node-a")
        rerun = await run_uploader(env, "--step", "2", "--writer", "i-a", str(big))
        out, err = await asyncio.wait_for(rerun.communicate(), 120)
        assert rerun.returncode == 0, err.decode()[-2000:]
        result = json.loads(out.decode().strip().splitlines()[-1])
        assert result["complete"] and result["latest_step"] == 2
        aborted = [json.loads(line) for line in err.decode().splitlines() if "stale_multipart_aborted" in line]
        assert [a["upload_id"] for a in aborted] == [upload["UploadId"]]
        async with aio_session.create_client("s3", **aws_client_kwargs) as s3:
            assert (await s3.list_multipart_uploads(Bucket=BUCKET)).get("Uploads", []) == []
        restored = await store.restore_latest(tmp_path / "restore")
        assert restored is not None and restored.step == 2
        assert (restored.directory / "model.pt").read_bytes() == big.read_bytes()
