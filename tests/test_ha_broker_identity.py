"""Two HA control hosts on one broker under TLS: with one shared certificate each connection takes
the other's session (the broker names a session after the CN: use_username_as_clientid); with one
identity per host (`fleetd ca init --controller-host`, and the ACL it writes) both stay connected,
and both may command nodes. `fleetd doctor` (and `fleetd run`) name the shared one as fatal."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiomqtt
import pytest

from fleetd.config import FleetdConfig, HaConfig
from fleetd.doctor.host import identity_check
from fleetd.doctor.result import Status
from fleetd.protocol.topics import node_topic
from fleetd.shared.settings import MqttConfig
from tests.harness.ca_cli import ca_init
from tests.harness.mosquitto import Mosquitto
from tests.harness.ports import free_port
from tests.test_deploy_mosquitto import deployed_config


@pytest.fixture(scope="module")
def ca() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="fleetd-ha-ca-"))
    out = ca_init(d / "ca", "--controller-host", "ctl-a", "--controller-host", "ctl-b", broker_names=("127.0.0.1",))
    assert out.returncode == 0, out.stderr
    yield d / "ca"
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def broker(ca: Path) -> Iterator[Mosquitto]:
    port = free_port()
    b = Mosquitto(port=port, listener_block=deployed_config(ca, port))
    b.start()
    yield b
    b.close()


def tls(ca: Path, cn: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca / "ca.crt"))
    ctx.load_cert_chain(str(ca / f"{cn}.crt"), str(ca / f"{cn}.key"))
    return ctx


async def _until_dropped_or(stop: asyncio.Event, c: aiomqtt.Client) -> None:
    """Stay connected until ``stop`` (returns) or the broker drops the session (MqttError). The
    stop is checked here, not only by cancelling: a cancel that lands while aiomqtt connects can
    be lost, and a loop over ``c.messages`` alone then never ended (a 3-worker run, 2026-11-28)."""

    async def drain() -> None:
        async for _ in c.messages:
            pass

    dropped, stopped = asyncio.ensure_future(drain()), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({dropped, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (dropped, stopped):
            t.cancel()
        await asyncio.gather(dropped, stopped, return_exceptions=True)
    if not stopped.done() or stopped.cancelled():
        dropped.result()  # the broker's drop: MqttError, the caller reconnects


async def two_controllers(broker: Mosquitto, ca: Path, cns: tuple[str, str], until, timeout: float) -> tuple[int, int]:
    """Two controllers (their own client ids, as HA gives them), each reconnecting when dropped
    as fleetd's intake does, until ``until(connects)`` holds (or ``timeout``); how often each
    connected."""
    connects = [0, 0]
    stop = asyncio.Event()

    async def controller(k: int, cn: str) -> None:
        while not stop.is_set():
            try:
                async with aiomqtt.Client(
                    broker.host, broker.port, identifier=f"fleetd-prod-ctl-{k}", tls_context=tls(ca, cn), timeout=5
                ) as c:
                    connects[k] += 1
                    await c.subscribe("fleetd/prod/nodes/+/events", qos=1)
                    await c.publish(node_topic("prod", "i-0aaaaaaaaaaaaaaaa", "commands"), b"{}", qos=1)
                    await _until_dropped_or(stop, c)
            except aiomqtt.MqttError:
                await asyncio.sleep(0.2)  # the intake's reconnect backoff

    tasks = [asyncio.create_task(controller(k, cn)) for k, cn in enumerate(cns)]
    deadline = asyncio.get_running_loop().time() + timeout
    while not until(connects) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return connects[0], connects[1]


async def test_one_identity_per_control_host_keeps_both_sessions(broker: Mosquitto, ca: Path) -> None:
    before = broker.log_text().count("already connected, closing old connection")
    ids = ("fleetd-controller-ctl-a", "fleetd-controller-ctl-b")
    assert await two_controllers(broker, ca, ids, lambda c: min(c) >= 1, 30.0) == (1, 1)
    # Both connected: any takeover would show within a few reconnects; none comes.
    assert await two_controllers(broker, ca, ids, lambda c: max(c) > 1, 3.0) == (1, 1)
    assert broker.log_text().count("already connected, closing old connection") == before


async def test_a_shared_certificate_makes_the_two_take_each_others_session(broker: Mosquitto, ca: Path) -> None:
    before = broker.log_text().count("already connected, closing old connection")
    shared = ("fleetd-controller", "fleetd-controller")
    a, b = await two_controllers(broker, ca, shared, lambda c: sum(c) >= 4, 60.0)
    assert a + b >= 4  # they keep knocking each other off
    assert broker.log_text().count("already connected, closing old connection") > before


def test_doctor_names_a_shared_identity_in_ha_as_fatal(ca: Path) -> None:
    def cfg(cn: str) -> FleetdConfig:
        mqtt = MqttConfig(url="mqtts://127.0.0.1:8883", cert_file=ca / f"{cn}.crt", key_file=ca / f"{cn}.key")
        return FleetdConfig(mqtt=mqtt, ha=HaConfig(backend="dynamodb", host_id="ctl-a"))

    shared = identity_check(cfg("fleetd-controller"))
    assert shared.status is Status.FAIL and shared.fatal and "--controller-host ctl-a" in shared.fix
    own = identity_check(cfg("fleetd-controller-ctl-a"))
    assert own.status is Status.OK and "fleetd-controller-ctl-a" in own.detail
    assert identity_check(FleetdConfig()).status is Status.SKIP


def test_doctor_names_a_shared_identity_between_a_teams_jobs_as_fatal(ca: Path) -> None:
    """Several jobs' controllers on one broker (a team, or fleetd@NAME units) kick each other off
    just as HA hosts do (the test above): each needs its own certificate."""
    from fleetd.config import FleetConfig, TeamMemberConfig

    def cfg(cn: str) -> FleetdConfig:
        mqtt = MqttConfig(url="mqtts://127.0.0.1:8883", cert_file=ca / f"{cn}.crt", key_file=ca / f"{cn}.key")
        return FleetdConfig(mqtt=mqtt, fleet=FleetConfig(name="ctl-a"), team=TeamMemberConfig(member=True))

    shared = identity_check(cfg("fleetd-controller"))
    assert shared.status is Status.FAIL and shared.fatal and "--controller-host ctl-a" in shared.fix
    assert "team" in shared.detail
    assert identity_check(cfg("fleetd-controller-ctl-a")).status is Status.OK
