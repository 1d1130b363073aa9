"""fleetd's rendezvous steering with many members, on the real TCPStore (no torch workers).

    nice .venv/bin/python bench/steering_load.py --members 1000 [--leaves 5]

What runs: the store in its own process (fleetd.rendezvous.host, as `fleetd rendezvous`), fleetd's
``Steerer`` (the daemon's steering loop, unchanged) in this process, and the members simulated by
``--procs`` processes that write torch's real state blob (fleetd.rendezvous.state's codec) on the
real store: a formed round of N members, each process's members heartbeating every 2 s (one
compare-and-set per process), and, when fleetd's marker asks the survivors to re-form, each process
moving its members into the next round in one compare-and-set.

Per leave: the leaver's agent writes ``noticed`` and then ``drain_ready``; fleetd removes it and
writes ``leave``; the leaver writes ``left`` once told; fleetd pokes the survivors; they rejoin;
fleetd completes the round. ``leave_to_round_s``: from the ``drain_ready`` write to the round of
N-1 complete, as a member sees it. Store round trips are counted on fleetd's client.

Not modelled (and said so in the JSON): torchrun moves each node on its own, one compare-and-set
of the whole state per node (O(N) writes of an O(N) blob per re-form); here one per process. The
JSON gives the blob size and the time one such write costs, so that bound can be read off.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleetd.localnet import free_port, wait_port  # noqa: E402
from fleetd.protocol import rendezvous_keys as keys  # noqa: E402
from fleetd.rendezvous.state import MARKER_ADDR, NodeId, RendezvousState, decode, encode  # noqa: E402

RUN_ID = "load"


def addr(k: int) -> str:
    return f"10.{(k >> 16) & 255}.{(k >> 8) & 255}.{k & 255}"


def connect(port: int):  # -> TCPStore
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=30))


def cas(store, change) -> RendezvousState | None:
    key = keys.torch_state_key(RUN_ID)
    for _ in range(1000):
        raw = store.get(key)
        new = change(decode(raw))
        if new is None:
            return None
        desired = encode(new)
        if store.compare_set(key, raw, desired) == desired:
            return new
    raise RuntimeError("compare-and-set lost 1000 times")


# ---------------------------------------------------------------------------- member processes
def member_proc(port: int, first: int, count: int, stop_file: Path, leavers: int) -> None:
    """Own members [first, first+count): heartbeat them, and move them to the next round when
    fleetd's marker pokes the survivors (one write per process)."""
    store = connect(port)
    mine = {NodeId(addr(k), 1000 + k, 0) for k in range(first, first + count)}
    # Only the bench's leavers watch their leave key (a real agent watches its own; polling
    # every member's key from here would cost the store N ops per loop).
    told_key = {n: keys.leave_key(RUN_ID, n.addr) for n in mine if 1000 <= n.pid < 1000 + leavers}
    gone: set[NodeId] = set()
    next_beat = 0.0
    rejoining = False
    while not stop_file.exists():
        now = datetime.now(UTC)
        raw = store.get(keys.torch_state_key(RUN_ID))
        live = mine - gone
        # A leaver told to leave stops its tree at once: ``left``.
        for n in [m for m in live if m in told_key]:
            if store.check([told_key[n]]):
                store.set(keys.left_key(RUN_ID, n.addr), keys.Left(exit_code=0).to_bytes())
                gone.add(n)
        live = mine - gone
        # Decoding 90 KB every poll in 4 processes would eat this 2-core box: look for fleetd's
        # marker in the bytes first, and decode while a re-form is under way or to heartbeat.
        beat_due = time.monotonic() >= next_beat
        if not (rejoining or beat_due or MARKER_ADDR.encode() in base64.b64decode(raw)):
            time.sleep(0.05)
            continue
        s = decode(raw)
        rejoining = bool(s is not None and (s.has_marker or (not s.complete and live - set(s.participants))))
        if s is not None and s.complete and s.has_marker and live & set(s.participants):

            def rejoin(s: RendezvousState, live: set = live, now: float = now) -> RendezvousState | None:
                if s.complete and s.has_marker:
                    # torch's exit op empties the complete round: round+1, the survivors join it.
                    return replace(
                        s,
                        round=s.round + 1,
                        complete=False,
                        deadline=None,
                        participants={n: 0 for n in live},
                        wait_list=frozenset(w for w in s.wait_list if w.addr == MARKER_ADDR),
                        last_heartbeats={
                            **{n: t for n, t in s.last_heartbeats.items() if n.addr == MARKER_ADDR},
                            **{n: now for n in live},
                        },
                    )
                if not s.complete and not live <= set(s.participants):
                    return replace(
                        s,
                        participants={**s.participants, **{n: 0 for n in live}},
                        last_heartbeats={**s.last_heartbeats, **{n: now for n in live}},
                    )
                return None

            cas(store, rejoin)
        elif s is not None and not s.complete and live - set(s.participants) and s.round > 0:
            cas(
                store,
                lambda s, live=live, now=now: (
                    replace(
                        s,
                        participants={**s.participants, **{n: 0 for n in live}},
                        last_heartbeats={**s.last_heartbeats, **{n: now for n in live}},
                    )
                    if not s.complete and not live <= set(s.participants)
                    else None
                ),
            )
        if beat_due:
            present = live & (set(s.participants) if s is not None else set())
            if present:
                cas(
                    store,
                    lambda s, present=present, now=now: replace(
                        s, last_heartbeats={**s.last_heartbeats, **{n: now for n in present if n in s.participants}}
                    ),
                )
                (stop_file.parent / f"ready-{first}").write_text("1")
            next_beat = time.monotonic() + 2.0
        time.sleep(0.05)


