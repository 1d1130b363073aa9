"""agent/supervise/store_ride.py's write-back, on torch's own rendezvous classes and a real TCPStore
(a server process that is SIGKILLed and started again on the same port): the round a node last read
comes back to a store that lost it, whichever way the node learns of the loss.

Each scenario runs in a fresh interpreter: ``install`` patches torch's classes process-wide.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

SCENARIO = textwrap.dedent(
    """
    import json, socket, subprocess, sys, time
    from datetime import UTC, datetime, timedelta
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from agent.supervise import store_ride
    from fleetd.shared.rendezvous_pickle import unpickle_rendezvous_state

    how = sys.argv[1]
    assert store_ride.install(outage_s=60)
    sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
    SERVER = ("import time, datetime; from torch.distributed import TCPStore; "
              f"s = TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False, "
              "timeout=datetime.timedelta(seconds=5)); print('up', flush=True); time.sleep(600)")

    def server():
        p = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE)
        assert p.stdout.readline().strip() == b"up"
        return p

    def client():
        return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))

    srv = server()
    backend = C10dRendezvousBackend(client(), "job")
    settings = dr.RendezvousSettings("job", 1, 3, dr.RendezvousTimeout(), timedelta(seconds=5), 3)
    holder = dr._BackendRendezvousStateHolder(backend, settings, cache_duration=0)
    state = dr._RendezvousState()
    state.round, state.complete = 3, True
    a, b = dr._NodeDesc("10.0.0.1", 1, 0), dr._NodeDesc("10.0.0.2", 1, 0)
    state.participants = {a: 0, b: 1}
    state.last_heartbeats = {a: datetime.now(UTC), b: datetime.now(UTC)}
    holder._state = state
    holder.mark_dirty()
    holder.sync()
    assert holder.state.complete and len(holder.state.participants) == 2

    if how == "restart":  # SIGKILL, and a new, empty server on the same port
        srv.kill(); srv.wait()
        srv = server()
    else:  # the store's state gone while this node's connection stayed up
        client().set("torch.rendezvous.job", C10dRendezvousBackend._NULL_SENTINEL)
    deadline = time.monotonic() + 30
    while True:
        try:
            holder.sync()
            break
        except Exception:  # the reconnect is paced (RECONNECT_EVERY_S)
            assert time.monotonic() < deadline
            time.sleep(0.2)
    raw = client().get("torch.rendezvous.job")
    back = unpickle_rendezvous_state(raw)
    srv.kill()
    print(json.dumps({
        "round": back.round if back else None,
        "complete": back.complete if back else None,
        "members": sorted(n.addr for n in back.participants) if back else [],
        "holder_round": holder.state.round,
    }))
    """
)


@pytest.mark.parametrize("how", ["restart", "emptied"])
def test_the_last_complete_round_comes_back_to_a_store_that_lost_it(how: str) -> None:
    out = subprocess.run([sys.executable, "-c", SCENARIO, how], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"round": 3, "complete": True, "members": ["10.0.0.1", "10.0.0.2"], "holder_round": 3}, (
        got,
        out.stderr[-2000:],
    )
    assert "round 3 written back to the new store (2 members)" in out.stderr
