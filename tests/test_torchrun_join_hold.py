"""agent/supervise/torchrun_main.py: a newcomer asks the running job for its hold checkpoint at the
moment it enters the wait list of a formed round (what makes the running agents restart their
workers), with its warm pool ready; never for a round still forming, where nothing trains yet.

Real torch rendezvous handlers over a real TCPStore, the newcomer in its own process (two
handlers in one process deadlock on the GIL inside a blocking store read). Deciding at the first
``next_rendezvous`` raced the running node's own round: it formed between the newcomer's look and
its join, and the running node restarted from step 0 in a store-outage test."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from agent.supervise import torchrun_main

NEWCOMER = """
import json, sys, time
from agent.supervise import torchrun_main
from tests.test_torchrun_join_hold import handler, members, store_client

store = store_client(int(sys.argv[1]))

def hold(timeout_s):  # what the running node's ranks would see when asked to save
    print(json.dumps({"hold": members(store)}), flush=True)

torchrun_main.checkpoint_before_join = hold
torchrun_main._patch(0.1)  # polls as in production: every 0.1 s, not every second
torchrun_main._hold_when_wait_listed(1.0)
if sys.argv[2] == "late":  # b looked while a's round formed; its first sync lands after (a slow store)
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    sync, waited = dr._BackendRendezvousStateHolder.sync, []
    def late_sync(self):
        if not waited:
            print(json.dumps({"entered": members(store)}), flush=True)
        while not waited and not members(store).get("complete"):
            time.sleep(0.05)
        waited.append(True)
        return sync(self)
    dr._BackendRendezvousStateHolder.sync = late_sync
h = handler(store, "127.0.0.2")
for _ in range(int(sys.argv[3])):  # its first join, then re-forms of its own (its agent restarting)
    info = h.next_rendezvous()
    print(json.dumps({"rank": info.rank, "world": info.world_size}), flush=True)
"""


def store_client(port: int) -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))


def handler(store: Any, addr: str) -> Any:
    """A node of a job of 1-2 nodes: a round of both forms at once (max_nodes); a round of one
    only when the test calls its last call (_call_last_call), never by a timer that a loaded box
    could miss (a subprocess importing torch takes ~15 s there)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    # Each round's rank 0 publishes its address afresh (torch's shared-store path publishes only
    # at a handler's first round, and the handlers here re-form without restarting).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    timeout = dr.RendezvousTimeout(join=timedelta(seconds=600), last_call=timedelta(seconds=600))
    backend = C10dRendezvousBackend(store, "job")
    return dr.DynamicRendezvousHandler.from_backend("job", store, backend, 1, 2, local_addr=addr, timeout=timeout)


def members(store: Any) -> dict[str, Any]:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    got = C10dRendezvousBackend(store, "job").get_state()
    s = pickle.loads(got[0]) if got else None
    if s is None:
        return {}
    addrs = lambda nodes: sorted(n.addr for n in nodes)  # noqa: E731
    return {"round": s.round, "complete": s.complete, "in": addrs(s.participants), "waiting": addrs(s.wait_list)}


