"""The rendezvous store has no authentication: fleetd does not act on store keys for an address
no fleet node announced (over MQTT, under its certificate). Real store host, real torch handlers."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from torch.distributed import TCPStore

from fleetd.protocol import rendezvous_keys as keys
from fleetd.rendezvous.client import RendezvousClient
from fleetd.rendezvous.steer_settings import SteerSettings
from fleetd.rendezvous.steering import Steerer
from tests.test_rendezvous_host import RUN, handler, host, join_in_thread  # noqa: F401 (fixture)

KNOWN, STRANGER = "127.0.0.2", "127.0.0.3"


async def test_drain_keys_of_an_address_no_fleet_node_claims_are_ignored(host):  # noqa: F811
    port, proc = host
    results: dict = {}
    a, b = handler(port, KNOWN), handler(port, STRANGER)
    threads = [join_in_thread(a, results, "a"), join_in_thread(b, results, "b")]
    try:
        async with RendezvousClient("127.0.0.1", port, RUN) as client:
            for _ in range(100):
                snap = await client.observe()
                if snap.state is not None and len(snap.state.participants) == 2:
                    break
                await asyncio.sleep(0.1)
            # Anyone who reaches the port writes "drain ready" for both addresses.
            raw = TCPStore("127.0.0.1", port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=5))
            for addr in (KNOWN, STRANGER):
                raw.set(keys.drain_ready_key(RUN, addr), keys.DrainReady(step=5, durable=True).to_bytes())
            steerer = Steerer(client, SteerSettings(), known_addr=lambda addr: addr == KNOWN)
            steerer.members = frozenset({KNOWN, STRANGER})
            obs = await steerer.observe(datetime.now(UTC))
            assert obs.drain_ready == frozenset({KNOWN})
            assert steerer.ignored_addrs == frozenset({STRANGER})
            # Once fleetd itself told the address to leave, its keys are read again.
            steerer.told_leave[STRANGER] = datetime.now(UTC)
            obs = await steerer.observe(datetime.now(UTC))
            assert obs.drain_ready == frozenset({KNOWN, STRANGER}) and steerer.ignored_addrs == frozenset()
            # Without a registry (standalone steering), nothing is filtered.
            plain = Steerer(client, SteerSettings())
            plain.members = frozenset({KNOWN, STRANGER})
            assert (await plain.observe(datetime.now(UTC))).drain_ready == frozenset({KNOWN, STRANGER})
    finally:
        for h in (a, b):
            h._stop_heartbeats()
        # The round never completes here: end the store so the joining threads end now, not
        # later in someone else's test.
        proc.kill()
        await asyncio.to_thread(lambda: [t.join(15) for t in threads])
        assert not any(t.is_alive() for t in threads)