# ---------------------------------------------------------------------------- the bench
class CountingStore:
    """fleetd's store client, counting round trips (every method call is one)."""

    def __init__(self, inner):
        self.inner = inner
        self.ops = 0

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def counted(*a, **kw):
            self.ops += 1
            return fn(*a, **kw)

        return counted


async def run(a: argparse.Namespace) -> dict:
    from fleetd.rendezvous.client import RendezvousClient
    from fleetd.rendezvous.steering import Steerer, SteerSettings

    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"steering-load-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    stop_file = work / "stop"
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from fleetd.rendezvous.host import HostSpec, "
            f"run_until_signalled as r; sys.exit(r(HostSpec('127.0.0.1', {port})))",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(work / "host.log").open("w"),
    )
    procs: list[subprocess.Popen] = []
    load_start = os.getloadavg()
    try:
        wait_port("127.0.0.1", port, 120)
        store = connect(port)
        now = datetime.now(UTC)
        members = [NodeId(addr(k), 1000 + k, 0) for k in range(a.members)]
        formed = RendezvousState(
            round=1,
            complete=True,
            participants={n: r for r, n in enumerate(sorted(members))},
            last_heartbeats={n: now for n in members},
        )
        blob = encode(formed)
        store.set(keys.torch_state_key(RUN_ID), blob)
        t = time.perf_counter()
        for _ in range(5):
            decode(store.get(keys.torch_state_key(RUN_ID)))
            store.compare_set(keys.torch_state_key(RUN_ID), blob, encode(formed))
        one_write_s = (time.perf_counter() - t) / 5
        share = -(-a.members // a.procs)
        for p in range(a.procs):
            first = p * share
            count = max(0, min(share, a.members - first))
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--member-proc",
                        "--port",
                        str(port),
                        "--first",
                        str(first),
                        "--count",
                        str(count),
                        "--stop",
                        str(stop_file),
                        "--leaves",
                        str(a.leaves),
                    ],
                    env=env,
                    stderr=(work / f"members-{p}.log").open("w"),
                )
            )
        client = RendezvousClient("127.0.0.1", port, RUN_ID)
        await client.connect()
        counting = CountingStore(client._store)
        client._store = counting
        steerer = Steerer(client, SteerSettings(min_nodes=1, max_nodes=a.members))
        passes: list[float] = []
        ops_per_pass: list[int] = []
        stop = asyncio.Event()

        async def steer() -> None:
            while not stop.is_set():
                before, t0 = counting.ops, time.perf_counter()
                await steerer.step()
                passes.append(time.perf_counter() - t0)
                ops_per_pass.append(counting.ops - before)
                await asyncio.sleep(steerer.settings.interval_s)

        async def progress() -> None:
            # Rank 0 of a training job bumps the progress counter (ElasticCheckpointer): with it,
            # a member whose heartbeat is late on this loaded box is a blip, not a loss.
            while not stop.is_set():
                await asyncio.to_thread(store.add, keys.progress_key(RUN_ID), 1)
                await asyncio.sleep(0.5)

        task = asyncio.create_task(steer())
        pulse = asyncio.create_task(progress())
        # Member processes import torch and start heartbeating (seconds on a loaded box).
        until = time.monotonic() + 300
        while len(list(work.glob("ready-*"))) < a.procs and time.monotonic() < until:
            await asyncio.sleep(0.5)
        await asyncio.sleep(a.settle_s)
        results = []
        size = a.members
        for leave in range(a.leaves):
            leaver = members[leave]
            round0 = decode(store.get(keys.torch_state_key(RUN_ID))).round
            t0 = time.time()
            store.set(keys.noticed_key(RUN_ID, leaver.addr), keys.Noticed(reason="bench").to_bytes())
            store.set(keys.drain_ready_key(RUN_ID, leaver.addr), keys.DrainReady(step=1, durable=True).to_bytes())
            size -= 1
            done_at = None
            deadline = time.monotonic() + a.timeout_s
            while time.monotonic() < deadline:
                s = decode(store.get(keys.torch_state_key(RUN_ID)))
                if (
                    s is not None
                    and s.complete
                    and s.round > round0
                    and len(s.participants) == size
                    and leaver not in s.participants
                ):
                    done_at = time.time()
                    break
                await asyncio.sleep(0.01)
            results.append(None if done_at is None else done_at - t0)
            await asyncio.sleep(3.0)  # let the steering forget the leave before the next
        stop.set()
        await task
        await pulse
    finally:
        stop_file.write_text("stop")
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        host.terminate()
        host.wait(15)
        shutil.rmtree(work, ignore_errors=True)
    ok = [r for r in results if r is not None]
    passes.sort()
    return {
        "members": a.members,
        "member_procs": a.procs,
        "leaves": a.leaves,
        "rounds_completed": len(ok),
        "leave_to_round_s": round(max(ok), 3) if ok else None,
        "leave_to_round_p50_s": round(statistics.median(ok), 3) if ok else None,
        "leave_to_round_each_s": [None if r is None else round(r, 3) for r in results],
        "steer_passes": len(passes),
        "steer_pass_p50_s": round(passes[len(passes) // 2], 4) if passes else None,
        "steer_pass_p99_s": round(passes[min(len(passes) - 1, int(0.99 * len(passes)))], 4) if passes else None,
        "store_ops_per_pass_p50": sorted(ops_per_pass)[len(ops_per_pass) // 2] if ops_per_pass else None,
        "store_ops_per_pass_max": max(ops_per_pass) if ops_per_pass else None,
        "state_blob_bytes": len(blob),
        "one_state_write_s": round(one_write_s, 4),
        "torch_per_node_rejoin_bound_s": round(one_write_s * a.members, 2),
        "modelled": "members move in one compare-and-set per process, not one per node as torchrun does",
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--members", type=int, default=1000)
    ap.add_argument("--leaves", type=int, default=5)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--member-proc", action="store_true")
    ap.add_argument("--port", type=int)
    ap.add_argument("--first", type=int)
    ap.add_argument("--count", type=int)
    ap.add_argument("--stop", type=Path)
    a = ap.parse_args()
    if a.member_proc:
        member_proc(a.port, a.first, a.count, a.stop, a.leaves)
        return
    r = asyncio.run(run(a))
    print(
        f"{r['members']} members: leave -> round complete p50 {r['leave_to_round_p50_s']} s, max "
        f"{r['leave_to_round_s']} s; steering pass p50 {r['steer_pass_p50_s']} s, "
        f"{r['store_ops_per_pass_p50']} store ops per pass (load {r['loadavg_start']} -> {r['loadavg_end']})"
    )
    print(json.dumps(r))


if __name__ == "__main__":
    main()
