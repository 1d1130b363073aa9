"""Before the first torchrun: the job's code made ready on this node, retried the way a crash is.

A failed setup (or a refused archive) is reported to fleetd as the trainer's exit with reason
``setup-failed: <detail>``; fleetd counts it as a failure of the job's code (its restarts, then
FAILED with the detail as the cause: fleetd/policy/job_state.py) and answers with restart-trainer,
which runs setup again. S3 being unreachable is not the job's fault: retried here with backoff.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from tenacity import RetryCallState

from agent.checkpoint_store.errors import StoreError
from agent.checkpoint_store.s3 import S3Bucket
from agent.supervise.workspace import JobWorkspace, SetupFailed, prepare
from fleetd.protocol.messages import TrainerExited
from fleetd.shared.backoff import failure_of, retrying
from fleetd.shared.logs import get_logger

log = get_logger(__name__)
SETUP_FAILED = "setup-failed"


def s3_fetch(aws: Any) -> Callable[[str, str], Awaitable[bytes]]:
    """(bucket, key) -> bytes over the node's own S3 settings."""

    async def fetch(bucket: str, key: str) -> bytes:
        async with S3Bucket.connect(bucket, region=aws.region, endpoint_url=aws.endpoint_url) as s3:
            data, _ = await s3.get_bytes(key)
        return data

    return fetch


async def until_ready(
    workspace: JobWorkspace,
    fetch: Callable[[str, str], Awaitable[bytes]],
    *,
    instance_id: str,
    publish_event: Callable[[Any], Awaitable[None]],
    wait_retry: Callable[[], Awaitable[None]],  # until fleetd's restart-trainer or a stop
    stopped: asyncio.Event,
) -> bool:
    """True once the code is ready; False if the agent is stopping first."""

    def fetch_failed(state: RetryCallState) -> None:
        log.warning("job_code_fetch_failed", error=str(failure_of(state))[:300], uri=workspace.uri)

    while not stopped.is_set():
        try:
            # S3 unreachable is not the job's fault: retried here, with backoff, until stopped.
            async for attempt in retrying(1.0, 30.0, retry_on=StoreError, stop=stopped, before_sleep=fetch_failed):
                if stopped.is_set():
                    return False
                with attempt:
                    await prepare(workspace, fetch)
            return True
        except SetupFailed as exc:
            log.error("job_setup_failed", exit_code=exc.exit_code, detail=exc.detail)
            reason = f"{SETUP_FAILED}: {exc.detail}"
            await publish_event(TrainerExited(instance_id=instance_id, exit_code=exc.exit_code, reason=reason))
            await wait_retry()
        except StoreError:
            return False  # stopped while S3 was unreachable
    return False
