"""`fleetd demo --scenario team`: three jobs of different priorities under one team budget.

The local cloud is the demo's (moto behind the fault proxy, mosquitto with the fleet PKI); on it
run three real job controllers (``fleetd run`` with ``[team] member = true``, each with its own
``fleetd rendezvous``, state directory, checkpoint prefix and nodes), and ``fleetd team run`` over
them, as on a control host with ``fleetd@NAME`` and ``fleetd-team``. The story, played by the
operator's hand on the team's config (a restart of the team's loop, as ``systemctl restart
fleetd-team`` after an edit):

1. Room for all three: each job starts on one node and trains.
2. The team's burn is cut to what two nodes cost: the team pauses the lowest-priority job, which
   stops through its coordinated checkpoint (durable in S3) and releases its node; the others
   train on.
3. Spot capacity is withdrawn from us-east-1 (the fault proxy answers every CreateFleet there
   with InsufficientInstanceCapacity) and the burn is raised again. The paused job may resume, but
   its region has no spot for it: the team reads the region as full and moves the job to
   us-west-2 (the move pays over its remaining work). Its daemon copies the checkpoint to the
   us-west-2 bucket, starts again there and resumes from it on a node in us-west-2; the other two
   keep their nodes in us-east-1.

The report says per job its state, region, spend and steps lost (from the trainers' own step
records), the pauses, the region moves and the team's spend against its budget.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fleetd.demo import configs
from fleetd.demo.broker import start_broker
from fleetd.demo.launcher import Launcher, template_job_env
from fleetd.demo.procs import Supervised
from fleetd.demo.progress import Progress
from fleetd.demo.runner import DemoOptions, DemoRun, _demo_pki, _new_run, _start, _stop_all, start_aws
from fleetd.demo.team_regions import (
    OTHER,
    Move,
    TwoRegions,
    dearer_elsewhere,
    declare_work,
    other_region,
    region_overrides,
    region_record,
    withdraw_spot,
)
from fleetd.demo.team_report import Pause, TeamJob, TeamStory, build_team_report, job_snapshot
from fleetd.localnet import free_port
from fleetd.localnet import wait_port_async as wait_port
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

# (name, priority): the lowest is the one the team pauses when its burn is cut.
TEAM_JOBS = (("prod", 10), ("dev", 5), ("sweep", 0))
TEAM_NAME = "demo-team"
PAUSED_JOB = "sweep"
STEP_TIMEOUT_S = 240.0  # each act of the story on a loaded two-core box


def _team_toml(path: Path, jobs: dict[str, TeamJob], total_usd: float, max_usd_per_hour: float) -> Path:
    entries = "".join(
        f'[[jobs]]\nname = "{j.name}"\nconfig = "{j.config}"\npriority = {j.priority}\n' for j in jobs.values()
    )
    path.write_text(
        f'[team]\nname = "{TEAM_NAME}"\ntotal_usd = {total_usd}\nmax_usd_per_hour = {max_usd_per_hour}\n'
        # Compressed like the demo's notices: a pass every 2 s, and a paused job may resume at once.
        "interval_s = 2.0\nmin_pause_s = 0.0\nresume_margin = 0.0\nchangeover_s = 60.0\nmetrics_port = 0\n"
        '[logging]\nlevel = "info"\njson = true\n' + entries
    )
    return path


async def _restart_team(run: DemoRun, story: TeamStory, max_usd_per_hour: float) -> None:
    """The operator edits the team's burn and restarts its loop."""
    assert story.team_config is not None
    if story.team is not None:
        await story.team.stop(timeout=15.0)
    _team_toml(story.team_config, story.jobs, story.total_usd, max_usd_per_hour)
    story.burn_usd_per_hour = max_usd_per_hour
    cli = [sys.executable, "-m", "fleetd.cli"]
    story.team = await _start(run, "team", [*cli, "team", "run", "--config", str(story.team_config)])
    log.info("demo_team_burn", max_usd_per_hour=max_usd_per_hour)


async def _start_job(
    run: DemoRun, job: TeamJob, ep: configs.DemoEndpoints, ami: str, budget_usd: float, ami_west: str
) -> Supervised:
    cli = [sys.executable, "-m", "fleetd.cli"]
    job.workdir.mkdir(parents=True, exist_ok=True)
    job.config = configs.fleetd_toml(
        job.workdir,
        ep,
        1,
        budget_usd,
        10.0,
        ami,
        job="toy",
        steps=None,
        fleet=job.name,
        overrides={
            "team": {"member": True},
            "fleet": {"max_nodes": 1},
            **_own_identity(ep, job.name),
            **(region_overrides(ami_west) if job.name == PAUSED_JOB else {}),
        },
    )
    if job.name == PAUSED_JOB:
        declare_work(job.workdir / "toy-job.toml")
    rendezvous = Supervised(
        f"rendezvous-{job.name}", [*cli, "rendezvous", "--config", str(job.config)], job.workdir / "rendezvous.log"
    )
    await rendezvous.start()
    run.children.append(rendezvous)  # type: ignore[arg-type]  # stops like a Child
    await wait_port("127.0.0.1", ep.rdzv_port, timeout=120)
    job.fleetd = await _start(run, f"fleetd-{job.name}", [*cli, "run", "--config", str(job.config)])
    return rendezvous