def _call_last_call(store: Any) -> None:
    """What fleetd's steering does to complete a round (CompleteRound): its last call ends now."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    backend = C10dRendezvousBackend(store, "job")
    while True:
        raw, token = backend.get_state() or (None, None)
        state = pickle.loads(raw)
        state.deadline = datetime.now(UTC) - timedelta(seconds=1)
        if (result := backend.set_state(pickle.dumps(state), token)) is not None and result[2]:
            return


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Any:
    from torch.distributed import TCPStore

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


def _newcomer(store: Any, sync: str = "now", joins: int = 2) -> subprocess.Popen[str]:
    cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-c", NEWCOMER, str(store.port), sync, str(joins)]
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, text=True)


def _until(check: Any, timeout_s: float) -> None:
    until = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < until, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("looks", ["after a's round formed", "while a's round forms"])
def test_a_newcomer_asks_for_the_hold_as_it_enters_a_formed_rounds_wait_list(store, looks):
    a = handler(store, "127.0.0.1")
    first = threading.Thread(target=a.next_rendezvous, daemon=True)  # a's round: a alone
    first.start()
    _until(lambda: members(store).get("in"), 60)
    said = []
    if looks == "after a's round formed":
        _call_last_call(store)
        first.join(60)
        b = _newcomer(store)
    else:  # the race: b looks while a's round is open, and syncs only once it has formed
        b = _newcomer(store, sync="late")
        assert b.stdout is not None
        said.append(json.loads(b.stdout.readline()))  # b is in its join, a's round still open
        _call_last_call(store)
        first.join(60)
    try:
        _until(lambda: members(store).get("waiting"), 120)  # b is listed: a's agent would restart now
        a.next_rendezvous()  # ... and does: round 1, a and b
        _until(lambda: members(store).get("waiting"), 120)  # b restarts its own workers
        a.next_rendezvous()  # round 2, a and b again
        out, _ = b.communicate(timeout=120)
    finally:
        b.kill()
    said += [json.loads(line) for line in out.splitlines()]
    if looks == "while a's round forms":
        assert said.pop(0) == {"entered": {"round": 0, "complete": False, "in": ["127.0.0.1"], "waiting": []}}
    # Asked once, before b was listed, while a's round was formed: a's ranks saved what they
    # trained. b's own re-form asked nothing: its round's ranks were stopping, not training (a
    # request there waited out its timeout while the others formed a round without it).
    assert said == [
        {"hold": {"round": 0, "complete": True, "in": ["127.0.0.1"], "waiting": []}},
        {"rank": 1, "world": 2},
        {"rank": 1, "world": 2},
    ]


def test_a_newcomer_into_a_round_still_forming_asks_nothing(store):
    a = handler(store, "127.0.0.1")
    first = threading.Thread(target=a.next_rendezvous, daemon=True)  # a's round waits for more nodes
    first.start()
    _until(lambda: members(store).get("in"), 60)
    b = _newcomer(store, joins=1)
    try:
        out, _ = b.communicate(timeout=120)  # both nodes in: the round forms at once (max_nodes)
    finally:
        b.kill()
    first.join(60)
    assert not first.is_alive()
    assert [json.loads(line) for line in out.splitlines()] == [{"rank": 1, "world": 2}]  # no hold asked


def test_the_hold_is_asked_once_per_formed_round_after_the_pool_is_warm(tmp_path, monkeypatch):
    """A sync that fails on a stale state brings the wait-list decision back for the same round;
    a member's own round asks nothing, a round formed without it does."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    calls: list[object] = []
    sock = tmp_path / "pool.sock"
    monkeypatch.setenv("FLEETD_WARM_POOL", str(sock))
    monkeypatch.setattr(dr.DynamicRendezvousHandler, "next_rendezvous", lambda self: calls.append("join"))
    monkeypatch.setattr(dr._DistributedRendezvousOpExecutor, "_add_to_wait_list", lambda self: calls.append("listed"))
    monkeypatch.setattr(torchrun_main, "checkpoint_before_join", lambda t: calls.append(("hold", sock.exists())))
    assert torchrun_main._hold_when_wait_listed(1.0)
    threading.Timer(0.3, sock.touch).start()  # the pool finishes importing torch
    dr.DynamicRendezvousHandler.next_rendezvous(object())  # a handler torch no longer shapes so
    assert calls == ["join"]  # torchrun joining asks nothing by itself

    def state(round_: int) -> Any:
        return SimpleNamespace(round=round_, participants={"a": 0})

    add = dr._DistributedRendezvousOpExecutor._add_to_wait_list
    for round_ in (3, 3, 4):  # a newcomer: a formed round 3, the same again, then round 4
        add(SimpleNamespace(_state=state(round_)))
    assert calls[1:] == [("hold", True), "listed", "listed", ("hold", True), "listed"]
    del calls[:]
    dr.DynamicRendezvousHandler.next_rendezvous(SimpleNamespace(_state_holder=SimpleNamespace(state=state(5))))
    add(SimpleNamespace(_state=state(5)))  # its own round 5, left to restart its workers
    add(SimpleNamespace(_state=state(6)))  # round 6 formed without it: that world trained
    assert calls == ["join", "listed", ("hold", True), "listed"]
