"""A team member's daemon reading its allotment (fleetd/team/member.py): a file it cannot read, a
job that is over, and a resume while the paused job's nodes are still going."""

from __future__ import annotations

from pathlib import Path

from fleetd.config import FleetConfig, FleetdConfig, TeamMemberConfig
from fleetd.policy.model import Market, Node, NodePhase, PoolId
from fleetd.policy.observation import DesiredJob, Observation
from fleetd.reconcile.state import StateStore
from fleetd.team.allotment_file import ALLOTMENT_NAME, AllotmentRecord, read_allotment, write_allotment
from fleetd.team.member import PAUSED_KEY, TeamMember

CFG = FleetdConfig(fleet=FleetConfig(name="j", min_nodes=1, max_nodes=4), team=TeamMemberConfig(member=True))


def record(kind: str, nodes: int = 2) -> AllotmentRecord:
    return AllotmentRecord(
        team="t", job="j", written_at=100.0, kind=kind, nodes=nodes, usd_per_hour=1.0, total_usd=20.0, reason="r"
    )


class Resumes:
    resumed = 0

    async def resume_job(self, reason: str) -> None:
        self.resumed += 1


def node(ec2_state: str) -> Node:
    return Node(
        instance_id="i-1",
        pool=PoolId("g5.xlarge", "us-east-1a"),
        market=Market.SPOT,
        price_per_hour=0.4,
        phase=NodePhase.RUNNING,
        ec2_state=ec2_state,
        launched_at=0.0,
    )


async def test_an_unreadable_allotment_keeps_the_last_one_read(tmp_path: Path) -> None:
    state = await StateStore.open(tmp_path)
    try:
        m = TeamMember("j", tmp_path, state)
        write_allotment(tmp_path, record("grow", nodes=3))
        obs, cfg = await m.bound(Observation(), CFG, now=110.0)
        assert obs.desired_job is DesiredJob.RUN and cfg.fleet.max_nodes == 3
        (tmp_path / ALLOTMENT_NAME).write_text('{"schema_version": 99}')
        obs, cfg = await m.bound(Observation(), CFG, now=120.0)
        assert obs.desired_job is DesiredJob.RUN and cfg.fleet.max_nodes == 3
        # A fresh daemon that never read a good one waits: with no node, nothing to stop or buy.
        obs, _ = await TeamMember("j", tmp_path, state).bound(Observation(), CFG, now=130.0)
        assert obs.desired_job is DesiredJob.RUN and obs.stop_issued_at == 130.0
    finally:
        await state.close()


async def test_a_pause_leaves_a_finished_job_alone_and_a_resume_waits_for_the_stopped_nodes(tmp_path: Path) -> None:
    state = await StateStore.open(tmp_path)
    try:
        commander = Resumes()
        m = TeamMember("j", tmp_path, state, commander)  # type: ignore[arg-type]  # a partial double
        write_allotment(tmp_path, record("pause", nodes=0))
        over = Observation(desired_job=DesiredJob.END)
        assert (await m.bound(over, CFG, now=110.0))[0].desired_job is DesiredJob.END
        obs, _ = await m.bound(Observation(nodes=(node("running"),)), CFG, now=111.0)
        assert obs.desired_job is DesiredJob.STOP and await state.get_meta(PAUSED_KEY) == 111.0
        await state.set_meta("stop_issued_at", 111.0)  # the planner's StopJob, as executed

        write_allotment(tmp_path, record("resume"))
        stopping = Observation(nodes=(node("running"),), stop_issued_at=111.0)
        obs, _ = await m.bound(stopping, CFG, now=130.0)
        assert obs.desired_job is DesiredJob.STOP and await state.get_meta("stop_issued_at") == 111.0
        gone = Observation(nodes=(node("terminated"),), stop_issued_at=111.0)
        obs, _ = await m.bound(gone, CFG, now=140.0)
        assert obs.desired_job is DesiredJob.RUN and obs.stop_issued_at is None
        assert await state.get_meta("stop_issued_at") is None and await state.get_meta(PAUSED_KEY) is None
        assert commander.resumed == 1  # the rendezvous closed at the stop is opened again
    finally:
        await state.close()