def _own_identity(ep: configs.DemoEndpoints, job: str) -> dict[str, dict[str, object]]:
    """The job's controller connects with its own certificate: one shared by the three would have
    the broker close each one's session when the next connects (use_username_as_clientid)."""
    from fleetd.identity.acl import controller_cn

    if ep.pki is None:
        return {}
    return {"mqtt": ep.pki.client_mqtt(ep.mqtt_url, controller_cn(job))}


def _launcher(job: TeamJob, ec2: TwoRegions, ep: configs.DemoEndpoints, signer: Any, first_octet: int) -> Launcher:
    def agent_conf(iid: str, addr: str, imds_url: str) -> Path:
        return configs.agent_toml(job.workdir, ep, 1, iid, addr, imds_url, steps=1_000_000, fleet=job.name)

    async def describe() -> Any:
        return await ec2.instances(job.name)

    # The toy's pace: at most 5 steps/s per job, so three jobs and their controllers share two cores.
    env = {"FLEETD_EVENTS_FILE": str(job.events), "FLEETD_TOY_WORK_S": "0.2", "FLEETD_TOY_SATURATE_AT": "1"}
    launcher = Launcher(
        job.workdir,
        describe,
        agent_conf,
        env=env,
        terminate=ec2.terminate,
        identity_signer=signer,
        job_env=lambda inst: template_job_env(ec2.client_of(inst), inst, fleet=job.name),
    )
    launcher._next_octet = first_octet
    return launcher


async def _until(what: str, check: Any, timeout_s: float = STEP_TIMEOUT_S) -> float:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if check():
            return time.time()
        await asyncio.sleep(1.0)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


async def _play(
    run: DemoRun, story: TeamStory, node_price: float, durable: Callable[[str], Awaitable[int | None]], proxy: Any
) -> None:
    """The story's three acts (module docstring)."""
    jobs = story.jobs

    def all_train() -> bool:
        return all(Progress.load(j.events).final_step > 0 for j in jobs.values())

    await _until("every job trains", all_train)
    run.training_since = time.time()
    log.info("demo_team_training", after_s=round(run.training_since - run.started_at, 1))
    await asyncio.sleep(5.0)  # a few steps each, at the allotments now in force

    paused = jobs[PAUSED_JOB]
    before = Progress.load(paused.events).final_step
    pause = Pause(PAUSED_JOB, time.time(), before)
    pause.others_at_cut = {j.name: Progress.load(j.events).final_step for j in jobs.values() if j.name != PAUSED_JOB}
    story.pauses.append(pause)
    # What the other two burn, and half of what the lowest priority does: it must give its node back.
    await _restart_team(run, story, _burn_without(story, PAUSED_JOB))

    def released() -> bool:
        snap = job_snapshot(paused)
        launcher = paused.launcher
        return snap is not None and snap.stop_issued_at is not None and launcher is not None and not launcher.live()

    pause.released_at = await _until(f"{PAUSED_JOB} paused and its node released", released)
    pause.last_step_before = Progress.load(paused.events).final_step
    # What S3 holds for the job now (a step's manifest is written last): nothing newer can come
    # while it is paused, so this is the checkpoint a resume must start from.
    pause.durable_step = await durable(PAUSED_JOB)
    await asyncio.sleep(2.0)

    # Act 3: us-east-1 runs out of spot, then the burn is raised: the paused job may resume, but
    # only in the other region.
    move = Move(PAUSED_JOB, time.time(), pause.last_step_before, durable_step=pause.durable_step)
    story.moves.append(move)
    withdraw_spot(proxy)
    await _restart_team(run, story, round(4.0 * node_price, 4))

    def trained_past() -> bool:
        return Progress.load(paused.events).final_step > pause.last_step_before

    pause.trained_past_at = await _until(f"{PAUSED_JOB} resumed and trained past its pause", trained_past)
    released_at = pause.released_at
    resumed = [r for r in Progress.load(paused.events).restarts() if r.at > released_at]
    if resumed:
        pause.resumed_at, pause.resumed_from = resumed[0].at, resumed[0].from_step
        move.resumed_at, move.resumed_from = resumed[0].at, resumed[0].from_step
    record = region_record(paused.workdir / "state")
    if record is not None:
        move.moved_from, move.moved_to, move.objects = record.moved_from, record.region, record.objects
        move.copied_at = record.moved_at
    if paused.launcher is not None:
        live = paused.launcher.live()
        move.resumed_in = live[0].zone if live else None
    await asyncio.sleep(3.0)  # one more pass of every controller: the spend and states reported


