"""`fleetd demo`: a local cloud, the real daemons, local nodes, injected interruptions, a report.

Everything it starts is a child in its own process group, stopped in reverse order on the way
out (also on Ctrl-C or an error), so nothing survives the demo.

    moto server (EC2, S3) ← fault proxy ← fleetd run        (controller, real adapters)
    mosquitto (TLS, ACL)  ← fleetd run, agents, this view    (amqtt/plaintext with --insecure)
    fleetd run's enrolment endpoint ← each agent at boot (its signed identity document → its cert)
    fleetd rendezvous     ← torchrun on every node
    launcher: each EC2 instance → fake IMDS + fleet-agent run (→ torchrun → train_toy)
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetd.demo import configs
from fleetd.demo.broker import start_broker
from fleetd.demo.launcher import Launcher, fleet_instances, template_job_env
from fleetd.demo.monitor import WireView
from fleetd.demo.procs import Child, Supervised
from fleetd.demo.scenario import Scenario
from fleetd.demo.security import DemoPki
from fleetd.localnet import free_port
from fleetd.localnet import wait_port_async as wait_port
from fleetd.shared.logs import get_logger
from fleetd.shared.settings import MqttConfig

if TYPE_CHECKING:
    from fleetd.adapters.faults import FaultProxy

log = get_logger(__name__)

# The demo's cloud is local: every process it starts uses these keys, so nothing can ever reach
# a real AWS account from a demo, whatever the user's environment holds.
DEMO_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "fleetd-demo",
    "AWS_SECRET_ACCESS_KEY": "fleetd-demo",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass
class DemoOptions:
    nodes: int = 3
    duration_s: float = 180.0
    scenario: Scenario | None = None
    budget_usd: float = 5.0
    max_usd_per_hour: float = 10.0
    workdir: Path | None = None
    live_view: bool = True
    steps: int = 1_000_000  # the job never finishes inside a demo
    job: str = "toy"  # fleetd.demo.configs.DEMO_JOBS: toy, hf (Hugging Face Trainer), lightning
    # False (default): MQTT over TLS with per-node certificates from enrolment and the fleet ACL,
    # as deployed. True: plaintext anonymous MQTT, for debugging only.
    insecure: bool = False
    fail_at_step: int = 0  # the toy raises at this step (a bug in the job's code); 0: never
    # A story (scripted interruptions, or scaling) in a job that never finishes: the demo ends
    # once it is told (`fleetd.demo.story.told_at`), at the latest `story.OVERTIME_S` past
    # ``duration_s``, which then places its events.
    end_when_told: bool = False


@dataclass
class DemoRun:
    """Everything the demo started, plus what it observed (for the view and the report)."""

    opts: DemoOptions
    workdir: Path
    children: list[Child] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    training_since: float | None = None  # wall clock
    training_since_loop: float | None = None  # the event loop's clock (the launcher's timestamps)
    injected: list[tuple[float, str, str]] = field(default_factory=list)  # (wall time, kind, target)
    fleetd: Child | None = None
    rendezvous: Supervised | None = None  # restarted when it dies, as systemd would
    view: WireView | None = None
    launcher: Launcher | None = None
    stopped_by_budget: bool = False
    job_ended: bool = False  # the job ended (succeeded, failed, cancelled) and every node is gone
    story_played_at: float | None = None  # wall time the scenario's last step and reclaim were done
    story_fleet: int | None = None  # the fleet's size once the story played (told: it trains whole)
    story_told: bool = False  # the demo ended because its story was told (fleetd.demo.story)
    failure: str | None = None  # why the demo could not show the loop working


async def _start(run: DemoRun, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
    child = await Child.start(name, argv, run.workdir / f"{name}.log", env=env)
    run.children.append(child)
    return child


async def _stop_all(run: DemoRun) -> None:
    if run.launcher is not None:
        await run.launcher.close()
    for child in reversed(run.children):
        await child.stop(timeout=15.0 if child.name == "fleetd" else 5.0)


@dataclass
class _LocalCloud:
    """What the demo started before any node: how the nodes, the view and the report reach it."""

    moto_url: str
    aws: dict[str, Any]  # aiobotocore client arguments (moto directly)
    ep: configs.DemoEndpoints
    pki: DemoPki | None
    mqtt_url: str
    max_nodes: int
    rendezvous: Supervised


async def run_demo(opts: DemoOptions) -> dict[str, Any]:
    from aiobotocore.session import get_session

    from fleetd.demo.report import build_report

    run = _new_run(opts)
    events_file = run.workdir / "trainer-events.jsonl"
    proxy: FaultProxy | None = None
    session = get_session()
    try:
        moto_url, proxy = await start_aws(run)
        cloud = await _start_cloud(run, session, moto_url, proxy.url)
        async with session.create_client("ec2", **cloud.aws) as ec2:
            launcher = run.launcher = _launcher(run, ec2, cloud, events_file)
            view = run.view = WireView(configs.DEMO_FLEET)
            await _watch_until_done(run, launcher, view, ec2, proxy, cloud, events_file)
            # The controller stops before the money is read: its last pass is then the ledger's
            # last word, so this report, `fleetd status` and a `fleetd report` run any time later
            # state the same spend (nodes it did not see end are billed up to that pass).
            if run.fleetd is not None:
                await run.fleetd.stop(timeout=15.0)
            report = await build_report(run, events_file, ec2, session, cloud.aws)
        return report
    finally:
        await _stop_all(run)
        if proxy is not None:
            proxy.stop()


def _new_run(opts: DemoOptions) -> DemoRun:
    """The demo's local AWS keys, its work folder, and SIGTERM cancelling the demo."""
    os.environ.update(DEMO_AWS_ENV)
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(var, None)
    workdir = opts.workdir or Path(tempfile.mkdtemp(prefix="fleetd-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run = DemoRun(opts, workdir)
    # Every child runs in its own session (so that a stop takes its whole tree): a SIGTERM that
    # ended this process at once would leave them all running. It cancels the demo instead, and
    # run_demo's ``finally`` stops everything it started (SIGINT does the same through asyncio).
    main = asyncio.current_task()
    if main is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    return run


async def start_aws(run: DemoRun) -> tuple[str, FaultProxy]:
    """The local EC2 and S3 (moto server) and the fault proxy fleetd talks to, which also answers
    the price APIs as AWS would: (moto's URL, the proxy)."""
    from fleetd.adapters.faults import FaultProxy

    moto_url = await _start_moto(run)
    price_list, spot_prices = configs.demo_price_fakes()
    return moto_url, FaultProxy(moto_url, price_list=price_list, spot_prices=spot_prices).start()


async def _start_moto(run: DemoRun) -> str:
    """The local EC2 and S3 (moto server); returns its URL."""
    moto_port = free_port()
    await _start(run, "moto", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)])
    await wait_port("127.0.0.1", moto_port, timeout=30)
    return f"http://127.0.0.1:{moto_port}"


