"""EC2's slow calls (CreateFleet, TerminateInstances) in their own task, off the reconcile pass.

The pass decides and records (the launch intent, the termination request: both before any call)
and hands the call to :class:`CloudCalls`, which runs it in one of two lanes, terminations and
launches, each one job at a time in submission order. A failed call drops the queued jobs and hands
its error to the next pass (``take_error``); every finished job wakes the loop (``on_done``)
(docs/DESIGN.md "How far one control host goes"; docs/measurements/2026-11-load.md).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fleetd.adapters.aws_errors import AwsError
from fleetd.shared.logs import get_logger

log = get_logger(__name__)


@dataclass(slots=True)
class Job:
    name: str
    call: Callable[[], Awaitable[object]]
    instance_ids: frozenset[str] = frozenset()
    launch: bool = False
    token: str = ""  # the launch's client token (its instances carry it as a tag)
    submitted: float = field(default_factory=time.monotonic)


# A termination (it frees budget and quota) never waits behind a CreateFleet, whose token check
# alone took over a minute on a loaded moto at 2,000 instances.
LANES = ("terminate", "launch")


def _lane(job: Job) -> str:
    return "launch" if job.launch else "terminate"


class CloudCalls:
    def __init__(self, on_done: Callable[[], None] = lambda: None) -> None:
        # Held by a pass from its observation to its last action, and by a job recording its answer: no
        # pass sees the EC2 view with a launch's instances and the state DB without them, or the reverse.
        self.lock = asyncio.Lock()
        self._on_done = on_done
        self._queues: dict[str, deque[Job]] = {lane: deque() for lane in LANES}
        self._current: dict[str, Job] = {}
        self._ready = {lane: asyncio.Event() for lane in LANES}
        self._terminated = asyncio.Event()  # a termination job ended (a launch may wait on it)
        self._idle = asyncio.Event()
        self._idle.set()
        self._error: AwsError | None = None
        self._failed_at = float("-inf")  # when a call last failed (take_error leaves it)
        self.seconds: list[float] = []  # recent jobs' durations (what the pass no longer waits on)

    # -- what the pass asks ---------------------------------------------------------------------
    def terminating(self, instance_id: str) -> bool:
        return any(instance_id in j.instance_ids for j in self._jobs())

    # No launch is planned while one is queued or running: the observation cannot show a launch's
    # instances before its call returns, so a second pass would buy them again.
    @property
    def launching(self) -> bool:
        return any(j.launch for j in self._jobs())

    def launch_tokens(self) -> set[str]:
        """Launches whose call is queued or on the wire: their instances may already show in
        the EC2 view (tagged) before the answer is recorded; the pass leaves them to the job."""
        return {j.token for j in self._jobs() if j.launch and j.token}

    def submit(self, job: Job) -> None:
        self._queues[_lane(job)].append(job)
        self._idle.clear()
        self._ready[_lane(job)].set()

    def take_error(self) -> AwsError | None:
        error, self._error = self._error, None
        return error

    async def idle(self) -> None:
        """Until every submitted job has finished (a bounded run ends with its calls made)."""
        await self._idle.wait()

    def _jobs(self) -> list[Job]:
        return [*self._current.values(), *(j for q in self._queues.values() for j in q)]

    # -- the workers ----------------------------------------------------------------------------
    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for lane in LANES:
                tg.create_task(self._run_lane(lane), name=f"cloud-calls-{lane}")

    async def _run_lane(self, lane: str) -> None:
        queue, ready = self._queues[lane], self._ready[lane]
        while True:
            if not queue:
                if not self._jobs():
                    self._idle.set()
                ready.clear()
                await ready.wait()
                continue
            job = self._current[lane] = queue.popleft()
            # A pass that replaces nodes ends the old ones first: they free quota and budget.
            if lane == "launch" and not await self._after_earlier_terminations(job):
                del self._current[lane]
                continue
            started = time.monotonic()
            try:
                await job.call()
            except AwsError as exc:
                # Planned from a view that is now older than this failure: re-planned, not retried.
                dropped = [j.name for q in self._queues.values() for j in q]
                for q in self._queues.values():
                    q.clear()
                self._error = exc
                self._failed_at = time.monotonic()
                log.warning(
                    "cloud_call_failed",
                    job=job.name,
                    kind=exc.kind,
                    code=exc.code,
                    operation=exc.operation,
                    error=exc.message,
                    dropped=dropped or None,
                )
            except Exception as exc:  # a bug in one job's follow-up must not end the worker
                log.error("cloud_call_crashed", job=job.name, error=repr(exc))
            finally:
                del self._current[lane]
            took = time.monotonic() - started
            self.seconds = [*self.seconds[-99:], took]
            log.info(
                "cloud_call_done",
                job=job.name,
                seconds=round(took, 4),
                queued_s=round(started - job.submitted, 4),
                instances=len(job.instance_ids) or None,
                lane=lane,
            )
            if lane == "terminate":
                self._terminated.set()
            if not self._jobs():
                self._idle.set()
            self._on_done()

    async def _after_earlier_terminations(self, job: Job) -> bool:
        """Wait for the terminations submitted before this launch; False (the launch dropped) if
        a call failed meanwhile: it was planned from a view older than that failure."""
        while any(
            j.submitted <= job.submitted for j in [*self._current.values(), *self._queues["terminate"]] if not j.launch
        ):
            self._terminated.clear()
            await self._terminated.wait()
        if self._failed_at >= job.submitted:
            log.warning("cloud_call_dropped", job=job.name, why="a call failed while it waited for terminations")
            return False
        return True
