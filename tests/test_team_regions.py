"""A team job in several regions: how the team's loop reads a dry region and a move's payback
(fleetd/team/inputs.py, arbiter.decide), the job's config in another region and its region
record (fleetd/team/region_file.py), the copy of its objects to that region's bucket against moto
(fleetd/team/region_move.py) and the member daemon's side of a move (fleetd/team/member.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetd.config import (
    CapacityConfig,
    FleetConfig,
    FleetdConfig,
    FleetdJobConfig,
    RegionSettings,
    TeamMemberConfig,
)
from fleetd.policy.observation import DesiredJob, Observation
from fleetd.policy.team_model import RegionOffer, TeamJob
from fleetd.reconcile.state import StateStore
from fleetd.shared.settings import AwsConfig, CheckpointConfig
from fleetd.snapshot import BudgetView, CheckpointView, NodeView, PoolView, StatusSnapshot
from fleetd.team.allotment_file import AllotmentRecord, write_allotment
from fleetd.team.arbiter import decide
from fleetd.team.config import TeamConfig, TeamGroup, TeamJobEntry
from fleetd.team.inputs import JobSeen, dry_regions, offer_of, region_dry, remaining_gpu_hours, team_job
from fleetd.team.member import PAUSED_KEY, TeamMember
from fleetd.team.region_file import (
    REGION_NAME,
    RegionError,
    RegionRecord,
    effective_config,
    in_region,
    read_region,
    write_region,
)
from fleetd.team.region_move import copy_job_objects, copy_order, job_prefix, layout_of, to_copy
from tests.test_team_member import Resumes, node

NOW = 10_000.0
WEST = RegionSettings(region="us-west-2", bucket="ckpt-west", ami_id="ami-west", subnet_ids=("subnet-w",))


def cfg(state_dir: Path = Path("/var/lib/fleetd/j"), **job: object) -> FleetdConfig:
    return FleetdConfig(
        aws=AwsConfig(region="us-east-1"),
        fleet=FleetConfig(name="j", min_nodes=1, max_nodes=2, state_dir=state_dir),
        capacity=CapacityConfig(instance_types=("g5.xlarge",), ami_id="ami-east", zones=("us-east-1a",)),
        checkpoints=CheckpointConfig(bucket="ckpt-east", prefix="checkpoints"),
        job=FleetdJobConfig(name="toy", **job),  # type: ignore[arg-type]
        team=TeamMemberConfig(member=True, regions=(WEST,)),
    )


def pool(name: str, spot: float, od: float, error_until: float | None = None) -> PoolView:
    return PoolView(
        pool=name,
        offered=True,
        spot_price=spot,
        on_demand_price=od,
        gpus=1,
        relative_throughput=1.0,
        capacity_error_until=error_until,
    )


def node_view(iid: str, step: int | None = None, sps: float | None = None) -> NodeView:
    return NodeView(
        instance_id=iid,
        pool="g5.xlarge@us-east-1a",
        market="spot",
        price_per_hour=0.4,
        state="running",
        ec2_state="running",
        launched_at=0.0,
        step=step,
        steps_per_s=sps,
    )


def snapshot(pools: list[PoolView], nodes: tuple[NodeView, ...] = (), region: str = "us-east-1") -> StatusSnapshot:
    budget = BudgetView(
        total_usd=100.0, max_usd_per_hour=10.0, spent_usd=1.0, burn_usd_per_hour=0.0, forecast_usd=1.0, level="normal"
    )
    return StatusSnapshot(
        fleet="j",
        written_at=NOW,
        reconcile_interval_s=10.0,
        pools=tuple(pools),
        nodes=nodes,
        budget=budget,
        region=region,
    )


def entry(name: str = "j", priority: int = 0) -> TeamJobEntry:
    return TeamJobEntry(name=name, config=Path(f"/etc/fleetd/{name}.toml"), priority=priority, checkpoint_gb=10.0)


# --- the team's view -------------------------------------------------------------------------------
def test_a_region_is_dry_for_a_job_only_when_every_pool_it_may_buy_in_has_a_capacity_error() -> None:
    some = JobSeen(entry(), cfg(), snapshot([pool("g5@a", 0.4, 1.0, NOW + 30), pool("g5@b", 0.5, 1.0)]))
    assert not region_dry(some, NOW)
    offer = offer_of(some, NOW)  # priced by the pool it may still buy in
    assert offer is not None and offer.node_price_per_hour == 0.5
    every = JobSeen(entry(), cfg(), snapshot([pool("g5@a", 0.4, 1.0, NOW + 30), pool("g5@b", 0.5, 1.2, NOW + 5)]))
    assert region_dry(every, NOW) and dry_regions([some, every], NOW) == frozenset({"us-east-1"})
    staying = offer_of(every, NOW)  # what staying costs there: on-demand
    assert staying is not None and staying.node_price_per_hour == 1.0
    assert not region_dry(every, NOW + 31)  # the errors ran out: the planner tries again


def test_remaining_work_comes_from_total_steps_and_the_measured_or_declared_pace() -> None:
    unknown = JobSeen(entry(), cfg(), snapshot([pool("g5@a", 0.4, 1.0)]))
    assert remaining_gpu_hours(unknown) == 0.0  # no total_steps: a move never shows to pay
    declared = JobSeen(entry(), cfg(total_steps=36_100, steps_per_s=1.0), snapshot([pool("g5@a", 0.4, 1.0)]))
    assert remaining_gpu_hours(declared) == pytest.approx(36_100 / 3600 * 2)  # at max_nodes 2
    nodes = (node_view("i-1", step=100, sps=2.0), node_view("i-2", step=100, sps=2.0))
    measured = JobSeen(entry(), cfg(total_steps=14_500, steps_per_s=1.0), snapshot([pool("g5@a", 0.4, 1.0)], nodes))
    # Each node reports the job's pace (2 steps/s), not its share: 14,400 steps at 2/s on 2 nodes.
    assert remaining_gpu_hours(measured) == pytest.approx(14_400 / 2.0 / 3600 * 2)
    # Paused (no node): the pace measured before, at its full size, rather than nothing.
    paused = snapshot([pool("g5@a", 0.4, 1.0)]).model_copy(update={"throughput_by_nodes": {1: 1.0, 2: 1.8}})
    before = JobSeen(entry(), cfg(total_steps=3_600), paused)
    assert remaining_gpu_hours(before) == pytest.approx(3_600 / 1.8 / 3600 * 2)


def test_a_job_mid_move_is_not_planned_from_the_old_regions_status() -> None:
    moving = cfg().model_copy(update={"aws": AwsConfig(region="us-west-2")})
    view = team_job(JobSeen(entry(), moving, snapshot([pool("g5@a", 0.4, 1.0)], region="us-east-1")), NOW)
    assert isinstance(view, str) and "moving from us-east-1 to us-west-2" in view
    west = RegionOffer("us-west-2", 0.45, 0.45)
    job = team_job(JobSeen(entry(), cfg(), snapshot([pool("g5@a", 0.4, 1.0)]), elsewhere=(west,)), NOW)
    assert isinstance(job, TeamJob) and [o.region for o in job.offers] == ["us-east-1", "us-west-2"]


def test_the_team_moves_the_job_that_found_its_region_dry_and_keeps_the_others_where_they_are() -> None:
    team = TeamConfig(
        team=TeamGroup(total_usd=100.0, max_usd_per_hour=10.0), jobs=(entry("prod", 10), entry("sweep", 0))
    )
    west = RegionOffer("us-west-2", 0.45, 0.45)
    running = snapshot([pool("g5@a", 0.4, 1.0)], (node_view("i-1"),))
    prod = JobSeen(entry("prod", 10), cfg(Path("/var/lib/fleetd/prod")), running, elsewhere=(west,))
    dry = snapshot([pool("g5@a", 0.4, 1.0, NOW + 60), pool("g5@b", 0.42, 1.0, NOW + 60)]).model_copy(
        update={"checkpoint": CheckpointView(step=40, durable_at=NOW - 100)}  # placed: its checkpoint is here
    )
    work = cfg(Path("/var/lib/fleetd/sweep"), total_steps=10_000_000, steps_per_s=5.0)
    sweep = JobSeen(entry("sweep", 0), work, dry, elsewhere=(west,))
    done = decide(team, [prod, sweep], NOW)
    regions = {r.job: r.region for r in done.written}
    assert regions == {"prod": "us-east-1", "sweep": "us-west-2"}, (done.skipped, [r.reason for r in done.written])
    (moved,) = [r for r in done.written if r.job == "sweep"]
    assert "moves to us-west-2, it pays" in moved.reason
    # The same with no declared work: the move is not shown to pay, so the job waits at home.
    idle = JobSeen(entry("sweep", 0), cfg(Path("/var/lib/fleetd/sweep")), dry, elsewhere=(west,))
    stays = {r.job: r for r in decide(team, [prod, idle], NOW).written}["sweep"]
    assert stays.region == "us-east-1" and "does not pay" in stays.reason and stays.nodes == 0


# --- the job's config in a region, and its record ----------------------------------------------------
def test_a_job_runs_in_another_region_with_that_regions_settings_and_can_come_back(tmp_path: Path) -> None:
    home = cfg(tmp_path)
    west = in_region(home, "us-west-2")
    assert (west.aws.region, west.checkpoints.bucket, west.capacity.ami_id) == ("us-west-2", "ckpt-west", "ami-west")
    assert west.capacity.subnet_ids == ("subnet-w",) and west.capacity.zones == ()  # home zones mean nothing there
    back = in_region(west, "us-east-1")
    assert (back.aws.region, back.checkpoints.bucket, back.capacity.ami_id) == ("us-east-1", "ckpt-east", "ami-east")
    with pytest.raises(RegionError, match="eu-west-1 is not one of the job's"):
        in_region(home, "eu-west-1")

    assert effective_config(home) is home  # never moved
    record = RegionRecord(
        job="j", region="us-west-2", moved_from="us-east-1", moved_at=1.0, objects=3, bytes=10, copy_s=0.1
    )
    write_region(tmp_path, record)
    assert read_region(tmp_path) == record
    assert effective_config(home).checkpoints.bucket == "ckpt-west"
    unlisted = home.model_copy(update={"team": TeamMemberConfig(member=True)})
    with pytest.raises(RegionError, match="no longer lists"):
        effective_config(unlisted)  # never a silent return to the old checkpoint
    (tmp_path / REGION_NAME).write_text("{")
    with pytest.raises(RegionError, match="cannot be read"):
        effective_config(home)


# --- the copy, against moto ----------------------------------------------------------------------------
async def _buckets(aio_session, aws_client_kwargs: dict) -> None:
    async with aio_session.create_client("s3", **aws_client_kwargs) as s3:
        await s3.create_bucket(Bucket="ckpt-east")
    west = {**aws_client_kwargs, "region_name": "us-west-2"}
    async with aio_session.create_client("s3", **west) as s3:
        await s3.create_bucket(Bucket="ckpt-west", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})


async def test_the_copy_moves_every_object_of_the_job_and_only_its_own_pointer_last(
    aio_session, aws_client_kwargs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fleetd.team import region_move

    await _buckets(aio_session, aws_client_kwargs)
    home = cfg()
    prefix = job_prefix(home)
    big = b"x" * (6 * 1024 * 1024)  # copied part by part once the single-copy limit is lowered
    objects = {
        f"{prefix}step-7/model.pt": big,
        f"{prefix}step-7/MANIFEST.json": b"{}",
        f"{prefix}latest": b"7",
        f"{prefix}code/abc.tar.gz": b"code",
        "checkpoints/other-job/step-1/model.pt": b"not ours",
    }
    async with aio_session.create_client("s3", **aws_client_kwargs) as s3:
        for key, body in objects.items():
            await s3.put_object(Bucket="ckpt-east", Key=key, Body=body)
    assert sorted(objects, key=lambda k: (copy_order(k), k))[-2:] == [
        f"{prefix}step-7/MANIFEST.json",
        f"{prefix}latest",
    ]
    # What a resume needs: the two newest durable steps, `latest` and the code; not older steps,
    # not a step still being uploaded (no manifest).
    listed = [(f"{prefix}step-{n}/{f}", 1) for n in (3, 5, 7) for f in ("model.pt", "MANIFEST.json")]
    listed += [(f"{prefix}step-9/model.pt", 1), (f"{prefix}latest", 1), (f"{prefix}code/abc.tar.gz", 1)]
    keys = [k for k, _ in to_copy(layout_of(home), listed)]
    assert {k.split("/")[2] for k in keys if "/step-" in k} == {"step-5", "step-7"}
    assert keys[-1] == f"{prefix}latest" and f"{prefix}code/abc.tar.gz" in keys
    monkeypatch.setattr(region_move, "COPY_OBJECT_MAX", 5 * 1024 * 1024)
    monkeypatch.setattr(region_move, "PART_BYTES", 5 * 1024 * 1024)
    async with aio_session.create_client("s3", **{**aws_client_kwargs, "region_name": "us-west-2"}) as s3:
        copied = await copy_job_objects(s3, home, in_region(home, "us-west-2"))
        listed = await s3.list_objects_v2(Bucket="ckpt-west")
        got = await s3.get_object(Bucket="ckpt-west", Key=f"{prefix}step-7/model.pt")
        body = await got["Body"].read()
    assert copied.objects == 4 and copied.bytes == len(big) + 2 + 1 + 4
    assert sorted(o["Key"] for o in listed["Contents"]) == sorted(k for k in objects if k.startswith(prefix))
    assert body == big


# --- the member daemon's side -------------------------------------------------------------------------
def allotment(region: str) -> AllotmentRecord:
    return AllotmentRecord(
        team="t", job="j", written_at=NOW, kind="move", nodes=1, usd_per_hour=1.0, total_usd=20.0, region=region
    )


async def test_a_member_stops_copies_and_asks_to_start_again_in_the_allotted_region(
    tmp_path: Path, aio_session, aws_client_kwargs: dict
) -> None:
    await _buckets(aio_session, aws_client_kwargs)
    home = cfg(tmp_path).model_copy(
        update={"aws": AwsConfig(region="us-east-1", endpoint_url=aws_client_kwargs["endpoint_url"])}
    )
    key = f"{job_prefix(home)}step-3/MANIFEST.json"
    async with aio_session.create_client("s3", **aws_client_kwargs) as s3:
        await s3.put_object(Bucket="ckpt-east", Key=key, Body=b"{}")
    state = await StateStore.open(tmp_path)
    try:
        member = TeamMember("j", tmp_path, state, Resumes())  # type: ignore[arg-type]  # a partial double
        moved_to: list[str] = []
        member.mover.on_move = moved_to.append
        write_allotment(tmp_path, allotment("us-west-2"))
        # Still training in us-east-1: first the coordinated stop (checkpoint, every node released).
        obs, _ = await member.bound(Observation(nodes=(node("running"),)), home, now=NOW)
        assert obs.desired_job is DesiredJob.STOP and await state.get_meta(PAUSED_KEY) == NOW
        assert read_region(tmp_path) is None and not moved_to
        # Stopped and gone: the copy runs beside the passes; the job stays stopped meanwhile.
        stopped = Observation(stop_issued_at=NOW)
        obs, _ = await member.bound(stopped, home, now=NOW + 1)
        assert obs.desired_job is DesiredJob.STOP
        await member.mover.wait()
        assert moved_to == ["us-west-2"]  # asked for the restart as soon as the record was written
        obs, _ = await member.bound(stopped, home, now=NOW + 2)  # (the daemon stops; nothing more happens)
        assert obs.desired_job is DesiredJob.STOP and moved_to == ["us-west-2"]
        record = read_region(tmp_path)
        assert record is not None and (record.region, record.moved_from, record.objects) == (
            "us-west-2",
            "us-east-1",
            1,
        )
        west = {**aws_client_kwargs, "region_name": "us-west-2"}
        async with aio_session.create_client("s3", **west) as s3:
            assert (await s3.head_object(Bucket="ckpt-west", Key=key))["ContentLength"] == 2
        # Started again there (effective_config): the pause's marks make it resume from the copy.
        there = effective_config(home)
        fresh = TeamMember("j", tmp_path, state, resumes := Resumes())  # type: ignore[arg-type]
        obs, _ = await fresh.bound(Observation(stop_issued_at=NOW), there, now=NOW + 300)
        assert obs.desired_job is DesiredJob.RUN and resumes.resumed == 1
        assert await state.get_meta(PAUSED_KEY) is None
        # A paused job's allotted region is the team's guess for later: nothing moves for it.
        assert fresh.mover.target(there, "us-east-1", training=False) is None
        # An allotment naming a region the job's config does not list moves nothing.
        write_allotment(tmp_path, allotment("eu-west-1"))
        obs, _ = await fresh.bound(Observation(), there, now=NOW + 310)
        assert fresh.mover.target(there, "eu-west-1") is None and json.loads((tmp_path / REGION_NAME).read_text())
    finally:
        await state.close()


async def test_a_copy_the_team_calls_off_is_stopped_and_a_dry_run_copies_nothing(
    tmp_path: Path, aio_session, aws_client_kwargs: dict
) -> None:
    await _buckets(aio_session, aws_client_kwargs)
    endpoint = aws_client_kwargs["endpoint_url"]
    home = cfg(tmp_path).model_copy(update={"aws": AwsConfig(region="us-east-1", endpoint_url=endpoint)})
    state = await StateStore.open(tmp_path)
    try:
        dry = TeamMember("j", tmp_path, state, Resumes(), dry_run=True)  # type: ignore[arg-type]
        write_allotment(tmp_path, allotment("us-west-2"))
        obs, _ = await dry.bound(Observation(stop_issued_at=NOW), home, now=NOW)
        assert obs.desired_job is DesiredJob.STOP and read_region(tmp_path) is None and dry.mover._task is None

        member = TeamMember("j", tmp_path, state, Resumes())  # type: ignore[arg-type]
        moved: list[str] = []
        member.mover.on_move = moved.append
        await member.bound(Observation(stop_issued_at=NOW), home, now=NOW + 1)  # the copy starts
        task = member.mover._task
        assert task is not None
        write_allotment(tmp_path, allotment("us-east-1"))  # the team changes its mind at once
        obs, _ = await member.bound(Observation(stop_issued_at=NOW), home, now=NOW + 2)
        assert task.done() and member.mover._task is None
        # Either it was stopped before its record (the job stays home and resumes) or the record
        # was already written (the job is in us-west-2 now and must not resume here): never both.
        if moved:
            assert read_region(tmp_path) is not None and obs.desired_job is DesiredJob.STOP
        else:
            assert read_region(tmp_path) is None and obs.desired_job is DesiredJob.RUN
    finally:
        await state.close()