async def _demo_pki(run: DemoRun, controllers: tuple[str, ...] = ()) -> DemoPki | None:
    """The fleet PKI (TLS, per-node certificates, ACL), or None with ``--insecure``."""
    if run.opts.insecure:
        log.warning(
            "demo_insecure",
            why="--insecure: plaintext, anonymous MQTT with no ACL; any local "
            "process can publish for any node or command any agent. For debugging only.",
        )
        return None
    return await asyncio.to_thread(DemoPki.create, run.workdir, controllers)


async def _start_cloud(run: DemoRun, session: Any, moto_url: str, proxy_url: str) -> _LocalCloud:
    """The broker, the bucket, fleetd's config, then the rendezvous host and fleetd itself."""
    opts, workdir = run.opts, run.workdir
    pki = await _demo_pki(run)
    broker, mqtt_url, broker_kind = await start_broker(workdir, pki)
    run.children.append(broker)
    ep = configs.DemoEndpoints(
        aws_url=proxy_url,
        s3_url=moto_url,
        mqtt_url=mqtt_url,
        rdzv_port=free_port(),
        pki=pki,
        enrol_port=free_port() if pki is not None else 0,
    )
    aws: dict[str, Any] = {"endpoint_url": moto_url, "region_name": "us-east-1"}
    async with session.create_client("s3", **aws) as s3:
        await s3.create_bucket(Bucket=configs.DEMO_BUCKET)
    async with session.create_client("ec2", **aws) as ec2:
        ami = (await ec2.describe_images(Owners=["amazon"]))["Images"][0]["ImageId"]
    shape = opts.scenario.fleet if opts.scenario is not None else None
    max_nodes = shape.max_nodes if shape is not None else opts.nodes + 1
    fleetd_conf = configs.fleetd_toml(
        workdir, ep, opts.nodes, opts.budget_usd, opts.max_usd_per_hour, ami, shape, job=opts.job, steps=opts.steps
    )
    rendezvous = await _start_controller(run, fleetd_conf, ep.rdzv_port)
    log.info("demo_cloud_ready", workdir=str(workdir), broker=broker_kind, moto=moto_url)
    return _LocalCloud(moto_url, aws, ep, pki, mqtt_url, max_nodes, rendezvous)


