"""What makes a notice's re-form fast, checked against torch's own code: the poke opens the next
round (RendezvousState.poked), rendezvous events are named without walking the stack
(agent/supervise/rdzv_events.py), a non-zero rank waits for rank 0's store to listen
(agent/supervise/master_wait.py), and botocore's data files are parsed once per process
(agent.checkpoint_store.s3). Timings: docs/measurements/2026-11-rendezvous.md."""

from __future__ import annotations

import asyncio
import base64
import pickle
import socket
import threading
import time
from datetime import UTC, datetime, timedelta

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _Action,
    _NodeDesc,
    _RendezvousContext,
    _RendezvousExitOp,
    _RendezvousJoinOp,
)

from agent.supervise import master_wait, rdzv_events, tail_poll
from fleetd.rendezvous import decide
from fleetd.rendezvous.state import NodeId, RendezvousState, encode

NOW = datetime(2026, 11, 27, 6, 0, tzinfo=UTC)
A, B, C = NodeId("127.0.0.2", 100, 0), NodeId("127.0.0.3", 200, 0), NodeId("127.0.0.9", 300, 0)


def _torch(s: RendezvousState):  # what torch's agents read from the store
    return pickle.loads(base64.b64decode(encode(s)))


def _ctx(s: RendezvousState, n: NodeId) -> _RendezvousContext:
    settings = RendezvousSettings("job", 1, 8, RendezvousTimeout(), timedelta(seconds=1), 15)
    return _RendezvousContext(_NodeDesc(n.addr, n.pid, n.local_id), _torch(s), settings)


def test_poke_opens_the_next_round_that_torchs_ops_join_at_once():
    formed = RendezvousState(
        round=3,
        complete=True,
        participants={A: 0, B: 1},
        wait_list=frozenset({C}),  # a newcomer already waiting
        last_heartbeats={A: NOW, B: NOW, C: NOW},
    )
    s = formed.poked(NOW)
    assert (s.round, s.complete, s.participants) == (4, False, {})
    assert s.has_marker and s.waiting == {C} and set(s.last_heartbeats) - {C} == {n for n in s.wait_list if n.is_marker}
    deadline = time.monotonic() + 60
    for node in (A, B, C):
        # torch's agent sees the marker (num_nodes_waiting > 0), has nothing to leave, and adds
        # itself to the open round: no wait-list detour, no wait for the last one out.
        assert len(_ctx(s, node).state.wait_list) >= 1
        assert _RendezvousExitOp()(_ctx(s, node), deadline) is _Action.FINISH
        assert _RendezvousJoinOp()(_ctx(s, node), deadline) is _Action.ADD_TO_PARTICIPANTS


def test_the_open_round_waits_for_a_member_still_stopping_its_workers():
    from dataclasses import replace

    formed = RendezvousState(round=3, complete=True, participants={A: 0, B: 1}, last_heartbeats={A: NOW, B: NOW})
    members = formed.participant_addrs
    poked = formed.poked(NOW)
    # A joined at once (torch set its 2 s last call); B is still saving on SIGTERM.
    s = replace(
        poked,
        participants={A: 0},
        deadline=NOW + timedelta(seconds=0.5),
        last_heartbeats={**poked.last_heartbeats, A: NOW},
    )
    at = NOW + timedelta(seconds=1.5)
    seen = {"127.0.0.2": at, "127.0.0.3": NOW}
    acts = decide.steer(decide.Observation(state=s, now=at, members=members, heartbeats=seen))
    assert [type(a).__name__ for a in acts] == ["HoldRound"] and acts[0].until == at + decide.HOLD_STEP
    # Once B is in, the round forms; past max(dead_after, hang_after) torch's last call decides.
    both = replace(s, participants={A: 0, B: 0})
    acts = decide.steer(decide.Observation(state=both, now=at, members=members, heartbeats=seen))
    assert [type(a).__name__ for a in acts] == ["CompleteRound"]
    late = NOW + timedelta(seconds=10.5)
    fresh = replace(s, last_heartbeats={**s.last_heartbeats, A: late})
    acts = decide.steer(
        decide.Observation(state=fresh, now=late, members=members, heartbeats={**seen, "127.0.0.2": late})
    )
    assert "HoldRound" not in [type(a).__name__ for a in acts]


def test_rendezvous_events_get_torchs_own_method_names():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    original = dr.get_method_name

    def caller() -> tuple[str, str]:
        def record() -> tuple[str, str]:  # as torch's _record calls it
            return original(), rdzv_events.method_name()

        return record()

    assert caller() == ("caller", "caller")
    assert rdzv_events.method_name(10_000) == "no_method_name"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_client_rank_waits_for_rank_0s_store_then_connects():
    import importlib

    rdzv = importlib.import_module("torch.distributed.rendezvous")
    original = rdzv._create_c10d_store
    try:
        assert master_wait.install() and not master_wait.install()  # once
        port, got = _free_port(), {}

        def client() -> None:
            store = rdzv._create_c10d_store("127.0.0.1", port, 1, 2, timedelta(seconds=60))
            store.set("from-1", "hello")
            got["client"] = store

        t = threading.Thread(target=client)
        t.start()
        time.sleep(0.1)  # the client is polling by now; rank 0 comes late, as it often does
        master = rdzv._create_c10d_store("127.0.0.1", port, 0, 2, timedelta(seconds=60))
        t.join(60)
        assert master.get("from-1") == b"hello"
    finally:
        rdzv._create_c10d_store = original


def test_wait_listening_gives_up_after_its_timeout():
    assert not master_wait.wait_listening("127.0.0.1", _free_port(), 0.05)


def test_botocore_data_is_parsed_once_per_process():
    from agent.checkpoint_store import s3

    s3.warm_client_data()
    (loader,) = s3._LOADERS.values()
    parsed = len(loader._cache)

    async def make_client() -> object:
        async with s3.S3Bucket.connect("b", region="us-east-1", endpoint_url="http://127.0.0.1:9"):
            return s3._session(None).get_component("data_loader")

    # Each asyncio.run is a new loop, so a new session: both use the warmed loader, and creating
    # their clients parses nothing more (no request is sent).
    assert asyncio.run(make_client()) is loader and asyncio.run(make_client()) is loader
    assert len(loader._cache) == parsed


def test_torchruns_output_copiers_poll_at_fleetds_interval(tmp_path):
    """tail_poll.install() reaches the copiers torch's own process context creates (it passes no
    interval), and stopping the group still copies every line the workers wrote."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys
        from agent.supervise import tail_poll
        assert tail_poll.install()
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
        ctx = start_processes(
            name="w",
            entrypoint=sys.executable,
            args={{0: ("-c", "print('from the worker')")}},
            envs={{0: {{}}}},
            logs_specs=DefaultLogsSpecs(log_dir={str(tmp_path)!r}, tee=Std.ALL),
        )
        while ctx.wait(timeout=5) is None:
            pass
        ctx.close()
        print("intervals", sorted({{t._interval_sec for t in ctx._tail_logs}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "from the worker" in out.stdout
    assert f"intervals [{tail_poll.POLL_S}]" in out.stdout