async def run_team_demo(opts: DemoOptions) -> dict[str, Any]:
    from aiobotocore.session import get_session

    from fleetd.adapters.faults import FaultProxy

    run = _new_run(opts)
    story = TeamStory()
    proxy: FaultProxy | None = None
    session = get_session()
    try:
        moto_url, proxy = await start_aws(run)
        names = tuple(name for name, _ in TEAM_JOBS)
        pki = await _demo_pki(run, names)  # a controller identity per job (fleetd ca init --controller-host)
        broker, mqtt_url, _ = await start_broker(run.workdir, pki, names)
        run.children.append(broker)
        aws: dict[str, Any] = {"endpoint_url": moto_url, "region_name": "us-east-1"}
        async with session.create_client("s3", **aws) as s3:
            await s3.create_bucket(Bucket=configs.DEMO_BUCKET)
        ami_west = await other_region(session, aws)
        dearer_elsewhere(proxy)
        async with (
            session.create_client("ec2", **aws) as ec2,
            session.create_client("ec2", **{**aws, "region_name": OTHER}) as ec2_west,
        ):
            regions = TwoRegions(ec2, ec2_west)
            ami = (await ec2.describe_images(Owners=["amazon"]))["Images"][0]["ImageId"]
            supervised = []
            for i, (name, priority) in enumerate(TEAM_JOBS):
                job = TeamJob(name, priority, run.workdir / name, Path(), run.workdir / name / "trainer-events.jsonl")
                story.jobs[name] = job
                ep = configs.DemoEndpoints(
                    aws_url=proxy.url,
                    s3_url=moto_url,
                    mqtt_url=mqtt_url,
                    rdzv_port=free_port(),
                    pki=pki,
                    enrol_port=free_port() if pki is not None else 0,
                )
                supervised.append(await _start_job(run, job, ep, ami, opts.budget_usd, ami_west))
                job.launcher = _launcher(job, regions, ep, pki.signer if pki is not None else None, 10 + 50 * i)
            node_price = _priciest_spot()
            story.total_usd = opts.budget_usd
            story.team_config = run.workdir / "team.toml"
            await _restart_team(run, story, round(4.0 * node_price, 4))
            try:
                async with asyncio.TaskGroup() as tg:
                    watchers = [tg.create_task(s.watch()) for s in supervised]
                    watchers += [tg.create_task(j.launcher.run()) for j in story.jobs.values() if j.launcher]
                    try:
                        await _play(run, story, node_price, lambda job: _durable_step(session, aws, job), proxy)
                    except TimeoutError as exc:
                        story.failure = f"{exc}; see the logs in {run.workdir}"
                    for t in watchers:
                        t.cancel()
            except* Exception as group:
                story.failure = "; ".join(repr(e) for e in group.exceptions)
            for job in story.jobs.values():
                if job.fleetd is not None:
                    await job.fleetd.stop(timeout=15.0)
            if story.team is not None:
                await story.team.stop(timeout=15.0)
        return build_team_report(run, story)
    finally:
        for job in story.jobs.values():
            if job.launcher is not None:
                await job.launcher.close()
        await _stop_all(run)
        if proxy is not None:
            proxy.stop()


async def _durable_step(session: Any, aws: dict[str, Any], job: str) -> int | None:
    """The newest step of ``job`` whose manifest is in S3 (durable), None if none is."""
    from fleetd.demo.report import durable_steps

    return max(await durable_steps(session, aws, f"checkpoints/{job}/"), default=None)


def _priciest_spot() -> float:
    """The dearest spot price a demo node may get: the team's first burn is a multiple of it, so
    every job fits whichever pool it is priced at."""
    _, spot = configs.demo_price_fakes()
    return max(p for p in spot.overrides.values() if p is not None)


def _burn_without(story: TeamStory, paused: str) -> float:
    """A team burn that keeps every job but ``paused`` at the allotments now in force: theirs in
    full plus half of ``paused``'s, so only the lowest priority's need no longer fits."""
    from fleetd.team.allotment_file import read_allotment

    burns = {}
    for job in story.jobs.values():
        record = read_allotment(job.workdir / "state")
        burns[job.name] = record.usd_per_hour if record is not None else 0.0
    return round(sum(v for k, v in burns.items() if k != paused) + 0.5 * burns[paused], 4)
