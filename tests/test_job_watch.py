"""The job watcher (fleetd/job_watch.py) around the pure lifecycle: a real node registry fed the
agents' messages, the state files `fleetd status` and `fleetd cancel` share with it, the restart
commands it sends and what it asks of the planner."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from fleetd.intake.events import from_message
from fleetd.intake.registry import NodeRegistry
from fleetd.intake.signals import TrainingSignals
from fleetd.job_record import CancelRequest, read_job, write_cancel
from fleetd.job_watch import JobWatcher
from fleetd.policy.job_state import JobSettings, JobState
from fleetd.policy.model import Market, Node, NodePhase, PoolId
from fleetd.policy.observation import DesiredJob, Observation
from fleetd.protocol.messages import RestartTrainerCommand, Status, TrainerExited

POOL = PoolId("g5.xlarge", "us-east-1a")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ctx_with(*iids: str, step: int = 10) -> SimpleNamespace:
    nodes = tuple(Node(i, POOL, Market.SPOT, 0.5, launched_at=0.0, phase=NodePhase.RUNNING, step=step) for i in iids)
    return SimpleNamespace(last_report=SimpleNamespace(observation=Observation(nodes=nodes)))


def watcher(tmp_path: Path, clock: Clock, sent: list, **kw) -> tuple[JobWatcher, NodeRegistry, TrainingSignals]:
    registry = NodeRegistry(clock=clock)
    signals = TrainingSignals(registry, clock=clock)

    async def send(cmd) -> None:
        sent.append(cmd)

    w = JobWatcher(
        JobSettings(max_restarts=1, settle_s=5.0),
        registry,
        signals,
        state_dir=tmp_path,
        send_command=send,
        clock=clock,
        **kw,
    )
    return w, registry, signals


def say(registry: NodeRegistry, msg, at: float) -> None:
    event = from_message(msg, at)
    assert event is not None
    registry.apply(event)


async def test_a_finished_job_succeeds_persists_and_releases_every_node(tmp_path: Path) -> None:
    clock, sent = Clock(), []
    w, registry, signals = watcher(tmp_path, clock, sent)
    ctx = ctx_with("i-1", "i-2")
    for iid in ("i-1", "i-2"):
        say(registry, Status(instance_id=iid, state="training"), clock.now)
    await w.tick(ctx)
    assert w.record.state is JobState.RUNNING and signals.desired_job is DesiredJob.RUN
    clock.now += 60
    for iid in ("i-1", "i-2"):
        say(registry, TrainerExited(instance_id=iid, exit_code=0, reason="finished"), clock.now)
        say(registry, Status(instance_id=iid, state="ready"), clock.now)
    await w.tick(ctx)
    assert w.record.state is JobState.SUCCEEDED
    on_disk = read_job(tmp_path)
    assert on_disk is not None and on_disk.state is JobState.SUCCEEDED and on_disk.terminal
    # No durable checkpoint of the last step yet: the nodes stay up to 30 s for its upload.
    assert signals.desired_job is DesiredJob.RUN
    clock.now += 31
    await w.tick(ctx)
    assert signals.desired_job is DesiredJob.END and sent == []
    assert not w.job_active()
    # A new daemon life reads the ended job back and keeps it ended.
    w2, _, signals2 = watcher(tmp_path, clock, sent)
    w2.load()
    await w2.tick(ctx)
    assert w2.record.state is JobState.SUCCEEDED and signals2.desired_job is DesiredJob.END


async def test_a_failing_job_is_restarted_once_then_fails(tmp_path: Path) -> None:
    clock, sent = Clock(), []
    w, registry, signals = watcher(tmp_path, clock, sent)
    ctx = ctx_with("i-1")
    say(registry, Status(instance_id="i-1", state="training"), clock.now)
    await w.tick(ctx)
    clock.now += 30
    say(registry, TrainerExited(instance_id="i-1", exit_code=1, reason="failed"), clock.now)
    await w.tick(ctx)
    assert [type(c) for c in sent] == [RestartTrainerCommand] and w.record.restarts == 1
    clock.now += 30
    say(registry, TrainerExited(instance_id="i-1", exit_code=1, reason="failed"), clock.now)
    await w.tick(ctx)
    assert w.record.state is JobState.FAILED and len(sent) == 1
    assert signals.desired_job is DesiredJob.END  # at once: nothing more will be saved


async def test_fleetd_cancel_reaches_the_daemon_and_asks_for_a_coordinated_stop(tmp_path: Path) -> None:
    clock, sent = Clock(), []
    w, registry, signals = watcher(tmp_path, clock, sent)
    ctx = ctx_with("i-1")
    say(registry, Status(instance_id="i-1", state="training"), clock.now)
    await w.tick(ctx)
    conf = tmp_path / "fleetd.toml"
    conf.write_text(f'[fleet]\nstate_dir = "{tmp_path}"\n')
    out = subprocess.run(
        [sys.executable, "-m", "fleetd.cli", "cancel", "--config", str(conf), "--reason", "wrong data"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    await w.tick(ctx)
    assert w.record.state is JobState.CANCELLED and "wrong data" in w.record.reason
    assert signals.desired_job is DesiredJob.STOP
    assert json.loads((tmp_path / "job.json").read_text())["state"] == "cancelled"
    # A second cancel of an ended job says so.
    again = subprocess.run(
        [sys.executable, "-m", "fleetd.cli", "cancel", "--config", str(conf)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 1 and "already ended" in again.stderr


async def test_a_bad_cancel_file_is_logged_and_the_job_goes_on(tmp_path: Path) -> None:
    clock, sent = Clock(), []
    w, registry, _ = watcher(tmp_path, clock, sent)
    (tmp_path / "cancel.json").write_text("{not json")
    say(registry, Status(instance_id="i-1", state="training"), clock.now)
    await w.tick(ctx_with("i-1"))
    assert w.record.state is JobState.RUNNING
    write_cancel(tmp_path, CancelRequest(reason="now", requested_at=clock.now))
    await w.tick(ctx_with("i-1"))
    assert w.record.state is JobState.CANCELLED


async def test_the_watcher_survives_a_failing_tick(tmp_path: Path) -> None:
    clock, sent = Clock(), []
    w, _, _ = watcher(tmp_path, clock, sent, interval_s=0.01)
    broken = SimpleNamespace(last_report=SimpleNamespace(observation=object()))  # no .nodes
    task = asyncio.create_task(w.run(broken))
    await asyncio.sleep(0.05)
    assert not task.done()
    task.cancel()


async def test_the_job_lives_in_the_state_store_a_new_leader_continues_it(tmp_path: Path) -> None:
    """The record goes to the reconciler's state store too (shared by an HA pair: a new leader,
    with its own host's state dir, continues the job there), and a job that ended with another
    code version is a new run of the job, not an ended one."""
    from fleetd.reconcile.state import StateStore

    store = await StateStore.open(tmp_path / "shared")
    try:
        clock, sent = Clock(), []
        w, registry, _ = watcher(tmp_path / "a", clock, sent, code_digest="a" * 64)
        ctx = ctx_with("i-1")
        ctx.reconciler = SimpleNamespace(state=store)
        say(registry, Status(instance_id="i-1", state="training"), clock.now)
        await w.tick(ctx)
        clock.now += 60
        say(registry, TrainerExited(instance_id="i-1", exit_code=3, reason="failed"), clock.now)
        await w.tick(ctx)
        assert w.record.restarts == 1
        stored = await store.get_meta("job")
        assert stored["state"] == "running" and stored["restarts"] == 1 and stored["code_digest"] == "a" * 64

        # Another host takes over: no job.json of its own, the store's record wins.
        w2, registry2, _ = watcher(tmp_path / "b", clock, [], code_digest="a" * 64)
        w2.load()
        assert w2.record.state is JobState.PENDING
        say(registry2, Status(instance_id="i-1", state="training"), clock.now)
        await w2.tick(ctx)
        assert w2.record.restarts == 1 and w2.record.state is JobState.RUNNING

        # It ends; a job file with new code started later is a new run, the same code is not.
        await store.set_meta("job", {**(await store.get_meta("job")), "state": "failed", "ended_at": clock.now})
        same, _, _ = watcher(tmp_path / "d", clock, [], code_digest="a" * 64)
        await same.tick(_with_store(store))
        assert same.record.state is JobState.FAILED
        fresh, _, _ = watcher(tmp_path / "c", clock, [], code_digest="b" * 64)
        await fresh.tick(_with_store(store))
        assert fresh.record.state is JobState.PENDING and fresh.record.restarts == 0
        assert (await store.get_meta("job"))["code_digest"] == "b" * 64  # the new run replaced it
    finally:
        await store.close()


def _with_store(store: object) -> SimpleNamespace:
    ctx = ctx_with()
    ctx.reconciler = SimpleNamespace(state=store)
    return ctx


async def test_every_state_change_is_in_the_ledger_once_and_in_the_report(tmp_path: Path) -> None:
    from fleetd.commands.report import job_history, render_table
    from fleetd.policy import ledger
    from fleetd.reconcile.ledger_store import LedgerStore

    store = await LedgerStore.open(tmp_path / "ledger.db")
    try:
        clock, sent = Clock(), []
        w, registry, _ = watcher(tmp_path, clock, sent, ledger=store, code_digest="ab" * 32)
        ctx = ctx_with("i-1")
        say(registry, Status(instance_id="i-1", state="training"), clock.now)
        await w.tick(ctx)
        await w.tick(ctx)  # no change: nothing new
        clock.now += 30
        say(registry, TrainerExited(instance_id="i-1", exit_code=1, reason="failed"), clock.now)
        await w.tick(ctx)
        clock.now += 30
        say(registry, TrainerExited(instance_id="i-1", exit_code=1, reason="failed"), clock.now)
        await w.tick(ctx)
        events = await store.events()
    finally:
        await store.close()
    changes = [e for e in events if isinstance(e, ledger.JobStateChanged)]
    assert [c.state for c in changes][0] == "running" and changes[-1].state == "failed"
    assert len({c.event_id for c in changes}) == len(changes)
    assert all(c.code_digest == "ab" * 32 for c in changes)
    history = job_history(events)
    assert [h["state"] for h in history] == [c.state for c in changes]
    # Not billing: spend and goodput are what they were without them.
    assert ledger.summarize(events, clock.now, {}) == ledger.summarize(
        [e for e in events if not isinstance(e, ledger.JobStateChanged)], clock.now, {}
    )
    table = render_table(
        {
            **ledger.summarize(events, clock.now, {}).as_json(),
            "job": None,
            "stall": None,
            "job_history": history,
        }
    )
    assert "job states:" in table and "failed" in table


async def test_a_ledger_that_fails_does_not_stop_the_lifecycle(tmp_path: Path) -> None:
    class Broken:
        async def append(self, *events) -> int:
            raise OSError("disk full")

    clock, sent = Clock(), []
    w, registry, _ = watcher(tmp_path, clock, sent, ledger=Broken())
    say(registry, Status(instance_id="i-1", state="training"), clock.now)
    await w.tick(ctx_with("i-1"))
    assert w.record.state is JobState.RUNNING and read_job(tmp_path) is not None