async def _start_controller(run: DemoRun, fleetd_conf: Path, rdzv_port: int) -> Supervised:
    """`fleetd rendezvous` (supervised: restarted when it dies, as systemd would), then `fleetd run`."""
    cli = [sys.executable, "-m", "fleetd.cli"]
    rendezvous = run.rendezvous = Supervised(
        "rendezvous", [*cli, "rendezvous", "--config", str(fleetd_conf)], run.workdir / "rendezvous.log"
    )
    await rendezvous.start()
    run.children.append(rendezvous)  # type: ignore[arg-type]  # stops like a Child
    # `fleetd rendezvous` imports torch first: seconds on a quiet box, over 30 s on a loaded
    # 2-core one (a chaos run failed there). A slow start is not a hang.
    await wait_port("127.0.0.1", rdzv_port, timeout=120)
    run.fleetd = await _start(run, "fleetd", [*cli, "run", "--config", str(fleetd_conf)])
    return rendezvous


def _launcher(run: DemoRun, ec2: Any, cloud: _LocalCloud, events_file: Path) -> Launcher:
    """Boots a local node (fake IMDS + fleet-agent) for every EC2 instance fleetd launches."""
    opts, workdir = run.opts, run.workdir

    async def describe() -> list[Mapping[str, Any]]:
        return await fleet_instances(ec2, configs.DEMO_FLEET)

    def agent_conf(iid: str, addr: str, imds_url: str) -> Path:
        return configs.agent_toml(
            workdir, cloud.ep, cloud.max_nodes, iid, addr, imds_url, steps=opts.steps, job=opts.job
        )

    paced = opts.scenario.trainer_env() if opts.scenario is not None else {}
    env = {"FLEETD_EVENTS_FILE": str(events_file), **paced}
    if opts.fail_at_step:
        env["FLEETD_TOY_FAIL_AT_STEP"] = str(opts.fail_at_step)

    async def terminate(iid: str) -> None:
        # The node powered itself off (dead man's switch): for a spot instance, AWS
        # turns an instance-initiated shutdown into a termination.
        await ec2.terminate_instances(InstanceIds=[iid])

    return Launcher(
        workdir,
        describe,
        agent_conf,
        env=env,
        terminate=terminate,
        identity_signer=cloud.pki.signer if cloud.pki is not None else None,
        job_env=lambda inst: template_job_env(ec2, inst),
    )


async def _watch_until_done(
    run: DemoRun,
    launcher: Launcher,
    view: WireView,
    ec2: Any,
    proxy: FaultProxy,
    cloud: _LocalCloud,
    events_file: Path,
) -> None:
    """The nodes, the wire view, the scenario's interruptions and the screen, until the demo is
    done (_until_done). A component that breaks is recorded in ``run.failure``, not raised."""
    from fleetd.demo.play import play_scenario
    from fleetd.demo.view import render_loop

    pki, mqtt_url = cloud.pki, cloud.mqtt_url
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(launcher.run(), name="launcher"),
                tg.create_task(
                    view.run(pki.observer(mqtt_url) if pki is not None else MqttConfig(url=mqtt_url)),
                    name="view",
                ),
                tg.create_task(play_scenario(run, ec2, proxy, events_file), name="scenario"),
                tg.create_task(render_loop(run, events_file), name="render"),
                tg.create_task(cloud.rendezvous.watch(), name="rendezvous-supervisor"),
            ]
            await _until_done(run, events_file)
            for t in tasks:
                t.cancel()
    except* Exception as group:
        # A demo component broke: say so in the report, and still stop everything cleanly.
        run.failure = "; ".join(repr(e) for e in group.exceptions)
        log.error("demo_component_failed", errors=[repr(e) for e in group.exceptions])