def test_the_allotment_file_refuses_a_newer_schema_and_garbage(tmp_path: Path) -> None:
    import pytest

    from fleetd.protocol.errors import ProtocolError

    assert read_allotment(tmp_path) is None
    write_allotment(tmp_path, record("keep"))
    assert read_allotment(tmp_path) == record("keep")
    for bad in ('{"schema_version": 2}', "not json", '{"team": "t"}'):
        (tmp_path / ALLOTMENT_NAME).write_text(bad)
        with pytest.raises(ProtocolError):
            read_allotment(tmp_path)


async def test_another_jobs_allotment_is_not_taken_and_a_failed_reopen_is_retried(tmp_path: Path) -> None:
    class Flaky:
        calls = 0

        async def resume_job(self, reason: str) -> None:
            self.calls += 1
            if self.calls == 1:
                raise ConnectionError("rendezvous store restarting")

    state = await StateStore.open(tmp_path)
    try:
        commander = Flaky()
        m = TeamMember("j", tmp_path, state, commander)  # type: ignore[arg-type]  # a partial double
        write_allotment(tmp_path, record("keep").model_copy(update={"job": "other"}))
        obs, _ = await m.bound(Observation(), CFG, now=110.0)
        assert obs.stop_issued_at == 110.0  # not its share: it waits as with none
        await state.set_meta(PAUSED_KEY, 100.0)
        await state.set_meta("stop_issued_at", 100.0)
        write_allotment(tmp_path, record("resume"))
        obs, _ = await m.bound(Observation(stop_issued_at=100.0), CFG, now=120.0)
        assert obs.desired_job is DesiredJob.STOP and await state.get_meta(PAUSED_KEY) == 100.0  # kept: retried
        obs, _ = await m.bound(Observation(stop_issued_at=100.0), CFG, now=130.0)
        assert obs.desired_job is DesiredJob.RUN and obs.stop_issued_at is None and commander.calls == 2
        assert await state.get_meta(PAUSED_KEY) is None
    finally:
        await state.close()


async def test_a_job_held_with_nothing_running_is_never_stopped_again(tmp_path: Path) -> None:
    """A StopJob with no node would start a stop sequence waiting for nodes that never come. The
    team demo's move (a CI run, 2026-11-29) found one: resumed in its region, the job met no spot
    there and was moved before it ever ran; a pass between the move and the restart in the new
    region planned a second StopJob of a job already stopped once."""
    from fleetd.policy.model import StopJob
    from fleetd.policy.planner import plan
    from fleetd.team.region_file import RegionRecord

    class Refuses:
        async def resume_job(self, reason: str) -> None:
            raise ConnectionError("rendezvous store restarting")

    def stops(obs: Observation, now: float) -> list[StopJob]:
        return [a for a in plan(obs, CFG, now).actions if isinstance(a, StopJob)]

    state = await StateStore.open(tmp_path)
    try:
        # Moved (its checkpoint copied, the restart asked for): the passes left plan nothing.
        m = TeamMember("j", tmp_path, state, Resumes())  # type: ignore[arg-type]  # a partial double
        write_allotment(tmp_path, record("keep"))
        m.mover.moved = RegionRecord(
            job="j", region="us-west-2", moved_from="us-east-1", moved_at=1.0, objects=1, bytes=2, copy_s=0.1
        )
        obs, _ = await m.bound(Observation(), CFG, now=110.0)
        assert obs.stop_issued_at == 110.0 and stops(obs, 110.0) == []
        # Still running there (not a state the mover reaches, but the stop it would need): StopJob.
        obs, _ = await m.bound(Observation(nodes=(node("running"),)), CFG, now=111.0)
        assert obs.desired_job is DesiredJob.STOP and len(stops(obs, 111.0)) == 1

        # Paused, its stop done and cleared by a resume that then failed to reopen the rendezvous.
        await state.set_meta(PAUSED_KEY, 100.0)
        write_allotment(tmp_path, record("resume"))
        retried = TeamMember("j", tmp_path, state, Refuses())  # type: ignore[arg-type]
        obs, _ = await retried.bound(Observation(), CFG, now=120.0)
        assert obs.stop_issued_at == 120.0 and stops(obs, 120.0) == []
        assert await state.get_meta(PAUSED_KEY) == 100.0  # the resume is retried on the next pass
    finally:
        await state.close()
