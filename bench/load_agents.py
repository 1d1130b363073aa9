"""One process of simulated agents for bench/agents_load.py: many light MQTT clients, each speaking
what a real fleet-agent speaks (agent/node/mqtt_session.py) with the real wire models:

- a retained ``status`` (training, with its node address), the offline Status as its last will;
- ``telemetry`` at QoS 0 every second (phase spread over the second), step advancing;
- on a ``drain`` command: status ``draining``, then (after ``--leave-after``) ``trainer-exited``
  and status ``leaving``, as a node that checkpointed and stopped its tree does;
- notices: this process publishes ``--notice-rate`` per second on its own agents' ``events``
  topics (QoS 1), each agent at most once.

    python bench/load_agents.py --broker 127.0.0.1:1883 --fleet f --ids ids.txt --out counts.json
    python bench/load_agents.py --observe --broker ... --fleet f --out observed.json

``--observe``: one client subscribed to every node's events and commands (not telemetry) that
stamps each notice and each drain on arrival: notice on the broker -> drain on the broker.
Both modes stop on SIGTERM and write their counts as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import ssl
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiomqtt

from fleetd.protocol.messages import GpuSample, Notice, Status, Telemetry, TrainerExited, parse_message
from fleetd.protocol.topics import fleet_filter, node_topic, parse_topic

DRAINING: set[asyncio.Task] = set()  # drain sequences in flight (finished before disconnecting)
COUNTS = {
    "status": 0,
    "telemetry": 0,
    "events": 0,
    "publish_errors": 0,
    "connect_errors": 0,
    "commands": 0,
    "drains": 0,
    "connected": 0,
    "notices": 0,
}


class Identities:
    """Certificates from the fleet CA, CN = the instance id, as enrolment would issue them (the
    real agent gets its own by enrolling; here the bench signs them itself, from the CA files)."""

    def __init__(self, pki: Path) -> None:
        import tempfile

        from fleetd.identity.ca import CaFiles, LocalCa

        self.files = CaFiles(pki)
        self.ca = LocalCa.load(self.files)
        self.dir = Path(tempfile.mkdtemp(prefix="load-agents-pki-"))

    def context(self, cn: str) -> ssl.SSLContext:
        from cryptography.hazmat.primitives.asymmetric import ec

        from fleetd.identity.ca import key_pem, pem

        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC)
        cert = self.ca.sign(cn, key.public_key(), timedelta(hours=6), now)
        crt, keyf = self.dir / f"{cn}.crt", self.dir / f"{cn}.key"
        crt.write_bytes(pem(cert))
        keyf.write_bytes(key_pem(key))
        ctx = ssl.create_default_context(cafile=str(self.files.ca_cert))
        ctx.load_cert_chain(str(crt), str(keyf))
        return ctx

    def observer(self) -> ssl.SSLContext:
        from fleetd.identity.ca import OBSERVER_CN

        crt, key = self.files.client(OBSERVER_CN)
        ctx = ssl.create_default_context(cafile=str(self.files.ca_cert))
        ctx.load_cert_chain(str(crt), str(key))
        return ctx


class Agent:
    def __init__(
        self,
        host: str,
        port: int,
        fleet: str,
        iid: str,
        addr: str,
        leave_after: float,
        tls: ssl.SSLContext | None = None,
    ):
        self.host, self.port, self.fleet, self.iid, self.addr = host, port, fleet, iid, addr
        self.tls = tls
        self.leave_after = leave_after
        self.client: aiomqtt.Client | None = None
        self.noticed = False
        self.step = 0
        self.topic = {ch: node_topic(fleet, iid, ch) for ch in ("status", "telemetry", "events", "commands")}

    def status(self, state: str) -> Status:
        return Status(
            instance_id=self.iid,
            state=state,
            agent_version="load",
            instance_type="g5.xlarge",
            lifecycle="spot",
            node_addr=self.addr,
        )

    async def publish(self, channel: str, payload: bytes, qos: int, retain: bool = False) -> None:
        if self.client is None:
            return
        COUNTS[f"{channel}_attempted"] = COUNTS.get(f"{channel}_attempted", 0) + 1
        try:
            await self.client.publish(self.topic[channel], payload, qos=qos, retain=retain, timeout=30)
            COUNTS[channel] += 1
        except (aiomqtt.MqttError, TimeoutError):
            COUNTS["publish_errors"] += 1

    async def run(self, stop: asyncio.Event) -> None:
        will = aiomqtt.Will(self.topic["status"], self.status("offline").to_json(), qos=1, retain=True)
        for attempt in range(20):
            try:
                async with aiomqtt.Client(
                    self.host,
                    self.port,
                    identifier=f"fleet-agent-{self.fleet}-{self.iid}",
                    will=will,
                    clean_session=True,
                    keepalive=60,
                    timeout=30,
                    tls_context=self.tls,
                ) as client:
                    self.client = client
                    await client.subscribe(self.topic["commands"], qos=1)
                    await self.publish("status", self.status("training").to_json(), 1, retain=True)
                    COUNTS["connected"] += 1
                    tasks = [asyncio.create_task(self._telemetry(stop)), asyncio.create_task(self._commands(client))]
                    waiter = asyncio.create_task(stop.wait())
                    done, _ = await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
                    for t in [*tasks, waiter]:
                        t.cancel()
                    await asyncio.gather(*tasks, waiter, return_exceptions=True)
                    if stop.is_set():
                        return
                    for t in done:
                        if t is not waiter and t.exception() is not None:
                            raise t.exception()
            except (aiomqtt.MqttError, TimeoutError):
                COUNTS["connect_errors"] += 1
            self.client = None
            await asyncio.sleep(0.5 + random.random() * attempt)

    async def _telemetry(self, stop: asyncio.Event) -> None:
        await asyncio.sleep(random.random())  # spread the fleet over the second
        gpus = (GpuSample(index=0, util_pct=95.0, mem_used_mib=20000, mem_total_mib=24576),)
        while not stop.is_set():
            started = time.monotonic()
            self.step += 3
            t = Telemetry(
                instance_id=self.iid,
                gpus=gpus,
                cpu_pct=40.0,
                mem_used_pct=30.0,
                step=self.step,
                steps_per_s=3.0,
                world_size=1,
            )
            await self.publish("telemetry", t.to_json(), 0)
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))

    async def _commands(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            COUNTS["commands"] += 1
            msg = parse_message(bytes(message.payload))
            if msg.kind == "drain":
                COUNTS["drains"] += 1
                task = asyncio.get_running_loop().create_task(self._drain())
                DRAINING.add(task)
                task.add_done_callback(DRAINING.discard)

    async def _drain(self) -> None:
        await self.publish("status", self.status("draining").to_json(), 1, retain=True)
        await asyncio.sleep(self.leave_after)
        await self.publish(
            "events",
            TrainerExited(instance_id=self.iid, exit_code=0, reason="drained", last_step=self.step).to_json(),
            1,
        )
        await self.publish("status", self.status("leaving").to_json(), 1, retain=True)

    async def notice(self) -> None:
        self.noticed = True
        n = Notice(instance_id=self.iid, action="terminate", action_time=datetime.now(UTC) + timedelta(seconds=120))
        await self.publish("events", n.to_json(), 1)
        COUNTS["notices"] += 1


async def agents_main(a: argparse.Namespace, stop: asyncio.Event, quiet: asyncio.Event) -> None:
    host, port = a.broker.rsplit(":", 1)
    ids = [line.split() for line in Path(a.ids).read_text().split("\n") if line.strip()]
    ids_ = Identities(Path(a.pki)) if a.pki else None
    agents = [
        Agent(host, int(port), a.fleet, iid, addr, a.leave_after, ids_.context(iid) if ids_ else None)
        for iid, addr in ids
    ]
    async with asyncio.TaskGroup() as tg:
        for agent in agents:
            tg.create_task(agent.run(stop))
            await asyncio.sleep(a.connect_spread_s / max(1, len(agents)))
        tg.create_task(_notices(agents, a, quiet))
        await stop.wait()


async def _notices(agents: list[Agent], a: argparse.Namespace, stop: asyncio.Event) -> None:
    if a.notice_rate <= 0:
        return
    await asyncio.sleep(a.notice_delay_s)
    rng = random.Random(a.seed)
    pending = [ag for ag in agents]
    rng.shuffle(pending)
    period = 1.0 / a.notice_rate
    nxt = time.monotonic()
    while pending and not stop.is_set() and COUNTS["notices"] < a.max_notices:
        await pending.pop().notice()
        nxt += period
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, nxt - time.monotonic()))


async def observe_main(a: argparse.Namespace, stop: asyncio.Event, seen: dict) -> None:
    host, port = a.broker.rsplit(":", 1)
    ids_ = Identities(Path(a.pki)) if a.pki else None
    # With the fleet ACL the observer may only read; the malformed messages come from a node
    # identity of their own (i-0bad), on its own topics, as a broken agent's would.
    bad_tls = ids_.context("i-0bad") if ids_ else None
    observer_tls = ids_.observer() if ids_ else None
    async with (
        aiomqtt.Client(
            host, int(port), identifier=f"load-observer-{a.fleet}", timeout=30, tls_context=observer_tls
        ) as client,
        aiomqtt.Client(host, int(port), identifier="i-0bad", timeout=30, tls_context=bad_tls) as bad_client,
    ):
        await client.subscribe(fleet_filter(a.fleet, "events"), qos=1)
        await client.subscribe(fleet_filter(a.fleet, "commands"), qos=1)
        await client.subscribe("$SYS/broker/#", qos=0)
        Path(a.out + ".ready").write_text("ready")

        async def read() -> None:
            async for m in client.messages:
                now = time.time()
                topic = str(m.topic)
                if topic.startswith("$SYS/"):
                    seen["sys"][topic] = bytes(m.payload).decode(errors="replace")
                    continue
                where = parse_topic(topic)
                msg = parse_message(bytes(m.payload))
                if msg.kind == "notice":
                    seen["notice"].setdefault(where.instance_id, now)
                elif msg.kind == "drain":
                    seen["drain"].setdefault(where.instance_id, now)
                elif where.channel == "commands":
                    seen["other_commands"][msg.kind] = seen["other_commands"].get(msg.kind, 0) + 1

        async def bad() -> None:
            # Malformed payloads on a node's telemetry topic: fleetd must reject each, and live.
            if a.bad_rate <= 0:
                return
            while True:
                await asyncio.sleep(1.0 / a.bad_rate)
                await bad_client.publish(
                    node_topic(a.fleet, "i-0bad", "telemetry"), b'{"kind": "telemetry", "cpu', qos=0
                )
                seen["bad_sent"] = seen.get("bad_sent", 0) + 1

        task = asyncio.create_task(read())
        bad_task = asyncio.create_task(bad())
        await stop.wait()
        bad_task.cancel()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--broker", required=True)
    ap.add_argument("--fleet", required=True)
    ap.add_argument("--ids", help="file: one 'instance-id node-addr' per line")
    ap.add_argument("--out", required=True)
    ap.add_argument("--observe", action="store_true")
    ap.add_argument("--notice-rate", type=float, default=0.0, help="notices per second from this process")
    ap.add_argument("--notice-delay-s", type=float, default=0.0)
    ap.add_argument("--max-notices", type=int, default=10**9)
    ap.add_argument("--leave-after", type=float, default=1.0)
    ap.add_argument("--connect-spread-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bad-rate", type=float, default=0.0, help="observer: malformed messages per second")
    ap.add_argument("--pki", default="", help="the fleet CA's folder: TLS with a certificate per client")
    a = ap.parse_args()

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if a.observe:
            seen: dict = {"notice": {}, "drain": {}, "other_commands": {}, "sys": {}}
            await observe_main(a, stop, seen)
            Path(a.out).write_text(json.dumps(seen))
        else:
            quiet = asyncio.Event()  # SIGTERM: no new notice, let drains in flight finish, then go
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, quiet.set)

            async def settle() -> None:
                await quiet.wait()
                deadline = time.monotonic() + 8.0
                await asyncio.sleep(2.0)  # a drain for the last notice may still be on its way
                while DRAINING and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                stop.set()

            settler = asyncio.create_task(settle())
            await agents_main(a, stop, quiet)
            await settler
            Path(a.out).write_text(json.dumps(COUNTS))

    asyncio.run(run())


if __name__ == "__main__":
    main()