async def _until_done(run: DemoRun, events_file: Path) -> None:
    """The demo lasts until the job ends and fleetd has released every node, or ``duration_s`` of
    training (set-up time is not counted; for a job that finishes, a cap), or until its story is
    told (``end_when_told``), or until fleetd stops the job (budget cap), or until fleetd dies."""
    from fleetd.demo import story
    from fleetd.demo.progress import Progress

    hard_deadline = time.time() + run.opts.duration_s + 120.0  # set-up must not hang forever
    cap_s = story.training_cap_s(run.opts.duration_s, run.opts.end_when_told)
    while True:
        await asyncio.sleep(1.0)
        now = time.time()
        # Training began: a step reported, or (code that reports none: folder mode) the job runs
        # and has saved a version fleetd made durable. "Running" alone is not training: a plain
        # script can spend tens of seconds on a loaded box importing torch and joining its
        # process group, and a scenario played then hits nodes that have nothing to save.
        if run.training_since is None and (Progress.load(events_file).final_step > 0 or _job_saved(run)):
            run.training_since = now
            run.training_since_loop = asyncio.get_running_loop().time()
            log.info("demo_training_started", after_s=round(now - run.started_at, 1))
        if run.training_since is not None and now - run.training_since >= cap_s:
            return
        if run.opts.end_when_told and run.story_played_at is None:
            _scale_down_played(run)
        if run.opts.end_when_told and run.story_played_at is not None and run.story_fleet is not None:
            told_at = story.told_at(Progress.load(events_file), run.story_played_at, run.story_fleet)
            if told_at is not None and now >= told_at:
                run.story_told = True
                log.info("demo_story_told", why="the story played and the whole fleet trains again")
                return
        if run.training_since is None and now > hard_deadline:  # set-up only: a slow start is not a hang
            run.failure = f"training did not start in time; see the logs in {run.workdir}"
            log.error("demo_deadline", why=run.failure)
            return
        if run.fleetd is not None and not run.fleetd.running:
            run.failure = f"fleetd exited with {run.fleetd.proc.returncode}: {run.fleetd.tail(3)}"
            log.error("demo_fleetd_exited", code=run.fleetd.proc.returncode, tail=run.fleetd.tail(5))
            return
        if _job_over(run) and run.launcher is not None and not run.launcher.live():
            run.job_ended = True
            log.info("demo_job_ended", why="the job ended and fleetd released every node")
            return
        if _job_stopped(run) and run.launcher is not None and not run.launcher.live():
            run.stopped_by_budget = True
            log.info("demo_budget_stop", why="fleetd stopped the job at the budget cap and released every node")
            return


def _scale_down_played(run: DemoRun) -> None:
    """A scaling story (a fleet shape, no scripted steps) has played once fleetd released a node
    on its own: the node not worth its price, drained and terminated."""
    scenario = run.opts.scenario
    if scenario is None or scenario.fleet is None or scenario.steps or run.launcher is None:
        return
    injected = {target for _, _, target in run.injected}
    if any(n.stopped_at is not None and n.instance_id not in injected for n in run.launcher.nodes.values()):
        run.story_played_at, run.story_fleet = time.time(), len(run.launcher.live())
        log.info("demo_story_played", why="fleetd released a node on its own (a scale-down)", fleet=run.story_fleet)


def _job_over(run: DemoRun) -> bool:
    from fleetd.demo.view import status_snapshot

    snap = status_snapshot(run.workdir)
    return snap is not None and snap.job is not None and snap.job.terminal


def _job_saved(run: DemoRun) -> bool:
    """The job runs and a checkpoint of it is durable (fleetd's snapshot)."""
    from fleetd.demo.view import status_snapshot

    snap = status_snapshot(run.workdir)
    return (
        snap is not None and snap.job is not None and str(snap.job.state) == "running" and snap.checkpoint is not None
    )


def _job_stopped(run: DemoRun) -> bool:
    from fleetd.demo.view import status_snapshot

    snap = status_snapshot(run.workdir)
    return snap is not None and snap.stop_issued_at is not None
